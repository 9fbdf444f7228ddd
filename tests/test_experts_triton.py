"""The routed experts' Triton GEMV (kimi/ops/experts_triton.py) and its op `kimi::moe_gemv` against float64
references, with gradients. Without a GPU they run through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); on the H200 compiled."""

import pytest
import torch

import kimi
from helpers import rel_err, tiny
from kimi.config import KDAConfig
from kimi.ops import experts, experts_triton
from kimi.ops.registry import triton

pytestmark = pytest.mark.skipif(triton is None, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _routed(counts, K, M, dtype, transposed):
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    N, E = int(offs[-1]), len(counts)
    x = torch.randn(N, K, dtype=dtype)
    w = torch.randn(E, K, M, dtype=dtype).transpose(1, 2) if transposed else torch.randn(E, M, K, dtype=dtype)
    return x.to(DEVICE), w.to(DEVICE), offs.to(DEVICE)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("counts", [
    [0, 1, 0, 0, 1, 1, 0, 1],          # decode at batch 1: single rows, most experts empty
    [3, 0, 17, 1, 0, 40, 2, 0],        # several 16-row blocks for one expert
    [0, 0, 0, 5],                      # only the last expert
])
@pytest.mark.parametrize("transposed", [False, True])
def test_moe_gemv_matches_reference(dtype, tol, counts, transposed):
    """M and K not multiples of the blocks; w contiguous or a transposed view (the experts' stored layout)."""
    x, w, offs = _routed(counts, K=72, M=100, dtype=dtype, transposed=transposed)
    ref = experts_triton.moe_gemv_reference(x.double(), w.double(), offs)
    for blocks in ({"block_m": 32, "block_k": 32}, {}):    # {}: autotuned on a GPU, 64 x 128 interpreted
        y = experts_triton.moe_gemv_triton(x, w, offs, **blocks)
        assert y.dtype == dtype and y.shape == ref.shape
        assert rel_err(y.double(), ref) < tol


def test_moe_gemv_op_gradients():
    """The op's backward (grouped_mm for dx, grouped_mm_wgrad for dw) against float64 autograd of the reference."""
    x, w, offs = _routed([2, 0, 3, 1], K=32, M=48, dtype=torch.float32, transposed=False)
    x.requires_grad_(), w.requires_grad_()
    dy = torch.randn(x.shape[0], w.shape[1], device=DEVICE)
    gx, gw = torch.autograd.grad((experts.moe_gemv(x, w, offs) * dy).sum(), (x, w))
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    rx, rw = torch.autograd.grad((experts_triton.moe_gemv_reference(x64, w64, offs) * dy.double()).sum(), (x64, w64))
    assert rel_err(gx.double(), rx) < 1e-5 and rel_err(gw.double(), rw) < 1e-5


def test_decode_experts_through_gemv_equal_dense():
    """The model path: Backend(moe="gemv") gives the dense reference's logits."""
    cfg = tiny(num_hidden_layers=2, attn_res_block_size=1,
               linear_attn_config=KDAConfig(num_heads=4, head_dim=32, kda_layers=(1,), full_attn_layers=(2,)))
    params = kimi.init_params(cfg, seed=0, device=DEVICE)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), device=DEVICE)
    got = kimi.forward(params, ids, cfg, kimi.Backend(moe="gemv"))
    want = kimi.forward(params, ids, cfg, kimi.Backend(moe="dense"))
    assert rel_err(got, want) < 1e-5


def test_moe_gemv_frozen_weights_get_no_gradient(monkeypatch):
    """Frozen experts (LoRA): the backward computes dx only; dw, an [E, M, K] tensor, is never built."""
    x, w, offs = _routed([1, 2, 0, 3], K=32, M=16, dtype=torch.float32, transposed=False)
    x.requires_grad_()
    calls = []
    orig = experts.grouped_mm_wgrad
    monkeypatch.setattr(experts, "grouped_mm_wgrad", lambda *a: calls.append(1) or orig(*a))
    (gx,) = torch.autograd.grad(experts.moe_gemv(x, w, offs).square().sum(), (x,))
    x64 = x.detach().double().requires_grad_()
    (rx,) = torch.autograd.grad(experts_triton.moe_gemv_reference(x64, w.double(), offs).square().sum(), (x64,))
    assert not calls and rel_err(gx.double(), rx) < 1e-5
