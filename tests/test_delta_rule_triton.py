"""The Triton state pass of chunked KDA (kimi/ops/delta_rule_triton.py) and its op `kimi::kda_states` against the
float64 chunk loop, forward and backward. Without a GPU they run through Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1); on the H200 compiled."""

import pytest
import torch

from helpers import rel_err
from kimi.ops import delta_rule_triton as dt
from kimi.ops.registry import triton

pytestmark = pytest.mark.skipif(triton is None, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _delta_inputs(R, N, C, K, V):
    r = lambda *s: torch.randn(*s, dtype=torch.float64)
    return (r(R, N, C, V), r(R, N, C, K) * K ** -0.5, r(R, N, C, K) * K ** -0.5,
            torch.rand(R, N, K, dtype=torch.float64), r(R, K, V))


@pytest.mark.parametrize("R, N, C, K, V", [(3, 4, 16, 32, 48), (2, 3, 24, 20, 16), (1, 5, 64, 128, 128)])
def test_delta_states_matches_reference(R, N, C, K, V):
    """The Triton state pass (fp32) against the float64 loop: every entering state, every U and the final state.
    C, K, V not powers of two (masked blocks) and the release's 64 / 128 / 128."""
    x = _delta_inputs(R, N, C, K, V)
    ref = dt.delta_states_reference(*x)
    got = dt.delta_states_triton(*(t.float().to(DEVICE) for t in x))
    for g, r in zip(got, ref):
        assert g.dtype == torch.float32 and g.shape == r.shape
        assert rel_err(g.double().cpu(), r) < 1e-5


@pytest.mark.parametrize("used", ["all", "final state only"])
def test_kda_states_op_gradients(used):
    """The op's backward (the reverse Triton pass, then batched algebra) against float64 autograd of the loop, for
    gradients reaching every output or only the final state (autograd passes None for the others)."""
    x = _delta_inputs(2, 4, 16, 24, 40)
    probes = [torch.randn(t.shape, dtype=torch.float64)
              for t in dt.delta_states_reference(*x)]
    if used != "all":
        probes[0] = probes[1] = None

    def grads(fn, xs):
        xs = [t.clone().requires_grad_() for t in xs]
        outs = fn(*xs)
        loss = sum((o * p.to(o)).sum() for o, p in zip(outs, probes) if p is not None)
        return torch.autograd.grad(loss, xs)

    ref = grads(dt.delta_states_reference, x)
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
    assert not w.is_contiguous() and dt._row_strided(w) is w and dt._row_strided(u) is u
    assert dt._row_strided(w.transpose(0, 1)).is_contiguous()
    k, d, s0 = (t.float().to(DEVICE) for t in (k64, d64, s064))
    ref = dt.delta_states_reference(u64, w64, k64, d64, s064)
    for g, r in zip(dt.delta_states_triton(u, w, k, d, s0), ref):
        assert rel_err(g.double().cpu(), r) < 1e-5
    dh, dU, dsN = (torch.randn_like(t) for t in dt.delta_states_triton(u.contiguous(), w.contiguous(), k, d, s0))
    strided = dt.delta_states_bwd_triton(w, k, d, dh, dU, dsN)
    dense = dt.delta_states_bwd_triton(w.contiguous(), k, d, dh, dU, dsN)
    assert all(torch.equal(a, b) for a, b in zip(strided, dense))


def test_delta_states_tf32_dots():
    """With TF32 dots (what training on a GPU uses: its fp32 matmuls run in TF32 too) the state pass still tracks
    the float64 loop at TF32's precision (inputs rounded to 10 mantissa bits, sums in fp32), forward and backward
    passes; by default the kernels follow torch's float32 matmul precision. (Under the interpreter the dots are
    full fp32 whatever the precision asked.)"""
    x = _delta_inputs(2, 8, 64, 128, 64)
    xs = [t.float().to(DEVICE) for t in x]
    ref = dt.delta_states_reference(*x)
    got = dt.delta_states_triton(*xs, tf32=True)
    assert all(rel_err(g.double().cpu(), r) < 5e-3 for g, r in zip(got, ref))
    if DEVICE == "cuda":   # the precision is really asked for: TF32 and IEEE dots round differently
        assert not torch.equal(got[1], dt.delta_states_triton(*xs, tf32=False)[1])
    dh, dU, dsN = (torch.randn_like(t) for t in got)
    bwd = [dt.delta_states_bwd_triton(xs[1], xs[2], xs[3], dh, dU, dsN, tf32=t) for t in (True, False)]
    assert all(rel_err(a.double(), b.double()) < 5e-3 for a, b in zip(*bwd))
    before = torch.get_float32_matmul_precision()
    try:
        for precision, tf32 in (("high", True), ("highest", False)):
            torch.set_float32_matmul_precision(precision)
            default, chosen = dt.delta_states_triton(*xs), dt.delta_states_triton(*xs, tf32=tf32)
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
    ref = dt.delta_states_reference(u, w, k, d, s0) if which == "fwd" else _delta_bwd_reference(w, k, d, *grads)
    f32 = lambda *ts: [t.float().to(DEVICE) for t in ts]
    blocks = dt._DELTA_BLOCKS[which, prec]
    assert blocks and all((bv, nw) in dt._ALL_BLOCKS for bv, nw in blocks)
    for bv, nw in blocks:
        BC, BK, _ = dt._delta_blocks(C, K, V, bv)
        outs = [torch.full_like(r, float("nan"), dtype=torch.float32, device=DEVICE) for r in ref]
        if which == "fwd":
            uu, ww, kk, dd, ss = f32(u, w, k, d, s0)
            args = (uu, ww, kk, dd, ss, *outs, N, uu.stride(1), uu.stride(2), ww.stride(1), ww.stride(2))
        else:
            ww, kk, dd, dh, dU, dsN = f32(w, k, d, *grads)
            args = (ww, kk, dd, dh, dU, dsN, *outs, N, ww.stride(1), ww.stride(2))
        dt._DELTA_KERNELS[which][(R, triton.cdiv(V, bv))](*args, C, K, V, BC=BC, BK=BK, BV=bv, PREC=prec,
                                                               num_warps=nw)
        for name, o, r in zip(("S_n", "U", "S_N") if which == "fwd" else ("dU", "lambda", "ds0"), outs, ref):
            assert rel_err(o.double().cpu(), r) < tol, (bv, nw, name)


def test_delta_states_rejects_what_it_cannot_run():
    x = _delta_inputs(1, 2, 16, 16, 16)
    with pytest.raises(ValueError, match="float32 tensors expected"):
        dt.delta_states_triton(*(t.to(DEVICE) for t in x))                      # float64
    u, w, k, d, s0 = (t.float().to(DEVICE) for t in _delta_inputs(1, 1, 16, 300, 16))
    with pytest.raises(ValueError, match="K=300 must be at most 256"):
        dt.delta_states_triton(u, w, k, d, s0)


def test_delta_states_block_v_and_devices_are_checked():
    u, w, k, d, s0 = (t.float().to(DEVICE) for t in _delta_inputs(1, 2, 16, 16, 40))
    ref = dt.delta_states_triton(u, w, k, d, s0, block_v=16)          # three column blocks, the last one masked
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(ref, dt.delta_states_triton(u, w, k, d, s0)))
    with pytest.raises(ValueError, match="block_v=24 must be a power of two"):
        dt.delta_states_triton(u, w, k, d, s0, block_v=24)
    with pytest.raises(ValueError, match=r"block_v=32 does not run with tf32 dots .* takes \[16\]"):
        dt.delta_states_triton(u, w, k, d, s0, block_v=32, tf32=True)      # out of shared memory on the H200
    if DEVICE == "cuda":
        with pytest.raises(RuntimeError, match="on one CUDA device"):
            dt.delta_states_triton(u, w, k, d, s0.cpu())
