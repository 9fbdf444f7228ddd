"""Triton kernels (kimi/kernels.py) against their float64 references, with gradients where they have them. Without
a GPU they run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on the H200 compiled."""

import pytest
import torch

import kimi
from helpers import rel_err, tiny
from kimi import kernels, ops
from kimi.kernels import triton
from kimi.config import KDAConfig

pytestmark = pytest.mark.skipif(kernels.triton is None, reason="triton is not installed")
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
    ref = kernels.moe_gemv_reference(x.double(), w.double(), offs)
    for blocks in ({"block_m": 32, "block_k": 32}, {}):    # {}: autotuned on a GPU, 64 x 128 interpreted
        y = kernels.moe_gemv(x, w, offs, **blocks)
        assert y.dtype == dtype and y.shape == ref.shape
        assert rel_err(y.double(), ref) < tol


def test_moe_gemv_op_gradients():
    """The op's backward (grouped_mm for dx, grouped_mm_wgrad for dw) against float64 autograd of the reference."""
    x, w, offs = _routed([2, 0, 3, 1], K=32, M=48, dtype=torch.float32, transposed=False)
    x.requires_grad_(), w.requires_grad_()
    dy = torch.randn(x.shape[0], w.shape[1], device=DEVICE)
    gx, gw = torch.autograd.grad((ops.moe_gemv(x, w, offs) * dy).sum(), (x, w))
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    rx, rw = torch.autograd.grad((kernels.moe_gemv_reference(x64, w64, offs) * dy.double()).sum(), (x64, w64))
    assert rel_err(gx.double(), rx) < 1e-5 and rel_err(gw.double(), rw) < 1e-5


def test_decode_experts_through_gemv_equal_dense(monkeypatch):
    """The model path: Backend(moe="grouped") sends a few tokens through moe_gemv (forced here on the CPU) and
    gives the dense reference's logits."""
    monkeypatch.setattr(ops, "use_gemv", lambda z: True)
    cfg = tiny(num_hidden_layers=2, attn_res_block_size=1,
               linear_attn_config=KDAConfig(num_heads=4, head_dim=32, kda_layers=(1,), full_attn_layers=(2,)))
    params = kimi.init_params(cfg, seed=0, device=DEVICE)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), device=DEVICE)
    got = kimi.forward(params, ids, cfg, kimi.Backend(moe="grouped"))
    want = kimi.forward(params, ids, cfg, kimi.Backend(moe="dense"))
    assert rel_err(got, want) < 1e-5


def test_moe_gemv_frozen_weights_get_no_gradient():
    """Frozen experts (LoRA): the backward computes dx only; dw, an [E, M, K] tensor, is never built."""
    x, w, offs = _routed([1, 2, 0, 3], K=32, M=16, dtype=torch.float32, transposed=False)
    x.requires_grad_()
    calls = []
    orig = ops.grouped_mm_wgrad
    ops.grouped_mm_wgrad = lambda *a: calls.append(1) or orig(*a)
    try:
        (gx,) = torch.autograd.grad(ops.moe_gemv(x, w, offs).square().sum(), (x,))
    finally:
        ops.grouped_mm_wgrad = orig
    x64 = x.detach().double().requires_grad_()
    (rx,) = torch.autograd.grad(kernels.moe_gemv_reference(x64, w.double(), offs).square().sum(), (x64,))
    assert not calls and rel_err(gx.double(), rx) < 1e-5


# ---------------------------------------------------------------------------------------------- delta_states

def _delta_inputs(R, N, C, K, V):
    r = lambda *s: torch.randn(*s, dtype=torch.float64)
    return (r(R, N, C, V), r(R, N, C, K) * K ** -0.5, r(R, N, C, K) * K ** -0.5,
            torch.rand(R, N, K, dtype=torch.float64), r(R, K, V))


@pytest.mark.parametrize("R, N, C, K, V", [(3, 4, 16, 32, 48), (2, 3, 24, 20, 16), (1, 5, 64, 128, 128)])
def test_delta_states_matches_reference(R, N, C, K, V):
    """The Triton state pass (fp32) against the float64 loop: every entering state, every U and the final state.
    C, K, V not powers of two (masked blocks) and the release's 64 / 128 / 128."""
    x = _delta_inputs(R, N, C, K, V)
    ref = kernels.delta_states_reference(*x)
    got = kernels.delta_states(*(t.float().to(DEVICE) for t in x))
    for g, r in zip(got, ref):
        assert g.dtype == torch.float32 and g.shape == r.shape
        assert rel_err(g.double().cpu(), r) < 1e-5


@pytest.mark.parametrize("used", ["all", "final state only"])
def test_kda_states_op_gradients(used):
    """The op's backward (the reverse Triton pass, then batched algebra) against float64 autograd of the loop, for
    gradients reaching every output or only the final state (autograd passes None for the others)."""
    x = _delta_inputs(2, 4, 16, 24, 40)
    probes = [torch.randn(t.shape, dtype=torch.float64)
              for t in kernels.delta_states_reference(*x)]
    if used != "all":
        probes[0] = probes[1] = None

    def grads(fn, xs):
        xs = [t.clone().requires_grad_() for t in xs]
        outs = fn(*xs)
        loss = sum((o * p.to(o)).sum() for o, p in zip(outs, probes) if p is not None)
        return torch.autograd.grad(loss, xs)

    ref = grads(kernels.delta_states_reference, x)
    got = grads(torch.ops.kimi.kda_states, [t.float().to(DEVICE) for t in x])
    for name, g, r in zip("u w k d s0".split(), got, ref):
        assert rel_err(g.double().cpu(), r) < 1e-5, name


def test_delta_states_reads_column_slices_in_place():
    """KDA hands the state pass w and u as column slices of one [R, N, C, K + V] tensor: the kernels read them with
    their row strides (no copy) and give the reference's result, forward and backward; a layout whose rows are not
    evenly spaced is copied first."""
    R, N, C, K, V = 3, 4, 16, 24, 40
    u64, w64, k64, d64, s064 = _delta_inputs(R, N, C, K, V)
    wu = torch.cat([w64, u64], -1).float().to(DEVICE)
    w, u = wu.split([K, V], -1)
    assert not w.is_contiguous() and kernels._row_strided(w) is w and kernels._row_strided(u) is u
    assert kernels._row_strided(w.transpose(0, 1)).is_contiguous()
    k, d, s0 = (t.float().to(DEVICE) for t in (k64, d64, s064))
    ref = kernels.delta_states_reference(u64, w64, k64, d64, s064)
    for g, r in zip(kernels.delta_states(u, w, k, d, s0), ref):
        assert rel_err(g.double().cpu(), r) < 1e-5
    dh, dU, dsN = (torch.randn_like(t) for t in kernels.delta_states(u.contiguous(), w.contiguous(), k, d, s0))
    strided = kernels.delta_states_bwd(w, k, d, dh, dU, dsN)
    dense = kernels.delta_states_bwd(w.contiguous(), k, d, dh, dU, dsN)
    assert all(torch.equal(a, b) for a, b in zip(strided, dense))


def test_delta_states_tf32_dots():
    """With TF32 dots (what training on a GPU uses: its fp32 matmuls run in TF32 too) the state pass still tracks
    the float64 loop at TF32's precision (inputs rounded to 10 mantissa bits, sums in fp32), forward and backward
    passes; by default the kernels follow torch's float32 matmul precision. (Under the interpreter the dots are
    full fp32 whatever the precision asked.)"""
    x = _delta_inputs(2, 8, 64, 128, 64)
    xs = [t.float().to(DEVICE) for t in x]
    ref = kernels.delta_states_reference(*x)
    got = kernels.delta_states(*xs, tf32=True)
    assert all(rel_err(g.double().cpu(), r) < 5e-3 for g, r in zip(got, ref))
    if DEVICE == "cuda":   # the precision is really asked for: TF32 and IEEE dots round differently
        assert not torch.equal(got[1], kernels.delta_states(*xs, tf32=False)[1])
    dh, dU, dsN = (torch.randn_like(t) for t in got)
    bwd = [kernels.delta_states_bwd(xs[1], xs[2], xs[3], dh, dU, dsN, tf32=t) for t in (True, False)]
    assert all(rel_err(a.double(), b.double()) < 5e-3 for a, b in zip(*bwd))
    before = torch.get_float32_matmul_precision()
    try:
        for precision, tf32 in (("high", True), ("highest", False)):
            torch.set_float32_matmul_precision(precision)
            default, chosen = kernels.delta_states(*xs), kernels.delta_states(*xs, tf32=tf32)
            assert all(torch.equal(a, b) for a, b in zip(default, chosen))
    finally:
        torch.set_float32_matmul_precision(before)


def _delta_bwd_reference(w, k, d, dh, dU_in, dsN):
    """`delta_states_bwd`'s recurrence as a float64 loop over chunks in reverse."""
    L, dUs, lams = dsN, [], []
    for n in reversed(range(w.shape[1])):
        dU = dU_in[:, n] + k[:, n] @ L
        dUs.append(dU)
        lams.append(L)
        L = dh[:, n] + d[:, n, :, None] * L - w[:, n].transpose(-1, -2) @ dU
    return torch.stack(dUs[::-1], 1), torch.stack(lams[::-1], 1), L


@pytest.mark.parametrize("prec", ["ieee", "tf32"])
@pytest.mark.parametrize("which", ["fwd", "bwd"])
def test_delta_states_every_tuned_config(which, prec):
    """Every block shape the autotuner may pick, launched on its own, gives the float64 loop's result: the
    autotuner only times its configs (on the H200 the forward's 16-column block with 8 warps faulted with TF32 dots,
    an illegal memory access, and was timed with the rest in a training run). The release's C / K and a V with two
    column blocks of the widest config on a GPU; small masked shapes under the interpreter."""
    R, N, C, K, V = (2, 8, 64, 128, 128) if DEVICE == "cuda" else (2, 3, 16, 24, 40)
    tol = 5e-3 if prec == "tf32" and DEVICE == "cuda" else 1e-5      # the interpreter's dots are full fp32
    u, w, k, d, s0 = _delta_inputs(R, N, C, K, V)
    grads = [torch.randn(*s, dtype=torch.float64) for s in ((R, N, K, V), (R, N, C, V), (R, K, V))]
    ref = kernels.delta_states_reference(u, w, k, d, s0) if which == "fwd" else _delta_bwd_reference(w, k, d, *grads)
    f32 = lambda *ts: [t.float().to(DEVICE) for t in ts]
    blocks = kernels._DELTA_BLOCKS[which, prec]
    assert blocks and all((bv, nw) in kernels._ALL_BLOCKS for bv, nw in blocks)
    for bv, nw in blocks:
        BC, BK, _ = kernels._delta_blocks(C, K, V, bv)
        outs = [torch.full_like(r, float("nan"), dtype=torch.float32, device=DEVICE) for r in ref]
        if which == "fwd":
            uu, ww, kk, dd, ss = f32(u, w, k, d, s0)
            args = (uu, ww, kk, dd, ss, *outs, N, uu.stride(1), uu.stride(2), ww.stride(1), ww.stride(2))
        else:
            ww, kk, dd, dh, dU, dsN = f32(w, k, d, *grads)
            args = (ww, kk, dd, dh, dU, dsN, *outs, N, ww.stride(1), ww.stride(2))
        kernels._DELTA_KERNELS[which][(R, triton.cdiv(V, bv))](*args, C, K, V, BC=BC, BK=BK, BV=bv, PREC=prec,
                                                               num_warps=nw)
        for name, o, r in zip(("S_n", "U", "S_N") if which == "fwd" else ("dU", "lambda", "ds0"), outs, ref):
            assert rel_err(o.double().cpu(), r) < tol, (bv, nw, name)


def test_delta_states_rejects_what_it_cannot_run():
    x = _delta_inputs(1, 2, 16, 16, 16)
    with pytest.raises(ValueError, match="float32 tensors expected"):
        kernels.delta_states(*(t.to(DEVICE) for t in x))                      # float64
    u, w, k, d, s0 = (t.float().to(DEVICE) for t in _delta_inputs(1, 1, 16, 300, 16))
    with pytest.raises(ValueError, match="K=300 must be at most 256"):
        kernels.delta_states(u, w, k, d, s0)


def test_delta_states_block_v_and_devices_are_checked():
    u, w, k, d, s0 = (t.float().to(DEVICE) for t in _delta_inputs(1, 2, 16, 16, 40))
    ref = kernels.delta_states(u, w, k, d, s0, block_v=16)          # three column blocks, the last one masked
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(ref, kernels.delta_states(u, w, k, d, s0)))
    with pytest.raises(ValueError, match="block_v=24 must be a power of two"):
        kernels.delta_states(u, w, k, d, s0, block_v=24)
    with pytest.raises(ValueError, match=r"block_v=32 does not run with tf32 dots .* takes \[16\]"):
        kernels.delta_states(u, w, k, d, s0, block_v=32, tf32=True)      # out of shared memory on the H200
    if DEVICE == "cuda":
        with pytest.raises(RuntimeError, match="on one CUDA device"):
            kernels.delta_states(u, w, k, d, s0.cpu())
