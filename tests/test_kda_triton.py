"""The Triton chunked KDA forward (kimi/ops/kda_triton.py) against the float64 recurrence `kda_recurrent` and the
fp32 chunked form `kda_chunk`: outputs, final states, the intra-chunk quantities and the context-parallel pre-pass
(the backward: tests/test_kda_bwd_triton.py, on this file's cases and inputs).

Inputs are fresh each run (conftest seeds torch; hypothesis draws its own seed). Without a GPU the kernels run
through Triton's interpreter (conftest sets TRITON_INTERPRET=1), which for 16-bit inputs rounds the dot operands
as the tensor cores do (kda_triton's `_dot`), so the bf16 tolerances below are the GPU's; the `gpu` tests run the
K3 shape on the H200.

Tolerances (‖out − ref‖ / ‖ref‖ against float64 on the same, already rounded, inputs):
- fp32 inputs: 3e-6. Every dot is IEEE fp32; the one error beyond `kda_chunk`'s (~1e-7) is the anchored diagonal
  block, e^{g(n,r]} · e^{−g(n,j]} as two rounded factors whose exponents reach ±75 with gates of −5: measured
  ≤ 6e-7. A wrong mask, decay or segment is O(1e-2) or more.
- bf16 inputs: 5e-3 for o and the state (the ratio fla's own chunk_kda tests use). The bf16 output itself is
  rounded (~1.7e-3 of the norm); the pairwise strips take bf16 operands (q·e^g rounded: ~2e-3 on Aqk), the solve
  and the state pass TF32 ones: measured o 2.0–2.6e-3, state 0.9–1.2e-3; U_n and Aqk stored in bf16 between the
  kernels (the defaults since round 5) add ~3e-4 to o (2.9 → 3.2–3.3e-3 at T = 160, K = V = 128) and nothing to
  the state, whose update takes the fp32 U_n.
- The forward's options (kda_triton.V3: the "v4" and "v6" strips, other key pieces, fp32 scratch, the solve's and
  the state pass's dots, its column blocks, what is bf16 between the kernels) are held to the same tolerances
  in test_forward_options and test_forward_strips_variants; with its defaults (16-bit inputs: "v6", the factors
  from the chunks' prefix sums; fp32 ones: "v4", sums of exactly the gates spanned; the state pass's launch by the
  shape) w, q̃, k̃, S_n, U_n and Aqk are bf16 for bf16 inputs.
"""

import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import rel_err, resets
from kimi import kda
from kimi.ops import delta_rule, kda_triton as kt
from kimi.ops.registry import triton

pytestmark = pytest.mark.skipif(triton is None, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
FP32_TOL, BF16_TOL = 3e-6, 5e-3
GATES = ["bounded", "saturated", "near zero", "mixed"]


def _gate(kind, B, T, H, K, gen=None):
    """K3's bounded gates: lb·sigmoid (lb = −5), all at the bound, all near 0, and each entry −5 or near 0."""
    rn = lambda *s: torch.randn(*s, dtype=F64, generator=gen)
    near0 = -1e-3 * torch.rand(B, T, H, K, dtype=F64, generator=gen)
    if kind == "bounded":
        a_log = (1 + 15 * torch.rand(H, dtype=F64, generator=gen)).log()
        return kda.kda_gate(rn(B, T, H, K), a_log, rn(H * K), -5.0)
    if kind == "saturated":
        return torch.full((B, T, H, K), -5.0, dtype=F64)
    if kind == "near zero":
        return near0
    if kind == "mixed":
        return torch.where(torch.rand(B, T, H, K, generator=gen) < 0.5, -5.0, near0)
    raise ValueError(kind)


def _inputs(B, T, H, K, V, gate="bounded", dtype=torch.float32, h0=True, seed=None):
    """q, k (unit rows), v in `dtype`; g, beta and the initial state in fp32 (as the layer passes them)."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, dtype=F64, generator=gen)
    x = dict(q=kda.l2norm(rn(B, T, H, K)).to(dtype), k=kda.l2norm(rn(B, T, H, K)).to(dtype),
             v=rn(B, T, H, V).to(dtype), g=_gate(gate, B, T, H, K, gen).float(),
             beta=torch.sigmoid(rn(B, T, H)).float(), initial_state=rn(B, H, K, V).float() if h0 else None)
    return {n: t.to(DEVICE) if t is not None else None for n, t in x.items()}


def _f64(x):
    return {n: t.cpu().double() if t is not None else None for n, t in x.items()}


def _call(fn, x, reset=None, scale=0.25, **kw):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"],
              reset.to(x["q"].device) if reset is not None else None, scale=scale, **kw)


# ---------------------------------------------------------------------------------------------- forward

CASES = {   # name: (B, T, H, K, V, gate, reset positions per row, initial state)
    "bounded, resets inside and at a chunk edge": (2, 100, 2, 32, 16, "bounded", [[5, 40], [64]], True),
    "documents in a row, near-zero / -5 gates": (2, 150, 2, 16, 24, "mixed", [[0, 17, 18, 64, 128, 149], []], True),
    "saturated at -5, no initial state": (1, 70, 2, 32, 32, "saturated", None, False),
    "near-zero gates, one short chunk": (2, 37, 1, 16, 16, "near zero", [[], [36]], True),
}


@functools.cache
def _forward_case(case, dtype):
    """Inputs of a forward case and their float64 (o, S) (for fp32 also `kda_chunk`'s), drawn once a session: the
    two forwards are checked on the same inputs, and the recurrence (most of a case's time) runs once."""
    B, T, H, K, V, gate, pos, h0 = CASES[case]
    x = _inputs(B, T, H, K, V, gate, dtype, h0)
    reset = resets(B, T, pos) if pos else None
    chunk = _call(delta_rule.kda_chunk, x, reset) if dtype == torch.float32 else None
    return x, reset, _call(delta_rule.kda_recurrent, _f64(x), reset), chunk


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_float64_recurrence(case, dtype):
    """o and the final state against the float64 recurrence on the same inputs, T not a multiple of the chunk, with
    packed documents; for fp32 also no worse than 4x the traced fp32 `kda_chunk` (+1e-6)."""
    B, T, H, K, V, gate, pos, h0 = CASES[case]
    x, reset, (o_ref, S_ref), chunk = _forward_case(case, dtype)
    o, S = _call(kt.kda_chunk_fwd_triton, x, reset)
    assert o.dtype == dtype and o.shape == (B, T, H, V) and S.dtype == torch.float32 and S.shape == (B, H, K, V)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert rel_err(o.cpu(), o_ref) < tol and rel_err(S.cpu(), S_ref) < tol
    if dtype == torch.float32:
        o_c, S_c = chunk
        assert rel_err(o.cpu(), o_ref) <= 4 * rel_err(o_c.cpu(), o_ref) + 1e-6
        assert rel_err(S.cpu(), S_ref) <= 4 * rel_err(S_c.cpu(), S_ref) + 1e-6


@pytest.mark.parametrize("case", ["documents in a row, near-zero / -5 gates", "saturated at -5, no initial state"])
def test_forward_strips_variants(case, monkeypatch):
    """The strips the defaults do not run for 16-bit inputs (kda_triton.V3["strips"]; the defaults: "v6" for 16-bit
    inputs, its prefix sums from `_gamma_kernel`, and "v4" for fp32 ones): "v4" in bf16, on two of the cases above:
    documents at and inside chunk edges with mixed gates, gates at the bound, partial chunks (at K = 128:
    test_forward_options)."""
    monkeypatch.setitem(kt.V3, "strips", "v4")
    x, reset, (o_ref, S_ref), chunk = _forward_case(case, torch.bfloat16)
    o, S = _call(kt.kda_chunk_fwd_triton, x, reset)
    assert rel_err(o.cpu(), o_ref) < BF16_TOL and rel_err(S.cpu(), S_ref) < BF16_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dim_128(dtype):
    """The release's K = V = 128 (several key and state-column blocks per program) at a tiny T, a document start
    inside the one short chunk."""
    x = _inputs(1, 40, 1, 128, 128, "bounded", dtype)
    reset = resets(1, 40, [[23]])
    o_ref, S_ref = _call(delta_rule.kda_recurrent, _f64(x), reset, scale=128 ** -0.5)
    o, S = _call(kt.kda_chunk_fwd_triton, x, reset, scale=128 ** -0.5)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert rel_err(o.cpu(), o_ref) < tol and rel_err(S.cpu(), S_ref) < tol
    if dtype == torch.bfloat16:   # the fast path really rounds its operands: not the fp32 run's result rounded
        o32, S32 = _call(kt.kda_chunk_fwd_triton, {n: t.float() for n, t in x.items()}, reset, scale=128 ** -0.5)
        assert not torch.equal(o, o32.to(dtype)) and not torch.equal(S, S32)


def test_forward_options(monkeypatch):
    """The forward's options (kda_triton.V3) at K = V = 128 in bf16, a document start inside a chunk: v4's strips
    with other w pieces and fp32 scratch and states, or with the state pass's "x2" dots in 16-column blocks; its
    "x2n" dots (the two bf16 parts side by side in one dot) in 16- and 32-column blocks (the default at these few
    heads: 8 columns; 32 at 32 heads), "x2" in 64 (the default at 96 heads) with the output kernel's whole key dim
    in one piece; the state pass's bf16 dots; the solve's bf16 dots; u as well as U_n in bf16 with q̃, k̃ and d
    from the solve; fp32 u, U_n and Aqk; each within the bf16 tolerance of the float64 recurrence; the default bf16
    scratch really rounded (it differs from the fp32 scratch's result). Two gate kinds as two heads."""
    T = 80
    xs = [_inputs(1, T, 1, 128, 128, gate, torch.bfloat16) for gate in ("bounded", "mixed")]
    x = {n: torch.cat([t[n] for t in xs], dim=2 if n != "initial_state" else 1) for n in xs[0]}
    reset = resets(1, T, [[23]])
    o_ref, S_ref = _call(delta_rule.kda_recurrent, _f64(x), reset, scale=128 ** -0.5)
    o_16, _ = _call(kt.kda_chunk_fwd_triton, x, reset, scale=128 ** -0.5)
    for options in (dict(strips="v4", block_kw=16, scratch="fp32", states="fp32"),
                    dict(strips="v4", block_kw=64, state_dots="x2", state_block=16, state_warps=8, state_stages=2),
                    dict(state_dots="x2n", state_block=16, state_warps=4, state_stages=2),
                    dict(state_dots="x2n", state_block=32, state_warps=8, state_stages=3),
                    dict(state_dots="x2", state_block=64, state_warps=4, state_stages=2, output_bk=128),
                    dict(state_dots="16", state_block=32), dict(solve_dots="16", block_kw=64),
                    dict(u16=True, strips_qkd=False), dict(u16=False, a16=False)):
        with monkeypatch.context() as mp:
            for name, value in options.items():
                mp.setitem(kt.V3, name, value)
            o, S, scratch, _ = _call(kt.kda_chunk_fwd_triton, x, reset, scale=128 ** -0.5, residuals=True)
            s16 = kt.V3["scratch"] == "16"
            want = {"u": torch.bfloat16 if s16 and kt.V3["u16"] else torch.float32,   # U_n, as the backward keeps it
                    "A": torch.bfloat16 if s16 and kt.V3["a16"] else torch.float32}
        assert {n: scratch[n].dtype for n in want} == want, options
        assert rel_err(o.cpu(), o_ref) < BF16_TOL and rel_err(S.cpu(), S_ref) < BF16_TOL, options
        if "scratch" in options:
            assert not torch.equal(o, o_16)


def test_output_in_state_pass(monkeypatch):
    """O_n formed in the state pass (kda_triton.V3["out"] = "state": no `_output_kernel`, S_n and U_n stored only
    with residuals) at K = V = 32 in bf16, a document start inside a chunk, its dots on S_n and U_n as two bf16
    parts, in 16-column blocks and in `_auto_state`'s 8 at these two heads, alone and keeping the backward's
    scratch: within the bf16 tolerance of the float64 recurrence, and the kept S_n, U_n and the final state are the
    output kernel's path's exactly (the same chain of S)."""
    T = 80
    x = _inputs(1, T, 2, 32, 32, "mixed", torch.bfloat16)
    reset = resets(1, T, [[23]])
    o_ref, S_ref = _call(delta_rule.kda_recurrent, _f64(x), reset)
    launch = dict(state_block=16, state_dots="x2n", state_warps=8, state_stages=3)
    with monkeypatch.context() as mp:
        for name, value in dict(out="kernel", **launch).items():
            mp.setitem(kt.V3, name, value)
        o_k, S_k, scratch_k, states_k = _call(kt.kda_chunk_fwd_triton, x, reset, residuals=True)
    for options in (launch, dict(state_block="auto")):
        with monkeypatch.context() as mp:
            for name, value in {"out": "state", **options}.items():
                mp.setitem(kt.V3, name, value)
            o, S = _call(kt.kda_chunk_fwd_triton, x, reset)
            o_r, S_r, scratch, states = _call(kt.kda_chunk_fwd_triton, x, reset, residuals=True)
        assert rel_err(o.cpu(), o_ref) < BF16_TOL and rel_err(S.cpu(), S_ref) < BF16_TOL, options
        assert torch.equal(o, o_r) and torch.equal(S, S_r), options
        if options.get("state_block") == 16:
            assert torch.equal(S, S_k) and torch.equal(states, states_k) and torch.equal(scratch["u"], scratch_k["u"])


def test_output_in_state_pass_auto():
    """`fuse_output`'s "auto" (the default): O_n in the state pass for 16-bit inputs where `_auto_state` runs at most
    one program an SM in at most four column blocks (32 heads: 32 columns), not at 96 heads (two programs an SM)
    nor at 8 (sixteen 8-column blocks, each reading q̃ and Aqk again), nor for fp32 inputs or scratch."""
    cpu, bf, f32 = torch.device("cpu"), torch.bfloat16, torch.float32
    assert kt.V3["out"] == "auto"
    assert kt.fuse_output(32, 128, bf, bf, cpu)
    assert not kt.fuse_output(96, 128, bf, bf, cpu) and not kt.fuse_output(8, 128, bf, bf, cpu)
    assert not kt.fuse_output(32, 128, f32, f32, cpu) and not kt.fuse_output(32, 128, bf, f32, cpu)


@settings(max_examples=10, deadline=None)
@given(data=st.data(), T=st.integers(1, 140), H=st.integers(1, 2), K=st.sampled_from([16, 24, 32]),
       V=st.sampled_from([16, 20, 32]), chunk_size=st.sampled_from([16, 32, 64]), gate=st.sampled_from(GATES),
       h0=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_forward_any_shape(data, T, H, K, V, chunk_size, gate, h0, seed):
    """Drawn lengths, widths (K, V not powers of two: masked pieces), chunk sizes, gates and document starts, fp32."""
    x = _inputs(1, T, H, K, V, gate, h0=h0, seed=seed)
    reset = resets(1, T, [data.draw(st.lists(st.integers(0, T - 1), max_size=5))])
    o_ref, S_ref = _call(delta_rule.kda_recurrent, _f64(x), reset)
    o, S = _call(kt.kda_chunk_fwd_triton, x, reset, chunk_size=chunk_size)
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(S.cpu(), S_ref) < FP32_TOL


def test_intra_chunk_quantities():
    """`kda_intra_triton`'s w, u, q̃, k̃, d, Aqk and (I + L)⁻¹ against their definitions (kda_triton's docstring)
    in float64: pairwise exponentials over [C, C, K], the solve by `solve_triangular`, segments from the resets;
    fp32 inputs (the "v4" strips: 16-bit inputs' "v6" is held to the bf16 tolerances of the forward tests)."""
    B, T, H, K, V, C = 1, 64, 2, 16, 24, 32
    x = _inputs(B, T, H, K, V, "bounded", h0=False)
    reset = resets(B, T, [[9, 32, 50]])
    got = kt.kda_intra_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], reset.to(DEVICE), scale=0.25,
                              chunk_size=C, inverse=True)
    N = T // C
    q, k, v, g, beta = (t.cpu().double().transpose(1, 2).reshape(B * H, N, C, -1) for t in
                        (x["q"], x["k"], x["v"], x["g"], x["beta"][..., None]))
    seg = reset.reshape(B, 1, N, C).expand(B, H, N, C).reshape(B * H, N, C).long().cumsum(-1)
    same = seg[..., :, None] == seg[..., None, :]
    row = torch.arange(C)
    gam = g.cumsum(-2)
    span = torch.where((row[:, None] >= row[None, :])[..., None], gam[..., :, None, :] - gam[..., None, :, :],
                       float("-inf"))                                      # g(j, r] for j <= r
    pair = lambda a: (a[..., :, None, :] * k[..., None, :, :] * span.exp()).sum(-1)
    L = torch.where(same & (row[:, None] > row[None, :]), pair(k), 0.0) * beta
    A = torch.where(same & (row[:, None] >= row[None, :]), pair(q), 0.0) * 0.25
    first, last = (seg == 0)[..., None], (seg == seg[..., -1:])[..., None]
    eye = torch.eye(C, dtype=F64)
    inv = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    want = dict(w=inv @ (beta * k * gam.exp() * first), u=inv @ (beta * v), qd=0.25 * q * gam.exp() * first,
                kd=k * (gam[..., -1:, :] - gam).exp() * last, A=A,
                d=gam[..., -1, :].exp() * (seg[..., -1:] == 0), M=inv)
    for name, ref in want.items():
        assert got[name].shape == ref.shape, name
        assert rel_err(got[name].cpu(), ref) < 1e-5, name


# ---------------------------------------------------------------------------------------------- context parallelism

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cp_prepass_is_the_slice_map(dtype):
    """S_end = M S_start + S_zero for a random S_start, against the float64 forward from S_start; M against the
    float64 transition (the recurrence from S = I with v = 0) on near-zero gates, where M stays O(1); a document
    start in the slice makes M exactly 0.
    Then two slices chained by their pre-passes give the whole sequence's final state, and the second slice run
    from the chained state gives the whole sequence's outputs there."""
    B, T, H, K, V = 2, 90, 2, 16, 24
    x = _inputs(B, T, H, K, V, "bounded", dtype, h0=False)
    reset = resets(B, T, [[], [70]])
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    s_zero, M = kt.kda_cp_prepass_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], reset.to(DEVICE), chunk_size=32)
    assert s_zero.shape == (B, H, K, V) and M.shape == (B, H, K, K) and M.dtype == s_zero.dtype == torch.float32
    x64 = _f64(x)
    s_start = torch.randn(B, H, K, V, dtype=F64)
    _, S_ref = _call(delta_rule.kda_recurrent, x64 | {"initial_state": s_start}, reset)
    assert rel_err(M.cpu().double() @ s_start + s_zero.cpu(), S_ref) < tol
    # M itself on near-zero gates: over 90 tokens of bounded gates it decays to ~1e-25 (its part of S_end, checked
    # above, is then nothing), where a relative error of M measures only the rounding of vanishing entries
    xm = _inputs(B, T, H, K, V, "near zero", dtype, h0=False)
    _, M = kt.kda_cp_prepass_triton(xm["q"], xm["k"], xm["v"], xm["g"], xm["beta"], reset.to(DEVICE), chunk_size=32)
    zeros_v = torch.zeros(B, T, H, K, dtype=F64)
    _, M_ref = _call(delta_rule.kda_recurrent, _f64(xm) | {"v": zeros_v, "initial_state": torch.eye(K, dtype=F64)
                                                           .expand(B, H, K, K)}, reset)
    assert rel_err(M[0].cpu(), M_ref[0]) < (1e-5 if dtype == torch.float32 else 2e-2)
    assert torch.equal(M[1].cpu(), torch.zeros(H, K, K))                   # row 1 has a document start

    cut = 50                                                               # two "ranks": [0, 50) and [50, 90)
    part = lambda lo, hi: {n: t[:, lo:hi] for n, t in x.items() if n != "initial_state"}
    rst = lambda lo, hi: reset[:, lo:hi].to(DEVICE)
    (z0, M0), (z1, M1) = (kt.kda_cp_prepass_triton(**part(lo, hi), reset=rst(lo, hi)) for lo, hi in ((0, cut),
                                                                                                      (cut, T)))
    s_cut = z0                                                             # rank 0 starts from zero
    s_end = M1 @ s_cut + z1
    o_ref, S_ref = _call(delta_rule.kda_recurrent, x64, reset)
    assert rel_err(s_end.cpu(), S_ref) < tol
    o1, S1 = kt.kda_chunk_fwd_triton(**part(cut, T), initial_state=s_cut, reset=rst(cut, T), scale=0.25)
    assert rel_err(o1.cpu(), o_ref[:, cut:]) < tol and rel_err(S1.cpu(), S_ref) < tol


# ---------------------------------------------------------------------------------------------- contract

def test_rejects_what_it_cannot_run():
    x = _inputs(1, 20, 1, 16, 16)
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        _call(kt.kda_chunk_fwd_triton, {n: t.double() for n, t in x.items()})
    with pytest.raises(ValueError, match="chunk_size=24 must be 16, 32 or 64"):
        _call(kt.kda_chunk_fwd_triton, x, chunk_size=24)
    with pytest.raises(ValueError, match="initial_state must be float32"):
        _call(kt.kda_chunk_fwd_triton, x | {"initial_state": x["initial_state"].double()})
    with pytest.raises(ValueError, match="reset must be"):
        _call(kt.kda_chunk_fwd_triton, x, reset=torch.zeros(1, 19, dtype=torch.bool))
    with pytest.raises(ValueError, match="at least one token"):
        _call(kt.kda_chunk_fwd_triton, {n: t[:, :0] if n != "initial_state" else t for n, t in x.items()})


@pytest.mark.parametrize("name, value, match", [("strips", "v3", "strips"), ("u16", "u", "u16"),
                                                ("split", True, "unknown options"), ("pieces", 1, "unknown options"),
                                                ("out", "states", "out")])
def test_rejects_options_that_do_not_exist(name, value, match, monkeypatch):
    """A retired or mistyped `V3` option is a named error, not the defaults run in its place."""
    monkeypatch.setitem(kt.V3, name, value)
    with pytest.raises(ValueError, match=match):
        _call(kt.kda_chunk_fwd_triton, _inputs(1, 20, 1, 16, 16, dtype=torch.bfloat16))


# ---------------------------------------------------------------------------------------------- H200

def _k3_inputs(dtype, T=8192, H=96, B=1, K=128):
    x = _inputs(B, T, H, K, K, "bounded", dtype)
    return x, resets(B, T, [[0, 1300, 1847, 3895, 4858, 5129]])            # FlashKDA's varlen documents


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("documents", [False, True])
def test_gpu_k3_shape_matches_chunk(dtype, documents):
    """B = 1, T = 8192, H = 96, K = V = 128 against `kda_chunk` in fp32 (IEEE matmuls) on the same inputs: bf16
    within FLA's 5e-3, fp32 within 2e-5 (measured on the CPU at small shapes ≤ 6e-7 against float64)."""
    x, reset = _k3_inputs(dtype)
    reset = reset.cuda() if documents else None
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        o_ref, S_ref = _call(delta_rule.kda_chunk, {n: t.float() for n, t in x.items()}, reset, scale=128 ** -0.5)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    o, S = _call(kt.kda_chunk_fwd_triton, x, reset, scale=128 ** -0.5)
    tol = 2e-5 if dtype == torch.float32 else BF16_TOL
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_err(o, o_ref) < tol and rel_err(S, S_ref) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 32])
@pytest.mark.parametrize("out", ["kernel", "state"])
def test_gpu_matches_float64_recurrence(H, out, monkeypatch):
    """bf16 at K = V = 128 over 16 chunks against the float64 recurrence, with documents, at 8 and 32 heads (the
    state pass's 8- and 32-column launches), O_n from `_output_kernel` or from the state pass (V3["out"])."""
    monkeypatch.setitem(kt.V3, "out", out)
    _check_k3_against_float64(H)


def _check_k3_against_float64(H):
    """bf16 at K = V = 128, T = 1024, with documents: output and final state against the float64 recurrence."""
    x, _ = _k3_inputs(torch.bfloat16, T=1024, H=H)
    reset = resets(1, 1024, [[100, 640, 641]]).cuda()
    o_ref, S_ref = _call(delta_rule.kda_recurrent, {n: t.double() for n, t in x.items()}, reset,
                         scale=128 ** -0.5)
    o, S = _call(kt.kda_chunk_fwd_triton, x, reset, scale=128 ** -0.5)
    assert rel_err(o, o_ref) < BF16_TOL and rel_err(S, S_ref) < BF16_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("out", ["kernel", "state"])
def test_gpu_state_pass_x2n_launches_match_float64_recurrence(stages, out, monkeypatch):
    """The forward's state pass on x2n dots in a fixed 16-column launch at one to three stages (`V3`'s state_block,
    state_dots, state_stages; "auto" takes two or three), O_n from either kernel, against the float64 recurrence:
    the reverse pass's x2n dots at one stage gave wrong gradients on an H100 (Triton 3.6)."""
    for name, value in dict(state_block=16, state_dots="x2n", state_stages=stages, state_warps=8, out=out).items():
        monkeypatch.setitem(kt.V3, name, value)
    _check_k3_against_float64(8)


@pytest.mark.gpu
def test_gpu_cp_prepass_at_k3_width():
    """The pre-pass at K = V = 128, T = 4096, bf16: M S + S_zero against the forward from S."""
    x, _ = _k3_inputs(torch.bfloat16, T=4096, H=8)
    s_zero, M = kt.kda_cp_prepass_triton(x["q"], x["k"], x["v"], x["g"], x["beta"])
    s = x["initial_state"]
    _, S_ref = _call(delta_rule.kda_chunk, {n: t.float() for n, t in x.items()}, scale=128 ** -0.5)
    assert rel_err(M @ s + s_zero, S_ref) < BF16_TOL
