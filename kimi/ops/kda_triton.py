"""Triton kernels of chunked KDA's forward (the gated delta rule of `delta_rule.kda_recurrent`, computed as
`delta_rule.kda_chunk` does), beside their references in `delta_rule.py`.

Per (sequence, head) and chunk of C tokens (rows r = 0..C−1, entering state S_n), with g(j, r] = Σ_{j<u≤r} g_u the
decay from token j to token r, Γ_r = g(−1, r], and seg_r the number of document starts at rows ≤ r of the chunk:

    L   = β_r Σ_d k_r k_j e^{g(j,r]}           j < r, same segment       (strictly lower)
    Aqk = s Σ_d q_r k_j e^{g(j,r]}             j ≤ r, same segment
    w   = (I + L)⁻¹ (β K ⊙ e^{Γ} · [seg_r = 0])      u = (I + L)⁻¹ (β V)
    q̃   = s Q ⊙ e^{Γ} · [seg_r = 0]            k̃ = K ⊙ e^{g(j, C−1]} · [seg_j = last]
    d   = e^{Γ_{C−1}} · [no document starts in the chunk]

and the chunks hand the state on in order:

    U_n = u_n − w_n S_n,    O_n = q̃_n S_n + Aqk_n U_n,    S_{n+1} = diag(d_n) S_n + k̃_nᵀ U_n.

Only the first segment of a chunk sees S_n and only the last one writes S_{n+1}; the pairwise terms are masked by
segment, so a document that starts inside a chunk starts from zero exactly.

**Kernels.** The intra-chunk quantities take two launches. The strips, one program per (chunk, query block a of
BC = 16 rows, first row n_a, sequence × head), build block a's rows of L and Aqk with every factor anchored at n_a:
queries carry e^{g(n_a, r]} ≤ 1, earlier keys e^{g(j, n_a]} ≤ 1, keys of the block itself e^{−g(n_a, j]} ≤ e^{15·5}.
Aqk and β·L go to scratch, and each strip inverts its own diagonal block I + L_aa (L_aa nilpotent) as
(I − N)(I + N²)(I + N⁴)(I + N⁸), three squarings and three products of [BC, BC] blocks, written in place of L_aa.
The solve (`_solve3_kernel`, one program per chunk and sequence × head) reads that back and finishes (I + L)⁻¹ by
doubling: with Mi inverting the diagonal blocks of size s and E the coupling of each 2s-block's halves,
(D + E)⁻¹ = Mi − Mi E Mi exactly (block forward substitution), log2(C / BC) levels of two [C, C] dots (two at
C = 64); then w = (I + L)⁻¹ R_w and u = (I + L)⁻¹ R_u as dots with it. For 16-bit inputs (`V3["strips"] = "v6"`)
`_gamma_kernel` first stores each chunk's prefix sums Γ (times log2 e, so that every factor is one ex2) and
`_strips6_kernel` takes every factor from them, e^{Γ_r − Γ_{n_a}} and e^{Γ_{n_a} − Γ_j}, in one [BC, C] dot per key
piece, and forms q̃, k̃ and d from the rows it holds: no scans, at the price of differences of prefix sums (off by
an ulp of |Γ·log2 e| ≤ 7.3·C, far below the operands' 16-bit rounding). fp32 inputs (and `V3["strips"] = "v4"`)
run `_strips4_kernel`, which meets the keys one block b of BC rows at a time (a [BC, BC] dot per key piece, only
16-row scans: the keys carry e^{g(j, m_b]}, summed within b, times e^{g(m_b, n_a]}, g_{n_a} plus the gates of the
whole blocks between), so that every exponent is a sum over exactly the gates it spans (gates are ≤ 0: these sums
do not cancel), and also writes q̃, k̃ and d.
The sequential pass, `_state_kernel` (one program per sequence × head and block of state columns), carries its
block of S through the chunks in fp32 registers, storing S_n and U_n, and `_output_kernel`, one program per (chunk,
sequence × head, column block), forms O_n = q̃_n S_n + Aqk_n U_n from them in parallel. Or the pass forms O_n
itself from its registers (`V3["out"]`), beside the chain of S, and stores S_n and U_n only for a backward.
For 16-bit inputs w, q̃, k̃, S_n, U_n and Aqk are bf16 between the kernels (`V3`; u stays fp32, and the state pass
updates S with its fp32 U_n), and q̃_n S_n and Aqk_n U_n then take bf16 operands (the same products as TF32 ones of
bf16 values); "v6" forms q̃, k̃ and d in the strips, leaving the solve w and u; with `V3["state_dots"] = "x2"`
the pass's two dots take w and k̃ as stored and the fp32 S_n and U_n as the sum of two bf16 parts (two bf16 dots
each: 16 bits of mantissa against TF32's 11).

**Gates.** The anchored diagonal block needs e^{−g(n_a, j]} to stay finite over 15 tokens: the kernels take the
bounded gate of K3, g ∈ [−5, 0] (as FLA's `safe_gate`); unbounded softplus gates belong to `delta_rule.kda_chunk`.

**Precision.** fp32 inputs: IEEE fp32 dots throughout. 16-bit inputs (the fast path, `PRECISION`): the pairwise
strips of L / Aqk take 16-bit operands on the tensor cores, the triangular solve and the state pass TF32 ones
(16-bit operands there double the error: the state rounded to bf16 costs ~2e-3 of the final state alone); sums
are fp32, and so are the state, the scratch and every exponential. Under Triton's interpreter the 16-bit dot is
wrong and TF32 is full fp32 (triton 3.9), so `_dot` rounds the operands as the tensor cores take them (16-bit:
to nearest even; TF32: low 13 bits dropped, the coarser of the hardware's choices) and multiplies exactly: the
CPU tests measure the GPU's rounding.

**Backward.** `kda_bwd_triton.py` (its own module docstring); it reruns `kda_intra_triton` with `inverse` and
`_state_pass` storing S_n, and takes `_state_bwd_kernel` (the state recurrence's adjoint) from here.

**Context parallelism.** A slice of a sequence maps a start state S to M S + S_zero (the chunk step is affine in
S: S_{n+1} = (diag(d_n) − k̃_nᵀ w_n) S_n + k̃_nᵀ u_n). `kda_cp_prepass_triton` returns S_zero (the state pass
from zero) and M (the same pass with u = 0 from S = I); a document start inside the slice zeroes M. Running a
slice from a given start state is `kda_chunk_fwd_triton(..., initial_state=S)`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import interpreted, sm_count, tl, triton, triton_available

SUB_CHUNK = 16   # BC: rows of one diagonal block (its anchored exponentials span at most 15 gates)

if triton is not None:
    @triton.jit
    def _to16(x, DT: tl.constexpr, EMULATE: tl.constexpr):
        """x in DT, rounded to nearest even as on the GPU (the interpreter truncates fp32 to bf16: the bits are
        rounded first, so the conversion is exact)."""
        if EMULATE:
            if DT == tl.bfloat16:
                bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                x = bits.to(tl.float32, bitcast=True)
        return x.to(DT)

    @triton.jit
    def _operand(x, P: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr):
        """x (fp32) as `_dot` with operands P multiplies it: rounded to DT for "16", to TF32 for "tf32" (low 13
        bits dropped: the hardware then takes it exactly), unchanged for "ieee"."""
        if P == "16":
            x = _to16(x, DT, EMULATE).to(tl.float32)
        elif P == "tf32":
            x = (x.to(tl.float32).to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        return x

    @triton.jit
    def _dot(a, b, acc, P: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr):
        """acc + a @ b, accumulated in fp32, operands as P says: "ieee" fp32, "tf32" (10-bit mantissas), "16" (DT:
        bf16 / fp16), "x2" (a already in DT, b split into two DT parts hi + lo: two 16-bit dots, b kept to 16 bits
        of mantissa, a 16-bit operand never widened in registers), "x2n" (the same parts as the two column halves
        of one dot, a @ [hi | lo], then the halves added: one wgmma group). Under the interpreter (EMULATE), whose
        16-bit dot is wrong and whose TF32 is full fp32, the operands are rounded as the tensor cores take them
        (TF32: low 13 bits dropped) and multiplied exactly."""
        if P == "16":
            a = _to16(a, DT, EMULATE)
            b = _to16(b, DT, EMULATE)
            if EMULATE:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        elif P == "tf32":
            if EMULATE:
                a = (a.to(tl.float32).to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
                b = (b.to(tl.float32).to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
        elif P == "x2":   # a already in DT (16-bit scratch); b fp32 as the sum of two DT parts
            a = _to16(a, DT, EMULATE)
            hi = _to16(b, DT, EMULATE)
            lo = _to16(b.to(tl.float32) - hi.to(tl.float32), DT, EMULATE)
            if EMULATE:
                acc = tl.dot(a.to(tl.float32), hi.to(tl.float32), acc, input_precision="ieee")
                acc = tl.dot(a.to(tl.float32), lo.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, lo, tl.dot(a, hi, acc))
        elif P == "x2n":   # "x2" as one dot of twice the columns: a @ [hi | lo], then its two halves summed
            hi = _to16(b, DT, EMULATE)
            lo = _to16(b.to(tl.float32) - hi.to(tl.float32), DT, EMULATE)
            M: tl.constexpr = a.shape[0]
            KB: tl.constexpr = b.shape[0]
            NB: tl.constexpr = b.shape[1]
            hl = tl.reshape(tl.permute(tl.join(hi, lo), (0, 2, 1)), (KB, 2 * NB))
            if EMULATE:
                r = tl.dot(_to16(a, DT, EMULATE).to(tl.float32), hl.to(tl.float32), input_precision="ieee")
            else:
                r = tl.dot(a.to(DT), hl)
            r_hi, r_lo = tl.split(tl.permute(tl.reshape(r, (M, 2, NB)), (0, 2, 1)))
            acc = acc + r_hi + r_lo
        else:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return acc

    @triton.jit
    def _exp(x):
        """e^x as 2^(x·log2 e): the arithmetic of `tl.exp` (the same multiply, then ex2.approx) without its guard for
        results below 2^−126 (a compare and two predicated multiplies around the ex2: five sm_90 instructions become
        two), which flush to zero here, far below any sum they enter."""
        return tl.math.exp2(x * 1.4426950408889634)

    @triton.jit
    def _chunk_rows(reset_ptr, n, bh, T, H, C: tl.constexpr, HAS_RESET: tl.constexpr):
        """The rows of chunk n of sequence × head bh: (t their positions [C], valid, tok = token·H + h for the
        [B, T, H, ·] inputs, rst their document starts, seg the segment of every row, n_seg the starts in the
        chunk). A row sees the entering state iff seg == 0 and writes the leaving one iff seg == n_seg."""
        b = bh // H
        h = bh % H
        t = n * C + tl.arange(0, C)
        valid = t < T
        tok = (b * T + t) * H + h
        if HAS_RESET:
            rst = tl.load(reset_ptr + b * T + t, mask=valid, other=0)
        else:
            rst = tl.zeros([C], dtype=tl.int32)
        return t, valid, tok, rst, tl.cumsum(rst, 0), tl.sum(rst, 0)

    @triton.jit
    def _state_kernel(w_ptr, u_ptr, kd_ptr, d_ptr, s0_ptr, sN_ptr, h_ptr, U_ptr, K, V, N, C: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, S0: tl.constexpr, HAS_U: tl.constexpr, STORE: tl.constexpr,
                      STATE: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr, qd_ptr=None, A_ptr=None,
                      o_ptr=None, T=1, H=1, OUT: tl.constexpr = ""):
        # program (row bh, block of BV state columns); the state's K rows and BV columns stay in fp32 registers
        # through the N chunks, from S0 to the final state in sN. S0: 0 zeros, 1 loaded
        # from s0 [B·H, K, V], 2 the identity (the transition, V = K).
        # HAS_U False: u = 0. STORE: the state entering every chunk into h [B·H, N, K, V] (in its dtype), and
        # U_n into U (u itself or its own buffer, in its dtype: what `_output_kernel` and the backward read).
        # OUT (the operands of its two dots, `_dot`'s P; "" none): also O_n = q̃_n S_n + Aqk_n U_n into o
        # [B, T, H, V] from the fp32 S_n and U_n in registers, `_output_kernel`'s work off the chain of S.
        bh = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, C)
        kk = tl.arange(0, BK)
        vv = tl.program_id(1) * BV + tl.arange(0, BV)
        mk = kk < K
        mv = vv < V
        m_kv = mk[:, None] & mv[None, :]
        if S0 == 1:
            S = tl.load(s0_ptr + bh * K * V + kk[:, None] * V + vv[None, :], mask=m_kv, other=0.0)
        elif S0 == 2:
            S = tl.where(m_kv & (kk[:, None] == vv[None, :]), 1.0, 0.0)
        else:
            S = tl.zeros([BK, BV], dtype=tl.float32)
        for n in range(N):
            rws = (bh * N + n) * C + c
            if STORE:
                tl.store(h_ptr + ((bh * N + n) * K + kk[:, None]) * V + vv[None, :],
                         _to16(S, h_ptr.dtype.element_ty, EMULATE), mask=m_kv)
            w = tl.load(w_ptr + rws[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
            U = -_dot(w, S, tl.zeros([C, BV], dtype=tl.float32), STATE, DT, EMULATE)
            if HAS_U:
                U += tl.load(u_ptr + rws[:, None] * V + vv[None, :], mask=mv[None, :], other=0.0).to(tl.float32)
            if STORE:   # U_n in U's dtype; the update below takes the fp32 U
                tl.store(U_ptr + rws[:, None] * V + vv[None, :], _to16(U, U_ptr.dtype.element_ty, EMULATE),
                         mask=mv[None, :])
            if OUT != "":
                A = tl.load(A_ptr + rws[:, None] * C + c[None, :])
                qd = tl.load(qd_ptr + rws[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
                o = _dot(qd, S, _dot(A, U, tl.zeros([C, BV], dtype=tl.float32), OUT, DT, EMULATE), OUT, DT, EMULATE)
                t = n * C + c
                tl.store(o_ptr + (((bh // H) * T + t) * H + bh % H)[:, None] * V + vv[None, :],
                         _to16(o, o_ptr.dtype.element_ty, EMULATE), mask=(t < T)[:, None] & mv[None, :])
            kd = tl.load(kd_ptr + rws[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
            dn = tl.load(d_ptr + (bh * N + n) * K + kk, mask=mk, other=0.0)
            S = dn[:, None] * S + _dot(tl.trans(kd), U, tl.zeros([BK, BV], dtype=tl.float32), STATE, DT, EMULATE)
        tl.store(sN_ptr + bh * K * V + kk[:, None] * V + vv[None, :], S, mask=m_kv)

    @triton.jit
    def _state_bwd_kernel(qd_ptr, kd_ptr, w_ptr, A_ptr, d_ptr, do_ptr, dsN_ptr, dh_ptr, dU_ptr, dh0_ptr,
                          T, H, K, V, N, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          HAS_DSN: tl.constexpr, HAS_DH0: tl.constexpr, STATE: tl.constexpr, DT: tl.constexpr,
                          EMULATE: tl.constexpr):
        # program (row bh, block of BV state columns), chunks in reverse: dS (the gradient of the state leaving
        # chunk n) stays in fp32 registers. Writes dS_{n+1} into dh [B·H, N, K, V], dU_n into dU [B·H, N, C, V]
        # and dS_0 into dh0 [B·H, K, V].
        bh = tl.program_id(0).to(tl.int64)
        b = bh // H
        h = bh % H
        c = tl.arange(0, C)
        kk = tl.arange(0, BK)
        vv = tl.program_id(1) * BV + tl.arange(0, BV)
        mk = kk < K
        mv = vv < V
        m_kv = mk[:, None] & mv[None, :]
        if HAS_DSN:
            dS = tl.load(dsN_ptr + bh * K * V + kk[:, None] * V + vv[None, :], mask=m_kv, other=0.0)
        else:
            dS = tl.zeros([BK, BV], dtype=tl.float32)
        for i in range(N):
            n = N - 1 - i
            rws = (bh * N + n) * C + c
            tl.store(dh_ptr + ((bh * N + n) * K + kk[:, None]) * V + vv[None, :], dS, mask=m_kv)
            t = n * C + c
            do = tl.load(do_ptr + ((b * T + t) * H + h)[:, None] * V + vv[None, :],
                         mask=(t < T)[:, None] & mv[None, :], other=0.0).to(tl.float32)
            A = tl.load(A_ptr + rws[:, None] * C + c[None, :])
            kd = tl.load(kd_ptr + rws[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
            dU = _dot(kd, dS, _dot(tl.trans(A), do, tl.zeros([C, BV], dtype=tl.float32), STATE, DT, EMULATE),
                      STATE, DT, EMULATE)
            tl.store(dU_ptr + rws[:, None] * V + vv[None, :], dU, mask=mv[None, :])
            qd = tl.load(qd_ptr + rws[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
            w = tl.load(w_ptr + rws[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
            dn = tl.load(d_ptr + (bh * N + n) * K + kk, mask=mk, other=0.0)
            dS = _dot(tl.trans(qd), do, dn[:, None] * dS, STATE, DT, EMULATE)
            dS = _dot(tl.trans(-w), dU, dS, STATE, DT, EMULATE)
        if HAS_DH0:
            tl.store(dh0_ptr + bh * K * V + kk[:, None] * V + vv[None, :], dS, mask=m_kv)

    @triton.jit
    def _block_cumsum(x, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr):
        """Inclusive sums of x [C, BK] down its rows (up them: REVERSE), restarting at every block of BC rows."""
        return tl.reshape(tl.cumsum(tl.reshape(x, [C // BC, BC, BK]), 1, reverse=REVERSE), [C, BK])

    @triton.jit
    def _output_kernel(qd_ptr, A_ptr, U_ptr, h_ptr, o_ptr, T, H, K, V, N, C: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, STATE: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr,
                       QS: tl.constexpr = "", AU: tl.constexpr = ""):
        # program (chunk n, row bh, block of BV output columns): O_n = q̃_n S_n + Aqk_n U_n
        # from the state pass's S_n (h [B·H, N, K, V]) and U_n; chunk-parallel. QS "16": q̃_n S_n with 16-bit
        # operands (both stored in 16 bits: the same products as TF32's, at the 16-bit rate); "": STATE's. AU: the
        # same for Aqk_n U_n.
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        c = tl.arange(0, C)
        vv = tl.program_id(2) * BV + tl.arange(0, BV)
        mv = vv < V
        rws = (bh * N + n) * C + c
        o = tl.zeros([C, BV], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            mk = kk < K
            qd = tl.load(qd_ptr + rws[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
            S = tl.load(h_ptr + ((bh * N + n) * K + kk[:, None]) * V + vv[None, :], mask=mk[:, None] & mv[None, :],
                        other=0.0)
            if QS == "16":
                o = _dot(qd, S, o, "16", DT, EMULATE)
            else:
                o = _dot(qd, S, o, STATE, DT, EMULATE)
        A = tl.load(A_ptr + rws[:, None] * C + c[None, :])
        U = tl.load(U_ptr + rws[:, None] * V + vv[None, :], mask=mv[None, :], other=0.0)
        if AU == "16":
            o = _dot(A, U, o, "16", DT, EMULATE)
        else:
            o = _dot(A, U, o, STATE, DT, EMULATE)
        t = n * C + c
        tl.store(o_ptr + ((b * T + t) * H + h)[:, None] * V + vv[None, :], _to16(o, o_ptr.dtype.element_ty, EMULATE),
                 mask=(t < T)[:, None] & mv[None, :])

    @triton.jit
    def _qkd_from_gamma(q, kt, gam, g_end, first, last, scale, rows, kk, mk, qd_ptr, kd_ptr, K,
                        EMULATE: tl.constexpr):
        """q̃ = s q e^{Γ_r} on the chunk's first segment and k̃ = k e^{Γ_{C−1} − Γ_j} on its last (a difference of
        prefix sums: 16-bit inputs; `gam`, `g_end` Γ · log2 e as `_gamma_kernel` stores it), stored at scratch rows
        `rows` in their pointers' dtype."""
        qd = tl.where(first, scale * q * tl.math.exp2(gam), 0.0)
        kd = tl.where(last, kt * tl.math.exp2(g_end[None, :] - gam), 0.0)
        tl.store(qd_ptr + rows[:, None] * K + kk[None, :], _to16(qd, qd_ptr.dtype.element_ty, EMULATE), mask=mk)
        tl.store(kd_ptr + rows[:, None] * K + kk[None, :], _to16(kd, kd_ptr.dtype.element_ty, EMULATE), mask=mk)

    @triton.jit
    def _solve3(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, qd_ptr, kd_ptr, d_ptr, M_ptr, r_ptr, n, bh, K, V,
                N, scale, valid, tok, first, last, n_seg, C: tl.constexpr, BC: tl.constexpr, LOG_BC: tl.constexpr,
                LEVELS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, INVERSE: tl.constexpr, SOLVE: tl.constexpr,
                DT: tl.constexpr, EMULATE: tl.constexpr, QKD: tl.constexpr, GAMMA: tl.constexpr):
        """Chunk n's (I + L)⁻¹ from the strips' M (β·L with (I + L_aa)⁻¹ on the diagonal blocks), by the doubling of
        the module docstring from level LOG_BC = log2(BC) on, each level reading its coupling afresh; written over M
        if INVERSE. Then w and u as dots with it, and q̃, k̃, d if QKD (else the strips wrote them; QKD needs GAMMA).
        GAMMA: r holds Γ · log2 e (`_gamma_kernel`; 16-bit inputs; its factors then bare ex2), and k̃ takes
        e^{Γ_{C−1} − Γ_j}; else Γ is a scan of g here (sums of exactly the gates spanned)."""
        tl.static_assert(GAMMA or not QKD)
        rows = tl.arange(0, C)
        out = (bh * N + n) * C + rows
        r2 = rows[:, None]
        c2 = rows[None, :]
        Mi = tl.load(M_ptr + out[:, None] * C + c2, mask=r2 // BC == c2 // BC, other=0.0)
        z = tl.zeros([C, C], dtype=tl.float32)
        for lvl in tl.static_range(LOG_BC, LEVELS):
            s = 1 << lvl
            E = tl.load(M_ptr + out[:, None] * C + c2,
                        mask=(r2 // (2 * s) == c2 // (2 * s)) & ((r2 // s) % 2 == 1) & ((c2 // s) % 2 == 0), other=0.0)
            Mi = Mi - _dot(Mi, _dot(E, Mi, z, SOLVE, DT, EMULATE), z, SOLVE, DT, EMULATE)
        if INVERSE:
            tl.debug_barrier()   # every thread has read L before (I + L)⁻¹ replaces it
            tl.store(M_ptr + out[:, None] * C + c2, Mi)
        beta = tl.load(beta_ptr + tok, mask=valid, other=0.0).to(tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            mk = kk[None, :] < K
            m = valid[:, None] & mk
            kt = tl.load(k_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            if GAMMA:   # Γ · log2 e from `_gamma_kernel` in r
                gam = tl.load(r_ptr + out[:, None] * K + kk[None, :], mask=mk, other=0.0)
                eg = tl.math.exp2(gam)                                            # e^{Γ_r}
            else:
                g = tl.load(g_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
                gam = tl.cumsum(g, 0)
                eg = _exp(gam)
            rhs = tl.where(first, beta[:, None] * kt * eg, 0.0)
            if QKD:   # v6 strips that leave q̃, k̃ and d to the solve (V3["strips_qkd"] False)
                q = tl.load(q_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
                g_end = tl.load(r_ptr + ((bh * N + n) * C + C - 1) * K + kk, mask=kk < K, other=0.0)
                _qkd_from_gamma(q, kt, gam, g_end, first, last, scale, out, kk, mk, qd_ptr, kd_ptr, K, EMULATE)
                tl.store(d_ptr + (bh * N + n) * K + kk, tl.where(n_seg == 0, tl.math.exp2(g_end), 0.0), mask=kk < K)
            w = _dot(Mi, rhs, tl.zeros([C, BK], dtype=tl.float32), SOLVE, DT, EMULATE)
            tl.store(w_ptr + out[:, None] * K + kk[None, :], _to16(w, w_ptr.dtype.element_ty, EMULATE), mask=mk)
        for v0 in range(0, V, BV):
            vv = v0 + tl.arange(0, BV)
            mv = vv[None, :] < V
            v = tl.load(v_ptr + tok[:, None] * V + vv[None, :], mask=valid[:, None] & mv, other=0.0).to(tl.float32)
            u = _dot(Mi, beta[:, None] * v, tl.zeros([C, BV], dtype=tl.float32), SOLVE, DT, EMULATE)
            tl.store(u_ptr + out[:, None] * V + vv[None, :], _to16(u, u_ptr.dtype.element_ty, EMULATE), mask=mv)

    @triton.jit
    def _solve3_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, reset_ptr, w_ptr, u_ptr, qd_ptr, kd_ptr, d_ptr, M_ptr,
                       r_ptr, T, H, K, V, N, scale, C: tl.constexpr, BC: tl.constexpr, LOG_BC: tl.constexpr,
                       LEVELS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_RESET: tl.constexpr,
                       INVERSE: tl.constexpr, SOLVE: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr,
                       QKD: tl.constexpr, GAMMA: tl.constexpr):
        # program (chunk n, row bh): `_solve3` after `_strips6_kernel` or `_strips4_kernel`
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        t, valid, tok, rst, seg, n_seg = _chunk_rows(reset_ptr, n, bh, T, H, C, HAS_RESET)
        _solve3(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, qd_ptr, kd_ptr, d_ptr, M_ptr, r_ptr, n, bh, K, V,
                N, scale, valid, tok, (seg == 0)[:, None], (seg == n_seg)[:, None], n_seg, C, BC, LOG_BC, LEVELS, BK,
                BV, INVERSE, SOLVE, DT, EMULATE, QKD, GAMMA)

    @triton.jit
    def _gate_sum(g_ptr, seq, h, n, lo, hi, kk, mk, T, H, K, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
        """Σ of the gates of chunk n's blocks lo..hi−1 (of BC rows) on the key channels kk: [BK]."""
        acc = tl.zeros([BK], dtype=tl.float32)
        for c in range(lo, hi):
            t = n * C + c * BC + tl.arange(0, BC)
            g = tl.load(g_ptr + ((seq * T + t) * H + h)[:, None] * K + kk[None, :], mask=(t < T)[:, None] & mk,
                        other=0.0)
            acc += tl.sum(g.to(tl.float32), 0)
        return acc

    @triton.jit
    def _strips4_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, reset_ptr, qd_ptr, kd_ptr, A_ptr, M_ptr, d_ptr, T, H, K, N,
                        scale, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, HAS_RESET: tl.constexpr,
                        PAIR: tl.constexpr, SOLVE: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr):
        # program (n · NB + a, row bh) for chunk n and query block a, `V3["strips"] = "v4"`: block a's
        # rows of Aqk and β·L (its diagonal block inverted) one [BC, BC] block of keys at a time, each a dot per
        # key piece, and q̃, k̃ of its rows (d from the last block). Only 16-row scans: key block b < a carries
        # e^{g(j, m_b] + g(m_b, n_a]}, the first a sum within b, the second g_{n_a} plus the whole blocks between,
        # so every exponent is a sum of exactly the gates it spans.
        NB: tl.constexpr = C // BC
        n = tl.program_id(0) // NB
        a = tl.program_id(0) % NB
        bh = tl.program_id(1).to(tl.int64)
        seq = bh // H
        h = bh % H
        t, valid, tok, rst, seg, n_seg = _chunk_rows(reset_ptr, n, bh, T, H, C, HAS_RESET)
        rows = tl.arange(0, C)
        lr = tl.arange(0, BC)
        ra = a * BC + lr
        va = ((n * C + ra) < T)[:, None]
        toka = (seq * T + n * C + ra) * H + h
        a_rows = (bh * N + n) * C + ra
        seg_a = tl.sum(tl.where(rows[None, :] <= ra[:, None], rst[None, :], 0), 1)
        beta_a = tl.load(beta_ptr + toka, mask=(n * C + ra) < T, other=0.0).to(tl.float32)
        zb = tl.zeros([BC, BC], dtype=tl.float32)
        # the diagonal block (its own keys carry e^{−g(n_a, j]} ≤ e^{75}), q̃, k̃ and d, piece by piece
        d_qk = zb
        d_kk = zb
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            mk = (kk < K)[None, :]
            g_a = tl.load(g_ptr + toka[:, None] * K + kk[None, :], mask=va & mk, other=0.0).to(tl.float32)
            q_a = tl.load(q_ptr + toka[:, None] * K + kk[None, :], mask=va & mk, other=0.0).to(tl.float32)
            k_a = tl.load(k_ptr + toka[:, None] * K + kk[None, :], mask=va & mk, other=0.0).to(tl.float32)
            f = tl.cumsum(tl.where(lr[:, None] > 0, g_a, 0.0), 0)             # g(n_a, r]
            e = _exp(f)
            kb = k_a * _exp(-f)
            d_qk = _dot(q_a * e, tl.trans(kb), d_qk, PAIR, DT, EMULATE)
            d_kk = _dot(k_a * e, tl.trans(kb), d_kk, PAIR, DT, EMULATE)
            gam = _gate_sum(g_ptr, seq, h, n, 0, a, kk, mk, T, H, K, C, BC, BK) + tl.sum(
                tl.where(lr[:, None] == 0, g_a, 0.0), 0)                          # Γ_{n_a}
            after = _gate_sum(g_ptr, seq, h, n, a + 1, NB, kk, mk, T, H, K, C, BC, BK)
            qd = tl.where((seg_a == 0)[:, None], scale * q_a * _exp(gam[None, :] + f), 0.0)
            kd = tl.where((seg_a == n_seg)[:, None],
                          k_a * _exp(tl.cumsum(g_a, 0, reverse=True) - g_a + after[None, :]), 0.0)
            tl.store(qd_ptr + a_rows[:, None] * K + kk[None, :], _to16(qd, qd_ptr.dtype.element_ty, EMULATE), mask=mk)
            tl.store(kd_ptr + a_rows[:, None] * K + kk[None, :], _to16(kd, kd_ptr.dtype.element_ty, EMULATE), mask=mk)
            if a == NB - 1:
                dn = tl.where(n_seg == 0, _exp(gam + tl.sum(tl.where(lr[:, None] > 0, g_a, 0.0), 0)), 0.0)
                tl.store(d_ptr + (bh * N + n) * K + kk, dn, mask=kk < K)
        same = seg_a[:, None] == seg_a[None, :]
        a_qk = tl.where(same & (lr[None, :] <= lr[:, None]), d_qk * scale, 0.0)
        tl.store(A_ptr + a_rows[:, None] * C + ra[None, :], _to16(a_qk, A_ptr.dtype.element_ty, EMULATE))
        nil = tl.where(same & (lr[None, :] < lr[:, None]), d_kk, 0.0) * beta_a[:, None]
        inv = (lr[:, None] == lr[None, :]).to(tl.float32) - nil
        pw = nil
        tl.static_assert(BC == 16)
        for i in tl.static_range(3):   # (I + N)⁻¹ = (I − N)(I + N²)(I + N⁴)(I + N⁸)
            pw = _dot(pw, pw, zb, SOLVE, DT, EMULATE)
            inv = _dot(inv, pw, inv, SOLVE, DT, EMULATE)
        tl.store(M_ptr + a_rows[:, None] * C + ra[None, :], inv)
        # earlier key blocks b: e^{g(j, m_b]} within b, e^{g(m_b, n_a]} the gates between
        for b in range(a):
            rb = b * BC + lr
            vb = ((n * C + rb) < T)[:, None]
            tokb = (seq * T + n * C + rb) * H + h
            s_qk = zb
            s_kk = zb
            for k0 in range(0, K, BK):
                kk = k0 + tl.arange(0, BK)
                mk = (kk < K)[None, :]
                g_a = tl.load(g_ptr + toka[:, None] * K + kk[None, :], mask=va & mk, other=0.0).to(tl.float32)
                q_a = tl.load(q_ptr + toka[:, None] * K + kk[None, :], mask=va & mk, other=0.0).to(tl.float32)
                k_a = tl.load(k_ptr + toka[:, None] * K + kk[None, :], mask=va & mk, other=0.0).to(tl.float32)
                g_b = tl.load(g_ptr + tokb[:, None] * K + kk[None, :], mask=vb & mk, other=0.0).to(tl.float32)
                k_b = tl.load(k_ptr + tokb[:, None] * K + kk[None, :], mask=vb & mk, other=0.0).to(tl.float32)
                e = _exp(tl.cumsum(tl.where(lr[:, None] > 0, g_a, 0.0), 0))      # e^{g(n_a, r]}
                gap = _gate_sum(g_ptr, seq, h, n, b + 1, a, kk, mk, T, H, K, C, BC, BK) + tl.sum(
                    tl.where(lr[:, None] == 0, g_a, 0.0), 0)                      # g(m_b, n_a]
                kp = k_b * _exp(tl.cumsum(g_b, 0, reverse=True) - g_b + gap[None, :])     # e^{g(j, n_a]} ≤ 1
                s_qk = _dot(q_a * e, tl.trans(kp), s_qk, PAIR, DT, EMULATE)
                s_kk = _dot(k_a * e, tl.trans(kp), s_kk, PAIR, DT, EMULATE)
            seg_b = tl.sum(tl.where(rows[None, :] <= rb[:, None], rst[None, :], 0), 1)
            same = seg_a[:, None] == seg_b[None, :]
            tl.store(A_ptr + a_rows[:, None] * C + rb[None, :],
                     _to16(tl.where(same, s_qk * scale, 0.0), A_ptr.dtype.element_ty, EMULATE))
            tl.store(M_ptr + a_rows[:, None] * C + rb[None, :], tl.where(same, s_kk, 0.0) * beta_a[:, None])
        for b in range(a + 1, NB):   # zeros above the diagonal blocks (the output pass reads Aqk whole)
            tl.store(A_ptr + a_rows[:, None] * C + (b * BC + lr)[None, :], zb.to(A_ptr.dtype.element_ty))

    @triton.jit
    def _gamma_kernel(g_ptr, r_ptr, T, H, K, N, C: tl.constexpr, BK: tl.constexpr):
        # program (chunk n, row bh, key piece): Γ_r = Σ_{u ≤ r} g_u of the chunk's rows, in
        # units of ln 2 (Γ_r · log2 e: its readers' factors are then bare ex2), into r [B·H, N, C, K] fp32
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        t = n * C + tl.arange(0, C)
        kk = tl.program_id(2) * BK + tl.arange(0, BK)
        m = (t < T)[:, None] & (kk < K)[None, :]
        g = tl.load(g_ptr + (((bh // H) * T + t) * H + bh % H)[:, None] * K + kk[None, :], mask=m, other=0.0)
        out = (bh * N + n) * C + tl.arange(0, C)
        tl.store(r_ptr + out[:, None] * K + kk[None, :], tl.cumsum(g.to(tl.float32), 0) * 1.4426950408889634,
                 mask=(kk < K)[None, :])

    @triton.jit
    def _strips6_kernel(q_ptr, k_ptr, beta_ptr, reset_ptr, r_ptr, A_ptr, M_ptr, qd_ptr, kd_ptr, d_ptr, T, H, K, N,
                        scale, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, HAS_RESET: tl.constexpr,
                        PAIR: tl.constexpr, SOLVE: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr,
                        QKD: tl.constexpr = False):
        # program (n · NB + a, row bh) for chunk n and query block a, `V3["strips"] = "v6"` (16-bit
        # inputs): block a's rows of Aqk and β·L against every key of the chunk, one [BC, C] dot per key piece (its
        # diagonal block then inverted), the anchored factors from the chunk's prefix sums Γ (`_gamma_kernel`, in r,
        # times log2 e: each factor one ex2) instead of scans: queries e^{Γ_r − Γ_{n_a}} ≤ 1, keys e^{Γ_{n_a} − Γ_j}
        # (≤ 1 before n_a, ≤ e^{75} in block a). A difference of two prefix sums is off by an ulp of Γ · log2 e
        # (≤ 7.3·C): far below the operands' 16-bit rounding.
        # QKD: also q̃, k̃ of its rows (e^{Γ_r}, e^{Γ_{C−1} − Γ_j}) and, from the last block, d (the solve then forms
        # only w and u).
        NB: tl.constexpr = C // BC
        n = tl.program_id(0) // NB
        a = tl.program_id(0) % NB
        bh = tl.program_id(1).to(tl.int64)
        seq = bh // H
        h = bh % H
        t, valid, tok, rst, seg, n_seg = _chunk_rows(reset_ptr, n, bh, T, H, C, HAS_RESET)
        rows = tl.arange(0, C)
        lr = tl.arange(0, BC)
        ra = a * BC + lr
        va = ((n * C + ra) < T)[:, None]
        toka = (seq * T + n * C + ra) * H + h
        a_rows = (bh * N + n) * C + ra
        c_rows = (bh * N + n) * C + rows
        seg_a = tl.sum(tl.where(rows[None, :] <= ra[:, None], rst[None, :], 0), 1)
        upto = (valid & (rows < a * BC + BC))[:, None]                       # the keys the strip meets
        s_kk = tl.zeros([BC, C], dtype=tl.float32)
        s_qk = tl.zeros([BC, C], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            mk = (kk < K)[None, :]
            gam = tl.load(r_ptr + c_rows[:, None] * K + kk[None, :], mask=upto & mk, other=0.0)
            kt = tl.load(k_ptr + tok[:, None] * K + kk[None, :], mask=upto & mk, other=0.0).to(tl.float32)
            g_na = tl.load(r_ptr + ((bh * N + n) * C + a * BC) * K + kk, mask=kk < K, other=0.0)
            k_an = kt * tl.math.exp2(g_na[None, :] - gam)   # rows past the strip: k = 0, Γ = 0 (a factor ≤ 1)
            gam_a = tl.load(r_ptr + a_rows[:, None] * K + kk[None, :], mask=mk, other=0.0)
            e = tl.math.exp2(gam_a - g_na[None, :])
            q_a = tl.load(q_ptr + toka[:, None] * K + kk[None, :], mask=va & mk, other=0.0).to(tl.float32)
            k_a = tl.load(k_ptr + toka[:, None] * K + kk[None, :], mask=va & mk, other=0.0).to(tl.float32)
            s_kk = _dot(k_a * e, tl.trans(k_an), s_kk, PAIR, DT, EMULATE)
            s_qk = _dot(q_a * e, tl.trans(k_an), s_qk, PAIR, DT, EMULATE)
            if QKD:
                g_end = tl.load(r_ptr + ((bh * N + n) * C + C - 1) * K + kk, mask=kk < K, other=0.0)
                _qkd_from_gamma(q_a, k_a, gam_a, g_end, (seg_a == 0)[:, None], (seg_a == n_seg)[:, None], scale,
                                a_rows, kk, mk, qd_ptr, kd_ptr, K, EMULATE)
                if a == NB - 1:
                    tl.store(d_ptr + (bh * N + n) * K + kk, tl.where(n_seg == 0, tl.math.exp2(g_end), 0.0),
                             mask=kk < K)
        beta_a = tl.load(beta_ptr + toka, mask=(n * C + ra) < T, other=0.0).to(tl.float32)
        same = seg_a[:, None] == seg[None, :]
        a_qk = tl.where(same & (rows[None, :] <= ra[:, None]), s_qk * scale, 0.0)
        tl.store(A_ptr + a_rows[:, None] * C + rows[None, :], _to16(a_qk, A_ptr.dtype.element_ty, EMULATE))
        tl.store(M_ptr + a_rows[:, None] * C + rows[None, :],
                 tl.where(same & (rows[None, :] < ra[:, None]), s_kk * beta_a[:, None], 0.0))
        tl.debug_barrier()   # L_aa back as one [BC, BC] block
        nil = tl.load(M_ptr + a_rows[:, None] * C + ra[None, :])
        zb = tl.zeros([BC, BC], dtype=tl.float32)
        inv = (lr[:, None] == lr[None, :]).to(tl.float32) - nil
        pw = nil
        tl.static_assert(BC == 16)
        for i in tl.static_range(3):   # (I + N)⁻¹ = (I − N)(I + N²)(I + N⁴)(I + N⁸)
            pw = _dot(pw, pw, zb, SOLVE, DT, EMULATE)
            inv = _dot(inv, pw, inv, SOLVE, DT, EMULATE)
        tl.debug_barrier()   # every thread has read L_aa
        tl.store(M_ptr + a_rows[:, None] * C + ra[None, :], inv)

_DT16 = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _pow2(x: int) -> int:
    return max(16, 1 << (x - 1).bit_length())


def state_config(K: int, V: int, ieee: bool, block_v: int | None = None) -> dict:
    """The sequential passes' launch config (`_state_kernel`, `_state_bwd_kernel`): the whole key dim, state columns
    in blocks of `block_v` (the forward's, `V3["state_block"]`: a [128, 64] fp32 state at 4 warps, 255 registers in
    the sm_90 offline compile, two programs an SM) or else 32 at K = 128, one stage at K = 128 (pipelined, fp32 [C, K]
    tiles need more shared memory than Hopper has). IEEE dots (fp32 inputs) run on the CUDA cores with both operands
    in registers: 16 columns and 8 warps at K = 128 (0.9 KB of spills a thread, against 11 KB at 32 columns and 4
    warps)."""
    BK = _pow2(K)
    if ieee and BK > 64:
        return dict(BK=BK, BV=min(_pow2(V), 16), num_warps=8, num_stages=1)
    if block_v is not None:
        return dict(BK=BK, BV=min(_pow2(V), block_v), num_warps=4, num_stages=1)
    return dict(BK=BK, BV=min(_pow2(V), 64 if BK <= 64 else 32), num_warps=4, num_stages=2 if BK <= 64 else 1)


def solve_config(C: int, K: int, V: int, ieee: bool) -> dict:
    """The intra-chunk launches' config: w in key pieces of `V3["block_kw"]` and u in value pieces of 64 in the solve,
    its `V3["num_warps"]` warps, `V3["stages"]` for the strips and the solve (sm_90 offline compile at K = V = 128,
    bf16 with the defaults: the solve 166 registers, no spills); IEEE dots (fp32 inputs, whose operands sit in
    registers) 16-column key pieces, one stage and 8 warps at C = 64."""
    if ieee:
        return dict(BKW=min(_pow2(K), 16), BV=min(_pow2(V), 64), num_warps=8 if C >= 64 else 4, num_stages=1)
    return dict(BKW=min(_pow2(K), V3["block_kw"]), BV=min(_pow2(V), 64), num_warps=V3["num_warps"],
                num_stages=V3["stages"])


def output_config(K: int, V: int, ieee: bool) -> dict:
    """The output kernel's launch config: up to 128 output columns a program (q̃ and Aqk read once a chunk), the key
    dim in pieces of 64, 8 warps, two stages (sm_90 offline compile at K = V = 128: 60 registers, 48 KB of shared
    memory; ptxas serializes its wgmma, a wait after each); `V3["output_bk"]` another key piece for 16-bit
    inputs, one stage when it covers K (at 128: 99 registers, the wgmma not serialized). IEEE dots 64 columns and
    key pieces of 32 (no spills)."""
    if ieee:
        return dict(BK=min(_pow2(K), 32), BV=min(_pow2(V), 64), num_warps=8, num_stages=2)
    if V3["output_bk"] is None:
        return dict(BK=min(_pow2(K), 64), BV=min(_pow2(V), 128), num_warps=8, num_stages=2)
    bk = min(_pow2(K), V3["output_bk"])
    return dict(BK=bk, BV=min(_pow2(V), 128), num_warps=8, num_stages=1 if bk >= K else 2)


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
           reset: Tensor | None, chunk_size: int, name: str):
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"{name}: q, k and g must be [B, T, H, K] alike, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(g.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"{name}: v must be [B, T, H, V] and beta [B, T, H] for q {tuple(q.shape)}, got "
                         f"{tuple(v.shape)} and {tuple(beta.shape)}")
    if T == 0:
        raise ValueError(f"{name}: KDA needs at least one token")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{name}: q, k, v must share one dtype of float32, bfloat16, float16 (the kernels compute in "
                         f"fp32; float64 is delta_rule.kda_chunk's), got {q.dtype}, {k.dtype}, {v.dtype}")
    if K > 256 or v.shape[-1] > 256:
        raise ValueError(f"{name}: K={K}, V={v.shape[-1]} must be at most 256 (the state rows stay in registers)")
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"{name}: chunk_size={chunk_size} must be 16, 32 or 64 (sub-blocks of {SUB_CHUNK} rows)")
    if initial_state is not None and (initial_state.shape != (B, H, K, v.shape[-1])
                                      or initial_state.dtype != torch.float32):
        raise ValueError(f"{name}: initial_state must be float32 [B, H, K, V] = {[B, H, K, v.shape[-1]]}, got "
                         f"{initial_state.dtype} {list(initial_state.shape)}")
    if reset is not None and reset.shape != (B, T):
        raise ValueError(f"{name}: reset must be [B, T] = {[B, T]}, got {list(reset.shape)}")
    tensors = [t for t in (q, k, v, g, beta, initial_state, reset) if t is not None]
    devices = {t.device for t in tensors}
    if len(devices) > 1 or not triton_available(devices.pop()):
        raise RuntimeError(f"{name} needs Triton and its tensors on one CUDA device (or TRITON_INTERPRET=1), got "
                           f"{sorted({str(t.device) for t in tensors})}")


PRECISION = {"pair": "16", "solve": "tf32", "state": "tf32"}
"""Operands of the dots for 16-bit inputs (fp32 inputs: "ieee" everywhere): "pair" the pairwise strips of L and
Aqk, "solve" the triangular solve, "state" the state pass; "16" (the inputs' dtype), "tf32" or "ieee"."""


V3 = {"state_block": "auto", "scratch": "16", "states": "16", "block_kw": 32, "num_warps": 4, "stages": 2,
      "state_stages": 1, "state_warps": 4, "state_dots": "tf32", "strips": "v6", "strip_warps": 2, "solve_warps": None,
      "block_k4": 32, "block_k6": 32, "solve_dots": None, "u16": "U", "a16": True, "strips_qkd": True,
      "output_bk": None, "out": "auto"}
"""Options of the forward for 16-bit inputs: "state_block" the state columns of one sequential program (16, 32, 64,
or "auto");
"scratch" the dtype of w, q̃ and k̃ between the kernels and "states" that of the stored S_n: "16" (bf16; the state
and output dots then round their operands to TF32 or take them as bf16) or "fp32";
"state_stages", "state_warps" the state pass's launch, "state_dots" its dots' operands with bf16 scratch ("tf32";
"x2": w and k̃ as they are stored, S_n and U_n split in two bf16 parts, more exact than TF32 with no fp32 copy of w
and k̃ in registers; "x2n": the same products with the two parts side by side in one dot of twice the columns, half
the wgmma groups on the chain, and its dots 16 wide at a "state_block" of 8; "16": S_n and U_n rounded to bf16, as
FLA's state pass); "state_block" "auto": `_auto_state`
picks the columns, warps, stages and dots by the shape (the other three options then unused);
the intra-chunk launches: "strips" "v6" (`_gamma_kernel`, then `_strips6_kernel` with key pieces of "block_k6") or
"v4" (`_strips4_kernel`, key pieces of "block_k4"; what fp32 inputs run), "strip_warps" their warps (16-bit inputs,
v6 and v4 alike; 2, measured faster than 4 with v6: docs/performance.md#kda); the solve's
"block_kw" (w's key piece), "num_warps" ("solve_warps" over it), "stages" (software pipelining of the loads, the
strips' too) and "solve_dots" (its operands; None: `PRECISION["solve"]`; "16": bf16, as FLA's);
"u16" with "scratch" "16": True, u and U_n bf16 (the state pass updates S with its fp32 U_n); "U", U_n alone
(its own buffer; u stays fp32); "a16": Aqk bf16 (with a bf16 U_n the output's Aqk_n U_n takes bf16 operands);
"strips_qkd" (with "v6"): the strips form q̃, k̃ and d, the solve only w and u;
"output_bk" the output kernel's key piece for 16-bit inputs (None: `output_config`'s; the whole key dim in one piece
runs one stage: the loop over pieces then has one trip);
"out" where O_n is formed: "kernel" (`_output_kernel`, from the stored S_n and U_n), "state" (in the state pass,
which then stores S_n and U_n only for a backward) or "auto" (`fuse_output`; its dots' operands: `out_dots`).
(The name: the third forward design; docs/performance.md#kda has the earlier two.)"""


_V3_KEYS = frozenset(V3)


def _check_v3() -> None:
    """One named error for a `V3` that names an option that does not exist (a retired one, a typo) or a value the
    kernels do not know, rather than a default run in its place."""
    unknown = sorted(set(V3) - _V3_KEYS)
    if unknown:
        raise ValueError(f"kda_triton.V3: unknown options {unknown} (the options: {sorted(_V3_KEYS)})")
    allowed = {"strips": ("v4", "v6"), "u16": (True, False, "U"), "a16": (True, False),
               "strips_qkd": (True, False), "scratch": ("16", "fp32"), "states": ("16", "fp32"),
               "output_bk": (None, 16, 32, 64, 128, 256), "out": ("kernel", "state", "auto")}
    bad = {n: V3[n] for n, ok in allowed.items() if V3[n] not in ok}
    if bad:
        raise ValueError(f"kda_triton.V3: {bad} not among {({n: allowed[n] for n in bad})}")


def _dots(dtype: torch.dtype, *which: str) -> dict:
    """The dot operands of `which` ("pair", "solve", "state") for inputs of `dtype` (fp32: "ieee" everywhere), the
    16-bit operand type and whether the interpreter emulates the tensor cores' rounding. fp16 inputs take bf16
    operands: the anchored diagonal blocks' factors reach e^{75} with gates of −5, past fp16's range."""
    prec = {w.upper(): PRECISION[w] if dtype in _DT16 else "ieee" for w in which}
    return dict(prec, DT=tl.bfloat16 if dtype in _DT16 else tl.float32, EMULATE=interpreted())


def kda_intra_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, reset: Tensor | None = None, *,
                     scale: float, chunk_size: int = 64, inverse: bool = False,
                     scratch: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """The intra-chunk quantities of every chunk (module docstring): the strips (one program per chunk, query block
    of 16 rows and sequence × head; for 16-bit inputs after `_gamma_kernel`), then the solve (one per chunk and
    sequence × head).

    q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], reset [B, T] bool or None. Returns tensors over rows
    R = B·H (b-major) and chunks N = ⌈T / C⌉ (the last chunk zero-padded): w, q̃ ("qd"), k̃ ("kd") [R, N, C, K]
    (in `scratch`: fp32 or bf16), u [R, N, C, V] (fp32; in `scratch` with `V3["u16"]` True), Aqk ("A")
    [R, N, C, C] (fp32; in `scratch` with `V3["a16"]`), d [R, N, K] (fp32); with `inverse` also (I + L)⁻¹ ("M")
    [R, N, C, C] fp32 (the backward's)."""
    _check_v3()
    _check(q, k, v, g, beta, None, reset, chunk_size, "kda_intra_triton")
    return _intra(q, k, v, g, beta, reset, scale=scale, chunk_size=chunk_size, inverse=inverse, scratch=scratch)


def _intra(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, reset: Tensor | None, *, scale: float,
           chunk_size: int, inverse: bool, scratch: torch.dtype) -> dict[str, Tensor]:
    """`kda_intra_triton` on inputs already checked (its callers' `_check` and `_check_v3`)."""
    if scratch not in (torch.float32, torch.bfloat16):
        raise ValueError(f"kda_intra_triton: scratch={scratch} must be float32 or bfloat16")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    N = -(-T // C)
    R = B * H
    f32 = dict(dtype=torch.float32, device=q.device)
    s16 = dict(dtype=scratch, device=q.device)
    u16 = s16 if V3["u16"] is True else f32
    a16 = s16 if V3["a16"] else f32
    x = dict(w=torch.empty(R, N, C, K, **s16), u=torch.empty(R, N, C, V, **u16), qd=torch.empty(R, N, C, K, **s16),
             kd=torch.empty(R, N, C, K, **s16), A=torch.empty(R, N, C, C, **a16), d=torch.empty(R, N, K, **f32),
             M=torch.empty(R, N, C, C, **f32))   # L passes through M on its way to (I + L)⁻¹
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    rst = reset.to(torch.int32).contiguous() if reset is not None else q   # q: a pointer never read
    ieee = q.dtype not in _DT16   # fp32 inputs: IEEE dots, whose operands sit in registers (`solve_config`)
    cfg = solve_config(C, K, V, ieee=ieee)
    dots = _dots(q.dtype, "pair", "solve")
    blocks = dict(C=C, BC=SUB_CHUNK, HAS_RESET=reset is not None, num_stages=cfg["num_stages"], **dots)
    v6 = V3["strips"] == "v6" and not ieee   # fp32 inputs: v4's sums of exactly the gates spanned
    if v6:
        x["R"] = torch.empty(R, N, C, K, **f32)
    solve = {n: w for n, w in blocks.items() if n != "PAIR"}
    if V3["solve_dots"] and not ieee:
        solve["SOLVE"] = V3["solve_dots"]
    grid = (N * (C // SUB_CHUNK), R)
    if v6:
        bg = min(_pow2(K), 64)
        _gamma_kernel[(N, R, triton.cdiv(K, bg))](g, x["R"], T, H, K, N, C=C, BK=bg, num_warps=4)
        _strips6_kernel[grid](q, k, beta, rst, x["R"], x["A"], x["M"], x["qd"], x["kd"], x["d"], T, H, K, N,
                              float(scale), BK=min(_pow2(K), V3["block_k6"]), num_warps=V3["strip_warps"],
                              QKD=V3["strips_qkd"], **blocks)
    else:
        _strips4_kernel[grid](q, k, g, beta, rst, x["qd"], x["kd"], x["A"], x["M"], x["d"], T, H, K, N,
                              float(scale), BK=min(_pow2(K), 16 if ieee else V3["block_k4"]),
                              num_warps=4 if ieee else V3["strip_warps"], **blocks)
    _solve3_kernel[(N, R)](
        q, k, v, g, beta, rst, x["w"], x["u"], x["qd"], x["kd"], x["d"], x["M"], x.get("R", x["M"]), T, H, K, V,
        N, float(scale), BK=cfg["BKW"], BV=cfg["BV"], LOG_BC=SUB_CHUNK.bit_length() - 1,
        LEVELS=C.bit_length() - 1, INVERSE=inverse, QKD=v6 and not V3["strips_qkd"], GAMMA=v6,
        num_warps=V3["solve_warps"] or cfg["num_warps"] if not ieee else cfg["num_warps"], **solve)
    x.pop("R", None)   # Γ: the strips' and the solve's alone
    if not inverse:
        del x["M"]
    return x


def _state_pass(x: dict[str, Tensor], B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, *,
                s0: Tensor | None, identity: bool, with_u: bool, states: Tensor | None = None,
                block_v: int | str | None = None, launch: dict | None = None, dots: str | None = None,
                U: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """Run `_state_kernel` over the scratch `x` of `kda_intra_triton`; returns the final state [B, H, K, V].
    `states` [R, N, K, V]: also store the state entering every chunk there, and U_n = u_n − w_n S_n into `U` (of
    u's shape, `u_out_buffer`) or else over x["u"].
    block_v: the state columns of a program for 16-bit inputs (None: `state_config`'s own; "auto": `_auto_state`
    picks them, the launch and the dots by the shape); launch: num_warps and num_stages over `state_config`'s; dots:
    the operands of its two dots for 16-bit inputs (None: `PRECISION["state"]`; "x2", "x2n" and "16" need bf16 w
    and k̃, `_dot`). out [B, T, H, V]: also O_n = q̃_n S_n + Aqk_n U_n into it from the pass's registers (the work of
    `_output_pass`, which is then not needed), its dots' operands `out_dots`'s."""
    R, N, C = x["w"].shape[:3]
    scratch = x["w"].dtype if x["w"].dtype == x["kd"].dtype else torch.float32
    cfg, prec = state_launch(R, K, V, dtype, scratch, x["w"].device, block_v=block_v, launch=launch, dots=dots)
    sN = torch.empty(B, H, K, V, dtype=torch.float32, device=x["w"].device)
    s0_ptr = s0.contiguous() if s0 is not None else sN
    mode = 2 if identity else (1 if s0 is not None else 0)
    fused = {}
    if out is not None:
        fused = dict(qd_ptr=x["qd"], A_ptr=x["A"], o_ptr=out, T=T, H=H, OUT=out_dots(x, dtype, prec))
    _state_kernel[(R, triton.cdiv(V, cfg["BV"]))](
        x["w"], x["u"], x["kd"], x["d"], s0_ptr, sN, states if states is not None else sN,
        U if U is not None else x["u"], K, V, N, C=C, BK=cfg["BK"], BV=cfg["BV"], S0=mode, HAS_U=with_u,
        STORE=states is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **fused, **prec)
    return sN


def out_dots(x: dict[str, Tensor], dtype: torch.dtype, prec: dict) -> str:
    """The operands of O_n's two dots in the state pass (`_state_kernel`'s OUT) for inputs of `dtype` and the pass's
    dots `prec` (`_dots`): with bf16 q̃ and Aqk (16-bit inputs) "x2n", S_n and U_n each as two bf16 parts (16 bits of
    mantissa, where `_output_kernel` reads their bf16 copies; S_n and U_n rounded to bf16 instead ("16") gave wrong
    outputs at 32 columns on an H100 under Triton 3.6, docs/performance.md KDA round 10); else the pass's own."""
    if dtype in _DT16 and x["qd"].dtype == x["A"].dtype == torch.bfloat16:
        return "x2n"
    return prec["STATE"]


def fuse_output(R: int, V: int, dtype: torch.dtype, scratch: torch.dtype, device: torch.device) -> bool:
    """Whether the forward forms O_n in its state pass (`_state_kernel`'s OUT) rather than in `_output_kernel`:
    `V3["out"]` "state" always, "kernel" never, "auto" for 16-bit inputs with bf16 scratch where `_auto_state`
    leaves at most one program an SM (few sequences × heads: the pass is a chain of dependent dots with the SM
    otherwise idle) in at most four column blocks (every column block's program reads the chunk's q̃ and Aqk again:
    at 8 columns, sixteen of them, it measured slower; docs/performance.md, KDA round 10)."""
    if V3["out"] != "auto":
        return V3["out"] == "state"
    if dtype not in _DT16 or scratch != torch.bfloat16 or V3["state_block"] != "auto":
        return False
    sms = sm_count(device) if device.type == "cuda" else 132
    blocks = triton.cdiv(V, _auto_state(R, V, device)[0])
    return R * blocks <= sms and blocks <= 4


def state_launch(R: int, K: int, V: int, dtype: torch.dtype, scratch: torch.dtype, device: torch.device, *,
                 block_v: int | str | None = None, launch: dict | None = None,
                 dots: str | None = None) -> tuple[dict, dict]:
    """`_state_kernel`'s launch config and dot operands (`_dots`) over R = B·H rows, for inputs of `dtype` and w, k̃
    in `scratch`; block_v, launch and dots as `_state_pass` takes them."""
    if block_v == "auto" and scratch != torch.bfloat16:
        # fp32 scratch (the backward's recompute): the launch measured correct on the H200; `_auto_state`'s
        # pipelined narrow launches gave wrong states there with fp32 tiles (docs/performance.md#kda)
        block_v, launch = 64, None
    if block_v == "auto":
        block_v, launch, dots = _auto_state(R, V, device)
    cfg = {**state_config(K, V, ieee=dtype not in _DT16, block_v=block_v), **(launch or {})}
    prec = _dots(dtype, "state")
    if dots is not None and dtype in _DT16:
        if dots in ("x2", "x2n", "16") and scratch != torch.bfloat16:
            raise ValueError(f"_state_pass: dots={dots!r} needs bf16 w and k~, got {scratch}")
        prec["STATE"] = dots
    return cfg, prec


def forward_state_options(dtype: torch.dtype, scratch: torch.dtype) -> dict:
    """`_state_pass`'s block_v, launch and dots as `kda_chunk_fwd_triton` takes them from `V3`, for inputs of
    `dtype` with w, k̃ in `scratch`."""
    return dict(block_v=V3["state_block"],
                launch=dict(num_warps=V3["state_warps"], num_stages=V3["state_stages"]) if dtype in _DT16 else None,
                dots=V3["state_dots"] if scratch == torch.bfloat16 else None)


def u_out_buffer(x: dict[str, Tensor]) -> Tensor | None:
    """The bf16 buffer the state pass writes U_n into beside the fp32 u (`V3["u16"] = "U"` with bf16 scratch), or
    None (U_n over u)."""
    if V3["u16"] == "U" and x["w"].dtype == torch.bfloat16:
        return torch.empty(x["u"].shape, dtype=torch.bfloat16, device=x["u"].device)
    return None


def _auto_state(R: int, V: int, device: torch.device) -> tuple[int, dict, str]:
    """The state pass's launch for 16-bit inputs by the shape (`V3["state_block"] = "auto"`): (state columns a
    program, num_warps and num_stages, dots). With a program of 64 columns for every SM: 64 columns, 4 warps, two
    stages, "x2" dots (two programs an SM, all in one wave; "x2n" at 64 columns measured slower). With
    fewer rows (B·H) the pass is bound by each program's chain of dependent dots, so more and shorter chains win,
    with "x2n" dots (one wgmma group a product on the chain): the narrowest of 8, 16 and 32 columns (8 warps, three
    stages) that leaves at most one program an SM, else 16 columns at 4 warps and two stages (docs/performance.md,
    KDA rounds 8 and 9: 32 columns at 32 heads, where 16 put two programs on an SM)."""
    sms = sm_count(device) if device.type == "cuda" else 132
    if R * triton.cdiv(V, 64) >= sms:
        return 64, dict(num_warps=4, num_stages=2), "x2"
    if R * triton.cdiv(V, 8) <= sms:
        return 8, dict(num_warps=8, num_stages=3), "x2n"
    if R * triton.cdiv(V, 16) <= sms:
        return 16, dict(num_warps=8, num_stages=3), "x2n"
    if R * triton.cdiv(V, 32) <= sms:
        return 32, dict(num_warps=8, num_stages=3), "x2n"
    return 16, dict(num_warps=4, num_stages=2), "x2n"


def kda_chunk_fwd_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         initial_state: Tensor | None = None, reset: Tensor | None = None, *, scale: float,
                         chunk_size: int = 64, residuals: bool = False) -> tuple[Tensor, ...]:
    """KDA forward as Triton kernels: the contract of `delta_rule.kda_chunk` / `kda_recurrent` for float32 and
    16-bit inputs with bounded gates (g ∈ [−5, 0], module docstring).

    q, k [B, T, H, K] (L2-normalized), v [B, T, H, V] (one dtype: float32, bfloat16 or float16), g [B, T, H, K]
    log-decay, beta [B, T, H], initial_state [B, H, K, V] float32 or None, reset [B, T] bool (the state is zeroed
    before each True token). Returns o [B, T, H, V] in v.dtype and the final state [B, H, K, V] float32; with
    `residuals` also the scratch (`kda_intra_triton`'s dict with (I + L)⁻¹ in "M" and U_n over "u") and the
    states S_n [R, N, K, V] entering each chunk, for a backward that does not recompute them. Options for 16-bit
    inputs: `V3`."""
    _check(q, k, v, g, beta, initial_state, reset, chunk_size, "kda_chunk_fwd_triton")
    _check_v3()
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    s16 = q.dtype in _DT16
    scratch = torch.bfloat16 if s16 and V3["scratch"] == "16" else torch.float32
    x = _intra(q, k, v, g, beta, reset, scale=scale, chunk_size=chunk_size, inverse=residuals, scratch=scratch)
    R, N, C = x["w"].shape[:3]
    fuse = fuse_output(R, V, q.dtype, scratch, q.device)
    states, U = None, None
    if residuals or not fuse:   # S_n and U_n stored: for the backward, or for `_output_kernel`
        states = torch.empty(R, N, K, V, dtype=torch.bfloat16 if s16 and V3["states"] == "16" else torch.float32,
                             device=q.device)
        U = u_out_buffer(x)
    opts = dict(identity=False, with_u=True, states=states, U=U, out=o if fuse else None,
                **forward_state_options(q.dtype, scratch))
    sN = _state_pass(x, B, T, H, K, V, q.dtype, s0=initial_state, **opts)
    if not fuse:
        _output_pass(x, states, o, q.dtype, U=U)
    if U is not None:   # U_n replaces u from here on
        x["u"] = U
    return (o, sN, x, states) if residuals else (o, sN)


def _output_pass(x: dict[str, Tensor], states: Tensor, o: Tensor, dtype: torch.dtype, *,
                 U: Tensor | None = None) -> None:
    """O_n = q̃_n S_n + Aqk_n U_n into o [B, T, H, V] (`_output_kernel`), from the scratch `x` after a state pass
    that stored S_n into `states` [R, N, K, V] and U_n into `U` (None: over x["u"])."""
    R, N, C, K = x["qd"].shape
    B, T, H, V = o.shape
    U = U if U is not None else x["u"]
    cfg = output_config(K, V, ieee=dtype not in _DT16)
    dots = _dots(dtype, "state")
    qs = "16" if dtype in _DT16 and x["qd"].dtype == states.dtype == torch.bfloat16 else ""
    au = "16" if dtype in _DT16 and x["A"].dtype == U.dtype == torch.bfloat16 else ""
    _output_kernel[(N, R, triton.cdiv(V, cfg["BV"]))](
        x["qd"], x["A"], U, states, o, T, H, K, V, N, C=C, BK=cfg["BK"], BV=cfg["BV"], QS=qs, AU=au,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **dots)


def kda_cp_prepass_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, reset: Tensor | None = None,
                          *, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """What one slice of a sequence does to the state, for context parallelism: for every start state S,
    the slice's final state is M S + S_zero.

    Inputs as `kda_chunk_fwd_triton` (the slice's tokens). Returns (S_zero [B, H, K, V]: the final state from a
    zero start, M [B, H, K, K]: the product over the slice's chunks of diag(d_n) − k̃_nᵀ w_n, later chunks on the
    left), both float32. A document start inside the slice makes M zero. Then the ranks chain
    S_{i+1} = M_i S_i + S_zero_i, and each runs its slice with `kda_chunk_fwd_triton(initial_state=S_i)`."""
    _check(q, k, v, g, beta, None, reset, chunk_size, "kda_cp_prepass_triton")
    B, T, H, K = q.shape
    V = v.shape[-1]
    x = kda_intra_triton(q, k, v, g, beta, reset, scale=1.0, chunk_size=chunk_size)
    s_zero = _state_pass(x, B, T, H, K, V, q.dtype, s0=None, identity=False, with_u=True)
    M = _state_pass(x, B, T, H, K, K, q.dtype, s0=None, identity=True, with_u=False)
    return s_zero, M
