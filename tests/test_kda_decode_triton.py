"""The Triton decode step of KDA (kimi/ops/kda_decode_triton.py) against `kda_layer`'s torch path for T == 1
(`short_conv_cached`, `l2norm`, `kda_step` on `state * keep`) in float64: o, the state and the conv tails over several
steps, with rows that restart at a step, rows whose conv window still holds the previous document, and rows
mid-document. Without a GPU the kernel runs through Triton's interpreter (tests/conftest.py).

Tolerances:
- fp32 inputs: ‖out − ref‖ / ‖ref‖ < 1e-5 for o and the state (measured ~1e-7 after 4 steps: fp32 rounding of
  sums over K); the tails are raw inputs moved, so they must be bit-exact.
- bf16 inputs: the torch path rounds the conv outputs, the normalized q and k and o to bf16, and so does the kernel.
  The float64 reference rounds at the same points, and the raw inputs of channels whose rounded values lie within
  fp32 error of a bf16 rounding boundary are redrawn (`_near_tie`; a few channels per step at K = 128): there fp32
  and float64 may round apart by one bf16 ulp (a 1e-4 to 3e-3 change at these sizes). Then the kernel computes on
  exactly the reference's rounded values: the state gets the fp32 tolerance, and each element of o must be a
  round-to-nearest-even of a value within its fp32 error bound of the float64 o (`_check_rounded`).
"""

import pytest
import torch

from helpers import rel_err
from kimi.kda import l2norm, short_conv_cached
from kimi.ops.delta_rule import kda_step
from kimi.ops.registry import triton

if triton is not None:
    from kimi.ops import kda_decode_triton as kd

pytestmark = pytest.mark.skipif(triton is None, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
FP32_TOL = 1e-5
P0, STEPS = 5, 4        # slot of the first decoded token, steps per test
STARTS = [P0 + 1, 0, P0, P0 + 3]   # restart at step 1, mid-document, restart at step 0, restart at step 3


# ---------------------------------------------------------------------------------------------- reference

def _near_tie(x: torch.Tensor, err: torch.Tensor, dtype) -> torch.Tensor:
    """Where x, known to ±err, could round to two different values of dtype (all False for float32, which the
    reference does not round to)."""
    if dtype == torch.float32:
        return torch.zeros_like(x, dtype=torch.bool)
    return (x + err).to(dtype) != (x - err).to(dtype)


def _reference_step(xs, weights, tails, conv_reset, g, beta, S, *, scale, dtype):
    """`kda_layer`'s cached T == 1 step in float64, rounding to `dtype` where the torch path stores `dtype` values.
    xs and tails are float64 copies of the dtype values; tails are not modified. Returns (o before its rounding,
    the bound of o's fp32 error, the new state, the new tails, per stream q, k, v the channels [B, C] whose
    rounded values sit near a tie)."""
    B, H, K, V = S.shape
    rnd = (lambda t: t.to(dtype).to(F64)) if dtype != torch.float32 else (lambda t: t)
    later = conv_reset.flip(1).cumsum(1).flip(1) - conv_reset.int()      # document starts after each tap
    alive = (later == 0).to(F64)[..., None]                                  # [B, W, 1]
    convs, new_tails, ties = [], [], []
    for x, w, tail in zip(xs, weights, tails):
        W = w.shape[-1]
        window = torch.cat([tail, x[:, None]], 1)
        mag = (alive * window.abs() * w.double().view(-1, W).T.abs()).sum(1)   # Σ_j |w_j x_j| over live taps
        tail = tail.clone()
        y = short_conv_cached(x[:, None], w.double(), tail, conv_reset)[:, 0]
        ties.append(_near_tie(y, 2 ** -21 * (mag + y.abs()), dtype))   # the fp32 error bound of the W-term sum
        convs.append(rnd(y))
        new_tails.append(tail)
    q, k = (l2norm(c.view(B, H, K)) for c in convs[:2])
    for i, n in enumerate((q, k)):   # the sum of squares, the rsqrt and the product: well within 2^-19
        ties[i] |= _near_tie(n, 2 ** -19 * n.abs(), dtype).view(B, H * K)
    q, k = rnd(q), rnd(k)
    keep = (~conv_reset[:, -1]).to(F64)[:, None, None, None]
    o, S = kda_step(q, k, convs[2].view(B, H, V), g.double(), beta.double(), S * keep, scale=scale)
    o_err = 2 ** -18 * torch.einsum("bhkv,bhk->bhv", S.abs(), scale * q.abs())   # Σ_k |S q|: the dot's fp32 error
    return o, o_err, S, new_tails, ties


def _check_rounded(o: torch.Tensor, o_ref: torch.Tensor, o_err: torch.Tensor):
    """o (16-bit) is round-to-nearest-even of some value within o_err of o_ref (rounding is monotone)."""
    lo, hi = ((o_ref + s * o_err).to(o.dtype).double() for s in (-1, 1))
    got = o.double().cpu()
    bad = (got < lo) | (got > hi)
    assert not bad.any(), f"{int(bad.sum())} of {o.numel()} elements of o outside their rounding interval"


def _conv_weights(H, K, V, W):
    """fp32 depthwise conv weights [C, 1, W] for q, k (C = H·K) and v (C = H·V)."""
    return [torch.randn(H * D, 1, W) * W ** -0.5 for D in (K, K, V)]


def _conv_reset(pos, W, starts):
    window = pos + torch.arange(-(W - 1), 1)
    return window[None, :] == starts[:, None]


def _draw_step(B, H, K, V, dtype, weights, tails64, conv_reset, S64, scale, max_rounds=50):
    """New raw projections, g and beta for one step; the raw inputs of channels whose rounded values the reference
    finds near a tie are redrawn until there are none (a channel's conv output depends on its own input only)."""
    xs = [torch.randn(B, H * D).to(dtype) for D in (K, K, V)]
    g = -5 * torch.rand(B, H, K)                   # K3's bounded gate range [-5, 0]
    beta = torch.rand(B, H)
    for _ in range(max_rounds):
        *ref, ties = _reference_step([x.double() for x in xs], weights, tails64, conv_reset, g, beta, S64,
                                     scale=scale, dtype=dtype)
        if not any(t.any() for t in ties):
            return xs, g, beta, ref
        for x, t in zip(xs, ties):
            x[t] = torch.randn(int(t.sum())).to(dtype)
    raise AssertionError("near-tie roundings left after redrawing")


def _dev(*ts):
    """Copies on the test device (never the tensors themselves: the kernel writes some in place)."""
    return [t.to(DEVICE, copy=True) for t in ts]


# ---------------------------------------------------------------------------------------------- fused decode step

SHAPES = {   # name: (B, H, K, V, W, block_v)
    "K=V=16": (3, 2, 16, 16, 4, None),
    "K=V=32, four rows": (4, 3, 32, 32, 4, None),
    "K=24, V=40 in blocks of 16, W=3": (2, 2, 24, 40, 3, 16),
    "K=V=16, W=2 (a one-row tail)": (2, 2, 16, 16, 2, None),
    "K3 heads K=V=128": (1, 2, 128, 128, 4, None),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_match_reference(shape, dtype):
    """STEPS decode steps in a row (state and tails carried by the kernel): o, the state and the tails against the
    float64 torch path after every step. Rows restart at step 0 / 1 / 3 (state and taps before the start dropped,
    also in the following W−2 steps) or are mid-document; the initial state and tails are random history."""
    _decode_steps(shape, dtype)


THREE_BLOCKS = "K=24, V=40 in blocks of 16, W=3"


@pytest.mark.parametrize("shape, dtype, launch", [
    (THREE_BLOCKS, torch.bfloat16, dict(stream=True)), (THREE_BLOCKS, torch.bfloat16, dict(stream=True, stages=2)),
    (THREE_BLOCKS, torch.bfloat16, dict(max_registers=64)), (THREE_BLOCKS, torch.bfloat16, dict(v_first=False)),
    (THREE_BLOCKS, torch.bfloat16, dict(hoist=False)), (THREE_BLOCKS, torch.float32, dict(hoist=False)),
    (THREE_BLOCKS, torch.bfloat16, dict(hoist=False, state_ahead=False)),
    (THREE_BLOCKS, torch.bfloat16, dict(state_ahead=False)), (THREE_BLOCKS, torch.float32, dict(state_ahead=False)),
    ("K=V=16", torch.bfloat16, dict(state_ahead=False))],
    ids=["stream", "stream-2-stages", "register-cap", "conv-in-loop", "convs-in-turn", "convs-in-turn-fp32",
         "round-15-default", "no-state-ahead", "no-state-ahead-fp32", "no-state-ahead-one-block"])
def test_decode_steps_with_benchmark_launch_options(shape, dtype, launch):
    """The benchmarks' launch options (streaming cache hints, the column-block loop software-pipelined, a register
    cap, v's conv in the loop (round 14's default), the state not loaded a block ahead, the three convs' loads,
    barriers and shifts in turn (`hoist=False`), both (round 15's default)) match the float64 reference as the
    default does (`test_decode_steps_match_reference`): three column blocks a program (the last one partial), whose
    loads may run ahead of the previous block's in-place stores; and one block a program."""
    _decode_steps(shape, dtype, **launch)


def _decode_steps(shape, dtype, **launch):
    B, H, K, V, W, block_v = SHAPES[shape]
    scale = K ** -0.5
    starts = torch.tensor(STARTS[:B])
    weights = _conv_weights(H, K, V, W)
    tails = [torch.randn(B, W - 1, H * D).to(dtype) for D in (K, K, V)]
    state = 0.5 * torch.randn(B, H, K, V)
    tails64, S64 = [t.double() for t in tails], state.double()
    tails, state, weights_dev = _dev(*tails), *_dev(state), _dev(*weights)
    for step in range(STEPS):
        conv_reset = _conv_reset(P0 + step, W, starts)
        xs, g, beta, (o_ref, o_err, S64, tails64) = _draw_step(B, H, K, V, dtype, weights, tails64, conv_reset,
                                                                S64, scale)
        o = kd.kda_decode_step_triton(*_dev(*xs), *weights_dev, *tails, *_dev(conv_reset, g, beta), state,
                                      scale=scale, block_v=block_v, **launch)
        assert o.shape == (B, H, V) and o.dtype == dtype
        assert rel_err(state.cpu(), S64) < FP32_TOL, f"state after step {step}"
        for name, t, r in zip("qkv", tails, tails64):
            assert torch.equal(t.cpu(), r.to(dtype)), f"{name} tail after step {step}"
        if dtype == torch.float32:
            assert rel_err(o.cpu(), o_ref) < FP32_TOL, f"o at step {step}"
        else:
            _check_rounded(o, o_ref, o_err)


def _embedded(t: torch.Tensor, pad: int = 37):
    """t copied into the middle of a larger buffer of sentinels: (buffer, the contiguous view holding t)."""
    buf = torch.full((t.numel() + 2 * pad,), 7.0, dtype=t.dtype, device=t.device)
    view = buf[pad:pad + t.numel()].view(t.shape)
    view.copy_(t)
    return buf, view


def test_decode_updates_state_and_tails_in_place_only():
    """The state and the tails are written through their own storage (views into larger buffers: nothing outside
    them changes) and no input is written; o is a new tensor."""
    B, H, K, V, W = 2, 2, 16, 24, 4
    weights = _dev(*_conv_weights(H, K, V, W))
    conv_reset = _conv_reset(P0, W, torch.tensor([P0 - 1, 0]))
    xs = _dev(*(torch.randn(B, H * D) for D in (K, K, V)))
    g, beta = _dev(-5 * torch.rand(B, H, K), torch.rand(B, H))
    S0 = torch.randn(B, H, K, V)
    t0 = [torch.randn(B, W - 1, H * D) for D in (K, K, V)]
    (sbuf, state), *tail_bufs = [_embedded(t) for t in _dev(S0, *t0)]
    tails = [view for _, view in tail_bufs]
    inputs = [*xs, *weights, conv_reset.to(DEVICE), g, beta]
    before = [t.clone() for t in inputs]
    ptrs = [t.data_ptr() for t in (state, *tails)]

    o = kd.kda_decode_step_triton(*inputs[:6], *tails, *inputs[6:], state, scale=K ** -0.5)

    assert [t.data_ptr() for t in (state, *tails)] == ptrs
    assert all(o.data_ptr() != p for p in ptrs)
    for buf, view in [(sbuf, state), *tail_bufs]:
        assert (buf[:37] == 7.0).all() and (buf[37 + view.numel():] == 7.0).all(), "written outside the tensor"
    for a, b in zip(inputs, before):
        assert torch.equal(a, b), "an input was written"
    for t, old, x in zip(tails, t0, xs):   # shifted by one, the new raw input last
        assert torch.equal(t.cpu(), torch.cat([old[:, 1:], x.cpu()[:, None]], 1))
    _, _, S_ref, _, _ = _reference_step([x.double().cpu() for x in xs], [w.cpu() for w in weights],
                                        [t.double() for t in t0], conv_reset, g.cpu(), beta.cpu(), S0.double(),
                                        scale=K ** -0.5, dtype=torch.float32)
    assert rel_err(state.cpu(), S_ref) < FP32_TOL


@pytest.mark.parametrize("launch", [{}, dict(v_first=False), dict(block_v=8), dict(state_ahead=False, block_v=8),
                                    dict(hoist=False, block_v=8)],
                         ids=["default", "conv-in-loop", "state-ahead-two-blocks", "no-state-ahead",
                              "convs-in-turn-state-ahead"])
def test_restart_reads_neither_old_state_nor_dead_taps(launch):
    """A row whose new token starts its document computes from a zero state and zero taps without reading them:
    NaN there (e.g. garbage left by padding) does not reach o, the state or the other row (the default loads the
    state a block ahead, its first block with the convs' operands; also without that, and with the convs in turn)."""
    B, H, K, V, W = 2, 2, 16, 16, 4
    weights = _conv_weights(H, K, V, W)
    conv_reset = _conv_reset(P0, W, torch.tensor([P0, 0]))   # row 0 restarts, row 1 is mid-document
    xs = [torch.randn(B, H * D) for D in (K, K, V)]
    g, beta = -5 * torch.rand(B, H, K), torch.rand(B, H)
    S0 = torch.randn(B, H, K, V)
    t0 = [torch.randn(B, W - 1, H * D) for D in (K, K, V)]
    clean = [S0.clone(), *(t.clone() for t in t0)]
    for t in (S0, *t0):
        t[0] = float("nan")
    clean[0][0] = 0.0
    for t in clean[1:]:
        t[0] = 0.0
    state, *tails = _dev(S0, *t0)
    o = kd.kda_decode_step_triton(*_dev(*xs, *weights), *tails, *_dev(conv_reset, g, beta), state, scale=K ** -0.5,
                                  **launch)
    o_ref, _, S_ref, _, _ = _reference_step([x.double() for x in xs], weights, [t.double() for t in clean[1:]],
                                            conv_reset, g, beta, clean[0].double(), scale=K ** -0.5,
                                            dtype=torch.float32)
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(state.cpu(), S_ref) < FP32_TOL


def test_small_activations_norm_with_eps_inside_the_sqrt():
    """Raw inputs of ~1e-3 give conv outputs whose Σ q² is comparable to eps = 1e-6: the kernel matches `l2norm`
    (eps inside the sqrt), which differs from eps outside by far more than the tolerance at these values."""
    B, H, K, V, W = 2, 2, 16, 16, 4
    weights = _conv_weights(H, K, V, W)
    conv_reset = _conv_reset(P0, W, torch.tensor([0, P0 - 1]))
    xs = [1e-3 * torch.randn(B, H * D) for D in (K, K, V)]
    t0 = [1e-3 * torch.randn(B, W - 1, H * D) for D in (K, K, V)]
    g, beta, S0 = -5 * torch.rand(B, H, K), torch.rand(B, H), torch.randn(B, H, K, V)
    state, *tails = _dev(S0, *t0)
    o = kd.kda_decode_step_triton(*_dev(*xs, *weights), *tails, *_dev(conv_reset, g, beta), state, scale=K ** -0.5)
    o_ref, _, S_ref, _, _ = _reference_step([x.double() for x in xs], weights, [t.double() for t in t0], conv_reset,
                                            g, beta, S0.double(), scale=K ** -0.5, dtype=torch.float32)
    assert rel_err(o.cpu(), o_ref) < FP32_TOL and rel_err(state.cpu(), S_ref) < FP32_TOL
    c = short_conv_cached(xs[0].double()[:, None], weights[0].double(), t0[0].double(), conv_reset).view(B, H, K)
    assert rel_err(l2norm(c), c / (c.norm(dim=-1, keepdim=True) + 1e-6)) > 100 * FP32_TOL


# ---------------------------------------------------------------------------------------------- step without convs

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_inplace_matches_kda_step(dtype):
    """`kda_step_inplace_triton` (V split over the grid: 40 columns in blocks of 16) against float64 `kda_step` on
    `state * keep`, two steps, one row restarting at the second."""
    B, H, K, V = 2, 3, 32, 40
    scale = K ** -0.5
    state = torch.randn(B, H, K, V)
    S64 = state.double()
    state = state.to(DEVICE)
    for reset in (None, torch.tensor([False, True])):
        q, k = (l2norm(torch.randn(B, H, K)).to(dtype) for _ in range(2))
        v, g, beta = torch.randn(B, H, V).to(dtype), -5 * torch.rand(B, H, K), torch.rand(B, H)
        keep = 1.0 if reset is None else (~reset).to(F64)[:, None, None, None]
        o_ref, S64 = kda_step(q.double(), k.double(), v.double(), g.double(), beta.double(), S64 * keep,
                              scale=scale)
        o = kd.kda_step_inplace_triton(*_dev(q, k, v, g, beta), state, None if reset is None else reset.to(DEVICE),
                                       scale=scale, block_v=16)
        assert o.dtype == dtype and rel_err(state.cpu(), S64) < FP32_TOL
        if dtype == torch.float32:
            assert rel_err(o.cpu(), o_ref) < FP32_TOL
        else:
            _check_rounded(o, o_ref, 2 ** -18 * torch.einsum("bhkv,bhk->bhv", S64.abs(), scale * q.double().abs()))


# ---------------------------------------------------------------------------------------------- contract

def test_launch_config_and_errors():
    """The launch config is a function of the head dims; misuse gets one named error."""
    assert kd.decode_config(128, 128) == (128, 32, 4) and kd.decode_config(128, 128, fused=False) == (128, 64, 4)
    assert kd.decode_config(16, 16) == (16, 16, 1)
    B, H, K, W = 1, 1, 16, 4
    w = torch.randn(H * K, 1, W)
    x = torch.randn(B, H * K)
    tail = lambda: torch.zeros(B, W - 1, H * K)
    args = lambda state, t=None, wt=w: (x, x, x, wt, wt, wt, t if t is not None else tail(), tail(), tail(),
                                        torch.zeros(B, wt.shape[-1], dtype=torch.bool), torch.zeros(B, H, K),
                                        torch.zeros(B, H), state)
    S = torch.zeros(B, H, K, K)
    with pytest.raises(ValueError, match="contiguous float32"):
        kd.kda_decode_step_triton(*args(S.bfloat16()), scale=0.25)
    with pytest.raises(ValueError, match="one dtype"):
        kd.kda_decode_step_triton(*args(S, tail().bfloat16()), scale=0.25)
    with pytest.raises(ValueError, match="in place and must be contiguous"):
        kd.kda_decode_step_triton(*args(S, torch.zeros(B, H * K, W - 1).transpose(1, 2)), scale=0.25)
    with pytest.raises(ValueError, match="shapes"):
        kd.kda_decode_step_triton(*args(torch.zeros(B, H, K, 2 * K)), scale=0.25)
    with pytest.raises(ValueError, match="max_registers=300"):
        kd.kda_decode_step_triton(*args(S), scale=0.25, max_registers=300)
    with pytest.raises(ValueError, match="state_ahead needs"):
        kd.kda_decode_step_triton(*args(S), scale=0.25, state_ahead=True, v_first=False)
    with pytest.raises(ValueError, match="max_registers=8"):
        kd.kda_step_inplace_triton(x.view(B, H, K), x.view(B, H, K), x.view(B, H, K), torch.zeros(B, H, K),
                                   torch.zeros(B, H), S, scale=0.25, max_registers=8)
    with pytest.raises(ValueError, match="at least 2"):
        w1 = torch.randn(H * K, 1, 1)
        kd.kda_decode_step_triton(x, x, x, w1, w1, w1, *(torch.zeros(B, 0, H * K) for _ in range(3)),
                                  torch.zeros(B, 1, dtype=torch.bool), torch.zeros(B, H, K), torch.zeros(B, H), S,
                                  scale=0.25)


# ---------------------------------------------------------------------------------------------- GPU, K3 decode shape

K3_DECODE = (64, 96, 128, 128, 4)   # B, H, K, V, W


def _k3_decode_inputs(steps: int):
    """On the GPU at K3's decode shape: the conv weights, each row's document start (restarting within `steps`
    steps or mid-document), bf16 tails, a random fp32 state."""
    B, H, K, V, W = K3_DECODE
    weights = [w.to("cuda") for w in _conv_weights(H, K, V, W)]
    starts = torch.randint(0, P0 + steps, (B,))
    tails = [torch.randn(B, W - 1, H * D, device="cuda").bfloat16() for D in (K, K, V)]
    return weights, starts, tails, 0.5 * torch.randn(B, H, K, V, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [{}, dict(stream=True, stages=2, block_v=32), dict(max_registers=128),
                                    dict(v_first=False, block_v=32, num_warps=2),
                                    dict(block_v=16, num_warps=2), dict(hoist=False), dict(state_ahead=False)],
                         ids=["default", "stream", "register-cap", "conv-in-loop", "state-ahead-16-columns",
                              "convs-in-turn", "no-state-ahead"])
def test_gpu_k3_decode_matches_reference(launch):
    """B=64, H=96, K=V=128, bf16 activations, fp32 state, three steps (rows restarting at each, and mid-document),
    against the float64 reference on the GPU. At this size near-tie roundings are not redrawn (~1e-4 of the rounded
    values land one bf16 ulp from the reference's), so the tolerances are statistical: the state 1e-4 and o 5e-4
    relative to the rounded reference (the torch path's own fp32 run at B=16, H=24 differs by ≤ 6e-6 and 2.4e-5);
    the tails are moved bits, exact. Prints the time per step against the torch path's."""
    B, H, K, V, W = K3_DECODE
    dt, dev, scale = torch.bfloat16, "cuda", K ** -0.5
    weights, starts, tails, state = _k3_decode_inputs(3)
    tails64, S64 = [t.double() for t in tails], state.double()
    for step in range(3):
        conv_reset = _conv_reset(P0 + step, W, starts).to(dev)
        xs = [torch.randn(B, H * D, device=dev).to(dt) for D in (K, K, V)]
        g, beta = -5 * torch.rand(B, H, K, device=dev), torch.rand(B, H, device=dev)
        o = kd.kda_decode_step_triton(*xs, *weights, *tails, conv_reset, g, beta, state, scale=scale, **launch)
        o_ref, _, S64, tails64, _ = _reference_step([x.double() for x in xs], weights, tails64, conv_reset, g, beta,
                                                    S64, scale=scale, dtype=dt)
        assert all(torch.equal(t, r.to(dt)) for t, r in zip(tails, tails64)), step
        assert rel_err(state, S64) < 1e-4 and rel_err(o, o_ref.to(dt)) < 5e-4, step

    def torch_step():   # kda_layer's T == 1 path from the conv inputs to o, on copies
        q, k, v = (short_conv_cached(x[:, None], w, t, conv_reset)[:, 0] for x, w, t in zip(xs, weights, tails_t))
        q, k = l2norm(q.view(B, H, K)), l2norm(k.view(B, H, K))
        keep = (~conv_reset[:, -1]).float()[:, None, None, None]
        o, S = kda_step(q, k, v.view(B, H, V), g, beta, state_t * keep, scale=scale)
        state_t.copy_(S)
        return o.to(dt)

    tails_t, state_t = [t.clone() for t in tails], state.clone()
    us = []
    for fn in (lambda: kd.kda_decode_step_triton(*xs, *weights, *tails, conv_reset, g, beta, state, scale=scale),
               torch_step):
        fn()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(20):
            fn()
        ev[1].record()
        torch.cuda.synchronize()
        us.append(ev[0].elapsed_time(ev[1]) * 1e3 / 20)
    print(f"decode step B={B} H={H} K=V={K}: triton {us[0]:.0f} us ({2 * state.numel() * 4 / us[0] / 1e6:.2f} TB/s "
          f"on the state), torch path {us[1]:.0f} us")


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [{}, dict(state_ahead=False), dict(hoist=False)],
                         ids=["default", "no-state-ahead", "convs-in-turn"])
def test_gpu_v_first_launches_equal_the_conv_in_the_loop(launch):
    """The fused step with v's conv before the loop (the default: o holding v until each block overwrites it; its
    loads issued together, or the three convs in turn), with the state loaded a block ahead (the default) or not,
    against v's conv in the loop at the same blocks and warps, at K3's size: the same arithmetic, so o and the
    state agree to 1e-6 and the tails exactly, over five steps (rows restarting among them). A thread reading v
    back after another overwrote it with o, or a block of S after its store, would show here."""
    B, H, K, V, W = K3_DECODE
    dt, dev, scale = torch.bfloat16, "cuda", K ** -0.5
    weights, starts, tails, state = _k3_decode_inputs(5)
    tails2, state2 = [t.clone() for t in tails], state.clone()
    BK, BV, warps = kd.decode_config(K, V)
    for step in range(5):
        conv_reset = _conv_reset(P0 + step, W, starts).to(dev)
        xs = [torch.randn(B, H * D, device=dev).to(dt) for D in (K, K, V)]
        g, beta = -5 * torch.rand(B, H, K, device=dev), torch.rand(B, H, device=dev)
        o = kd.kda_decode_step_triton(*xs, *weights, *tails, conv_reset, g, beta, state, scale=scale, v_first=False,
                                      block_v=BV, num_warps=warps)
        o2 = kd.kda_decode_step_triton(*xs, *weights, *tails2, conv_reset, g, beta, state2, scale=scale,
                                       block_v=BV, num_warps=warps, **launch)
        assert all(torch.equal(a, b) for a, b in zip(tails, tails2)), step
        assert rel_err(state2, state) < 1e-6 and rel_err(o2, o) < 1e-6, step
