"""The KDA core: the gated delta rule over a sequence, its decode step and its chunked forms, each registered
as a `kimi::` op (docs/numerics.md#kda-recurrence, #kda-chunk).

Notation: B batch, T tokens, H heads, K key head dim, V value head dim, C chunk size, BC = 16 sub-chunk size. Per
(sequence, head) the state is S ∈ R^{K×V} ("K-first"). Per token: log-decay g_t ∈ R^K (g ≤ 0, decay α_t = e^{g_t}),
write strength β_t ∈ (0, 1), scale s = K^-1/2.

    S'_t = Diag(e^{g_t}) S_{t-1}                           decay key channels
    S_t  = S'_t + k_t (β_t (v_t − S'_tᵀ k_t))ᵀ             delta-rule write
    o_t  = S_tᵀ (s q_t)                                    read after the write (a token sees itself)

`kda_recurrent` is that loop and *defines* the op; `kda_chunk` computes the same thing chunkwise-parallel: within
a chunk the writes solve a unit-lower-triangular system (UT transform), only the state hand-off between chunks is
sequential. `kda_chunk_opaque` is `kda_chunk` as one opaque op (short compiles), `kda_chunk_triton` runs the
hand-off as the Triton state pass `kimi::kda_states` (kernels in `delta_rule_triton.py`). `kimi::kda_triton` is the
whole chunked forward and backward as Triton kernels (`kda_triton.py`; bounded gates), `kimi::kda_decode_step` a
cached decode token from the raw projections in one launch (`kda_decode_triton.py`).

Packed documents: `reset [B, T]` (True where a document starts) zeroes the state before that token; a chunk may
hold several documents, handled exactly with per-chunk segment ids. Math runs in fp32 for fp32/bf16/fp16 inputs and
in fp64 for fp64 inputs (`compute_dtype`), so the float64 recurrence is the golden reference of every form.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common import compute_dtype
from . import delta_rule_triton, kda_bwd_triton, kda_decode_triton, kda_triton
from .registry import traceable

SUB_CHUNK = 16  # BC: rows of one pairwise (diagonal) block


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (`_scan` applies it to the scan's outputs):
    torch 2.13's scan backward replays the step's graph, traced for contiguous output gradients, on whatever
    layout reaches the stacked outputs, and fails under Inductor otherwise (docs/compile.md#scan)."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _scan(step, state: Tensor, xs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """state, ys = fold of `step(state, x) -> (state, y)` over dim 0 of xs; ys stacked on dim 0. `step` must
    return contiguous tensors (their gradients are made contiguous to match, see `_ContiguousGrad`).

    Eager: a Python loop. Under torch.compile: the `scan` higher-order op, so the loop is one graph node whose
    length may be symbolic (no unrolling, no recompile per sequence length). The eager `scan` would re-trace
    for every new length, hence the split; both run the same `step`.
    """
    if torch.compiler.is_compiling():
        from torch._higher_order_ops.scan import scan
        state, ys = scan(step, state, xs)
        return _ContiguousGrad.apply(state), _ContiguousGrad.apply(ys)
    ys = []
    for i in range(xs[0].shape[0]):
        state, y = step(state, tuple(x[i] for x in xs))
        ys.append(y)
    if not ys:
        raise ValueError("KDA needs at least one token")
    return state, torch.stack(ys)


# ---------------------------------------------------------------------------------------------- recurrent form

def kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None,
                  reset: Tensor | None = None, *, scale: float) -> tuple[Tensor, Tensor]:
    """The definition of KDA (docs/numerics.md#kda-recurrence): a plain loop over T.

    q, k [B, T, H, K] (already L2-normalized), v [B, T, H, V], g [B, T, H, K] log-decay, beta [B, T, H],
    initial_state [B, H, K, V] or None (zeros), reset [B, T] bool: the state is zeroed before token t where True
    (so reset[:, 0] discards initial_state).
    Returns o [B, T, H, V] in v.dtype and the final state [B, H, K, V] in compute_dtype(q.dtype).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt, out_dt = compute_dtype(q.dtype), v.dtype
    S = q.new_zeros(B, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    keep = torch.ones(B, T, dtype=dt, device=q.device) if reset is None else (~reset).to(dt)

    def step(S, x):
        qt, kt, vt, gt, bt, kp = x
        o, S = kda_step(qt, kt, vt, gt, bt, S * kp[:, None, None, None], scale=scale)
        return S, o

    xs = tuple(t.to(dt).transpose(0, 1).contiguous() for t in (q, k, v, g, beta, keep))   # time first
    S, o = _scan(step, S, xs)
    return o.transpose(0, 1).to(out_dt), S


def kda_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, *,
             scale: float) -> tuple[Tensor, Tensor]:
    """One token of the recurrence, the decode update. q, k, g [B, H, K], v [B, H, V], beta [B, H],
    state [B, H, K, V]. Returns (o [B, H, V], new state), both in compute_dtype(q.dtype); the state is not
    modified in place."""
    dt = compute_dtype(q.dtype)
    q, k, v, g, beta, S = (t.to(dt) for t in (q, k, v, g, beta, state))
    S = g.exp()[..., None] * S                                             # decay key channels
    u = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", S, k))        # delta-rule correction
    S = S + k[..., None] * u[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", S, scale * q), S


# ---------------------------------------------------------------------------------------------- chunkwise form

def _suffix_sum(x: Tensor, dim: int) -> Tensor:
    """Σ_{u > j} x_u along dim (exclusive reverse cumsum), accumulated from the end so that the entries near the
    end (small spans) are exact to rounding instead of differences of two large prefix sums."""
    x = x.narrow(dim, 1, x.shape[dim] - 1)
    x = F.pad(x, (0, 0) * (-dim - 1) + (0, 1))
    return x.flip(dim).cumsum(dim).flip(dim)


def _intra_chunk(a: Tensor, k: Tensor, gs: Tensor, R: Tensor, E_diag: Tensor) -> Tensor:
    """A[r, j] = Σ_d a_r[d] k_j[d] e^{Σ_{j<u≤r} g_u[d]} for j ≤ r, per chunk.

    a, k [..., C, K]; gs [..., NS, BC, K] the gates by sub-chunk; R [..., NS, C, K] with R[a, j] = Σ_{j<u≤n_a} g_u
    (n_a the first row of sub-chunk a; 0 for j ≥ n_a); E_diag [..., NS, BC, BC, K] the masked pairwise factors of
    the diagonal blocks. Returns [..., C, C]; entries above the block diagonal are finite garbage for the caller
    to mask.
    """
    *lead, C, K = a.shape
    NS, BC = gs.shape[-3], gs.shape[-2]
    a_s = a.reshape(*lead, NS, BC, K)
    # Off-diagonal blocks, anchored at the first row n of the query sub-chunk (matmul form):
    #   e^{Σ_{j<u≤r} g} = e^{Σ_{n<u≤r} g} · e^{Σ_{j<u≤n} g}, both factors ≤ 1 for keys before the sub-chunk.
    # R is 0 for keys at or after n (those blocks are replaced or masked), i.e. the key-side exponent is already
    # clamped to ≤ 0 there; the explicit clamp keeps every factor ≤ 1 even for (out-of-contract) positive g.
    F_q = F.pad(gs[..., 1:, :], (0, 0, 1, 0)).cumsum(-2)              # Σ_{n<u≤r} g_u   [..., NS, BC, K]
    a_anch = a_s * F_q.exp()
    k_anch = k[..., None, :, :] * R.clamp(max=0).exp()                 # [..., NS, C, K]
    A = (a_anch @ k_anch.transpose(-1, -2)).reshape(*lead, NS, BC, NS, BC)
    # Diagonal blocks: the exact per-pair, per-channel factor ([BC, BC, K], CUDA-core work in FLA).
    # A product and a sum, not an einsum: einsum lowers this to a bmm with one batch entry per (r, j) pair, which
    # cuBLAS runs as many tiny GEMV launches (docs/performance.md#training-step); Inductor fuses the product and sum.
    A_diag = (a_s[..., :, None, :] * k.reshape(*lead, NS, 1, BC, K) * E_diag).sum(-1)
    on_diag = torch.eye(NS, dtype=torch.bool, device=a.device)[:, None, :, None]
    A = torch.where(on_diag, A_diag[..., :, :, None, :], A)
    return A.reshape(*lead, C, C)


def kda_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None,
              reset: Tensor | None = None, *, scale: float, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """KDA chunkwise-parallel (docs/numerics.md#kda-chunk); same contract and result as `kda_recurrent`."""
    return _chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, reset=reset, chunk_size=chunk_size)


def kda_chunk_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None,
                     reset: Tensor | None = None, *, scale: float, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """`kda_chunk` with the chunk-to-chunk state pass as the Triton op `kimi::kda_states` (float32 states on a
    GPU, or on the CPU under TRITON_INTERPRET=1); every chunk's output is then one batched matmul."""
    return _chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, reset=reset, chunk_size=chunk_size,
                    states=torch.ops.kimi.kda_states)


def _chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float,
             initial_state: Tensor | None, reset: Tensor | None, chunk_size: int,
             states: Callable | None = None) -> tuple[Tensor, Tensor]:
    """The chunked form of `kda_recurrent`.

    q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, K], beta [B, T, H], initial_state [B, H, K, V] or None,
    reset [B, T] bool or None. Returns o [B, T, H, V] in v.dtype and the final state [B, H, K, V] in
    compute_dtype(q.dtype).

    Per chunk (rows r = 0..C−1, entering state S_0), seg_r = number of resets at rows ≤ r inside the chunk, and
    g(j, r] = Σ_{j<u≤r} g_u (the decay from token j to token r):
        L      = β_r Σ_d k_r k_j e^{g(j,r]}            j < r, same segment
        Aqk    = s Σ_d q_r k_j e^{g(j,r]}              j ≤ r, same segment
        [w | u] = (I + L)^{-1} [β K⊙e^{Γ}·[seg_r = 0] | β V],    Γ_r = g(−1, r] (S_0 → row r)
        U'     = u − w S_0
        O      = s (Q⊙e^{Γ})·[seg_r = 0] S_0 + Aqk U'
        S_C    = [no reset in chunk] e^{Γ_{C−1}} S_0 + (K ⊙ e^{g(j, C−1]})ᵀ·[last segment] U'
    Only the first segment sees S_0 and only the last one writes the outgoing state, so the decay sums never
    need to restart inside a chunk: each factor spans tokens of one segment only, or is masked.
    Each sum is accumulated over exactly the tokens it spans (forward from the chunk start for S_0-facing
    factors, backward from the chunk end for state-facing ones, from the sub-chunk anchor for pairwise ones)
    rather than as a difference of two chunk prefix sums: with −1000 gates a prefix sum reaches −10⁴, and the
    difference of two such fp32 numbers loses ~1e-4 of relative accuracy in every factor.

    The handoff between chunks is the only sequential part. By default it is a `scan` whose step also forms the
    chunk's output (small matmuls, one chunk at a time). With `states` (`delta_rule_triton.delta_states_reference`'s
    contract, e.g. the Triton op `kimi::kda_states`) only the state recurrence runs in order; every chunk's output
    O = Q̃ S_n + Aqk U' is then one batched matmul over all chunks.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    BC = min(SUB_CHUNK, C)
    if C % BC:
        raise ValueError(f"kda_chunk: chunk_size={C} must be a multiple of {SUB_CHUNK} (or smaller than it)")
    NS = C // BC
    N = -(-T // C)
    pad = N * C - T
    dt, out_dt = compute_dtype(q.dtype), v.dtype
    dev = q.device

    def chunked(x: Tensor) -> Tensor:
        """[B, T, H, ...] -> [B, H, N, C, ...], right-padded with zeros (k = 0, β = 0, g = 0: no write, no decay)."""
        x = x.to(dt).transpose(1, 2).contiguous()   # F.pad by 0 returns its input: keep one layout for compile
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(B, H, N, C, *x.shape[3:])

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    if reset is None:
        reset = torch.zeros(B, T, dtype=torch.bool, device=dev)
    rs = F.pad(reset, (0, pad)).reshape(B, 1, N, C)                   # broadcast over heads

    # Segments (documents) inside each chunk.
    seg = rs.to(torch.int32).cumsum(-1)                                # [B, 1, N, C]
    first = (seg == 0)[..., None]                                      # rows that see S_0
    last = (seg == seg[..., -1:])[..., None]                           # rows that write the outgoing state
    carry = ~rs.any(-1)                                                # the chunk passes S_0 on
    same = seg[..., :, None] == seg[..., None, :]                      # [B, 1, N, C, C]
    row = torch.arange(C, device=dev)
    causal = same & (row[:, None] >= row[None, :])
    strict = same & (row[:, None] > row[None, :])

    # Decay sums (see the docstring for why each is accumulated over its own span).
    gam = g.cumsum(-2)                                                 # Γ_r = g(−1, r]     [B, H, N, C, K]
    suffix = _suffix_sum(g, -2)                                        # g(j, C−1]
    gs = g.reshape(B, H, N, NS, BC, K)
    upto_anchor = (row[None, :] <= (torch.arange(NS, device=dev) * BC)[:, None])[..., None]  # [NS, C, 1]
    R = _suffix_sum(torch.where(upto_anchor, g[..., None, :, :], 0.0), -2)  # g(j, n_a]  [B, H, N, NS, C, K]
    # Pairwise exponents of the diagonal BC×BC blocks: g(j, r] by a cumsum over r of the gates after j, set to
    # −inf above the diagonal *before* exp, so exp gives exact zeros with zero gradient. (The usual G_r − G_j is
    # positive up there and overflows; masking after exp then gives 0·inf = NaN gradients.)
    rb = torch.arange(BC, device=dev)
    after = (rb[None, :] > rb[:, None])[..., None]                     # [j, u, 1]: u > j
    D = torch.where(after, gs[..., None, :, :], 0.0).cumsum(-2).transpose(-2, -3)  # [.., NS, r, j, K]
    tril = (rb[:, None] >= rb[None, :])[..., None]
    E_diag = torch.where(tril, D, float("-inf")).exp()

    Aqk = torch.where(causal, _intra_chunk(q, k, gs, R, E_diag), 0.0) * scale
    L = torch.where(strict, _intra_chunk(k, k, gs, R, E_diag), 0.0) * beta[..., None]

    # UT transform: (I + L)^{-1} by one unit-lower-triangular solve against I (C columns), then one batched matmul
    # gives w and u together: the batched triangular solve has no tensor-core path, so it gets the narrow side.
    e_first = torch.where(first, gam, float("-inf")).exp()            # e^{Γ} on the first segment, else 0
    rhs = torch.cat([beta[..., None] * k * e_first, beta[..., None] * v], -1)
    eye = torch.eye(C, dtype=dt, device=dev)
    inv = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    w, u = (inv @ rhs).split([K, V], -1)
    q_s0 = scale * q * e_first                                        # the output's S_0 term, first segment only
    k_out = k * torch.where(last, suffix, float("-inf")).exp()        # keys → outgoing state, last segment only
    decay_s0 = torch.where(carry[..., None], gam[..., -1, :], float("-inf")).exp()  # [B, H, N, K]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    if states is not None:
        flat = [t.expand(B, H, *t.shape[2:]).reshape(B * H, *t.shape[2:]) for t in (u, w, k_out, decay_s0, S)]
        hs, U, S = states(*flat)
        o = q_s0 @ hs.view(B, H, N, K, V) + Aqk @ U.view(B, H, N, C, V)               # [B, H, N, C, V]
        o = o.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
        return o.to(out_dt), S.view(B, H, K, V)

    def handoff(S, x):  # the only sequential part: chunk n's output and outgoing state
        u_n, w_n, q_n, A_n, k_n, d_n = x
        U = u_n - w_n @ S
        return d_n[..., None] * S + k_n.transpose(-1, -2) @ U, q_n @ S + A_n @ U

    xs = tuple(t.movedim(2, 0).contiguous() for t in (u, w, q_s0, Aqk, k_out, decay_s0))   # chunks first
    S, o = _scan(handoff, S, xs)                                               # o [N, B, H, C, V]
    o = o.movedim(0, 2).reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    return o.to(out_dt), S




# ---------------------------------------------------------------------------------------------- opaque chunk

@torch.library.custom_op("kimi::kda_chunk_opaque", mutates_args=())
def kda_chunk_opaque(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None,
                     reset: Tensor | None = None, *, scale: float, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """`kda_chunk` as one graph node: Inductor does not trace the chunk algebra (most of a KDA layer's compile
    time), and autograd saves only the inputs. Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V])."""
    o, s = kda_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state, reset=reset, chunk_size=chunk_size)
    return o.contiguous(), s.contiguous()


@kda_chunk_opaque.register_fake
def _(q, k, v, g, beta, initial_state=None, reset=None, *, scale, chunk_size=64):
    B, T, H, K = q.shape
    return v.new_empty(B, T, H, v.shape[-1]), q.new_empty(B, H, K, v.shape[-1], dtype=compute_dtype(q.dtype))


@torch.library.custom_op("kimi::kda_chunk_opaque_bwd", mutates_args=())
def kda_chunk_opaque_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                         reset: Tensor | None, do: Tensor, ds: Tensor, *, scale: float,
                         chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `kda_chunk_opaque` by recomputation: the forward runs again under `torch.func.vjp` (which
    differentiates even here, below the autograd dispatch key, where `torch.autograd.grad` cannot). Returns the
    gradients of q, k, v, g, beta and the initial state (zeros when there was none)."""
    B, T, H, K = q.shape
    s0 = initial_state if initial_state is not None else q.new_zeros(B, H, K, v.shape[-1],
                                                                    dtype=compute_dtype(q.dtype))

    def fn(q, k, v, g, beta, s0):
        return kda_chunk(q, k, v, g, beta, scale=scale, initial_state=s0, reset=reset, chunk_size=chunk_size)
    _, vjp = torch.func.vjp(fn, q, k, v, g, beta, s0)
    return tuple(t.contiguous() for t in vjp((do, ds)))


@kda_chunk_opaque_bwd.register_fake
def _(q, k, v, g, beta, initial_state, reset, do, ds, *, scale, chunk_size):
    B, H, K, V = q.shape[0], q.shape[2], q.shape[3], v.shape[-1]
    s_dtype = initial_state.dtype if initial_state is not None else compute_dtype(q.dtype)
    return (*(t.new_empty(t.shape) for t in (q, k, v, g, beta)),    # contiguous, like the real outputs
            q.new_empty(B, H, K, V, dtype=s_dtype))


def _opaque_setup(ctx, inputs, keyword_only_inputs, output):
    q, k, v, g, beta, s0, reset = inputs
    ctx.save_for_backward(q, k, v, g, beta, s0, reset)
    ctx.scale, ctx.chunk_size = keyword_only_inputs["scale"], keyword_only_inputs.get("chunk_size", 64)
    ctx.has_s0 = s0 is not None


def _opaque_backward(ctx, do, ds):
    q, k, v, g, beta, s0, reset = ctx.saved_tensors
    grads = kda_chunk_opaque_bwd(q, k, v, g, beta, s0, reset, do.contiguous(), ds.contiguous(), scale=ctx.scale,
                                 chunk_size=ctx.chunk_size)
    return (*grads[:5], grads[5] if ctx.has_s0 else None, None)


kda_chunk_opaque.register_autograd(_opaque_backward, setup_context=_opaque_setup)


# ---------------------------------------------------------------------------------------------- Triton state pass

@torch.library.custom_op("kimi::kda_states", mutates_args=())
def kda_states(u: Tensor, w: Tensor, k: Tensor, d: Tensor, s0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The chunk-to-chunk state recurrence of chunked KDA in one Triton launch
    (`delta_rule_triton.delta_states_triton`): u [R, N, C, V], w, k [R, N, C, K], d [R, N, K], s0 [R, K, V] fp32 ->
    (entering states [R, N, K, V], U [R, N, C, V], final state [R, K, V])."""
    return delta_rule_triton.delta_states_triton(u, w, k, d, s0)


@kda_states.register_fake
def _(u, w, k, d, s0):
    R, N, C, V = u.shape
    return u.new_empty(R, N, w.shape[-1], V), u.new_empty(u.shape), s0.new_empty(s0.shape)


@torch.library.custom_op("kimi::kda_states_bwd", mutates_args=())
def kda_states_bwd(w: Tensor, k: Tensor, d: Tensor, dh: Tensor, dU: Tensor,
                   dsN: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The reverse recurrence of `kda_states`' backward (`delta_rule_triton.delta_states_bwd_triton`)."""
    return delta_rule_triton.delta_states_bwd_triton(w, k, d, dh, dU, dsN)


@kda_states_bwd.register_fake
def _(w, k, d, dh, dU, dsN):
    return dU.new_empty(dU.shape), dh.new_empty(dh.shape), dsN.new_empty(dsN.shape)


def _states_setup(ctx, inputs, output):
    u, w, k, d, s0 = inputs
    hs, U, _ = output
    ctx.save_for_backward(w, k, d, hs, U)


def _states_backward(ctx, dh, dU, dsN):
    """The sequential part is the kernel (Λ_{n+1}: the gradient of the state leaving chunk n); the rest is
    batched algebra: du = dU, dw = −dU Sᵀ, dk = U Λᵀ, dd = Σ_v S ⊙ Λ (docs/numerics.md#kda-state-pass)."""
    w, k, d, hs, U = ctx.saved_tensors
    dh = torch.zeros_like(hs) if dh is None else dh
    dU = torch.zeros_like(U) if dU is None else dU
    dsN = hs.new_zeros(hs.shape[0], *hs.shape[2:]) if dsN is None else dsN
    dU, lam, ds0 = kda_states_bwd(w, k, d, dh, dU, dsN)
    return dU, -(dU @ hs.transpose(-1, -2)), U @ lam.transpose(-1, -2), (hs * lam).sum(-1), ds0


kda_states.register_autograd(_states_backward, setup_context=_states_setup)


# ---------------------------------------------------------------------------------------------- Triton chunked KDA

GATE_BOUND = -5.0
"""The Triton chunked kernels (`kda_triton.py`) need log-decays g ≥ this per token and channel: K3's bounded gate
(`linear_attn_config.gate_lower_bound`); their anchored intra-chunk exponentials reach e^{15·|g|}."""


torch.library.define("kimi::kda_triton", "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
                     "Tensor? initial_state=None, Tensor? reset=None, *, float scale) -> (Tensor, Tensor)")


@torch.library.impl("kimi::kda_triton", "CompositeImplicitAutograd")
def kda_triton_core(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None,
                    reset: Tensor | None = None, *, scale: float) -> tuple[Tensor, Tensor]:
    """KDA's chunked forward as Triton kernels (`kda_triton.kda_chunk_fwd_triton`), the contract of `kda_recurrent`
    for bounded gates (g ≥ `GATE_BOUND`): o [B, T, H, V] in v's dtype and the fp32 final state [B, H, K, V].
    Differentiable through `kimi::_kda_triton_fwd`, which keeps the forward's scratch for the backward when
    `kda_bwd_triton.SAVE` is "forward" and a gradient will be taken (not under no_grad, nor for inputs that need
    none)."""
    save = (kda_bwd_triton.SAVE == "forward" and torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)))
    o, sN, _ = kda_triton_fwd(q, k, v, g, beta, initial_state, reset, scale=scale, save=save)
    return o, sN


@torch.library.custom_op("kimi::_kda_triton_fwd", mutates_args=())
def kda_triton_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                   reset: Tensor | None, *, scale: float, save: bool) -> tuple[Tensor, Tensor, list[Tensor]]:
    """`kimi::kda_triton`'s differentiable forward: (o, final state, scratch), the scratch `kda_bwd_triton.SAVED`
    when `save` (`kda_chunk_fwd_saving`), else none (`kda_chunk_fwd_triton`; the backward recomputes)."""
    s0 = initial_state.float() if initial_state is not None else None
    if not save:
        return (*kda_triton.kda_chunk_fwd_triton(q, k, v, g, beta, s0, reset, scale=scale), [])
    o, sN, saved = kda_bwd_triton.kda_chunk_fwd_saving(q, k, v, g, beta, s0, reset, scale=scale)
    return o, sN, [saved[n] for n in kda_bwd_triton.SAVED]


@kda_triton_fwd.register_fake
def _(q, k, v, g, beta, initial_state, reset, *, scale, save):
    B, T, H, K = q.shape
    layout = kda_bwd_triton.saved_layout(q, v).values() if save else ()
    return (v.new_empty(B, T, H, v.shape[-1]), q.new_empty(B, H, K, v.shape[-1], dtype=torch.float32),
            [q.new_empty(shape, dtype=dtype) for shape, dtype in layout])


@torch.library.custom_op("kimi::kda_triton_bwd", mutates_args=())
def kda_triton_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                   reset: Tensor | None, do: Tensor, ds: Tensor, *,
                   scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `kimi::kda_triton` (`kda_bwd_triton.kda_chunk_bwd_triton`: the intra-chunk scratch and the
    states recomputed, a reverse state pass, chunk-parallel kernels for the value and the key side), each in its
    input's dtype; the initial state's gradient is zeros when there was none."""
    return _triton_grads(q, k, v, g, beta, initial_state, reset, do, ds, scale, None)


@kda_triton_bwd.register_fake
def _(q, k, v, g, beta, initial_state, reset, do, ds, *, scale):
    s_dtype = initial_state.dtype if initial_state is not None else torch.float32
    return (*(t.new_empty(t.shape) for t in (q, k, v, g, beta)), q.new_empty(ds.shape, dtype=s_dtype))


@torch.library.custom_op("kimi::_kda_triton_bwd_saved", mutates_args=())
def kda_triton_bwd_saved(saved: list[Tensor], q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         initial_state: Tensor | None, reset: Tensor | None, do: Tensor, ds: Tensor, *,
                         scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`kimi::kda_triton_bwd` from the forward's scratch (`kimi::_kda_triton_fwd` with save)."""
    return _triton_grads(q, k, v, g, beta, initial_state, reset, do, ds, scale,
                         dict(zip(kda_bwd_triton.SAVED, saved)))


@kda_triton_bwd_saved.register_fake
def _(saved, q, k, v, g, beta, initial_state, reset, do, ds, *, scale):
    s_dtype = initial_state.dtype if initial_state is not None else torch.float32
    return (*(t.new_empty(t.shape) for t in (q, k, v, g, beta)), q.new_empty(ds.shape, dtype=s_dtype))


def _triton_grads(q, k, v, g, beta, initial_state, reset, do, ds, scale, saved):
    s0 = initial_state.float() if initial_state is not None else None
    grads = kda_bwd_triton.kda_chunk_bwd_triton(q, k, v, g, beta, s0, reset, do, ds.float(), scale=scale,
                                                saved=saved)
    dh0 = grads[5] if grads[5] is not None else q.new_zeros(ds.shape, dtype=torch.float32)
    like = (q, k, v, g, beta, initial_state if initial_state is not None else dh0)
    return tuple(d.to(t.dtype).contiguous() for d, t in zip((*grads[:5], dh0), like))


def _triton_setup(ctx, inputs, keyword_only_inputs, output):
    q, k, v, g, beta, s0, reset = inputs
    saved = output[2]
    ctx.mark_non_differentiable(*saved)
    # without this autograd hands the backward a zero tensor for every output without a gradient, the scratch
    # included: as much memory again as the scratch (1.8 GB at T = 8192, H = 96), allocated and zero-filled
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, g, beta, s0, reset, *saved)
    ctx.scale, ctx.has_s0 = keyword_only_inputs["scale"], s0 is not None


def _triton_backward(ctx, do, ds, _):
    q, k, v, g, beta, s0, reset, *saved = ctx.saved_tensors
    if do is None:      # only the final state was used
        do = v.new_zeros(v.shape)
    if ds is None:
        ds = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[-1], dtype=torch.float32)
    tensors = (q, k, v, g, beta, s0, reset, do.contiguous(), ds.contiguous())
    if saved:
        grads = kda_triton_bwd_saved(saved, *tensors, scale=ctx.scale)
    else:
        grads = kda_triton_bwd(*tensors, scale=ctx.scale)
    return (*grads[:5], grads[5] if ctx.has_s0 else None, None)


kda_triton_fwd.register_autograd(_triton_backward, setup_context=_triton_setup)


@torch.library.custom_op("kimi::kda_decode_step", mutates_args=("q_tail", "k_tail", "v_tail", "state"))
def kda_decode_step(q_raw: Tensor, k_raw: Tensor, v_raw: Tensor, q_weight: Tensor, k_weight: Tensor,
                    v_weight: Tensor, q_tail: Tensor, k_tail: Tensor, v_tail: Tensor, conv_reset: Tensor, g: Tensor,
                    beta: Tensor, state: Tensor, *, scale: float, eps: float) -> Tensor:
    """One cached decode token of a KDA layer from its raw projections, in one Triton launch
    (`kda_decode_triton.kda_decode_step_triton`): the three short convs, the q/k L2 norms and the delta-rule step;
    the conv tails and the fp32 state are updated in place. Returns o [B, H, V]."""
    return kda_decode_triton.kda_decode_step_triton(q_raw, k_raw, v_raw, q_weight, k_weight, v_weight, q_tail,
                                                    k_tail, v_tail, conv_reset, g, beta, state, scale=scale, eps=eps)


@kda_decode_step.register_fake
def _(q_raw, k_raw, v_raw, q_weight, k_weight, v_weight, q_tail, k_tail, v_tail, conv_reset, g, beta, state, *,
      scale, eps):
    B, H, K, V = state.shape
    return v_raw.new_empty(B, H, V)


# ---------------------------------------------------------------------------------------------- traceable ops

_CORE = ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? initial_state=None, Tensor? reset=None, *, "
         "float scale{extra}) -> (Tensor, Tensor)")
traceable("kda_recurrent" + _CORE.format(extra=""), kda_recurrent)
traceable("kda_chunk" + _CORE.format(extra=", int chunk_size=64"), kda_chunk)
traceable("kda_chunk_triton" + _CORE.format(extra=", int chunk_size=64"), kda_chunk_triton)
traceable("kda_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state, *, float scale) -> "
          "(Tensor, Tensor)", kda_step)
