"""The Triton KDA backward (kimi/ops/kda_bwd_triton.py) against the float64 autograd of the recurrence
`delta_rule.kda_recurrent`: dq, dk, dv, dg, dβ and dh0, each against its own tolerance, on the forward cases and
inputs of tests/test_kda_triton.py.

Tolerances (each gradient separately, loss Σ o·do + Σ S_N·dsN, ‖d − ref‖ / ‖ref‖):
- fp32 inputs: FP32_TOL (3e-6) for every gradient; measured ≤ 7.0e-7 over the cases below. What it took: dg is a
  suffix sum of per-row terms whose pairwise parts cancel, so the Aqk diagonal is kept out of them (it cancels
  exactly), both sides of every pair use one rounded product, each row takes the shorter of the suffix and the
  (negated) prefix sum, and exclusive prefix sums are never cumsum(x) − x; before those, dg reached 7e-6 with
  gates at −5.
- bf16 inputs: BWD_BF16_TOL (8e-3, FLA's ratio for its dq / dk / dv); measured dq, dk, dv ≤ 2.2e-3, dg ≤ 1.9e-3,
  dβ ≤ 1.4e-3, dh0 ≤ 5.1e-4 (the interpreter's 16-bit dots round as the tensor cores do). dq, dk, dv are returned
  in bf16 (their rounding alone is ~1e-3 of the norm), and the pairwise dots take bf16 operands (dAqk, dL and the
  anchored q, k), as in the forward.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.library import opcheck

from helpers import OpOutputs, rel_err, resets
from test_kda_triton import CASES, DEVICE, F64, FP32_TOL, GATES, _call, _f64, _inputs, _k3_inputs
from kimi.ops import delta_rule
from kimi.ops.registry import triton

if triton is not None:
    from kimi.ops import kda_bwd_triton as kb
    from kimi.ops import kda_triton as kt

pytestmark = pytest.mark.skipif(triton is None, reason="triton is not installed")

GRADS = ("q", "k", "v", "g", "beta", "initial_state")
BWD_BF16_TOL = 8e-3   # fp32: FP32_TOL (module docstring)


def _bwd_inputs(x, with_dsN, gen=None):
    B, T, H, K = x["q"].shape
    do = torch.randn(B, T, H, x["v"].shape[-1], dtype=F64, generator=gen).to(x["v"].dtype).to(DEVICE)
    dsN = torch.randn(B, H, K, x["v"].shape[-1], generator=gen).to(DEVICE) if with_dsN else None
    return do, dsN


def _reference_grads(x, reset, do, dsN, scale, fn=delta_rule.kda_recurrent, dtype=F64):
    """Autograd of `fn` in `dtype` on the same (rounded) inputs: the gradients of Σ o·do + Σ S_N·dsN, in GRADS'
    order (None for an absent initial state)."""
    xs = {n: t.detach().to(dtype).requires_grad_() if t is not None else None for n, t in x.items()}
    o, S = _call(fn, xs, reset, scale=scale)
    loss = (o * do.to(dtype)).sum() + ((S * dsN.to(dtype)).sum() if dsN is not None else 0)
    leaves = [xs[n] for n in GRADS if xs[n] is not None]
    grads = iter(torch.autograd.grad(loss, leaves))
    return [next(grads) if xs[n] is not None else None for n in GRADS]


def _check_grads(got, ref, x, tol):
    """Each gradient separately: dtype and shape of its input, relative error below its tolerance."""
    for name, d, r in zip(GRADS, got, ref):
        if r is None:
            assert d is None, name
            continue
        assert d.shape == x[name].shape and d.dtype == x[name].dtype, name
        assert torch.isfinite(d).all(), name
        err = rel_err(d.to(r.device), r)
        assert err < tol, f"d{name}: {err:.2e}"


BWD_CASES = {   # forward case, with a final-state gradient
    "bounded, resets inside and at a chunk edge": True,
    "documents in a row, near-zero / -5 gates": False,
    "saturated at -5, no initial state": True,
    "near-zero gates, one short chunk": False,
}


def _grads(x, reset, do, dsN, scale, **kw):
    return kb.kda_chunk_bwd_triton(*(x[n] for n in GRADS), reset.to(DEVICE) if reset is not None else None, do,
                                   dsN, scale=scale, **kw)


@pytest.mark.parametrize("case", BWD_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_float64_recurrence(case, dtype):
    """The forward cases (resets inside chunks, at chunk edges, at the first and last token; −5 and near-zero
    gates; with and without an initial state and a final-state gradient)."""
    B, T, H, K, V, gate, pos, h0 = CASES[case]
    x = _inputs(B, T, H, K, V, gate, dtype, h0)
    reset = resets(B, T, pos) if pos else None
    do, dsN = _bwd_inputs(x, BWD_CASES[case])
    ref = _reference_grads(_f64(x), reset, do.cpu(), dsN.cpu() if dsN is not None else None, 0.25)
    _check_grads(_grads(x, reset, do, dsN, 0.25), ref, x, FP32_TOL if dtype == torch.float32 else BWD_BF16_TOL)


@pytest.mark.parametrize("variant", ["recompute", "saved", "recompute, own reverse pass, auto columns, wide pairwise",
                                     "saved, 16-column reverse blocks, bf16 dS, q~ dO on bf16, TF32 chain",
                                     "saved, x2n reverse dots, 8-column blocks, 2 stages",
                                     "saved, state terms split, wide pairwise, auto columns, bf16 dS"])
def test_backward_head_dim_128(variant, monkeypatch):
    """K = V = 128 in bf16 (eight key blocks, two value blocks per program), a document start inside the short
    chunk; the scratch recomputed or the forward's (`kda_chunk_fwd_saving`), the reverse state pass's variants
    (`REVERSE`), the wide pairwise sums (`PAIRWISE`) and the state's terms in their own launch (`STATE_TERMS`)."""
    if "own" in variant:
        monkeypatch.setitem(kb.REVERSE, "kernel", "own")
    if "auto" in variant:
        monkeypatch.setitem(kb.REVERSE, "block_v", "auto")
    if "wide" in variant:
        monkeypatch.setattr(kb, "PAIRWISE", "wide")
    if "split" in variant:
        monkeypatch.setitem(kb.STATE_TERMS, "split", True)
    if "bf16 dS" in variant:
        monkeypatch.setitem(kb.REVERSE, "dstates", "16")
    if "16-column" in variant:
        monkeypatch.setitem(kb.REVERSE, "block_v", 16)
        monkeypatch.setitem(kb.REVERSE, "qd16", "q~ dO on bf16" in variant)
    if "TF32 chain" in variant:   # the chain's dots as at 96 heads' 64-column blocks
        monkeypatch.setitem(kb.REVERSE, "dots", None)
    if "x2n" in variant:
        monkeypatch.setitem(kb.REVERSE, "dots", "x2n")
        monkeypatch.setitem(kb.REVERSE, "num_stages", 2)
        monkeypatch.setitem(kb.REVERSE, "block_v", 8)
    x = _inputs(1, 40, 1, 128, 128, "bounded", torch.bfloat16)
    reset = resets(1, 40, [[23]])
    do, dsN = _bwd_inputs(x, True)
    ref = _reference_grads(_f64(x), reset, do.cpu(), dsN.cpu(), 128 ** -0.5)
    grads = _saved_grads if variant.startswith("saved") else _grads
    _check_grads(grads(x, reset, do, dsN, 128 ** -0.5), ref, x, BWD_BF16_TOL)


def _saved_grads(x, reset, do, dsN, scale, **kw):
    """The backward from `kda_chunk_fwd_saving`'s scratch, whose forward is `kda_chunk_fwd_triton`'s exactly."""
    inputs = [x[n] for n in GRADS] + [reset.to(DEVICE) if reset is not None else None]
    o, sN, saved = kb.kda_chunk_fwd_saving(*inputs, scale=scale, **kw)
    o_ref, sN_ref = kt.kda_chunk_fwd_triton(*inputs, scale=scale, **kw)
    assert torch.equal(o, o_ref) and torch.equal(sN, sN_ref)
    assert {n: (tuple(t.shape), t.dtype) for n, t in saved.items()} == kb.saved_layout(x["q"], x["v"], **kw)
    return kb.kda_chunk_bwd_triton(*inputs[:-1], inputs[-1], do, dsN, scale=scale, saved=saved, **kw)


def test_reverse_config_fits_one_wave():
    """block_v "auto" takes the narrowest column block whose programs fit one wave: one x2n program an SM (16-bit
    chain), two otherwise; "auto" dots take x2n up to 32 columns and K = 128; x2n at one stage is refused."""
    def pick(rows, K=128, chain=True):
        cfg = kb.reverse_config(K, 128, ieee=False, rows=rows, sms=132, chain=chain)
        return cfg["BV"], cfg["CHAIN"], cfg["num_stages"]
    assert pick(8) == (16, "x2n", 2)             # 64 programs
    assert pick(16)[:2] == (16, "x2n")           # 128
    assert pick(32)[:2] == (32, "x2n")           # 16 columns: 256 programs, two waves of one an SM
    assert pick(33)[:2] == (32, "x2n")           # 132
    assert pick(34)[:2] == (64, "")              # 32 columns: 136 programs; 64: TF32, two an SM
    assert pick(96)[:2] == (64, "")
    assert pick(32, chain=False)[:2] == (16, "")  # two programs an SM: 256 fit
    assert pick(8, K=256)[1] == ""               # x2n's two stages would not fit in shared memory
    assert kb.reverse_config(128, 32, ieee=False, rows=200, chain=True)["CHAIN"] == ""   # 64 → 32 columns, TF32
    assert kb.reverse_config(128, 128, ieee=True, rows=8)["CHAIN"] == ""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(kb.REVERSE, "num_stages", 1)
        with pytest.raises(ValueError, match="x2n dots at one stage"):
            pick(8)
        assert pick(96) == (64, "", 1)           # TF32 dots at one stage run


def test_x2n_chain_equals_x2(monkeypatch):
    """"x2n" (the two bf16 parts of dS / dU side by side in one dot) forms the same products as "x2" (two dots),
    which the interpreter multiplies exactly, so in the same 16-column blocks the fp32 chain results (dh0 and the
    final state) agree to fp32 summation order (numpy's matmul sums a [C, 2·16] product in another order than two
    [C, 16] ones: ≤ 1e-7 apart over 49 seeds), where a dropped low part moves them by 4e-4 (dh0) and 2e-3. Every
    other result passes through a bf16 rounding first: dq, dk, dv and o are bf16, and dg and dβ are formed from
    bf16 scratch, so they are bitwise equal unless that summation-order difference tips one of those roundings (2
    of the 49 seeds), which moved dq by 1.7e-4, dg by 4e-5 and dβ by 1e-5; a dropped low part moves each by
    1.5e-3 or more. V = 20 leaves the blocks partly masked. (The 8-column blocks the defaults take at few heads run
    in every bf16 test here against float64.)"""
    x = _inputs(1, 150, 1, 32, 20, "bounded", torch.bfloat16)
    reset = resets(1, 150, [[70]])
    do, dsN = _bwd_inputs(x, True)
    out = {}
    for dots in ("x2n", "x2"):
        with monkeypatch.context() as mp:
            mp.setitem(kt.V3, "state_dots", dots)
            mp.setitem(kt.V3, "state_block", 16)
            mp.setitem(kb.REVERSE, "dots", dots)
            mp.setitem(kb.REVERSE, "block_v", 16)
            mp.setitem(kb.REVERSE, "num_stages", 2)
            grads = _saved_grads(x, reset, do, dsN, 0.25)
            out[dots] = [*grads, *_call(kt.kda_chunk_fwd_triton, x, reset, scale=0.25)]
    tol = {"dq": 1e-3, "dk": 1e-3, "dv": 1e-3, "dg": 2e-4, "dbeta": 2e-4, "dh0": 1e-6, "o": 1e-3, "final state": 1e-6}
    assert len(out["x2n"]) == len(out["x2"]) == len(tol)
    for name, a, b in zip(tol, out["x2n"], out["x2"]):
        assert rel_err(a.float(), b.float()) < tol[name], name


def test_bf16_operands_equal_tf32(monkeypatch):
    """dO Uᵀ, dO S_nᵀ and U dS_{n+1}ᵀ on bf16 operands (kda_bwd_triton.BF16_OPERANDS) form the TF32
    dots' products exactly (their operands are stored in bf16), which the interpreter multiplies exactly: the fp32
    gradients (dg, dβ, dh0) agree to summation order, the bf16 ones to an ulp where that tips a rounding; an
    operand read from the wrong tensor or block moves them by O(1)."""
    x = _inputs(1, 100, 1, 32, 20, "bounded", torch.bfloat16)
    reset = resets(1, 100, [[70]])
    do, dsN = _bwd_inputs(x, True)
    out = {}
    for bf16 in (True, False):
        monkeypatch.setattr(kb, "BF16_OPERANDS", bf16)
        out[bf16] = _saved_grads(x, reset, do, dsN, 0.25)
    for a, b in zip(out[True], out[False]):
        assert rel_err(a.float(), b.float()) < (1e-6 if a.dtype == torch.float32 else 1e-3), (a.dtype, a.shape)


@pytest.mark.parametrize("case, dtype, pairwise", [
    ("bounded, resets inside and at a chunk edge", torch.bfloat16, "batched"),
    ("documents in a row, near-zero / -5 gates", torch.float32, "wide")])
def test_backward_from_forward_scratch(case, dtype, pairwise, monkeypatch):
    """`saved`: the forward's bf16 w, q̃, k̃, S_n (fp32 for fp32 inputs) instead of the fp32 recompute, on two of
    the forward cases (documents inside chunks and at their edges, with and without a final-state gradient), the
    fp32 one with the wide pairwise sums, the bf16 one with the state's terms in their own launch."""
    monkeypatch.setattr(kb, "PAIRWISE", pairwise)
    monkeypatch.setitem(kb.STATE_TERMS, "split", True)
    B, T, H, K, V, gate, pos, h0 = CASES[case]
    x = _inputs(B, T, H, K, V, gate, dtype, h0)
    reset = resets(B, T, pos)
    do, dsN = _bwd_inputs(x, BWD_CASES[case])
    ref = _reference_grads(_f64(x), reset, do.cpu(), dsN.cpu() if dsN is not None else None, 0.25)
    tol = FP32_TOL if dtype == torch.float32 else BWD_BF16_TOL
    _check_grads(_saved_grads(x, reset, do, dsN, 0.25), ref, x, tol)


@pytest.mark.parametrize("T, K, V, chunk_size, gate", [(53, 40, 20, 32, "near zero"), (30, 24, 48, 16, "mixed")])
def test_backward_variants_at_masked_widths(T, K, V, chunk_size, gate, monkeypatch):
    """bf16 from the forward's scratch with every variant on (wide pairwise sums, the state's terms in their own
    launch, the reverse pass's own kernel at "auto" columns with bf16 dS): key and value widths that leave masked
    channels in a block, chunks of 32 and 16, documents at and inside sub-block edges (and chunks without one,
    whose decay d_n carries dg a term)."""
    monkeypatch.setattr(kb, "PAIRWISE", "wide")
    monkeypatch.setitem(kb.STATE_TERMS, "split", True)
    monkeypatch.setitem(kb.REVERSE, "block_v", "auto")
    monkeypatch.setitem(kb.REVERSE, "dstates", "16")
    x = _inputs(1, T, 2, K, V, gate, torch.bfloat16)
    reset = resets(1, T, [[7, 16]])
    do, dsN = _bwd_inputs(x, True)
    ref = _reference_grads(_f64(x), reset, do.cpu(), dsN.cpu(), 0.25)
    _check_grads(_saved_grads(x, reset, do, dsN, 0.25, chunk_size=chunk_size), ref, x, BWD_BF16_TOL)


def test_op_keeps_the_forward_scratch_only_for_a_gradient(monkeypatch):
    """`SAVE = "forward"` through `kimi::kda_triton`: eager and compiled (fullgraph, AOT autograd) gradients against
    float64; a call under no_grad runs the plain forward; the private ops pass opcheck."""
    monkeypatch.setattr(kb, "SAVE", "forward")
    kept = []
    saving = kb.kda_chunk_fwd_saving
    monkeypatch.setattr(kb, "kda_chunk_fwd_saving", lambda *a, **kw: kept.append(1) or saving(*a, **kw))
    x = _inputs(1, 40, 2, 16, 16, "bounded", torch.bfloat16)
    reset = resets(1, 40, [[5, 32]])
    do, dsN = _bwd_inputs(x, True)
    ref = _reference_grads(_f64(x), reset, do.cpu(), dsN.cpu(), 0.25)
    op = lambda *a: torch.ops.kimi.kda_triton(*a, reset.to(DEVICE), scale=0.25)
    for fn in (op, torch.compile(op, fullgraph=True, backend="aot_eager_decomp_partition")):
        leaves = [x[n].detach().clone().requires_grad_() for n in GRADS]
        o, S = fn(*leaves)
        torch.autograd.backward((o, S), (do, dsN))
        _check_grads([t.grad for t in leaves], ref, x, BWD_BF16_TOL)
    assert len(kept) == 2
    with torch.no_grad():
        op(*(x[n] for n in GRADS))
    assert len(kept) == 2
    args = [x[n].float() for n in GRADS] + [reset.to(DEVICE)]
    o, S, saved = torch.ops.kimi._kda_triton_fwd(*args, scale=0.25, save=True)
    assert [n for n in kb.SAVED] == list(kb.saved_layout(args[0], args[2])) and len(saved) == len(kb.SAVED)
    opcheck(torch.ops.kimi._kda_triton_fwd.default, ([a.requires_grad_() for a in args[:-1]] + args[-1:]),
            dict(scale=0.25, save=True))
    opcheck(torch.ops.kimi._kda_triton_bwd_saved.default, (saved, *(a.detach() for a in args), do.float(), dsN),
            dict(scale=0.25))


def test_op_backward_gets_no_zeros_for_the_scratch(monkeypatch):
    """The scratch the forward keeps is an output of `kimi::_kda_triton_fwd` without a gradient: autograd must not
    hand its backward a zero tensor for each (as much memory again as the scratch); with o unused (the final state
    alone) the gradients equal those of a zero do."""
    monkeypatch.setattr(kb, "SAVE", "forward")
    x = _inputs(1, 40, 2, 16, 16, "bounded", torch.bfloat16)
    do, dsN = _bwd_inputs(x, True)
    scratch = {shape for shape, _ in kb.saved_layout(x["q"], x["v"]).values()}
    grads = []
    for outs, gouts in (((0, 1), (do, dsN)), ((1,), (dsN,)), ((0, 1), (torch.zeros_like(do), dsN))):
        leaves = [x[n].detach().clone().requires_grad_() for n in GRADS]
        res = torch.ops.kimi.kda_triton(*leaves, None, scale=0.25)
        with OpOutputs() as ops:
            torch.autograd.backward([res[i] for i in outs], gouts)
        zeros = {shape for op, shape in ops.outputs if op in (torch.ops.aten.zeros.default,
                                                              torch.ops.aten.zeros_like.default,
                                                              torch.ops.aten.new_zeros.default)}
        assert not scratch & zeros, zeros
        grads.append([t.grad for t in leaves])
    for a, b in zip(grads[1], grads[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@settings(max_examples=6, deadline=None)
@given(data=st.data(), T=st.integers(1, 100), K=st.sampled_from([16, 24, 40]), V=st.sampled_from([16, 20, 48]),
       chunk_size=st.sampled_from([16, 32, 64]), gate=st.sampled_from(GATES), h0=st.booleans(),
       with_dsN=st.booleans(), seed=st.integers(0, 2**31 - 1), pairwise=st.sampled_from(["batched", "wide"]))
def test_backward_any_shape(data, T, K, V, chunk_size, gate, h0, with_dsN, seed, pairwise):
    """Drawn lengths (T not a multiple of the chunk), widths (a second, masked key or value block), chunk sizes,
    gates, and document starts both at chunk and sub-block edges and anywhere, fp32; either pairwise layout."""
    x = _inputs(1, T, 1, K, V, gate, h0=h0, seed=seed)
    edges = [t for t in range(0, T, 16)]
    pos = data.draw(st.lists(st.sampled_from(edges), max_size=2)) + data.draw(
        st.lists(st.integers(0, T - 1), max_size=3))
    reset = resets(1, T, [pos])
    do, dsN = _bwd_inputs(x, with_dsN, torch.Generator().manual_seed(seed))
    ref = _reference_grads(_f64(x), reset, do.cpu(), dsN.cpu() if dsN is not None else None, 0.25)
    before, kb.PAIRWISE = kb.PAIRWISE, pairwise
    try:
        _check_grads(_grads(x, reset, do, dsN, 0.25, chunk_size=chunk_size), ref, x, FP32_TOL)
    finally:
        kb.PAIRWISE = before


def test_backward_rejects_bad_gradients():
    x = _inputs(1, 20, 1, 16, 16)
    do, dsN = _bwd_inputs(x, True)
    with pytest.raises(ValueError, match="do must be"):
        _grads(x, None, do[:, :10], dsN, 0.25)
    with pytest.raises(ValueError, match="dsN must be"):
        _grads(x, None, do, dsN.double(), 0.25)


# ---------------------------------------------------------------------------------------------- H200

@pytest.mark.gpu
@pytest.mark.parametrize("documents", [False, True])
def test_gpu_backward_k3_shape_matches_chunk(documents):
    """bf16 at B = 1, T = 8192, H = 96, K = V = 128, with a final-state gradient: every gradient against the fp32
    autograd of `kda_chunk` (IEEE matmuls) on the same inputs."""
    x, reset = _k3_inputs(torch.bfloat16)
    reset = reset.cuda() if documents else None
    do, dsN = _bwd_inputs(x, True)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = _reference_grads(x, reset, do, dsN, 128 ** -0.5, fn=delta_rule.kda_chunk, dtype=torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    _check_grads(_grads(x, reset, do, dsN, 128 ** -0.5), ref, x, BWD_BF16_TOL)


def _k3_documents_case(dtype):
    """K = V = 128, T = 1024, 8 heads with documents: the inputs, resets, output and final-state gradients, and the
    float64 autograd of the recurrence on them."""
    x, _ = _k3_inputs(dtype, T=1024, H=8)
    reset = resets(1, 1024, [[100, 640, 641]]).cuda()
    do, dsN = _bwd_inputs(x, True)
    return x, reset, do, dsN, _reference_grads(x, reset, do, dsN, 128 ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_backward_matches_float64_recurrence(dtype):
    """K = V = 128 over 16 chunks and 8 heads with documents against the float64 autograd of the recurrence:
    fp32 within 2e-5, bf16 within BWD_BF16_TOL; bf16 also from the forward's scratch (the op's path: at 8 heads
    the forward's state pass in 8-column blocks and the reverse pass with "x2n" dots)."""
    x, reset, do, dsN, ref = _k3_documents_case(dtype)
    tol = 2e-5 if dtype == torch.float32 else BWD_BF16_TOL
    _check_grads(_grads(x, reset, do, dsN, 128 ** -0.5), ref, x, tol)
    if dtype == torch.bfloat16:
        _check_grads(_saved_grads(x, reset, do, dsN, 128 ** -0.5), ref, x, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("reverse", [{"block_v": 16}, {"block_v": 32}, {"block_v": 64}, {"block_v": 32, "dots": None},
                                     {"block_v": 16, "dots": None, "num_stages": 2}, {"dots": "x2"}], ids=str)
def test_gpu_reverse_pass_launches_match_float64_recurrence(reverse, monkeypatch):
    """The op's path (bf16, from the forward's scratch) under the reverse pass's launches (`REVERSE` overrides: 16
    and 32 columns on x2n dots, 64 on TF32 as "auto" takes them; TF32 dots at 32 columns and one stage, at 16 and
    two; x2 dots) against the float64 autograd of the recurrence, at K = V = 128 with documents. (x2n dots at one
    stage, dk 0.11 off on an H100, are refused: `test_reverse_config_fits_one_wave`.)"""
    for name, value in reverse.items():
        monkeypatch.setitem(kb.REVERSE, name, value)
    x, reset, do, dsN, ref = _k3_documents_case(torch.bfloat16)
    _check_grads(_saved_grads(x, reset, do, dsN, 128 ** -0.5), ref, x, BWD_BF16_TOL)

