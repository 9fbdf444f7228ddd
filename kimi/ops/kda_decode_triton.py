"""Triton kernel of KDA's cached decode step (T = 1): the three short convs, the q/k L2 norms and the delta-rule
step in one launch, the conv tails and the fp32 state updated in place. The references are `kda.short_conv_cached`,
`kda.l2norm` and `delta_rule.kda_step` (docs/numerics.md#kda-recurrence), which `kda_layer`'s T == 1 path chains.

Per row b and head h, with window x_0..x_{W-1} = (the W−1 cached raw inputs, the new one) and tap j alive iff no
document start lies in (j, W−1] of `conv_reset`:

    q = l2norm(silu(Σ_j w_q[:, j] x_q,j · alive_j))        likewise k; v without the norm
    S' = diag(e^g) S            (S = 0 first where the new token starts its row's document)
    S  = S' + k (β (v − S'ᵀ k))ᵀ,    o = Sᵀ (scale · q)

**Kernel.** One program per (b, h) walks the V columns in blocks of BV (`decode_config`): the q/k conv and norm
and v's conv (kept in o until each block's output overwrites it) are computed once, then each [K, BV] block of S is
loaded with its v (block i + 1 while block i is updated), updated in registers and stored back, so the state is
read once and written once (the columns of S never mix). Every load before the loop (the reset flags, the three
convs' operands, g, beta and the first block of S) is issued before the first barrier: one round trip to memory,
then the convs, one barrier and the tails' shifts. Splitting V over programs instead would let one program shift a
q/k tail that another has yet to read (sharing the shift by ticket measured slower: every program redoes the q/k
conv and norm, docs/performance.md#kda); inside a program a barrier orders every read of a tail or a block of S
before its overwrite. `kda_step_inplace_triton` (no convs, q and k already normalized) has no tails and splits V
over the grid, (b·H + h, column block).

**Numerics.** fp32 math; the state is fp32. With 16-bit activations the values are rounded where the torch path
stores them in the activation dtype (conv outputs, normalized q and k, o), so the kernel computes what `kda_layer`
computes, to fp32 rounding. A restarting row's old state is never read (the torch path multiplies it by 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import interpreted, tl, triton, triton_available

_DT = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

if triton is not None:
    from .kda_triton import _to16

    @triton.jit
    def _conv_alive(reset_ptr, b, W: tl.constexpr, BW: tl.constexpr):
        """[BW] bool: tap j of row b's window is read (no document start after it in reset [B, W])."""
        j = tl.arange(0, BW)
        later = tl.load(reset_ptr + b * W + j[None, :], mask=(j[None, :] > j[:, None]) & (j[None, :] < W), other=0)
        return tl.sum(later.to(tl.int32), 1) == 0

    @triton.jit
    def _conv_load(x_ptr, tail_ptr, w_ptr, b, ch, m, C, W: tl.constexpr, BW: tl.constexpr):
        """Row b's conv operands over channels ch [BC] (mask m): the tail [BW, BC] (rows = window positions
        0..W−2 of tail [B, W−1, C]), the new input x [BC] (of [B, C]), the weights [BW, BC] and the last tap's [BC]
        in fp32 (of [C, 1, W])."""
        j = tl.arange(0, BW)
        m2 = (j < W - 1)[:, None] & m[None, :]
        t = tl.load(tail_ptr + (b * (W - 1) + j[:, None]) * C + ch[None, :], mask=m2, other=0.0)
        x = tl.load(x_ptr + b * C + ch, mask=m, other=0.0)
        w = tl.load(w_ptr + ch[None, :] * W + j[:, None], mask=m2, other=0.0).to(tl.float32)
        w_last = tl.load(w_ptr + ch * W + (W - 1), mask=m, other=0.0).to(tl.float32)
        return t, x, w, w_last

    @triton.jit
    def _conv_apply(t, x, w, w_last, alive, DT: tl.constexpr, EMULATE: tl.constexpr):
        """silu(Σ_j w_j x_j · alive_j) of `_conv_load`'s operands, fp32 rounded to DT."""
        y = tl.sum(tl.where(alive[:, None], t.to(tl.float32) * w, 0.0), 0) + w_last * x.to(tl.float32)
        y = y * tl.sigmoid(y)
        return _to16(y, DT, EMULATE).to(tl.float32)

    @triton.jit
    def _conv_shift(tail_ptr, t, x, b, ch, m, C, W: tl.constexpr, BW: tl.constexpr):
        """The tail shifted by one in place, x last (t, x: `_conv_load`'s, after a barrier: every thread holding a
        tail element must have read it before any thread overwrites it, and a layout may replicate elements across
        warps)."""
        j = tl.arange(0, BW)
        m2 = ((j >= 1) & (j < W - 1))[:, None] & m[None, :]
        tl.store(tail_ptr + (b * (W - 1) + j[:, None] - 1) * C + ch[None, :], t, mask=m2)
        tl.store(tail_ptr + (b * (W - 1) + W - 2) * C + ch, x, mask=m)

    @triton.jit
    def _conv_token(x_ptr, tail_ptr, w_ptr, reset_ptr, b, ch, m, C, W: tl.constexpr, BW: tl.constexpr,
                    DT: tl.constexpr, EMULATE: tl.constexpr):
        """silu(causal conv) of row b's new token over channels ch [BC] (mask m), as fp32 rounded to DT; shifts the
        tail [B, W−1, C] by one in place (the new raw input last). x [B, C], weights [C, 1, W], reset [B, W]."""
        t, x, w, w_last = _conv_load(x_ptr, tail_ptr, w_ptr, b, ch, m, C, W, BW)
        y = _conv_apply(t, x, w, w_last, _conv_alive(reset_ptr, b, W, BW), DT, EMULATE)
        tl.debug_barrier()
        _conv_shift(tail_ptr, t, x, b, ch, m, C, W, BW)
        return y

    @triton.jit
    def _l2norm(x, eps, DT: tl.constexpr, EMULATE: tl.constexpr):
        """x / sqrt(Σ x² + eps) in fp32, rounded to DT as `kda.l2norm` returns it."""
        y = x * tl.rsqrt(tl.sum(x * x, 0) + eps)
        return _to16(y, DT, EMULATE).to(tl.float32)

    @triton.jit
    def _load_state(s_row, keep, mk, vv, V, STREAM: tl.constexpr):
        """The [K, BV] block of S at the columns vv (rows at s_row [K, 1]), zeros where not keep (a restart reads
        nothing). STREAM: evict-first (the state is touched once a step: keep it from evicting the weights' lines
        in L2)."""
        m = tl.where(keep, mk[:, None] & (vv < V)[None, :], False)
        if STREAM:
            return tl.load(s_row + vv[None, :], mask=m, other=0.0, eviction_policy="evict_first")
        return tl.load(s_row + vv[None, :], mask=m, other=0.0)

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, wv_ptr, tq_ptr, tk_ptr, tv_ptr, reset_ptr,
                       g_ptr, beta_ptr, state_ptr, o_ptr, H, K, V, scale, eps,
                       W: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NB: tl.constexpr,
                       CONV: tl.constexpr, HAS_RESET: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr,
                       STREAM: tl.constexpr, STAGES: tl.constexpr, V_FIRST: tl.constexpr = False,
                       BVA: tl.constexpr = 16, AHEAD: tl.constexpr = False,
                       HOIST: tl.constexpr = False):
        # program (b·H + h, column split s): columns [s·NB·BV, (s+1)·NB·BV) of S in NB blocks of BV. With CONV
        # q, k, v are raw projections [B, H·K] / [B, H·V] and reset is the conv window's [B, W]; without, q, k
        # [B, H, K] are normalized, v [B, H, V], reset [B] (HAS_RESET). g [B, H, K], beta [B, H], state
        # [B, H, K, V], o [B, H, V], all dense. CONV: one column split (the program shifts the q/k tails).
        # V_FIRST (`v_first`, CONV only): v's conv over all V columns (BVA: V's power of two) beside q's and k's
        # before the loop, stored in o (the activation dtype it is rounded to), which the loop reads back a block
        # at a time before overwriting it: the loop then loads a block of S and of v, updates and stores them with
        # no conv (nor the conv's barrier) between. AHEAD (`state_ahead`, with V_FIRST): S loaded one block ahead,
        # the first block with the prologue's loads, block i + 1 while block i is updated (two blocks live). HOIST
        # (`hoist`, only with CONV and V_FIRST: the launch folds them in): every load before the loop (the reset
        # flags, g, beta, the three convs' tails, inputs and weights; with AHEAD the first block of S) is issued
        # first, then the convs and norms, one barrier, the three tail shifts: one round trip to memory where the
        # convs in turn wait for theirs in a chain (the compiler moves no load across a barrier).
        bh = tl.program_id(0).to(tl.int64)
        b = bh // H
        h = bh % H
        kk = tl.arange(0, BK)
        mk = kk < K
        s_row = state_ptr + bh * K * V + kk[:, None] * V
        if HOIST:
            g = tl.load(g_ptr + bh * K + kk, mask=mk, other=0.0)
            beta = tl.load(beta_ptr + bh).to(tl.float32)
            keep = tl.load(reset_ptr + b * W + (W - 1)) == 0
            alive = _conv_alive(reset_ptr, b, W, BW)
            va = tl.arange(0, BVA)
            cq = _conv_load(q_ptr, tq_ptr, wq_ptr, b, h * K + kk, mk, H * K, W, BW)
            ck = _conv_load(k_ptr, tk_ptr, wk_ptr, b, h * K + kk, mk, H * K, W, BW)
            cv = _conv_load(v_ptr, tv_ptr, wv_ptr, b, h * V + va, va < V, H * V, W, BW)
            if AHEAD:
                S_next = _load_state(s_row, keep, mk, tl.program_id(1) * NB * BV + tl.arange(0, BV), V, STREAM)
            q = _l2norm(_conv_apply(cq[0], cq[1], cq[2], cq[3], alive, DT, EMULATE), eps, DT, EMULATE)
            k = _l2norm(_conv_apply(ck[0], ck[1], ck[2], ck[3], alive, DT, EMULATE), eps, DT, EMULATE)
            v_all = _conv_apply(cv[0], cv[1], cv[2], cv[3], alive, DT, EMULATE)
            tl.store(o_ptr + bh * V + va, v_all.to(o_ptr.dtype.element_ty), mask=va < V)
            tl.debug_barrier()   # every tail read before its shift, every thread's v stored before it is read back
            _conv_shift(tq_ptr, cq[0], cq[1], b, h * K + kk, mk, H * K, W, BW)
            _conv_shift(tk_ptr, ck[0], ck[1], b, h * K + kk, mk, H * K, W, BW)
            _conv_shift(tv_ptr, cv[0], cv[1], b, h * V + va, va < V, H * V, W, BW)
            decay = tl.exp(g.to(tl.float32))
        elif CONV:
            keep = tl.load(reset_ptr + b * W + (W - 1)) == 0
            if AHEAD:
                S_next = _load_state(s_row, keep, mk, tl.program_id(1) * NB * BV + tl.arange(0, BV), V, STREAM)
            q = _l2norm(_conv_token(q_ptr, tq_ptr, wq_ptr, reset_ptr, b, h * K + kk, mk, H * K, W, BW, DT, EMULATE),
                        eps, DT, EMULATE)
            k = _l2norm(_conv_token(k_ptr, tk_ptr, wk_ptr, reset_ptr, b, h * K + kk, mk, H * K, W, BW, DT, EMULATE),
                        eps, DT, EMULATE)
            if V_FIRST:
                va = tl.arange(0, BVA)
                v_all = _conv_token(v_ptr, tv_ptr, wv_ptr, reset_ptr, b, h * V + va, va < V, H * V, W, BW, DT,
                                    EMULATE)
                tl.store(o_ptr + bh * V + va, v_all.to(o_ptr.dtype.element_ty), mask=va < V)
                tl.debug_barrier()   # every thread's v stored before any reads a block of it back
        else:
            if HAS_RESET:
                keep = tl.load(reset_ptr + b) == 0
            else:
                keep = True
            q = tl.load(q_ptr + bh * K + kk, mask=mk, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + bh * K + kk, mask=mk, other=0.0).to(tl.float32)
        if not HOIST:
            decay = tl.exp(tl.load(g_ptr + bh * K + kk, mask=mk, other=0.0).to(tl.float32))
            beta = tl.load(beta_ptr + bh).to(tl.float32)
        qs = scale * q
        for i in tl.range(NB, num_stages=STAGES):
            vv = (tl.program_id(1) * NB + i) * BV + tl.arange(0, BV)
            mv = vv < V
            m = mk[:, None] & mv[None, :]
            s_ptrs = s_row + vv[None, :]
            if AHEAD:
                S = S_next
                S_next = _load_state(s_row, keep, mk, vv + BV, V, STREAM)   # past V in the last block: masked
                v = tl.load(o_ptr + bh * V + vv, mask=mv, other=0.0).to(tl.float32)
            elif V_FIRST:
                S = _load_state(s_row, keep, mk, vv, V, STREAM)
                v = tl.load(o_ptr + bh * V + vv, mask=mv, other=0.0).to(tl.float32)
            elif CONV:
                v = _conv_token(v_ptr, tv_ptr, wv_ptr, reset_ptr, b, h * V + vv, mv, H * V, W, BW, DT, EMULATE)
                S = _load_state(s_row, keep, mk, vv, V, STREAM)
            else:
                v = tl.load(v_ptr + bh * V + vv, mask=mv, other=0.0).to(tl.float32)
                S = _load_state(s_row, keep, mk, vv, V, STREAM)
            S = decay[:, None] * S
            u = beta * (v - tl.sum(S * k[:, None], 0))
            S = S + k[:, None] * u[None, :]
            o = tl.sum(S * qs[:, None], 0)
            tl.debug_barrier()   # as in _conv_token: all reads of this block of S (and of v in o) before the first
            #                      write
            if STREAM:
                tl.store(s_ptrs, S, mask=m, cache_modifier=".cs")
            else:
                tl.store(s_ptrs, S, mask=m)
            tl.store(o_ptr + bh * V + vv, _to16(o, o_ptr.dtype.element_ty, EMULATE), mask=mv)


def decode_config(K: int, V: int, fused: bool = True) -> tuple[int, int, int]:
    """(BK, BV, num_warps) of the decode kernels for head dims K, V: all K rows and BV columns of the
    state in registers. The fused kernel (one program per row and head, walking its column blocks, v's conv first)
    takes 32 columns on 32 state elements a thread, the in-place step (column blocks over the grid) 64 columns on
    64. Tuned at B = 64, H = 96, K = V = 128 (`tests/bench/kda.py --decode-sweep`, docs/performance.md#kda): the
    fused step [128, 32] on 4 warps with `v_first` 321 µs against 335 for the conv in its loop on 2 warps (KDA round
    15, an H100; round 16 took its prologue's loads together and the state a block ahead at the same blocks); the
    plain step [128, 64] on 4 warps 335 µs against 369-389 (round 1, the H200)."""
    if K > 256:
        raise ValueError(f"kda decode: the key dim K={K} must be at most 256 (a [K, BV] state block stays in "
                         "registers)")
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(32 if fused else 64, triton.next_power_of_2(V)))
    return BK, BV, max(1, min(8, BK * BV // (1024 if fused else 2048)))


STREAM = False
"""Cache hints on the state's load and store (evict-first, streaming): a benchmark's option until timed."""


def _launch(q, k, v, weights, tails, reset, g, beta, state, o, *, scale, eps, W, conv, block_v, num_warps,
            stream=None, stages=1, max_registers=None, v_first=False, state_ahead=False, hoist=True):
    B, H, K, V = state.shape
    BK, BV, warps = decode_config(K, V, fused=conv)
    if block_v is not None or num_warps is not None:   # a benchmark's choice
        if block_v is not None and (block_v < 1 or block_v & (block_v - 1)):
            raise ValueError(f"kda decode: block_v={block_v} must be a power of two")
        BV, warps = block_v or BV, num_warps or warps
    NV = triton.cdiv(V, BV)
    NB, splits = (NV, 1) if conv else (1, NV)   # the fused step walks its column blocks, the plain one splits them
    if max_registers is not None and not 24 <= max_registers <= 255:
        raise ValueError(f"kda decode: max_registers={max_registers} must be None or within [24, 255] (ptxas)")
    cap = {} if max_registers is None else dict(maxnreg=max_registers)
    if state_ahead and not (conv and v_first):
        raise ValueError("kda decode: state_ahead needs the fused step with v_first=True")
    if B * H:
        _decode_kernel[(B * H, splits)](
            q, k, v, *weights, *tails, reset, g, beta, state, o, H, K, V, scale, eps,
            W=W, BW=triton.next_power_of_2(W), BK=BK, BV=BV, NB=NB, CONV=conv, HAS_RESET=reset is not None,
            DT=getattr(tl, _DT[q.dtype]), EMULATE=interpreted(), STREAM=STREAM if stream is None else stream,
            STAGES=stages, V_FIRST=v_first and conv, BVA=max(16, triton.next_power_of_2(V)), AHEAD=state_ahead,
            HOIST=hoist and v_first and conv, num_warps=warps, **cap)


def kda_decode_step_triton(q_raw: Tensor, k_raw: Tensor, v_raw: Tensor, q_weight: Tensor, k_weight: Tensor,
                           v_weight: Tensor, q_tail: Tensor, k_tail: Tensor, v_tail: Tensor, conv_reset: Tensor,
                           g: Tensor, beta: Tensor, state: Tensor, *, scale: float, eps: float = 1e-6,
                           block_v: int | None = None, num_warps: int | None = None, stream: bool | None = None,
                           stages: int = 1, max_registers: int | None = None, v_first: bool = True,
                           state_ahead: bool | None = None, hoist: bool = True) -> Tensor:
    """One cached decode token of KDA from the raw projections: `kda_layer`'s T == 1 path from the conv inputs to o.

    Args:
        q_raw, k_raw [B, H·K], v_raw [B, H·V]: the new token's projections (before the convs), one dtype: bfloat16,
            float16 or float32.
        q_weight, k_weight [H·K, 1, W], v_weight [H·V, 1, W]: the depthwise conv weights (`*_conv1d.weight`), W ≥ 2.
        q_tail, k_tail, v_tail [B, W−1, C]: the cached raw inputs (`cache["conv_q"]`, ...), contiguous, the
            activation dtype; shifted in place (the new raw input last).
        conv_reset [B, W] bool: `Step.conv_reset` (True at the row's first real token; taps before it read 0). Its
            last column is `Step.reset[:, 0]`: the state of those rows restarts from 0 before the token.
        g [B, H, K]: the log-decay (`kda_gate`'s output), beta [B, H]: the write strength, both read in fp32.
        state [B, H, K, V] float32, contiguous: the recurrent state, updated in place.
        scale: the query scale (K^-1/2); eps: `l2norm`'s (inside the sqrt).
        block_v, num_warps: override `decode_config`; stream: cache hints (`STREAM`); stages: the column-block
            loop's software-pipelining depth; max_registers: ptxas's register cap a thread (more programs an SM,
            more of the state in flight, at the price of spills); v_first (the default): v's conv for all columns
            before the state's loop (o holds it until overwritten), not a block's before each block; state_ahead (None:
            with v_first): S loaded a block ahead (the first block with the convs' loads); hoist (the default, with
            v_first): the loads of the convs, g, beta (and the first block of S) issued together before any conv,
            one barrier before the tails' shifts, not each conv's loads, barrier and shift in turn; all seven for
            benchmarks.

    Returns o [B, H, V] in the activation dtype. Static launch shapes, no host reads: CUDA-graph capturable.
    """
    B, H, K, V = state.shape
    W = q_weight.shape[-1]
    acts = dict(q_raw=(q_raw, (B, H * K)), k_raw=(k_raw, (B, H * K)), v_raw=(v_raw, (B, H * V)),
                q_tail=(q_tail, (B, W - 1, H * K)), k_tail=(k_tail, (B, W - 1, H * K)),
                v_tail=(v_tail, (B, W - 1, H * V)))
    shapes = dict(acts, q_weight=(q_weight, (H * K, 1, W)), k_weight=(k_weight, (H * K, 1, W)),
                  v_weight=(v_weight, (H * V, 1, W)), conv_reset=(conv_reset, (B, W)), g=(g, (B, H, K)),
                  beta=(beta, (B, H)))
    name = "kda_decode_step_triton"
    if W < 2:
        raise ValueError(f"{name}: the conv width W={W} must be at least 2 (W = 1 has no tail: use the torch path)")
    _check_common(name, state, shapes, {"q_tail": q_tail, "k_tail": k_tail, "v_tail": v_tail})
    dtypes = {n: t.dtype for n, (t, _) in acts.items()}
    if len(set(dtypes.values())) > 1 or q_raw.dtype not in _DT:
        raise ValueError(f"{name}: the projections and tails must share one dtype (bfloat16, float16 or float32), "
                         f"got {dtypes}")
    if conv_reset.dtype != torch.bool:
        raise ValueError(f"{name}: conv_reset must be bool, got {conv_reset.dtype}")
    o = v_raw.new_empty(B, H, V)
    q_raw, k_raw, v_raw, q_weight, k_weight, v_weight, g, beta = (
        t.contiguous() for t in (q_raw, k_raw, v_raw, q_weight, k_weight, v_weight, g, beta))
    _launch(q_raw, k_raw, v_raw, (q_weight, k_weight, v_weight), (q_tail, k_tail, v_tail),
            conv_reset.contiguous().view(torch.uint8), g, beta, state, o, scale=scale, eps=eps, W=W, conv=True,
            block_v=block_v, num_warps=num_warps, stream=stream, stages=stages, max_registers=max_registers,
            v_first=v_first, state_ahead=v_first if state_ahead is None else state_ahead, hoist=hoist)
    return o


def kda_step_inplace_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                            reset: Tensor | None = None, *, scale: float, block_v: int | None = None,
                            num_warps: int | None = None, stream: bool | None = None,
                            max_registers: int | None = None) -> Tensor:
    """`delta_rule.kda_step` with the state updated in place: q, k [B, H, K] already normalized, v [B, H, V], g
    [B, H, K], beta [B, H], state [B, H, K, V] float32 contiguous, reset [B] bool or None (True: the row's state
    restarts from 0 first, as `state * keep`). Programs over (b·H + h, block of BV state columns). Returns o
    [B, H, V] in v.dtype. block_v, num_warps, stream, max_registers: as `kda_decode_step_triton`'s."""
    B, H, K, V = state.shape
    shapes = dict(q=(q, (B, H, K)), k=(k, (B, H, K)), v=(v, (B, H, V)), g=(g, (B, H, K)), beta=(beta, (B, H)))
    if reset is not None:
        shapes["reset"] = (reset, (B,))
    _check_common("kda_step_inplace_triton", state, shapes, {})
    if q.dtype not in _DT or reset is not None and reset.dtype != torch.bool:
        raise ValueError(f"kda_step_inplace_triton: q must be bfloat16, float16 or float32 and reset bool, got "
                         f"{q.dtype}, {None if reset is None else reset.dtype}")
    o = v.new_empty(B, H, V)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if reset is not None:
        reset = reset.contiguous().view(torch.uint8)
    _launch(q, k, v, (None,) * 3, (None,) * 3, reset, g, beta, state, o, scale=scale, eps=0.0, W=1, conv=False,
            block_v=block_v, num_warps=num_warps, stream=stream, max_registers=max_registers)
    return o


def _check_common(name: str, state: Tensor, shapes: dict, in_place: dict[str, Tensor]):
    """Named errors for the state (fp32, contiguous, [B, H, K, V]), the shapes, in-place tensors that are not
    contiguous, and tensors off one Triton device."""
    if state.dim() != 4 or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"{name}: state must be a contiguous float32 [B, H, K, V] tensor (updated in place), got "
                         f"{state.dtype} {list(state.shape)}")
    bad = {n: (list(t.shape), list(want)) for n, (t, want) in shapes.items() if tuple(t.shape) != want}
    if bad:
        raise ValueError(f"{name}: shapes (got, expected) for state {list(state.shape)}: {bad}")
    strided = [n for n, t in in_place.items() if not t.is_contiguous()]
    if strided:
        raise ValueError(f"{name}: {strided} are updated in place and must be contiguous")
    devices = {t.device for t, _ in shapes.values()} | {state.device}
    if len(devices) > 1 or not triton_available(next(iter(devices))):
        raise RuntimeError(f"{name} needs Triton and its tensors on one CUDA device (or TRITON_INTERPRET=1), got "
                           f"{sorted(str(d) for d in devices)}")
