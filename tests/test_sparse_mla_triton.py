"""The Triton kernels of the sparse attention contract (kimi/ops/sparse_mla_triton.py) against a float64 evaluation
of the gathering reference `sparse_mla_gather` (+ `_bwd`): outputs, LSE, dq and dlatent with and without an LSE
gradient, -1 slots anywhere, empty rows, keys chosen by many queries, every head tiling, the deterministic dlatent
and the decode split. Without a GPU they run through Triton's interpreter at narrow latents (tests/conftest.py sets
TRITON_INTERPRET=1), with one test at the release's 576 / 512 widths; the tests marked `gpu` run on the H200 at
real sizes."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import rel_err
from kimi.ops import sparse_mla_triton as sm
from kimi.ops.registry import triton
from kimi.ops.sparse_attention import sparse_mla_gather, sparse_mla_gather_bwd

pytestmark = pytest.mark.skipif(triton is None, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
"""Relative to float64 on the same (rounded) inputs. fp32: IEEE dots, measured errors below 5e-7. bf16: o and dq are
rounded to bf16 and p, ds before their second dot; measured up to 4.6e-3 for o and dlatent and 9e-3 for dq (its
terms cancel: Σ_j ds_j = 0 without an LSE gradient) over 60 seeds, so 2e-2 leaves a 2x margin."""
F, Bw = sm.FwdConfig, sm.BwdConfig


def _selection(B, T, S, k, layout="holes", device=DEVICE):
    """indices int32 [B, T, k]: per row n distinct random keys, n drawn from 0..min(k, S) (the first row empty, the
    last full), either in random slots (-1 anywhere: "holes") or ascending then -1 (the indexer's "prefix")."""
    m = min(k, S)
    keys = torch.rand(B, T, S, device=device).argsort(-1)[..., :m]
    n = torch.randint(0, m + 1, (B, T), device=device)
    n[0, 0], n[-1, -1] = 0, m
    j = torch.arange(m, device=device)
    keys = torch.where(j < n[..., None], keys, -1)
    if layout == "prefix":
        keys = torch.where(keys < 0, S, keys).sort(-1).values
        keys = torch.where(keys == S, -1, keys)
    idx = torch.full((B, T, k), -1, dtype=torch.int32, device=device)
    if layout == "prefix":
        idx[..., :m] = keys.int()
    else:
        idx.scatter_(-1, torch.rand(B, T, k, device=device).argsort(-1)[..., :m], keys.int())
    return idx


def _inputs(B, T, H, S, D, d_v, dtype, grads=True):
    r = lambda *s: torch.randn(*s, device=DEVICE).to(dtype)
    q, lat = r(B, T, H, D), r(B, S, D)
    return q, lat, r(B, T, H, d_v), (torch.randn(B, T, H, device=DEVICE) if grads else None)


def _reference(q, lat, idx, do, dlse, scale, d_v):
    """float64 (o, lse, dq, dlatent) of the gathering reference on the same inputs."""
    q64, l64 = q.double(), lat.double()
    o, lse = sparse_mla_gather(q64, l64, idx, scale=scale, d_v=d_v)
    dq, dl = sparse_mla_gather_bwd(q64, l64, idx, o, lse, do.double(), None if dlse is None else dlse.double(),
                                   scale=scale, d_v=d_v)
    return o, lse, dq, dl


def _check_against_reference(q, lat, idx, do, dlse, scale, d_v, fwd_cfg=None, bwd_cfg=None, deterministic=False,
                             chunk_rows=None):
    """Run the kernels (the per-shape launch, or the given ones) and compare everything with float64."""
    if fwd_cfg is None:
        o, lse = sm.sparse_mla_fwd_triton(q, lat, idx, scale=scale, d_v=d_v)
    else:
        o, lse = sm.sparse_mla_fwd_launch(q, lat, idx, scale=scale, d_v=d_v, cfg=fwd_cfg)
    if bwd_cfg is None and chunk_rows is None:
        dq, dl = sm.sparse_mla_bwd_triton(q, lat, idx, o, lse, do, dlse, scale=scale, d_v=d_v,
                                          deterministic=deterministic)
    else:
        cfg = bwd_cfg or sm.bwd_config(*q.shape[:3], idx.shape[-1], q.shape[-1], d_v, q.device, q.dtype)
        dq, dl = sm.sparse_mla_bwd_launch(q, lat, idx, o, lse, do, dlse, scale=scale, d_v=d_v,
                                          deterministic=deterministic, cfg=cfg, chunk_rows=chunk_rows)
    o_r, lse_r, dq_r, dl_r = _reference(q, lat, idx, do, dlse, scale, d_v)
    tol = TOL[q.dtype]
    assert o.dtype == q.dtype and lse.dtype == torch.float32 and dq.dtype == q.dtype and dl.dtype == lat.dtype
    assert o.shape == o_r.shape and dq.shape == q.shape and dl.shape == lat.shape and o.is_contiguous()
    empty = ~((idx >= 0).any(-1))
    fin = torch.isfinite(lse_r)
    assert torch.equal(fin, ~empty[..., None].expand_as(fin))
    assert torch.equal(lse[~fin], lse_r[~fin].float())                        # -inf exactly
    assert torch.equal(o[empty], torch.zeros_like(o[empty])) and torch.equal(dq[empty], torch.zeros_like(dq[empty]))
    unselected = torch.ones(lat.shape[:2], dtype=torch.bool, device=lat.device)
    for b in range(idx.shape[0]):
        unselected[b, idx[b][idx[b] >= 0].long()] = False
    assert torch.equal(dl[unselected], torch.zeros_like(dl[unselected]))
    errs = dict(o=rel_err(o, o_r), lse=rel_err(lse[fin], lse_r[fin]), dq=rel_err(dq, dq_r), dlatent=rel_err(dl, dl_r))
    assert errs["lse"] < 1e-5 and max(errs.values()) < tol, errs
    return o, lse, dq, dl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B, T, H, S, D, d_v, k, layout", [
    (2, 6, 3, 40, 48, 32, 13, "holes"),        # 3 heads in one masked 16-head tile
    (1, 5, 16, 50, 44, 24, 37, "prefix"),      # value and tail widths not powers of two (masked columns)
    (1, 2, 96, 16, 48, 32, 20, "holes"),       # 96 heads: three 32-head tiles; k above S (every row short)
], ids=["H3", "H16", "H96"])
@pytest.mark.parametrize("lse_grad", [True, False], ids=["dlse", "no-dlse"])
def test_matches_float64_reference(dtype, B, T, H, S, D, d_v, k, layout, lse_grad):
    """Forward and backward with the per-shape launches: o, lse, dq, dlatent; empty rows give o = 0, lse = -inf
    and zero dq; latent rows no query selected get exactly zero gradient."""
    q, lat, do, dlse = _inputs(B, T, H, S, D, d_v, dtype, lse_grad)
    _check_against_reference(q, lat, _selection(B, T, S, k, layout), do, dlse, scale=D ** -0.5 * 1.7, d_v=d_v)


@pytest.mark.parametrize("fwd_cfg, bwd_cfg", [
    (F(heads=(64, 32), block_k=16, value_chunks=4), Bw(heads=(64, 32), block_k=16, dkv_block_k=16, dkv_block_h=64)),
    (F(heads=(16,) * 6, block_k=32), Bw(heads=(16,) * 6, block_k=32, dkv_block_k=64, dkv_block_h=16)),
    (F(heads=(128,), block_k=64, value_chunks=1), Bw(heads=(128,), block_k=64, dkv_block_k=32, dkv_block_h=128)),
    (F(heads=(32, 32, 32), block_k=16), Bw(heads=(32, 32, 32), block_k=16, dkv_block_k=32, dkv_block_h=32)),
], ids=["64+32,chunks4", "16x6", "128-padded,chunks1", "32x3"])
def test_every_head_tiling_matches(fwd_cfg, bwd_cfg):
    """96 heads under the other tilings (a 64- and a 32-head launch, six 16-head tiles, one tile padded to 128),
    key blocks smaller and larger than k's remainder, through the recomputing backward kernels."""
    q, lat, do, dlse = _inputs(1, 3, 96, 45, 48, 32, torch.float32)
    _check_against_reference(q, lat, _selection(1, 3, 45, 41), do, dlse, scale=0.2, d_v=32, fwd_cfg=fwd_cfg,
                             bwd_cfg=bwd_cfg)


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager-rescale", "lazy-rescale"])
@pytest.mark.parametrize("B, T, H, S, D, d_v, k, splits", [
    (1, 3, 96, 45, 48, 32, 41, 1),      # 96 heads as three 32-head tiles, exact widths (no column masks)
    (2, 4, 20, 50, 44, 24, 37, 2),      # widths not powers of two (masked columns), key splits merged
])
def test_value_chunks_kernel_matches(chunks, lazy, B, T, H, S, D, d_v, k, splits):
    """`_fwd_chunks_kernel` (`value_chunks`): the value columns in 1, 2 or 4 chunks, the accumulators rescaled at
    every step or only when a running max grew by more than 2^8. The latent rows grow in size along the index
    rows, so the max grows across key blocks and the lazy branch is both taken and skipped."""
    q, lat, do, dlse = _inputs(B, T, H, S, D, d_v, torch.float32)
    lat = lat * torch.linspace(0.2, 4.0, S, device=DEVICE)[None, :, None]
    idx = _selection(B, T, S, k, "prefix")
    cfg = F(heads=sm.head_tiles(H, 32), block_k=16, value_chunks=chunks, lazy_rescale=lazy, splits=splits)
    _check_against_reference(q, lat, idx, do, dlse, scale=0.3, d_v=d_v, fwd_cfg=cfg,
                             bwd_cfg=Bw(heads=sm.head_tiles(H, 32), block_k=16))


@pytest.mark.parametrize("scale", [0.0, -0.3])
def test_value_chunks_kernel_any_sign_of_the_scale(scale):
    """A zero or negative scale (found in review: the empty slots' -inf was scaled after masking, giving NaN)."""
    q, lat, do, dlse = _inputs(1, 3, 16, 20, 24, 16, torch.float32)
    cfg = F(heads=(16,), block_k=16, value_chunks=2, lazy_rescale=True)
    _check_against_reference(q, lat, _selection(1, 3, 20, 20), do, dlse, scale=scale, d_v=16, fwd_cfg=cfg,
                             bwd_cfg=Bw(heads=(16,), block_k=16))


def test_value_chunks_lazy_rescale_is_exercised():
    """The growing scores of the test above do raise a running max by more than 2^8 after the first block (so the
    lazy path rescales mid-row) and the result still matches: checked here on the scores themselves."""
    torch.manual_seed(3)
    q, lat, _, _ = _inputs(1, 2, 16, 64, 48, 32, torch.float32)
    lat = lat * torch.linspace(0.2, 4.0, 64, device=DEVICE)[None, :, None]
    idx = torch.arange(64, dtype=torch.int32, device=DEVICE).expand(1, 2, 64).contiguous()
    s = torch.einsum("bthd,bsd->bths", q.double(), lat.double()) * 0.3 * 1.4426950408889634
    first = s[..., :16].amax(-1)
    assert bool((s[..., 16:].amax(-1) > first + 8).any())          # a later block beats the first by > 2^8
    cfg = F(heads=(16,), block_k=16, value_chunks=4, lazy_rescale=True)
    o, lse = sm.sparse_mla_fwd_launch(q, lat, idx, scale=0.3, d_v=32, cfg=cfg)
    o_r, lse_r = sparse_mla_gather(q.double(), lat.double(), idx, scale=0.3, d_v=32)
    assert rel_err(o, o_r) < 1e-5 and rel_err(lse, lse_r) < 1e-6


@pytest.mark.parametrize("fwd_cfg, bwd_cfg, deterministic", [
    (F(heads=(32, 32, 32), block_k=16),
     Bw(heads=(32, 32, 32), block_k=16, slot_major=True, dkv_block_k=16, dkv_block_h=32, dkv_num_warps=4,
        dkv_num_stages=1), False),
    (F(heads=(64, 32), block_k=32),
     Bw(heads=(64, 32), block_k=32, slot_major=True, dkv_block_k=64, dkv_block_h=16), False),
    (F(heads=(16,) * 6, block_k=64, splits=2),
     Bw(heads=(16,) * 6, block_k=64, slot_major=True, dkv_block_k=64, dkv_block_h=16), True),
], ids=["32x3", "64+32", "16x6,key-splits,deterministic"])
def test_slot_major_kernels_match(fwd_cfg, bwd_cfg, deterministic):
    """The transposed dq kernel (`slot_major`: slots on the dots' M side) under several tilings, with the
    recomputing dkv kernel atomic and deterministic, and the dkv kernel's own warps and stages."""
    q, lat, do, dlse = _inputs(1, 3, 96, 45, 48, 32, torch.float32)
    _check_against_reference(q, lat, _selection(1, 3, 45, 41), do, dlse, scale=0.2, d_v=32, fwd_cfg=fwd_cfg,
                             bwd_cfg=bwd_cfg, deterministic=deterministic, chunk_rows=2 if deterministic else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_release_widths(dtype):
    """The release's widths: 96 heads, a 576-wide latent whose first 512 columns are the values, σ = 192^-1/2;
    k = 70 (one full and one partial block of 64), -1 slots anywhere."""
    q, lat, do, dlse = _inputs(1, 2, 96, 90, 576, 512, dtype)
    _check_against_reference(q, lat, _selection(1, 2, 90, 70), do, dlse, scale=192 ** -0.5, d_v=512)


@pytest.mark.parametrize("bwd_cfg", [
    Bw(heads=(32, 32, 32), block_k=64, slot_major=True, dkv_block_k=32, dkv_block_h=32),
    Bw(heads=(32, 32, 32), block_k=64, slot_major=True, dkv_gemm=True, gemm_block_k=128),
    Bw(heads=(32, 32, 32), block_k=64, slot_major=True, dkv_gemm=True, gemm_dq=True, gemm_block_k=64,
       gemm_block_n=64),
    Bw(heads=(32, 32, 32), block_k=64, dkv_gemm=True, gemm_dq=True, pds_all_heads=True, gemm_block_k=64,
       gemm_block_n=64),
    Bw(heads=(32, 32, 32), block_k=64, dkv_gemm=True, gemm_dq=True, gemm_dq_blocks=3, pds_all_heads=True,
       pds_dlat=True, pds_one_loop=True, gemm_block_k=64, gemm_block_n=64),
], ids=["dkv", "dkv-gemm", "gemm-dq", "pds", "pds-dlat"])
def test_slot_major_at_release_widths(bwd_cfg):
    """The transposed kernels at 96 x 576 / 512 in bf16, in the tiles proposed for the H200 (64 slots a step), with
    the recomputing dkv kernel and with the GEMM over the stored ds, p."""
    q, lat, do, dlse = _inputs(1, 2, 96, 90, 576, 512, torch.bfloat16)
    _check_against_reference(q, lat, _selection(1, 2, 90, 70), do, dlse, scale=192 ** -0.5, d_v=512,
                             fwd_cfg=F(heads=(32, 32, 32), block_k=64), bwd_cfg=bwd_cfg)


def test_the_op_honours_torch_deterministic_algorithms(monkeypatch):
    """`kimi::sparse_mla_triton`'s backward takes the fixed-order dlatent exactly when PyTorch's deterministic mode
    is on (the kernels of both paths are tested against float64 above and, at release sizes, for bitwise
    reproduction on the GPU), and its gradients match the reference either way."""
    from kimi.ops.sparse_attention import sparse_mla_triton
    asked = []
    real = sm.sparse_mla_bwd_triton

    def spy(*args, **kwargs):
        asked.append(kwargs["deterministic"])
        return real(*args, **kwargs)
    monkeypatch.setattr(sm, "sparse_mla_bwd_triton", spy)
    q, lat, do, _ = _inputs(1, 3, 4, 20, 48, 32, torch.float32)
    idx = _selection(1, 3, 20, 8)
    _, _, dq_r, dl_r = _reference(q, lat, idx, do, None, 0.3, 32)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        for on in (False, True):
            torch.use_deterministic_algorithms(on)
            qg, lg = q.clone().requires_grad_(), lat.clone().requires_grad_()
            o, _ = sparse_mla_triton(qg, lg, idx, scale=0.3, d_v=32)
            o.backward(do)
            assert rel_err(qg.grad, dq_r) < TOL[torch.float32] and rel_err(lg.grad, dl_r) < TOL[torch.float32]
    finally:
        torch.use_deterministic_algorithms(was)
    assert asked == [False, True]


def test_the_ops_backward_without_a_gradient_for_o_or_the_lse(monkeypatch):
    """`kimi::sparse_mla_triton` and `kimi::sparse_mla_gather` with only o or only the LSE in the loss: the
    backward gets None for the other one, not a zero tensor (the Triton kernels then run without the LSE term), and
    the gradients equal those of the same loss with an explicit zero gradient for it."""
    from kimi.ops.sparse_attention import sparse_mla_gather, sparse_mla_triton
    dlses = []
    real = sm.sparse_mla_bwd_triton

    def spy(*args, **kwargs):
        dlses.append(args[6])
        return real(*args, **kwargs)
    monkeypatch.setattr(sm, "sparse_mla_bwd_triton", spy)
    q, lat, do, dlse = _inputs(1, 3, 4, 20, 48, 32, torch.float32)
    idx = _selection(1, 3, 20, 8)
    for op in (sparse_mla_triton, sparse_mla_gather):
        grads = []
        for outs in ((do, None), (do, torch.zeros_like(dlse)), (None, dlse), (torch.zeros_like(do), dlse)):
            qg, lg = q.clone().requires_grad_(), lat.clone().requires_grad_()
            o, lse = op(qg, lg, idx, scale=0.3, d_v=32)
            torch.autograd.backward([t for t, g in zip((o, lse), outs) if g is not None],
                                    [g for g in outs if g is not None])
            grads.append((qg.grad, lg.grad))
        for a, b in (grads[0], grads[1]), (grads[2], grads[3]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert dlses[0] is None and dlses[1] is not None and dlses[2] is not None


@pytest.mark.parametrize("bwd_cfg, deterministic", [
    (Bw(heads=(32, 32, 32), block_k=16, slot_major=True, dkv_gemm=True, gemm_block_k=16, gemm_block_n=16,
        gemm_block_j=32), False),
    (Bw(heads=(64, 32), block_k=32, dkv_gemm=True, gemm_block_k=32, gemm_block_n=32, gemm_rows=2), True),
    (Bw(heads=(16,) * 6, block_k=16, slot_major=True, dkv_gemm=True, gemm_block_k=64, gemm_block_j=16,
        gemm_rows=1), False),
    (Bw(heads=(32, 32, 32), block_k=16, slot_major=True, dkv_gemm=True, gemm_dq=True, gemm_block_k=16,
        gemm_block_n=16), False),
    (Bw(heads=(64, 32), block_k=32, dkv_gemm=True, gemm_dq=True, gemm_block_k=32, gemm_block_n=64, gemm_rows=2),
     True),
    (Bw(heads=(32, 32, 32), block_k=16, dkv_gemm=True, gemm_dq=True, pds_all_heads=True, pds_block_c=16,
        gemm_block_k=32, gemm_block_n=16, gemm_rows=2), False),
    (Bw(heads=(32, 32, 32), block_k=64, dkv_gemm=True, gemm_dq=True, pds_all_heads=True, gemm_block_k=16,
        gemm_block_n=32), True),
    (Bw(heads=(32, 32, 32), block_k=16, dkv_gemm=True, gemm_dq=True, gemm_dq_blocks=3, pds_all_heads=True,
        pds_dlat=True, pds_block_c=16, gemm_block_k=32, gemm_block_n=16), False),
    (Bw(heads=(32, 32, 32), block_k=32, dkv_gemm=True, gemm_dq=True, gemm_dq_blocks=2, pds_all_heads=True,
        pds_dlat=True, pds_one_loop=True, gemm_block_k=16, gemm_block_n=32, gemm_rows=2), True),
    (Bw(heads=(32, 32, 32), block_k=16, dkv_gemm=True, gemm_dq=True, gemm_dq_blocks=3, pds_all_heads=True,
        pds_dlat=True, pds_one_loop=True, pds_block_c=32, gemm_block_k=16, gemm_block_n=16, gemm_rows=2), True),
], ids=["32x3,blocks16", "64+32,chunks2,deterministic", "16x6,chunks1", "gemm-dq,blocks16",
        "gemm-dq,chunks2,deterministic", "pds,blocks16,chunks2", "pds,deterministic", "pds-dlat,x3",
        "pds-dlat,one-loop,x2,chunks2,deterministic", "pds-dlat,one-loop,x3,chunks2,deterministic"])
def test_dkv_gemm_matches(bwd_cfg, deterministic):
    """dlatent from the ds and p the dq kernels store (`dkv_gemm`): value and tail column blocks narrower and wider
    than the widths, stacked-head steps that split [ds | p] inside and across its halves, chunks of one and two
    queries (a buffer reused), atomic and deterministic; the kernel walking the slots of a column block that also
    forms dq (`gemm_dq`: column blocks straddling the value / tail boundary and wider than the latent), with ds and
    p from the kernel for all heads of a query (`pds_all_heads`: column steps narrower and wider than the tail),
    that kernel also adding dlatent (`pds_dlat`; its columns in one loop: `pds_one_loop`), and column blocks two
    and three to a program (`gemm_dq_blocks`, the last ones past the latent's width)."""
    q, lat, do, dlse = _inputs(1, 3, 96, 45, 48, 32, torch.float32)
    _check_against_reference(q, lat, _selection(1, 3, 45, 41), do, dlse, scale=0.2, d_v=32, bwd_cfg=bwd_cfg,
                             deterministic=deterministic)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemm_dq_without_lse_gradient(dtype):
    """`gemm_dq` with ds, p from the per-query kernel (`pds_all_heads`, also adding dlatent: `pds_dlat`) and from
    the dq kernels, no LSE gradient
    (Δ = Σ do ⊙ o alone), 40 heads as a 32- and a 16-head group (the second masked), widths not powers of two."""
    q, lat, do, _ = _inputs(1, 4, 40, 30, 44, 24, dtype)
    idx = _selection(1, 4, 30, 23)
    for pds, fused, one in ((False, False, False), (True, True, False), (True, True, True)):
        _check_against_reference(q, lat, idx, do, None, scale=0.3, d_v=24, bwd_cfg=Bw(
            heads=(32, 16), block_k=16, dkv_gemm=True, gemm_dq=True, pds_all_heads=pds, pds_dlat=fused,
            pds_one_loop=one, pds_block_c=16, gemm_block_k=16, gemm_block_n=32))


@settings(max_examples=12)
@given(B=st.integers(1, 2), T=st.integers(1, 5), H=st.integers(1, 40), S=st.integers(1, 30), k=st.integers(1, 40),
       widths=st.sampled_from([(24, 16), (40, 32), (33, 17), (32, 32)]), block_k=st.sampled_from([16, 32, 64]),
       widest=st.sampled_from([16, 32, 64]), chunks=st.sampled_from([1, 2, 4]), splits=st.integers(1, 4),
       dkv=st.sampled_from([(16, 16), (32, 32), (64, 16)]), deterministic=st.booleans(), slot_major=st.booleans(),
       gemm=st.sampled_from([None, (16, 16, 16, None, ""), (32, 64, 32, 2, ""), (64, 16, 64, None, ""),
                             (16, 32, 16, 2, "dq"), (16, 16, 16, 2, "pds"), (32, 32, 16, None, "pds-dlat")]),
       layout=st.sampled_from(["holes", "prefix"]), seed=st.integers(0, 2**31 - 1))
def test_random_shapes_and_launches(B, T, H, S, k, widths, block_k, widest, chunks, splits, dkv, deterministic,
                                    slot_major, gemm, layout, seed):
    """Drawn shapes (a latent without a tail included) under drawn launches: head tiles, key blocks, value chunks,
    key splits, dkv tiles or the GEMM over stored ds, p (its blocks and chunks; forming dq; ds, p from the kernel
    for all heads of a query, which may add dlatent itself), atomic or deterministic, default or transposed
    (`slot_major`) dq kernels."""
    torch.manual_seed(seed)
    D, d_v = widths
    # with an LSE gradient: without one, rows of a single key have dq = 0 up to rounding (nothing to compare)
    q, lat, do, dlse = _inputs(B, T, H, S, D, d_v, torch.float32)
    heads = sm.head_tiles(H, widest)
    _check_against_reference(q, lat, _selection(B, T, S, k, layout), do, dlse, scale=0.3, d_v=d_v,
                             fwd_cfg=F(heads=heads, block_k=block_k, value_chunks=chunks, splits=splits),
                             bwd_cfg=Bw(heads=heads, block_k=block_k, dkv_block_k=dkv[0], dkv_block_h=dkv[1],
                                        slot_major=slot_major,
                                        **({} if gemm is None else dict(dkv_gemm=True, gemm_block_k=gemm[0],
                                                                        gemm_block_n=gemm[1], gemm_block_j=gemm[2],
                                                                        gemm_rows=gemm[3], gemm_dq=gemm[4] != "",
                                                                        pds_all_heads=gemm[4].startswith("pds"),
                                                                        pds_dlat=gemm[4] == "pds-dlat"))),
                             deterministic=deterministic)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_keys_selected_by_many_queries(deterministic):
    """Seven keys, 40 queries choosing up to six of them: every latent row's gradient sums over most queries (and
    all heads), through the atomics or the sorted per-key reduction (in chunks of 7 queries, across the batch
    boundary)."""
    q, lat, do, dlse = _inputs(2, 20, 5, 7, 40, 32, torch.float32)
    idx = _selection(2, 20, 7, 9)
    _check_against_reference(q, lat, idx, do, dlse, scale=0.3, d_v=32, deterministic=deterministic,
                             chunk_rows=7 if deterministic else None)


def test_deterministic_dlatent_is_bitwise_reproducible():
    """The deterministic backward twice on the same inputs: identical bits, in one chunk and in several (the
    interpreter runs programs in order, so the atomics are reproducible here too; the GPU test checks them apart)."""
    q, lat, do, dlse = _inputs(1, 12, 16, 10, 48, 32, torch.float32)
    idx = _selection(1, 12, 10, 8)
    o, lse = sm.sparse_mla_fwd_triton(q, lat, idx, scale=0.25, d_v=32)
    cfg = sm.bwd_config(1, 12, 16, 8, 48, 32, q.device)
    runs = [sm.sparse_mla_bwd_launch(q, lat, idx, o, lse, do, dlse, scale=0.25, d_v=32, deterministic=True, cfg=cfg,
                                     chunk_rows=c) for c in (None, None, 5)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert torch.equal(runs[0][0], runs[2][0]) and rel_err(runs[2][1], runs[0][1]) < 1e-6
    ref = _reference(q, lat, idx, do, dlse, 0.25, 32)
    assert rel_err(runs[0][1], ref[3]) < 1e-5


@pytest.mark.parametrize("T, splits, layout", [(1, 4, "prefix"), (2, 16, "holes"), (4, 3, "prefix")])
def test_decode_split_matches_reference(T, splits, layout):
    """The decode path: each index row (k = 300, not a multiple of the 64-slot block) split into key ranges whose
    partials are merged by their LSE. Rows with few keys leave whole splits empty; one row has none."""
    B, H, S, k = 3, 8, 400, 300
    q, lat, do, _ = _inputs(B, T, H, S, 40, 32, torch.float32, grads=False)
    idx = _selection(B, T, S, k, layout)
    idx[1, 0, 5:] = -1                                       # five keys: most splits of this row are empty
    o, lse = sm.sparse_mla_decode_triton(q, lat, idx, scale=0.2, d_v=32, splits=splits)
    o_r, lse_r = sparse_mla_gather(q.double(), lat.double(), idx, scale=0.2, d_v=32)
    fin = torch.isfinite(lse_r)
    assert torch.equal(torch.isfinite(lse), fin) and torch.equal(o[~fin[..., 0]], torch.zeros_like(o[~fin[..., 0]]))
    assert rel_err(o, o_r) < 1e-5 and rel_err(lse[fin], lse_r[fin]) < 1e-5


def test_decode_at_release_widths_and_the_automatic_split():
    """Few queries make `fwd_config` split the keys (a decision from the shapes alone); at 96 x 576 / 512 in bf16
    the split forward equals float64 like the unsplit one."""
    B, T, H, S, k = 2, 1, 96, 300, 256
    cfg = sm.fwd_config(B, T, H, k, 576, 512, torch.device(DEVICE))
    assert cfg.splits > 1 and cfg == sm.fwd_config(B, T, H, k, 576, 512, torch.device(DEVICE))
    q, lat, _, _ = _inputs(B, T, H, S, 576, 512, torch.bfloat16, grads=False)
    idx = _selection(B, T, S, k, "prefix")
    o, lse = sm.sparse_mla_fwd_triton(q, lat, idx, scale=192 ** -0.5, d_v=512)
    o_r, lse_r = sparse_mla_gather(q.double(), lat.double(), idx, scale=192 ** -0.5, d_v=512)
    fin = torch.isfinite(lse_r)
    assert rel_err(o, o_r) < TOL[torch.bfloat16] and rel_err(lse[fin], lse_r[fin]) < 1e-5


def test_degenerate_shapes():
    """No slots at all (k = 0), every row empty, and no queries: zeros, -inf and zero gradients, no NaN."""
    for k, fill in ((0, -1), (5, -1)):
        q, lat, do, dlse = _inputs(2, 3, 4, 6, 24, 16, torch.float32)
        idx = torch.full((2, 3, k), fill, dtype=torch.int32, device=DEVICE)
        o, lse = sm.sparse_mla_fwd_triton(q, lat, idx, scale=0.3, d_v=16)
        assert torch.equal(o, torch.zeros_like(o)) and bool((lse == float("-inf")).all())
        dq, dl = sm.sparse_mla_bwd_triton(q, lat, idx, o, lse, do, dlse, scale=0.3, d_v=16)
        assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dl, torch.zeros_like(dl))
    q, lat, do, dlse = _inputs(2, 0, 4, 6, 24, 16, torch.float32)
    o, lse = sm.sparse_mla_fwd_triton(q, lat, torch.zeros(2, 0, 3, dtype=torch.int32, device=DEVICE), scale=0.3,
                                      d_v=16)
    assert o.shape == (2, 0, 4, 16) and lse.shape == (2, 0, 4)


def test_launch_configs():
    """Head tiles cover 96 heads without padding; a prefill's launch has no key splits; decode shapes get them,
    each split at least two key blocks long; wrong tiles are refused."""
    assert sm.head_tiles(96, 32) == (32, 32, 32) and sm.head_tiles(96, 64) == (64, 32)
    assert sm.head_tiles(3, 32) == (16,) and sm.head_tiles(100, 32) == (32, 32, 32, 16)
    dev = torch.device(DEVICE)
    assert sm.fwd_config(1, 4096, 96, 2048, 576, 512, dev).splits == 1
    dec = sm.fwd_config(1, 1, 96, 2048, 576, 512, dev)
    assert 1 < dec.splits <= 16 and 2048 // dec.splits >= 2 * dec.block_k
    assert sm.bwd_config(1, 4096, 96, 2048, 576, 512, dev).heads == (32, 32, 32)
    q, lat, _, _ = _inputs(1, 1, 20, 8, 24, 16, torch.float32)
    idx = _selection(1, 1, 8, 4)
    with pytest.raises(ValueError, match="must be powers of two >= 16 covering H=20"):
        sm.sparse_mla_fwd_launch(q, lat, idx, scale=0.1, d_v=16, cfg=F(heads=(16,)))
    with pytest.raises(ValueError, match="value_chunks=3 must be 1, 2 or 4"):
        sm.sparse_mla_fwd_launch(q, lat, idx, scale=0.1, d_v=16, cfg=F(heads=(32,), value_chunks=3))
    with pytest.raises(ValueError, match="block_k=24 must be a power of two"):
        sm.sparse_mla_fwd_launch(q, lat, idx, scale=0.1, d_v=16, cfg=F(heads=(32,), block_k=24))


def test_rejects_what_it_cannot_run():
    q, lat, _, _ = _inputs(1, 2, 4, 8, 24, 16, torch.float32)
    idx = _selection(1, 2, 8, 4)
    with pytest.raises(ValueError, match="share a bfloat16/float16/float32 dtype"):
        sm.sparse_mla_fwd_triton(q.double(), lat.double(), idx, scale=0.1, d_v=16)
    with pytest.raises(ValueError, match="indices must be int32"):
        sm.sparse_mla_fwd_triton(q, lat, idx.long(), scale=0.1, d_v=16)
    with pytest.raises(ValueError, match="d_v=30 must be in 1..D=24"):
        sm.sparse_mla_fwd_triton(q, lat, idx, scale=0.1, d_v=30)
    with pytest.raises(ValueError, match="shapes disagree"):
        sm.sparse_mla_fwd_triton(q, lat[..., :20], idx, scale=0.1, d_v=16)
    o, lse = sm.sparse_mla_fwd_triton(q, lat, idx, scale=0.1, d_v=16)
    with pytest.raises(ValueError, match=r"do has shape \[1, 2, 4, 12\], expected \[1, 2, 4, 16\]"):
        sm.sparse_mla_bwd_triton(q, lat, idx, o, lse, o[..., :12], None, scale=0.1, d_v=16)


# ---------------------------------------------------------------------------------------------- on the H200

def _causal_selection(B, T, S, k, device):
    """The indexer's canonical form over a cache of S slots whose last T are the queries: causal, the top-k of
    random scores, ascending, -1 after (the early queries' rows are short)."""
    t = torch.arange(T, device=device) + (S - T)
    scores = torch.rand(B, T, S, device=device).masked_fill(torch.arange(S, device=device) > t[:, None], -1.0)
    top = scores.topk(k, dim=-1)
    idx = torch.where(top.values >= 0, top.indices, S).sort(-1).values
    return torch.where(idx == S, -1, idx).int()


@pytest.mark.gpu
@pytest.mark.parametrize("T, S", [(2048, 2048), (1024, 8192)], ids=["prefill", "cached"])
def test_cuda_release_sizes_match_float64(T, S):
    """96 heads, 576 / 512, top-2048 in bf16 at real lengths (causal selections, short early rows): forward, LSE,
    dq and dlatent with an LSE gradient against float64; the deterministic dlatent reproduces bitwise and agrees
    with the atomic one."""
    H, D, d_v, k = 96, 576, 512, 2048
    q, lat, do, dlse = _inputs(1, T, H, S, D, d_v, torch.bfloat16)
    idx = _causal_selection(1, T, S, k, "cuda")
    o, lse, dq, dl = _check_against_reference(q, lat, idx, do, dlse, scale=192 ** -0.5, d_v=d_v)
    dets = [sm.sparse_mla_bwd_triton(q, lat, idx, o, lse, do, dlse, scale=192 ** -0.5, d_v=d_v, deterministic=True)
            for _ in range(2)]
    assert torch.equal(dets[0][0], dets[1][0]) and torch.equal(dets[0][1], dets[1][1])
    assert torch.equal(dets[0][0], dq) and rel_err(dets[0][1], dl) < 1e-2


def _long_rows_check(T, H, D, d_v, k, device):
    """Forward and backward at length T (bf16, causal rows of min(t + 1, k) random keys), checked where float64 is
    affordable: o, LSE and dq on sampled rows (the first, the middle and the last, where q's offsets pass 2^31
    elements at 128K) against the float64 reference on those rows; dlatent of the sampled rows' own backward
    against float64; and the full run's dlatent against the sum of two half runs (rows from offset 0 again)."""
    scale = 192 ** -0.5
    q = torch.randn(1, T, H, D, device=device, dtype=torch.bfloat16)
    do = torch.randn(1, T, H, d_v, device=device, dtype=torch.bfloat16)
    lat = torch.randn(1, T, D, device=device, dtype=torch.bfloat16)
    dlse = torch.randn(1, T, H, device=device)
    t = torch.arange(T, device=device)[:, None]
    idx = (torch.rand(T, k, device=device) * (t + 1)).int().clamp(max=T - 1)
    idx = torch.where(torch.arange(k, device=device)[None] <= t, idx, -1)[None]
    o, lse = sm.sparse_mla_fwd_triton(q, lat, idx, scale=scale, d_v=d_v)
    dq, dl = sm.sparse_mla_bwd_triton(q, lat, idx, o, lse, do, dlse, scale=scale, d_v=d_v)
    n = min(16, T // 4)
    rows = torch.cat([torch.arange(n), T // 2 + torch.arange(n), T - 2 * n + torch.arange(2 * n)]).to(device)
    sub = [x[:, rows].contiguous() for x in (q, idx, do, dlse)]
    o_r, lse_r = sparse_mla_gather(sub[0].double(), lat.double(), sub[1], scale=scale, d_v=d_v)
    dq_r, dl_r = sparse_mla_gather_bwd(sub[0].double(), lat.double(), sub[1], o_r, lse_r, sub[2].double(),
                                       sub[3].double(), scale=scale, d_v=d_v)
    tol = TOL[torch.bfloat16]
    errs = dict(o=rel_err(o[:, rows], o_r), lse=rel_err(lse[:, rows], lse_r), dq=rel_err(dq[:, rows], dq_r))
    _, dl_sub = sm.sparse_mla_bwd_triton(sub[0], lat, sub[1], o[:, rows].contiguous(), lse[:, rows].contiguous(),
                                         sub[2], sub[3], scale=scale, d_v=d_v)
    errs["dlatent of the sampled rows"] = rel_err(dl_sub, dl_r)
    del dq, dl_sub
    h = T // 2
    halves = [sm.sparse_mla_bwd_triton(q[:, a:b], lat, idx[:, a:b], o[:, a:b], lse[:, a:b], do[:, a:b],
                                       dlse[:, a:b], scale=scale, d_v=d_v)[1].float() for a, b in ((0, h), (h, T))]
    errs["dlatent against two halves"] = rel_err(dl, halves[0] + halves[1])
    assert errs["lse"] < 1e-5 and max(errs.values()) < tol, errs


def test_long_rows_check_at_small_sizes():
    """`_long_rows_check` (the GPU's 8K-128K test) through the interpreter at narrow widths."""
    _long_rows_check(64, 16, 48, 32, 16, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [8192, 32768, 131072])
def test_cuda_long_rows_match_float64(T):
    """96 heads, 576 / 512, top-2048, bf16, at 8K, 32K and 128K (`_long_rows_check`): the tolerance is the bf16
    one of every test here (2e-2 relative; the LSE 1e-5)."""
    _long_rows_check(T, 96, 576, 512, 2048, "cuda")
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_cuda_float32_parity_path():
    """fp32 inputs on the GPU (IEEE dots, the launch `fwd_config` / `bwd_config` give fp32): float64's result to
    1e-5 at the release's widths."""
    H, D, d_v, S, k = 96, 576, 512, 1024, 512
    q, lat, do, dlse = _inputs(1, 64, H, S, D, d_v, torch.float32)
    _check_against_reference(q, lat, _causal_selection(1, 64, S, k, "cuda"), do, dlse, scale=192 ** -0.5, d_v=d_v)


@pytest.mark.gpu
@pytest.mark.parametrize("fwd_cfg, bwd_cfg", [
    (F(heads=(64, 32), block_k=32, value_chunks=4, num_warps=8), Bw(heads=(64, 32))),
    (F(heads=(64, 32), block_k=32, num_warps=8), Bw(heads=(16,) * 6, dkv_block_k=16, num_warps=4)),
    (F(heads=(32, 32, 32), block_k=32, num_stages=3), Bw(heads=(32, 32, 32), num_stages=1)),
    (F(heads=(32, 32, 32), value_chunks=1), Bw(heads=(32, 32, 32), block_k=16, slot_major=True)),
], ids=["64+32,chunks4", "64+32,16x6", "32x3,bk32", "chunks1,dq-sm16"])
def test_cuda_alternative_launches_compile_and_match(fwd_cfg, bwd_cfg):
    """The launches worth timing against the default ones fit the H200 (64 heads in the dkv kernel's steps need
    more than its 227 KB of shared memory) and give the float64 result."""
    H, D, d_v, S, k = 96, 576, 512, 4096, 2048
    q, lat, do, dlse = _inputs(1, 256, H, S, D, d_v, torch.bfloat16)
    _check_against_reference(q, lat, _causal_selection(1, 256, S, k, "cuda"), do, dlse, scale=192 ** -0.5,
                             d_v=d_v, fwd_cfg=fwd_cfg, bwd_cfg=bwd_cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("fwd_cfg, bwd_cfg", [
    (F(heads=(32, 32, 32), block_k=64, value_chunks=4),
     Bw(heads=(32, 32, 32), block_k=64, slot_major=True, num_warps=4, dkv_block_k=32, dkv_block_h=32)),
    (F(heads=(32, 32, 32), block_k=64),
     Bw(heads=(32, 32, 32), block_k=64, slot_major=True, num_warps=4, dkv_gemm=True, gemm_block_k=128,
        dkv_num_warps=8, gemm_rows=100)),
    (F(heads=(32, 32, 32), block_k=64),
     Bw(heads=(32, 32, 32), block_k=64, slot_major=True, num_warps=4, dkv_gemm=True, gemm_dq=True, gemm_block_k=64,
        gemm_block_n=64, gemm_rows=100)),
    (F(heads=(32, 32, 32), block_k=64),
     Bw(heads=(32, 32, 32), block_k=64, num_warps=8, num_stages=3, dkv_gemm=True, gemm_dq=True, pds_all_heads=True,
        gemm_block_k=64, gemm_block_n=64, dkv_num_warps=4, dkv_num_stages=2, gemm_rows=100)),
    (F(heads=(32, 32, 32), block_k=64),
     Bw(heads=(32, 32, 32), block_k=128, num_warps=8, num_stages=2, dkv_gemm=True, gemm_dq=True, gemm_dq_blocks=3,
        pds_all_heads=True, pds_dlat=True, pds_one_loop=True, gemm_block_k=64, gemm_block_n=64, dkv_num_warps=4,
        dkv_num_stages=2, gemm_rows=100)),
], ids=["chunks4,dq-sm64,dkv32x32", "dkv-gemm128", "gemm-dq", "pds", "pds-dlat"])
def test_cuda_slot_major_launches_compile_and_match(fwd_cfg, bwd_cfg):
    """The transposed dq kernel in the tiles proposed for timing (offline sm_90 compiles: no or few spills, wgmma
    at 64 slots) and the dlatent GEMMs over stored ds, p (chunks of 100 queries) fit the H200 and give the float64
    result."""
    H, D, d_v, S, k = 96, 576, 512, 4096, 2048
    q, lat, do, dlse = _inputs(1, 256, H, S, D, d_v, torch.bfloat16)
    _check_against_reference(q, lat, _causal_selection(1, 256, S, k, "cuda"), do, dlse, scale=192 ** -0.5,
                             d_v=d_v, fwd_cfg=fwd_cfg, bwd_cfg=bwd_cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("B, T", [(1, 1), (32, 1), (8, 4)])
def test_cuda_decode_matches_float64_and_replays_in_a_graph(B, T):
    """Decode at the release's sizes (k = 2048 of an 8K cache): the key-split forward against float64, then
    captured in a CUDA graph and replayed on new queries, equal to eager."""
    H, D, d_v, S, k = 96, 576, 512, 8192, 2048
    q, lat, _, _ = _inputs(B, T, H, S, D, d_v, torch.bfloat16, grads=False)
    idx = _causal_selection(B, T, S, k, "cuda")
    run = lambda: sm.sparse_mla_fwd_triton(q, lat, idx, scale=192 ** -0.5, d_v=d_v)
    o, lse = run()
    o_r, lse_r = sparse_mla_gather(q.double(), lat.double(), idx, scale=192 ** -0.5, d_v=d_v)
    assert sm.fwd_config(B, T, H, k, D, d_v, q.device).splits > 1 or B * T * 3 >= 264
    assert rel_err(o, o_r) < TOL[torch.bfloat16] and rel_err(lse, lse_r) < 1e-5
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, lse_g = run()
    q.copy_(torch.randn_like(q))
    graph.replay()
    o_e, lse_e = run()
    assert torch.equal(o_g, o_e) and torch.equal(lse_g, lse_e)


# ---------------------------------------------------------------------------------------------- the layer path

def test_triton_backend_equals_gather_in_the_model(monkeypatch):
    """`Backend(attn="triton")` through the whole model (packed documents, padding, several query blocks, fp32):
    the logits and the gradient of every parameter of the 'gather' path; and under torch.compile (fullgraph, the
    kernels as opaque ops with fakes) the same logits."""
    import kimi
    from kimi import ops
    from helpers import assert_backend_equals_gather
    monkeypatch.setattr(ops, "QUERY_BLOCK", 8)
    assert_backend_equals_gather(kimi.Backend(attn="triton", kda="chunk", moe="dense"))
