"""Kimi Delta Attention (KDA): the linear-attention mixer of the KDA layers (KDA.md §3-§9, MODEL.md §5).

Notation (KDA.md §1): B batch, T tokens, H heads, K key head dim, V value head dim, W short-conv width,
C chunk size, BC = 16 sub-chunk size. Per (sequence, head) the state is S ∈ R^{K×V} ("K-first"). Per token:
log-decay g_t ∈ R^K (g ≤ 0, decay α_t = e^{g_t}), write strength β_t ∈ (0, 1), scale s = K^-1/2.

    S'_t = Diag(e^{g_t}) S_{t-1}                           decay key channels
    S_t  = S'_t + k_t (β_t (v_t − S'_tᵀ k_t))ᵀ             delta-rule write
    o_t  = S_tᵀ (s q_t)                                    read after the write (a token sees itself)

`kda_recurrent` is that loop and *defines* the op; `kda_chunk` computes the same thing chunkwise-parallel
(KDA.md §8): within a chunk the writes solve a unit-lower-triangular system (UT transform), only the state
hand-off between chunks is sequential.

Packed documents: `reset [B, T]` (True where a document starts) zeroes the state before that token, in both
forms; the short conv never reads across a reset either. Nothing is unpadded, so a chunk may hold several
documents; `kda_chunk` handles that exactly with per-chunk segment ids.

Invariants (KDA.md §18, tested in tests/test_kda.py): chunk == recurrent (forward and gradients); outputs at t
depend on inputs at ≤ t only, and never on inputs of another document; right-padding with k = 0, β = 0, g = 0
is neutral; splitting a sequence and passing the final state as `initial_state` equals one run.

Numerics: every exponent that reaches `exp` is ≤ 0 (for g ≤ 0) or masked to -inf *before* `exp`, so no
intermediate overflows and no masked 0·inf turns into a NaN gradient. In `kda_chunk` every decay exponent is a sum
of g over exactly the tokens it spans, never a difference of two chunk prefix sums (KDA.md §8.3's G_r − G_j):
with −1000 gates those prefix sums reach −10⁴ and their fp32 difference is off by ~1e-4 in every factor; the
span sums keep fp32 chunk vs fp64 recurrence at ~2e-7 in all gate regimes. Math runs in fp32 for
fp32/bf16/fp16 inputs and in fp64 for fp64 inputs (`compute_dtype`), so the float64 path is a golden reference.
Memory: the pairwise diagonal blocks are [B, H, T/BC, BC, BC, K] = 16× the size of k (a few such tensors live for
autograd); fine for tests and moderate sizes, not for K3-size training (the FLA kernels' job).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops
from .common import compile_region, compute_dtype, linear

SUB_CHUNK = 16  # BC: rows of one pairwise (diagonal) block, KDA.md §8.2


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (`_scan` applies it to the scan's outputs).

    Works around a torch 2.13 scan bug: scan's backward replays the step's joint graph, traced by AOTAutograd for
    output gradients laid out like the step's outputs (contiguous), on slices of whatever gradient reaches the
    stacked outputs. With Inductor's decompositions that graph holds hard `view`s (a batched matmul flattening
    [B, H, C, V] to [B*H, C, V]), so a gradient in the consumer's layout (KDA's o [B, T, H, V] seen as
    [N, B, H, C, V]) fails to trace: "Cannot view a tensor with shape [2, 4, 64, 32] and strides
    (16384, 32, 128, 1) as (8, 64, 32)". Plain aot_eager keeps `reshape` and passes; Inductor and
    aot_eager_decomp_partition fail (tests/test_compile.py: test_scan_gradient_in_consumer_layout, and
    test_inductor_forward_backward_equals_eager at T = 128). The cost is one contiguous copy of the gradient.
    """

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

# ---------------------------------------------------------------------------------------------- gate, conv, norms

def kda_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None) -> Tensor:
    """Log-decay g [B, T, H, K] from the raw gate f [B, T, H, K] (KDA.md §5), in compute_dtype(f.dtype).

    Bounded (K3, lb < 0):  g = lb · sigmoid(e^{A_log[h]} · (f + dt_bias)) ∈ [lb, 0]
    Unbounded (None):      g = −e^{A_log[h]} · softplus(f + dt_bias)     ≤ 0
    A_log [H] and dt_bias [H*K] are fp32 checkpoint tensors; e^{A_log} sits inside the sigmoid (KDA.md §13.3).
    """
    H, K = f.shape[-2:]
    dt = compute_dtype(f.dtype)
    z = f.to(dt) + dt_bias.to(dt).view(H, K)
    a = A_log.to(dt).exp().view(H, 1)
    if lower_bound is None:
        return -a * F.softplus(z)
    return lower_bound * torch.sigmoid(a * z)


def short_conv(x: Tensor, weight: Tensor, reset: Tensor | None = None) -> Tensor:
    """Depthwise causal conv + SiLU (KDA.md §4). x [B, T, C], weight [C, 1, W] -> [B, T, C] in x.dtype.

    y[t, c] = silu(Σ_j w[c, 0, j] · x[t − (W−1) + j, c]), x = 0 before t = 0 and before the latest reset ≤ t.
    reset [B, T] bool: True where a document starts.
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    dt = compute_dtype(x.dtype)
    xp = F.pad(x.to(dt), (0, 0, W - 1, 0))  # zeros before t = 0
    w = weight.to(dt).view(C, W)
    if reset is not None:
        # Tap t−s belongs to token t's document iff no reset lies in (t−s, t]; the document index (a running
        # count of resets) is non-decreasing, so that is "same document index". Padded slots get −1: never equal.
        doc = reset.to(torch.int32).cumsum(1)
        docp = F.pad(doc, (W - 1, 0), value=-1)
    y = xp.new_zeros(B, T, C)
    for j in range(W):  # W static taps; no loop over T
        tap = xp[:, j:j + T]
        if reset is not None:
            tap = torch.where((docp[:, j:j + T] == doc)[..., None], tap, 0.0)
        y = y + tap * w[:, j]
    return F.silu(y).to(x.dtype)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(Σ x² + eps) over the last dim (eps inside the sqrt, KDA.md §6); fp32 math, x.dtype out."""
    xf = x.to(compute_dtype(x.dtype))
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def gated_rms_norm(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """(o / sqrt(mean(o²) + eps)) · weight · sigmoid(gate) over the last dim (KDA.md §9). o, gate [B, T, H, V],
    weight [V] shared by all heads. fp32 math, o.dtype out. The activation is sigmoid, not SiLU (KDA.md §13.5)."""
    dt = compute_dtype(o.dtype)
    of = o.to(dt)
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(dt) * torch.sigmoid(gate.to(dt))).to(o.dtype)


# ---------------------------------------------------------------------------------------------- the recurrence

def kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float,
                  initial_state: Tensor | None = None, reset: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The definition of KDA (KDA.md §7): a plain loop over T.

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
        o, S = kda_step(qt, kt, vt, gt, bt, scale=scale, state=S * kp[:, None, None, None])
        return S, o

    xs = tuple(t.to(dt).transpose(0, 1).contiguous() for t in (q, k, v, g, beta, keep))   # time first
    S, o = _scan(step, S, xs)
    return o.transpose(0, 1).to(out_dt), S


def kda_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float,
             state: Tensor) -> tuple[Tensor, Tensor]:
    """One token of the recurrence (KDA.md §10), the decode update. q, k, g [B, H, K], v [B, H, V], beta [B, H],
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
    """A[r, j] = Σ_d a_r[d] k_j[d] e^{Σ_{j<u≤r} g_u[d]} for j ≤ r (KDA.md §8.2), per chunk.

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
    # A product and a sum, not an einsum: einsum lowers this to a bmm with one batch entry per (r, j) pair
    # (B·H·N·NS·BC² ≈ 6M at 4096 tokens and 96 heads), which cuBLAS runs as ~100 batched-GEMV launches per call
    # and twice as many rank-1 GEMMs in the backward (~45 % of a K3.1-width training step on the H200). Inductor
    # fuses the product into the reduction; run eagerly it makes one more E_diag-sized temporary than the einsum.
    A_diag = (a_s[..., :, None, :] * k.reshape(*lead, NS, 1, BC, K) * E_diag).sum(-1)
    on_diag = torch.eye(NS, dtype=torch.bool, device=a.device)[:, None, :, None]
    A = torch.where(on_diag, A_diag[..., :, :, None, :], A)
    return A.reshape(*lead, C, C)


def kda_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float,
              initial_state: Tensor | None = None, reset: Tensor | None = None,
              chunk_size: int = 64, states: Callable | None = None) -> tuple[Tensor, Tensor]:
    """KDA chunkwise-parallel (KDA.md §8.1-8.3); same contract and result as `kda_recurrent`.

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
    chunk's output (small matmuls, one chunk at a time). With `states` (`kernels.delta_states`' contract, e.g. the
    Triton op `kimi::kda_states`) only the state recurrence runs in order; every chunk's output
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
    # positive up there and overflows; masking after exp then gives 0·inf = NaN gradients, KDA.md §8.2.)
    rb = torch.arange(BC, device=dev)
    after = (rb[None, :] > rb[:, None])[..., None]                     # [j, u, 1]: u > j
    D = torch.where(after, gs[..., None, :, :], 0.0).cumsum(-2).transpose(-2, -3)  # [.., NS, r, j, K]
    tril = (rb[:, None] >= rb[None, :])[..., None]
    E_diag = torch.where(tril, D, float("-inf")).exp()

    Aqk = torch.where(causal, _intra_chunk(q, k, gs, R, E_diag), 0.0) * scale
    L = torch.where(strict, _intra_chunk(k, k, gs, R, E_diag), 0.0) * beta[..., None]

    # UT transform: (I + L)^{-1} by one unit-lower-triangular solve against I (C columns), then one batched matmul
    # gives w and u together. Solving against [βK | βV] directly (K + V = 256 columns) left cuBLAS's batched
    # triangular solve, which does not use tensor cores, at 16.5 ms of a K3.1-width training step on the H200
    # (4.0 ms this way).
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


# ---------------------------------------------------------------------------------------------- the layer

def short_conv_cached(x: Tensor, weight: Tensor, tail: Tensor, reset: Tensor) -> Tensor:
    """`short_conv` continuing from a cache (KDA.md §10 step 1). x [B, T, C] new raw inputs, tail [B, W-1, C] the
    previous W-1 raw inputs (updated in place to the last W-1 of tail + x), reset [B, W-1+T] bool over that
    window (True at the row's first real token: taps before it read 0)."""
    W = weight.shape[-1]
    window = torch.cat([tail, x], dim=1)
    y = short_conv(window, weight, reset)[:, W - 1:]
    tail.copy_(window[:, window.shape[1] - (W - 1):])
    return y


@compile_region
def kda_layer(p: dict, x: Tensor, cfg, backend, *, reset: Tensor | None = None, cache: dict | None = None,
              step=None) -> Tensor:
    """One KDA mixer (KDA.md §3, MODEL.md §5.2). x [B, T, D] is the layer's normalized input; -> [B, T, D] in
    x.dtype. p is the layer's `self_attn` subtree (checkpoint names, kimi/params.py). reset [B, T] bool marks
    document starts: the convs and the recurrence restart there.

    With `cache` (this layer's dict from kimi/cache.py) and `step` (`cache.Step`), the convs and the recurrence
    continue from the cached tails and state, restart at each row's start slot, and write the cache in place."""
    la = cfg.linear_attn_config
    H, K = la.num_heads, la.head_dim
    B, T, _ = x.shape
    dt = compute_dtype(x.dtype)
    # All projections read the layer input x, not the conv outputs (KDA.md §3).
    if cache is None:
        conv = lambda name: short_conv(linear(x, p[f"{name}_proj"]), p[f"{name}_conv1d"]["weight"], reset)
    else:
        conv = lambda name: short_conv_cached(linear(x, p[f"{name}_proj"]), p[f"{name}_conv1d"]["weight"],
                                              cache[f"conv_{name}"], step.conv_reset)
    q, k, v = (conv(name).view(B, T, H, K) for name in ("q", "k", "v"))
    f = linear(linear(x, p["f_a_proj"]), p["f_b_proj"]).view(B, T, H, K)
    g = kda_gate(f, p["A_log"], p["dt_bias"], la.gate_lower_bound)
    beta = torch.sigmoid(linear(x, p["b_proj"]).to(dt))               # fp32 before the sigmoid (KDA.md §5)
    q, k = l2norm(q), l2norm(k)
    if cache is None:
        o, _ = ops.kda_core(q, k, v, g, beta, scale=K ** -0.5, backend=backend, reset=reset)
    elif T == 1:   # decode: one step of the recurrence (KDA.md §10)
        keep = (~step.reset[:, 0]).to(cache["state"].dtype)[:, None, None, None]
        o, S = ops.kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], K ** -0.5, cache["state"] * keep)
        o = o[:, None].to(v.dtype)
        cache["state"].copy_(S)
    else:          # (chunked) prefill: the chunked or recurrent core from the cached state
        o, S = ops.kda_core(q, k, v, g, beta, scale=K ** -0.5, backend=backend, initial_state=cache["state"],
                            reset=step.reset)
        cache["state"].copy_(S)
    if la.use_full_rank_gate:
        gate = linear(x, p["g_proj"])
    else:
        gate = linear(linear(x, p["g_a_proj"]), p["g_b_proj"])
    o = gated_rms_norm(o, gate.view(B, T, H, K), p["o_norm"]["weight"], cfg.rms_norm_eps)
    return linear(o.reshape(B, T, H * K), p["o_proj"])
