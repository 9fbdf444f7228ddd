"""Triton backward of chunked KDA in chunk-parallel kernels (notation of `kda_triton`'s module docstring).

`kda_chunk_bwd_triton` gives the gradients of `kda_triton.kda_chunk_fwd_triton`'s (o, final state). Its first
launches: the intra-chunk scratch again, with (I + L)⁻¹, in fp32, and the forward state pass storing every chunk's
entering state S_n and U_n (or neither: `saved`, the forward's own scratch from `kda_chunk_fwd_saving`, bf16 w, q̃,
k̃, S_n, U_n and Aqk for 16-bit inputs with `kda_triton.V3`'s defaults; `SAVE` picks for the op); the reverse state
pass (`kda_triton._state_bwd_kernel`, or `_state_bwd2_kernel` here, which takes the tiles in their stored dtype:
`REVERSE`; per row and block of state columns, chunks n = N−1..0 from dS_N, the final state's gradient)

    dU_n = Aqk_nᵀ dO_n + k̃_n dS_{n+1},    dS_n = q̃_nᵀ dO_n + diag(d_n) dS_{n+1} − w_nᵀ dU_n,

storing dS_{n+1} and dU_n (dS_0 is the initial state's gradient). Through the state, dq̃ = dO S_nᵀ,
dk̃ = U dS_{n+1}ᵀ, dw = −dU S_nᵀ, dd = Σ_v S_n ⊙ dS_{n+1}, dAqk = dO Uᵀ; through the solves X = (I + L)⁻¹ R,
dR = (I + L)⁻ᵀ dX, and dL = −(dR_w wᵀ + dR_u uᵀ) collapses to −dR_u Uᵀ because u = U + w S_n and
dR_w = −dR_u S_nᵀ. The per-chunk token gradients are then split in two kernels:

1. `_bwd_dav_kernel`, one program per (chunk, sequence × head): the value side. dAqk = s·dO Uᵀ (on Aqk's strict
   pattern, its diagonal apart), dR_u = (I + L)⁻ᵀ dU, dL = −dR_u Uᵀ (on L's pattern), dv = β dR_u and dβ's value
   part Σ_v dR_u ⊙ v. dAqk and dL go to [R, N, C, C] scratch in the pairwise dots' operand type (bf16 for 16-bit
   inputs: the dots round them so anyway), the diagonal and dβ's part in fp32.
2. `_bwd_dqkg_kernel`, one program per (block of key channels, chunk, sequence × head): the state side (dq̃ = dO S_nᵀ,
   dk̃ = U dS_{n+1}ᵀ, dR_w = −(I + L)⁻ᵀ dU S_nᵀ, dd = Σ_v S_n ⊙ dS_{n+1}), the pairwise gradients of L and Aqk,
   and dq, dk, dg and dβ's key part. The pairwise sums are one batched dot per side over the sub-blocks a of BC
   rows (first row n_a, so each pair (query block, key block) is multiplied once): query rows of block a carry
   e^{g(n_a, r]} ≤ 1; the keys against anchor a carry e^{g(j, n_a]} (earlier blocks, ≤ 1) or e^{−g(n_a, j]} (block
   a, ≤ e^{75}), a [C/BC, C, BK] tensor (`PAIRWISE` "wide": the same sums with the anchors side by side in the
   columns, [C, C] x [C, C/BC · BK] dots, each row then reading its own anchor's columns). For keys of block
   b < a, g(j, n_a] = g(j, m_b] + g(m_b, n_a] (m_b the last row of b): the first a sum over the rows it spans
   inside block b, the second the sums of the whole blocks between plus the gate of n_a, so every exponent is a
   sum of gates over exactly the tokens it spans and none is a difference of two chunk prefix sums.

   dΓ (the gradient w.r.t. the prefix sums of the gates) takes the pairwise terms from the same rounded operands
   on both sides of every pair, so their ± parts cancel in dg's suffix sums to fp32 accumulation error; each row
   takes the shorter of the suffix and the negated prefix sum (the pairwise part sums to zero over the chunk),
   exclusive prefix sums are a scan that adds only the earlier rows (never cumsum(x) − x), and the terms of k̃ and
   d (which span the gates after j, and all of them) are summed over exactly those.

Resets inside a chunk: dAqk and dL are masked by segment (a pair across a document start has no term), only the
first segment's rows see S_n (q̃, R_w carry [seg = 0]) and only the last one's write S_{n+1} (k̃ carries
[seg = last], d is zero with a start in the chunk); the initial state's gradient is dS_0 of the reverse pass and
the final state's gradient enters it as dS_N.
"""

from __future__ import annotations


import torch
from torch import Tensor

from .kda_triton import (_DT16, SUB_CHUNK, V3, _check, _dots, _pow2, _state_pass, kda_chunk_fwd_triton,
                         kda_intra_triton, state_config)
from .registry import sm_count, tl, triton

if triton is not None:
    from .kda_triton import _block_cumsum, _chunk_rows, _dot, _exp, _operand, _state_bwd_kernel, _to16

    @triton.jit
    def _add2(a0, b0, a1, b1):
        return a0 + a1, b0 + b1

    @triton.jit
    def _excl_combine1(x_l, px_l, x_r, px_r):
        return x_l + x_r, x_l + px_r

    @triton.jit
    def _excl_combine2(x_l, px_l, y_l, py_l, x_r, px_r, y_r, py_r):
        """Two exclusive prefix sums in one scan: with (x_t, 0) at row t, the scan's second member is Σ_{j<t} x_j,
        each a sum of exactly those terms (cumsum(x) − x would cancel x_t's own term against the sum: at a
        chunk's end k̃'s term is O(1) beside an O(e^{−5}) sum)."""
        return x_l + x_r, x_l + px_r, y_l + y_r, y_l + py_r

    @triton.jit
    def _state_bwd2_kernel(qd_ptr, kd_ptr, w_ptr, A_ptr, d_ptr, do_ptr, dsN_ptr, dh_ptr, dU_ptr, dh0_ptr,
                           T, H, K, V, N, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           HAS_DSN: tl.constexpr, HAS_DH0: tl.constexpr, QD16: tl.constexpr, STATE: tl.constexpr,
                           DT: tl.constexpr, EMULATE: tl.constexpr, CHAIN: tl.constexpr = ""):
        # `kda_triton._state_bwd_kernel`'s recurrence (program per row bh and block of BV state columns, chunks in
        # reverse, dS in fp32 registers), with the chunk's tiles loaded in their stored dtype (a pipelined loop,
        # num_stages > 1, fetches the next chunk's during this one's dots: none depends on dS), dS_{n+1} stored in
        # dh's dtype (rounded to nearest), and QD16: q̃ᵀ dO on 16-bit operands (both are stored in 16 bits: the
        # products are the TF32 ones). CHAIN: the operands of the two dots on the chain, k̃ dS and wᵀ dU ("x2" /
        # "x2n": dS and dU as two bf16 parts; Aqkᵀ dO and q̃ᵀ dO then on 16-bit operands, all stored so); "":
        # STATE's. dsN the final state's gradient, dh0 the initial state's.
        CH: tl.constexpr = CHAIN if CHAIN != "" else STATE
        AD: tl.constexpr = "16" if CHAIN != "" else STATE
        QD: tl.constexpr = "16" if QD16 or CHAIN != "" else STATE
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
            tl.store(dh_ptr + ((bh * N + n) * K + kk[:, None]) * V + vv[None, :],
                     _to16(dS, dh_ptr.dtype.element_ty, EMULATE), mask=m_kv)
            t = n * C + c
            do = tl.load(do_ptr + ((b * T + t) * H + h)[:, None] * V + vv[None, :],
                         mask=(t < T)[:, None] & mv[None, :], other=0.0)
            A = tl.load(A_ptr + rws[:, None] * C + c[None, :])
            kd = tl.load(kd_ptr + rws[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
            dU = _dot(kd, dS, _dot(tl.trans(A), do, tl.zeros([C, BV], dtype=tl.float32), AD, DT, EMULATE),
                      CH, DT, EMULATE)
            tl.store(dU_ptr + rws[:, None] * V + vv[None, :], dU, mask=mv[None, :])
            qd = tl.load(qd_ptr + rws[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
            w = tl.load(w_ptr + rws[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
            dn = tl.load(d_ptr + (bh * N + n) * K + kk, mask=mk, other=0.0)
            dS = _dot(tl.trans(qd), do, dn[:, None] * dS, QD, DT, EMULATE)
            dS = _dot(tl.trans(w), -dU, dS, CH, DT, EMULATE)
        if HAS_DH0:
            tl.store(dh0_ptr + bh * K * V + kk[:, None] * V + vv[None, :], dS, mask=m_kv)

    @triton.jit
    def _bwd_dav_kernel(v_ptr, beta_ptr, reset_ptr, M_ptr, U_ptr, dU_ptr, do_ptr, dA_ptr, dL_ptr, dAd_ptr, dbv_ptr,
                        dv_ptr, T, H, V, N, scale,
                        C: tl.constexpr, BV: tl.constexpr, HAS_RESET: tl.constexpr, SOLVE: tl.constexpr,
                        STATE: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr, OU16: tl.constexpr = False):
        # program (chunk n, row bh). Writes dAqk·s and dL [R, N, C, C] (their pointers'
        # dtype, zero off the pattern), the diagonal of dAqk·s and Σ_v dR_u ⊙ v [R, N, C] fp32, and dv [B, T, H, V].
        # OU16: dO Uᵀ on 16-bit operands (dO and U_n both stored in 16 bits: the products are the TF32 ones).
        PA: tl.constexpr = "16" if OU16 else STATE
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        rows = tl.arange(0, C)
        t, valid, tok, rst, seg, n_seg = _chunk_rows(reset_ptr, n, bh, T, H, C, HAS_RESET)
        out = (bh * N + n) * C + rows
        Mt = tl.trans(tl.load(M_ptr + out[:, None] * C + rows[None, :]))          # (I + L)⁻ᵀ
        beta = tl.load(beta_ptr + tok, mask=valid, other=0.0).to(tl.float32)
        dA = tl.zeros([C, C], dtype=tl.float32)
        dL = tl.zeros([C, C], dtype=tl.float32)
        db = tl.zeros([C], dtype=tl.float32)
        for v0 in range(0, V, BV):
            vv = v0 + tl.arange(0, BV)
            mv = vv[None, :] < V
            U = tl.load(U_ptr + out[:, None] * V + vv[None, :], mask=mv, other=0.0)
            dU = tl.load(dU_ptr + out[:, None] * V + vv[None, :], mask=mv, other=0.0)
            do = tl.load(do_ptr + tok[:, None] * V + vv[None, :], mask=valid[:, None] & mv, other=0.0)
            v = tl.load(v_ptr + tok[:, None] * V + vv[None, :], mask=valid[:, None] & mv, other=0.0).to(tl.float32)
            dA = _dot(do, tl.trans(U), dA, PA, DT, EMULATE)
            dR = _dot(Mt, dU, tl.zeros([C, BV], dtype=tl.float32), SOLVE, DT, EMULATE)
            dL = _dot(dR, tl.trans(U), dL, SOLVE, DT, EMULATE)
            db += tl.sum(dR * v, 1)
            tl.store(dv_ptr + tok[:, None] * V + vv[None, :], _to16(beta[:, None] * dR, dv_ptr.dtype.element_ty,
                                                                     EMULATE), mask=valid[:, None] & mv)
        # the diagonal apart: e^{g(r,r]} = 1 exactly, and it leaves dΓ alone (its two terms, ±q_r k_r, cancel)
        r2 = rows[:, None]
        c2 = rows[None, :]
        strict = (seg[:, None] == seg[None, :]) & (c2 < r2)
        tl.store(dAd_ptr + out, tl.sum(tl.where(r2 == c2, dA, 0.0), 1) * scale)
        tl.store(dbv_ptr + out, db)
        tl.store(dA_ptr + out[:, None] * C + c2, _to16(tl.where(strict, dA * scale, 0.0), dA_ptr.dtype.element_ty,
                                                       EMULATE))
        tl.store(dL_ptr + out[:, None] * C + c2, _to16(tl.where(strict, -dL, 0.0), dL_ptr.dtype.element_ty,
                                                       EMULATE))

    @triton.jit
    def _bwd_state_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, reset_ptr, M_ptr, U_ptr, h_ptr, dh_ptr, dU_ptr, do_ptr,
                          dqs_ptr, dks_ptr, dgs_ptr, dbs_ptr, T, H, K, V, N, scale, C: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, HAS_RESET: tl.constexpr, SOLVE: tl.constexpr,
                          STATE: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr, SU16: tl.constexpr = False):
        # program (key block kb, chunk n, row bh): the terms of dq, dk, dg and dβ through the state (dq̃ = dO S_nᵀ,
        # dk̃ = U dS_{n+1}ᵀ, dR_w = −(I + L)⁻ᵀ dU S_nᵀ, dd), `_bwd_dqkg_kernel`'s "through the state" for wider key
        # blocks, into dqs, dks, dgs fp32 [B, T, H, K] and dbs [K / BK, R, N, C] for its SPLIT. SU16: dO S_nᵀ and
        # U dS_{n+1}ᵀ on 16-bit operands (S_n, dS_{n+1}, U_n and dO all stored in 16 bits: the TF32 products).
        PS: tl.constexpr = "16" if SU16 else STATE
        kb = tl.program_id(0)
        n = tl.program_id(1)
        bh = tl.program_id(2).to(tl.int64)
        rows = tl.arange(0, C)
        t, valid, tok, rst, seg, n_seg = _chunk_rows(reset_ptr, n, bh, T, H, C, HAS_RESET)
        first = (seg == 0)[:, None]
        last = (seg == n_seg)[:, None]
        out = (bh * N + n) * C + rows
        st = bh * N + n
        kk = kb * BK + tl.arange(0, BK)
        mk = kk[None, :] < K
        m = valid[:, None] & mk
        g = tl.load(g_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
        kt = tl.load(k_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tok, mask=valid, other=0.0).to(tl.float32)
        z = tl.zeros([C, BK], dtype=tl.float32)
        dqd = tl.zeros([C, BK], dtype=tl.float32)
        dkd = tl.zeros([C, BK], dtype=tl.float32)
        dw = tl.zeros([C, BK], dtype=tl.float32)
        dd = tl.zeros([BK], dtype=tl.float32)
        for v0 in range(0, V, BV):
            vv = v0 + tl.arange(0, BV)
            mv = vv[None, :] < V
            m_kv = (kk[:, None] < K) & mv
            S = tl.load(h_ptr + (st * K + kk[:, None]) * V + vv[None, :], mask=m_kv, other=0.0)
            dS = tl.load(dh_ptr + (st * K + kk[:, None]) * V + vv[None, :], mask=m_kv, other=0.0)
            U = tl.load(U_ptr + out[:, None] * V + vv[None, :], mask=mv, other=0.0)
            dU = tl.load(dU_ptr + out[:, None] * V + vv[None, :], mask=mv, other=0.0)
            do = tl.load(do_ptr + tok[:, None] * V + vv[None, :], mask=valid[:, None] & mv, other=0.0)
            dqd = _dot(do, tl.trans(S), dqd, PS, DT, EMULATE)
            dkd = _dot(U, tl.trans(dS), dkd, PS, DT, EMULATE)
            dw = _dot(dU, tl.trans(S), dw, STATE, DT, EMULATE)
            dd += tl.sum(S.to(tl.float32) * dS.to(tl.float32), 1)
        Mt = tl.trans(tl.load(M_ptr + out[:, None] * C + rows[None, :]))
        dRw = -_dot(Mt, dw, z, SOLVE, DT, EMULATE)
        e_first = tl.where(first, _exp(tl.cumsum(g, 0)), 0.0)                     # e^{Γ_r}, first segment
        e_last = tl.where(last, _exp(tl.cumsum(g, 0, reverse=True) - g), 0.0)     # e^{g(j, C−1]}, last one
        s_state = tl.cumsum(beta[:, None] * kt * e_first * dRw + scale * q * e_first * dqd, 0, reverse=True)
        _, p_kd = tl.associative_scan((dkd * kt * e_last, z), 0, _excl_combine1)
        dn = tl.where(n_seg == 0, _exp(tl.sum(g, 0)), 0.0)
        at = tok[:, None] * K + kk[None, :]
        tl.store(dqs_ptr + at, scale * e_first * dqd, mask=m)
        tl.store(dks_ptr + at, beta[:, None] * e_first * dRw + e_last * dkd, mask=m)
        tl.store(dgs_ptr + at, s_state + p_kd + (dd * dn)[None, :], mask=m)
        tl.store(dbs_ptr + (kb * tl.num_programs(2) * N + st) * C + rows, tl.sum(kt * e_first * dRw, 1))

    @triton.jit
    def _bwd_dqkg_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, reset_ptr, M_ptr, U_ptr, h_ptr, dh_ptr, dU_ptr, do_ptr,
                         dA_ptr, dL_ptr, dAd_ptr, dq_ptr, dk_ptr, dg_ptr, dbk_ptr, dqs_ptr, dks_ptr, dgs_ptr,
                         T, H, K, V, N, scale,
                         C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         HAS_RESET: tl.constexpr, PAIR: tl.constexpr, SOLVE: tl.constexpr, STATE: tl.constexpr,
                         DT: tl.constexpr, EMULATE: tl.constexpr, WIDE: tl.constexpr = False,
                         SPLIT: tl.constexpr = False):
        # program (key block kb, chunk n, row bh): dq, dk, dg of the block's channels [B, T, H, K] and dβ's part
        # from them into dbk [K / BK, R, N, C] fp32. WIDE: the pairwise sums as four [C, C] x [C, C/BC · BK] dots,
        # the anchors side by side in the columns (`PAIRWISE`), instead of batched over the anchors. SPLIT: the
        # state's terms come from `_bwd_state_kernel` (dqs, dks, dgs fp32 [B, T, H, K]; `STATE_TERMS`).
        kb = tl.program_id(0)
        n = tl.program_id(1)
        bh = tl.program_id(2).to(tl.int64)
        NB: tl.constexpr = C // BC
        rows = tl.arange(0, C)
        t, valid, tok, rst, seg, n_seg = _chunk_rows(reset_ptr, n, bh, T, H, C, HAS_RESET)
        first = (seg == 0)[:, None]
        last = (seg == n_seg)[:, None]
        out = (bh * N + n) * C + rows
        st = bh * N + n
        kk = kb * BK + tl.arange(0, BK)
        mk = kk[None, :] < K
        m = valid[:, None] & mk
        g = tl.load(g_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
        kt = tl.load(k_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tok, mask=valid, other=0.0).to(tl.float32)
        z = tl.zeros([C, BK], dtype=tl.float32)

        # the anchored factors: per block of BC rows f = g(n_b, r], tail = g(j, m_b]; blocks' sums and first gates.
        # (tail and e_last below drop a row's own gate from an inclusive suffix sum, as the forward does: the
        # exponent stays ≤ 0 up to rounding, never a difference of two prefix sums that could overflow)
        lr = (rows % BC)[:, None]
        blk = (rows // BC)[:, None]
        f = _block_cumsum(tl.where(lr > 0, g, 0.0), C, BC, BK, False)
        tail = _block_cumsum(g, C, BC, BK, True) - g
        g3 = tl.reshape(g, [NB, BC, BK])
        bsum = tl.sum(g3, 1)                                                      # [NB, BK]
        gfirst = tl.sum(tl.where((tl.arange(0, BC) == 0)[None, :, None], g3, 0.0), 1)
        ia = tl.arange(0, NB)
        ia4 = ia[:, None, None, None]
        ib4 = ia[None, :, None, None]
        ic4 = ia[None, None, :, None]
        between = (ib4 < ic4) & (ic4 < ia4)                                       # blocks strictly between b, a
        span = tl.sum(tl.where(between, bsum[None, None, :, :], 0.0), 2) + gfirst[:, None, :]   # g(m_b, n_a]
        if WIDE:
            e_span = tl.where(ia[None, :, None] < ia[:, None, None], _exp(span), 0.0)               # [a, b, BK]
            ef = _exp(f)
            qf = _operand(q * ef, PAIR, DT, EMULATE)
            bf = _operand(beta[:, None] * kt * ef, PAIR, DT, EMULATE)
            j3 = rows[None, :]
            dA = tl.load(dA_ptr + (st * C + rows[:, None]) * C + j3)
            dL = tl.load(dL_ptr + (st * C + rows[:, None]) * C + j3)
            # [key j, anchor a, BK]: the keys anchored at every a side by side, the rows of block a in a's columns
            b3 = blk[:, :, None]
            a3 = ia[None, :, None]
            e_jab = tl.reshape(tl.broadcast_to(tl.permute(e_span, (1, 0, 2))[:, None, :, :], [NB, BC, NB, BK]),
                               [C, NB, BK])
            E3 = tl.where(b3 < a3, e_jab * _exp(tail)[:, None, :],
                          tl.where(b3 == a3, _exp(-f)[:, None, :], 0.0))
            K3 = _operand(kt[:, None, :] * E3, PAIR, DT, EMULATE)
            Kw = tl.reshape(K3, [C, NB * BK])
            Qw = tl.reshape(tl.where(b3 == a3, qf[:, None, :], 0.0), [C, NB * BK])
            Bw = tl.reshape(tl.where(b3 == a3, bf[:, None, :], 0.0), [C, NB * BK])
            zw = tl.zeros([C, NB * BK], dtype=tl.float32)
            own = b3 == a3                                                           # a row's own anchor
            xq = tl.sum(tl.where(own, tl.reshape(_dot(dA, Kw, zw, PAIR, DT, EMULATE), [C, NB, BK]), 0.0), 1)
            xl = tl.sum(tl.where(own, tl.reshape(_dot(dL, Kw, zw, PAIR, DT, EMULATE), [C, NB, BK]), 0.0), 1)
            Y3 = tl.reshape(_dot(tl.trans(dL), Bw, _dot(tl.trans(dA), Qw, zw, PAIR, DT, EMULATE), PAIR, DT, EMULATE),
                            [C, NB, BK])                                             # [key j, a, BK]
            dkk = tl.sum(E3 * Y3, 1)
            dgam = qf * xq + bf * xl - tl.sum(K3 * Y3, 1)
        else:
            e_span = tl.where(ia[None, :, None] < ia[:, None, None], _exp(span), 0.0)               # [a, b, BK]
            e_span = tl.reshape(tl.broadcast_to(e_span[:, :, None, :], [NB, NB, BC, BK]), [NB, C, BK])
            ef = _exp(f)
            a3 = ia[:, None, None]
            b3 = blk[None, :, :]
            E3 = tl.where(b3 < a3, e_span * _exp(tail)[None, :, :],
                          tl.where(b3 == a3, _exp(-f)[None, :, :], 0.0))              # [anchor a, key j, BK]
            K3 = _operand(kt[None, :, :] * E3, PAIR, DT, EMULATE)
            qf = _operand(q * ef, PAIR, DT, EMULATE)
            bf = _operand(beta[:, None] * kt * ef, PAIR, DT, EMULATE)
            Q3 = tl.reshape(qf, [NB, BC, BK])
            B3 = tl.reshape(bf, [NB, BC, BK])

            # the pairwise sums, each (query block, key block) pair once: rows of block a of dAqk and dL [NB, BC, C]
            # against the keys anchored at a, and their transposes against the rows of a
            i3 = ia[:, None, None] * BC + tl.arange(0, BC)[None, :, None]
            j3 = rows[None, None, :]
            dA3 = tl.load(dA_ptr + (st * C + i3) * C + j3)
            dL3 = tl.load(dL_ptr + (st * C + i3) * C + j3)
            dAT3 = tl.permute(dA3, (0, 2, 1))                                          # [a, key j, row of a]
            dLT3 = tl.permute(dL3, (0, 2, 1))
            z3 = tl.zeros([NB, BC, BK], dtype=tl.float32)
            xq3 = _dot(dA3, K3, z3, PAIR, DT, EMULATE)                                 # Σ_j dAqk_rj k_j e^{g(j,n_a]}
            xl3 = _dot(dL3, K3, z3, PAIR, DT, EMULATE)
            Y3 = _dot(dLT3, B3, _dot(dAT3, Q3, tl.zeros([NB, C, BK], dtype=tl.float32), PAIR, DT, EMULATE), PAIR, DT,
                      EMULATE)                                                        # [a, key j, BK]
            xq = tl.reshape(xq3, [C, BK])
            xl = tl.reshape(xl3, [C, BK])
            dkk = tl.sum(E3 * Y3, 0)
            dgam = tl.reshape(Q3 * xq3 + B3 * xl3, [C, BK]) - tl.sum(K3 * Y3, 0)

        if SPLIT:
            dAd = tl.load(dAd_ptr + out)[:, None]
            dkq = ef * xl
            at = tok[:, None] * K + kk[None, :]
            dq = tl.load(dqs_ptr + at, mask=m, other=0.0) + ef * xq + dAd * kt
            dk = tl.load(dks_ptr + at, mask=m, other=0.0) + beta[:, None] * dkq + dkk + dAd * q
            db = tl.sum(kt * dkq, 1)
            late = (2 * rows >= tl.minimum(T - n * C, C))[:, None]
            s_pair = tl.cumsum(dgam, 0, reverse=True)
            _, p_pair = tl.associative_scan((dgam, z), 0, _excl_combine1)
            dg = tl.where(late, s_pair, -p_pair) + tl.load(dgs_ptr + at, mask=m, other=0.0)
        else:
            # through the state
            dqd = tl.zeros([C, BK], dtype=tl.float32)
            dkd = tl.zeros([C, BK], dtype=tl.float32)
            dw = tl.zeros([C, BK], dtype=tl.float32)
            dd = tl.zeros([BK], dtype=tl.float32)
            for v0 in range(0, V, BV):
                vv = v0 + tl.arange(0, BV)
                mv = vv[None, :] < V
                m_kv = (kk[:, None] < K) & mv
                S = tl.load(h_ptr + (st * K + kk[:, None]) * V + vv[None, :], mask=m_kv, other=0.0)
                dS = tl.load(dh_ptr + (st * K + kk[:, None]) * V + vv[None, :], mask=m_kv, other=0.0)
                U = tl.load(U_ptr + out[:, None] * V + vv[None, :], mask=mv, other=0.0)
                dU = tl.load(dU_ptr + out[:, None] * V + vv[None, :], mask=mv, other=0.0)
                do = tl.load(do_ptr + tok[:, None] * V + vv[None, :], mask=valid[:, None] & mv,
                             other=0.0).to(tl.float32)
                dqd = _dot(do, tl.trans(S), dqd, STATE, DT, EMULATE)
                dkd = _dot(U, tl.trans(dS), dkd, STATE, DT, EMULATE)
                dw = _dot(dU, tl.trans(S), dw, STATE, DT, EMULATE)
                dd += tl.sum(S.to(tl.float32) * dS.to(tl.float32), 1)
            Mt = tl.trans(tl.load(M_ptr + out[:, None] * C + rows[None, :]))
            dRw = -_dot(Mt, dw, z, SOLVE, DT, EMULATE)

            dAd = tl.load(dAd_ptr + out)[:, None]
            e_first = tl.where(first, _exp(tl.cumsum(g, 0)), 0.0)                     # e^{Γ_r}, first segment
            e_last = tl.where(last, _exp(tl.cumsum(g, 0, reverse=True) - g), 0.0)     # e^{g(j, C−1]}, last one
            dkq = ef * xl
            dq = scale * e_first * dqd + ef * xq + dAd * kt
            dk = beta[:, None] * (e_first * dRw + dkq) + e_last * dkd + dkk + dAd * q
            db = tl.sum(kt * (e_first * dRw + dkq), 1)
            # suffix sums (the pairwise part and the terms of q̃ and R_w) in one scan, exclusive prefix sums (the
            # pairwise part, and k̃'s terms, which span the gates after j) in another
            late = (2 * rows >= tl.minimum(T - n * C, C))[:, None]
            s_pair, s_state = tl.associative_scan(
                (dgam, beta[:, None] * kt * e_first * dRw + scale * q * e_first * dqd), 0, _add2, reverse=True)
            _, p_pair, _, p_kd = tl.associative_scan((dgam, z, dkd * kt * e_last, z), 0, _excl_combine2)
            dn = tl.where(n_seg == 0, _exp(tl.sum(g, 0)), 0.0)
            dg = tl.where(late, s_pair, -p_pair) + s_state + p_kd + (dd * dn)[None, :]
        tl.store(dq_ptr + tok[:, None] * K + kk[None, :], _to16(dq, dq_ptr.dtype.element_ty, EMULATE), mask=m)
        tl.store(dk_ptr + tok[:, None] * K + kk[None, :], _to16(dk, dk_ptr.dtype.element_ty, EMULATE), mask=m)
        tl.store(dg_ptr + tok[:, None] * K + kk[None, :], _to16(dg, dg_ptr.dtype.element_ty, EMULATE), mask=m)
        tl.store(dbk_ptr + (kb * tl.num_programs(2) * N + st) * C + rows, db)


SAVE = "forward"
"""Where the op's backward (`delta_rule`'s `kimi::kda_triton`) takes the forward's scratch from: "recompute" (the
intra-chunk kernel and the forward state pass again, in fp32: autograd holds only the inputs) or "forward"
(`kda_chunk_fwd_saving` keeps what its kernels wrote, `SAVED`, in the forward's `V3` dtypes, for the backward's
`saved` argument: two launches fewer, the scratch held from forward to backward)."""

SAVED = ("w", "qd", "kd", "u", "A", "d", "M", "states")
"""What `kda_chunk_fwd_saving` keeps, in this order in the op: w, q̃, k̃ [R, N, C, K], U_n ("u": the state pass's
output, in its own bf16 buffer or over u as `V3["u16"]` says) [R, N, C, V], Aqk [R, N, C, C], d [R, N, K],
(I + L)⁻¹ ("M") [R, N, C, C] and S_n ("states") [R, N, K, V]."""

PAIRWISE = "wide"
"""How `_bwd_dqkg_kernel` lays out its pairwise sums over the C/BC anchor blocks: "batched" (one batched dot per
side, the anchors the batch: [C/BC, BC, C] x [C/BC, C, BK]) or "wide" (the anchors side by side in the columns: one
[C, C] x [C, C/BC · BK] dot per side, each row reading its own anchor's columns; the dots multiply C/BC times the
terms, as single wide tensor-core dots; with IEEE dots, fp32 inputs' parity path, the wide operands spill)."""

BF16_OPERANDS = True
"""True: the backward's chunk-parallel dots whose operands are all stored in bf16 (dO Uᵀ in `_bwd_dav_kernel`; dO S_nᵀ,
U dS_{n+1}ᵀ in `_bwd_state_kernel`) on bf16 operands rather than `PRECISION["state"]`'s TF32: the same products (a
bf16 value is exact in TF32) at twice the tensor-core rate, with fewer wgmma (sm_90 offline compile: 24 against 32
in `_bwd_state_kernel`; 0.8-1.2 % off the H200's forward+backward at the issue's three shapes: docs/performance.md,
KDA round 13). False: TF32 (the reference path of its test)."""


def b16(*ts: Tensor) -> bool:
    """Whether every tensor is stored in bf16."""
    return all(t.dtype == torch.bfloat16 for t in ts)


STATE_TERMS = {"split": True, "block_k": 32, "block_v": 64, "num_warps": 4, "num_stages": 1}
"""The terms of dq, dk, dg, dβ through the state: inside `_bwd_dqkg_kernel` (per 16 key channels, "split" False),
or in their own launch (`_bwd_state_kernel`, "block_k" key channels and "block_v" value channels a step,
"num_warps", "num_stages"; 16-bit inputs), which `_bwd_dqkg_kernel` then adds from fp32 scratch (dq, dk, dg
[B, T, H, K]): its programs no longer re-read U_n, dU, dO and (I + L)⁻¹ for every 16 key channels."""

REVERSE = {"kernel": "v3", "block_v": "auto", "num_warps": None, "num_stages": None, "qd16": False,
           "dstates": "16", "dots": "auto"}
"""The reverse state pass for 16-bit inputs: "kernel" "v3" (`kda_triton._state_bwd_kernel`) or "own"
(`_state_bwd2_kernel`: tiles in their stored dtype; "qd16" its q̃ᵀ dO on 16-bit operands when q̃ is stored in 16
bits: exact, but more registers), "own" always from the forward's scratch (`saved`); "block_v",
"num_warps", "num_stages" over `state_config`'s (None: its own); "dstates" the dtype of the stored dS_{n+1}:
"fp32" or "16" (bf16, with "own"); "dots" the operands of the own kernel's two dots on the chain (k̃ dS_{n+1}, wᵀ dU_n)
with bf16 scratch: None (`PRECISION["state"]`), "x2" (dS and dU as two bf16 parts, two dots), "x2n" (the same
parts side by side in one dot, as the forward's `V3["state_dots"]`; two stages: at one the gradients came out wrong,
and `reverse_config` refuses it) or "auto" ("x2n" where the block is at most 32 columns and K ≤ 128; TF32 at 64
columns, where x2n measured slower: docs/performance.md, KDA rounds 8 and 13).
block_v "auto": by the sequences × heads (`reverse_config`)."""


def dav_config(C: int, V: int, ieee: bool) -> dict:
    """`_bwd_dav_kernel`'s launch config: value channels in pieces of 64 (16 for IEEE dots, whose operands sit in
    registers) beside three [C, C] fp32 tiles, 8 warps at C = 64 (sm_90 offline compile at V = 128: bf16 241
    registers, fp32 196, no spills; fp32 at 32 columns 0.35 KB of spills a thread)."""
    return dict(BV=min(_pow2(V), 16 if ieee else 64), num_warps=8 if C >= 64 else 4, num_stages=1)


def dqkg_config(C: int, K: int, V: int, ieee: bool) -> dict:
    """`_bwd_dqkg_kernel`'s launch config: key channels in pieces of 16 (the keys anchored at every sub-block are a
    [C/16, C, BK] tensor, beside the [C/16, 16, C] rows of dAqk and dL and their transposes), value channels of 32;
    4 warps for 16-bit inputs, 8 for IEEE dots at C = 64. sm_90 offline compile at K = V = 128: bf16 255
    registers, no spills, 4.9 K instructions a warp (two programs an SM), against 4.1 K a warp at 8 warps (one
    program an SM: 1.7x the instructions a program) and 0.55 KB of spills with 32-channel key pieces; fp32 255
    registers, no spills."""
    return dict(BK=16, BV=min(_pow2(V), 32), num_warps=8 if C >= 64 and ieee else 4, num_stages=1)


def reverse_config(K: int, V: int, ieee: bool, rows: int = 1, sms: int = 132, chain: bool = False) -> dict:
    """The reverse state pass's launch config: `state_config`'s, with `REVERSE`'s overrides for 16-bit inputs, and
    "CHAIN" ("", "x2" or "x2n", `REVERSE["dots"]`), the chain dots of the own kernel when it runs on bf16 tiles
    (`chain` True). Each program is a sequential walk over the chunks (a second wave doubles the time, fewer programs
    leave SMs idle), so block_v "auto" takes the narrowest column block (of 16, 32) whose programs, `rows` sequences
    × heads times the column blocks, fit one wave on `sms` SMs, one program an SM with x2n dots (their two stages
    take 127 KB of shared memory at K = 128) and two without, else 64 columns. "auto" dots are x2n up to 32 columns
    and K = 128 (two stages at K = 256 need more shared memory than Hopper has), TF32 at 64 columns (measured
    faster there). x2n at one stage is refused (wrong gradients on an H100)."""
    cfg = dict(state_config(K, V, ieee=ieee), CHAIN="")
    if not ieee:
        auto = REVERSE["dots"] == "auto"
        dots = ("x2n" if cfg["BK"] <= 128 else None) if auto else REVERSE["dots"]
        dots = dots if chain else None
        bv = REVERSE["block_v"]
        if bv == "auto":
            per_sm = 1 if dots == "x2n" else 2
            bv = next((b for b in (16, 32) if rows * -(-V // b) <= per_sm * sms), 64)
        bv = cfg["BV"] if bv is None else bv
        if auto and bv > 32:
            dots = None
        bv = min(_pow2(V), bv)
        cfg.update(BV=bv, CHAIN=dots or "")
        if dots:
            cfg["num_stages"] = 2
        over = dict(num_warps=REVERSE["num_warps"], num_stages=REVERSE["num_stages"])
        cfg.update({n: x for n, x in over.items() if x is not None})
        if cfg["CHAIN"] == "x2n" and cfg["num_stages"] < 2:
            raise ValueError("kda_bwd_triton.REVERSE: x2n dots at one stage gave wrong gradients on an H100 (Triton "
                             "3.6: dk 0.11 off the float64 recurrence); take two stages or dots=None")
    return cfg


def saved_layout(q: Tensor, v: Tensor, chunk_size: int = 64) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The shapes and dtypes of `kda_chunk_fwd_saving`'s scratch (`SAVED`) for inputs like q [B, T, H, K] and
    v [B, T, H, V] (the op's fake builds them from this)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    R, N, C = B * H, -(-T // chunk_size), chunk_size
    s16 = q.dtype in _DT16
    sc = torch.bfloat16 if s16 and V3["scratch"] == "16" else torch.float32
    st = torch.bfloat16 if s16 and V3["states"] == "16" else torch.float32
    f32 = torch.float32
    return dict(w=((R, N, C, K), sc), qd=((R, N, C, K), sc), kd=((R, N, C, K), sc),
                u=((R, N, C, V), sc if V3["u16"] else f32), A=((R, N, C, C), sc if V3["a16"] else f32),
                d=((R, N, K), f32), M=((R, N, C, C), f32), states=((R, N, K, V), st))


def kda_chunk_fwd_saving(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         initial_state: Tensor | None = None, reset: Tensor | None = None, *, scale: float,
                         chunk_size: int = 64) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """`kda_triton.kda_chunk_fwd_triton` with its residuals: (o, final state, scratch), the scratch `SAVED` names
    (laid out as `saved_layout` says) for `kda_chunk_bwd_triton(..., saved=scratch)`."""
    o, sN, x, states = kda_chunk_fwd_triton(q, k, v, g, beta, initial_state, reset, scale=scale,
                                            chunk_size=chunk_size, residuals=True)
    return o, sN, {n: x[n] if n != "states" else states for n in SAVED}


def kda_chunk_bwd_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                         reset: Tensor | None, do: Tensor, dsN: Tensor | None, *, scale: float, chunk_size: int = 64,
                         saved: dict[str, Tensor] | None = None
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The gradients of `kda_chunk_fwd_triton`'s (o, final state) w.r.t. q, k, v, g, beta and the initial state,
    given do [B, T, H, V] (the output's gradient) and dsN [B, H, K, V] float32 or None (the final state's).

    Inputs as the forward's (same contract: bounded gates, resets, fp32 / 16-bit). Returns (dq, dk, dv, dg, dbeta,
    dh0), each gradient in its input's dtype (dq, dk, dv in q's; dg and dbeta in g's and beta's, fp32 in the
    layer) and dh0 [B, H, K, V] float32, None without an initial state; computed by the kernels of the module
    docstring, all state math in fp32. saved: `kda_chunk_fwd_saving`'s scratch for these inputs (then neither the
    intra-chunk kernel nor the forward state pass runs again), or None (both recomputed, in fp32).

    Scratch beyond the forward's: (I + L)⁻¹ [R, N, C, C], S_n and dS_{n+1} [R, N, K, V] and dU [R, N, C, V] in fp32
    (S_n the forward's with `saved`, dS_{n+1} in `REVERSE["dstates"]`), dAqk and dL [R, N, C, C] in the pairwise
    operand type; with `STATE_TERMS["split"]` the state's terms of dq and dk in fp32 [B, T, H, K] (dS_{n+1} and dU
    freed before dq and dk are allocated)."""
    _check(q, k, v, g, beta, initial_state, reset, chunk_size, "kda_chunk_bwd_triton")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if do.shape != v.shape:
        raise ValueError(f"kda_chunk_bwd_triton: do must be [B, T, H, V] = {list(v.shape)}, got {list(do.shape)}")
    if dsN is not None and (dsN.shape != (B, H, K, V) or dsN.dtype != torch.float32):
        raise ValueError(f"kda_chunk_bwd_triton: dsN must be float32 [B, H, K, V] = {[B, H, K, V]}, got "
                         f"{dsN.dtype} {list(dsN.shape)}")
    if saved is not None:
        layout = saved_layout(q, v, chunk_size)
        got = {n: (tuple(saved[n].shape), saved[n].dtype) if n in saved else None for n in SAVED}
        if got != layout:
            raise ValueError(f"kda_chunk_bwd_triton: saved must be kda_chunk_fwd_saving's scratch for these inputs "
                             f"{layout}, got {got}")
        x = {n: saved[n] for n in SAVED if n != "states"}
        states = saved["states"]
        R, N, C = B * H, layout["d"][0][1], chunk_size
    else:
        x = kda_intra_triton(q, k, v, g, beta, reset, scale=scale, chunk_size=chunk_size, inverse=True)
        R, N, C = x["w"].shape[:3]
        states = torch.empty(R, N, K, V, dtype=torch.float32, device=q.device)
    f32 = dict(dtype=torch.float32, device=q.device)
    s16 = q.dtype in _DT16
    # the saved scratch is 16-bit for 16-bit inputs, which `_state_bwd2_kernel` takes as stored (under the
    # interpreter `_state_bwd_kernel`'s negation of a bf16 tile is wrong)
    if REVERSE["dots"] not in (None, "x2", "x2n", "auto"):
        raise ValueError(f"kda_bwd_triton.REVERSE['dots'] = {REVERSE['dots']!r}: None, 'x2', 'x2n' or 'auto'")
    own = s16 and (REVERSE["kernel"] == "own" or saved is not None)
    dstates = torch.empty(R, N, K, V, dtype=torch.bfloat16 if own and REVERSE["dstates"] == "16" else torch.float32,
                          device=q.device)
    dU = torch.empty(R, N, C, V, **f32)
    dh0 = torch.empty(B, H, K, V, **f32) if initial_state is not None else None
    do = do.contiguous()
    dsN = dsN.contiguous() if dsN is not None else None

    if saved is None:   # the forward state pass again (S_n, U_n)
        _state_pass(x, B, T, H, K, V, q.dtype, s0=initial_state, identity=False, with_u=True, states=states,
                    block_v=V3["state_block"])
    # the reverse pass: chunks N − 1 down to 0, from dsN to dh0
    sms = sm_count(q.device) if q.is_cuda else 132
    rc = reverse_config(K, V, ieee=not s16, rows=R, sms=sms, chain=own and b16(x["qd"], x["A"], do))
    args = (x["qd"], x["kd"], x["w"], x["A"], x["d"], do, dsN if dsN is not None else dU, dstates, dU,
            dh0 if dh0 is not None else dU, T, H, K, V, N)
    launch = dict(C=C, BK=rc["BK"], BV=rc["BV"], HAS_DSN=dsN is not None, HAS_DH0=dh0 is not None,
                  num_warps=rc["num_warps"], num_stages=rc["num_stages"], **_dots(q.dtype, "state"))
    grid = (R, triton.cdiv(V, rc["BV"]))
    if own:
        qd16 = REVERSE["qd16"] and b16(x["qd"], do)
        _state_bwd2_kernel[grid](*args, QD16=qd16, CHAIN=rc["CHAIN"], **launch)
    else:
        _state_bwd_kernel[grid](*args, **launch)
    if saved is None:
        del x["w"], x["qd"], x["kd"], x["A"]
    U = x["u"]                                                    # U_n (the state pass wrote it over u)

    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    dv, dg = torch.empty_like(v), torch.empty_like(g)
    rst = reset.to(torch.int32).contiguous() if reset is not None else q
    dots = _dots(q.dtype, "pair", "solve", "state")
    pair16 = dict(dtype=torch.bfloat16 if dots["PAIR"] == "16" else torch.float32, device=q.device)
    dA = torch.empty(R, N, C, C, **pair16)
    dL = torch.empty(R, N, C, C, **pair16)
    dA_diag = torch.empty(R, N, C, **f32)
    dbv = torch.empty(R, N, C, **f32)
    split = STATE_TERMS["split"] and s16
    if split:   # the state's terms first, into fp32 scratch (dg's own buffer when it is fp32)
        dqs, dks = torch.empty(q.shape, **f32), torch.empty(q.shape, **f32)
        dgs = dg if dg.dtype == torch.float32 else torch.empty(q.shape, **f32)
        bks = min(_pow2(K), STATE_TERMS["block_k"])
        dbs = torch.empty(triton.cdiv(K, bks), R, N, C, **f32)
    cfg = dqkg_config(C, K, V, ieee=not s16)
    nkb = triton.cdiv(K, cfg["BK"])
    dbk = torch.empty(nkb, R, N, C, **f32)

    # the value side: dAqk, dL, dv and dβ's value part
    c = dav_config(C, V, ieee=not s16)
    _bwd_dav_kernel[(N, R)](
        v, beta, rst, x["M"], U, dU, do, dA, dL, dA_diag, dbv, dv, T, H, V, N, float(scale), C=C, BV=c["BV"],
        HAS_RESET=reset is not None, num_warps=c["num_warps"], num_stages=c["num_stages"], SOLVE=dots["SOLVE"],
        STATE=dots["STATE"], DT=dots["DT"], EMULATE=dots["EMULATE"], OU16=b16(U, do) and BF16_OPERANDS)
    if split:
        _bwd_state_kernel[(triton.cdiv(K, bks), N, R)](
            q, k, g, beta, rst, x["M"], U, states, dstates, dU, do, dqs, dks, dgs, dbs, T, H, K, V, N, float(scale),
            C=C, BK=bks, BV=min(_pow2(V), STATE_TERMS["block_v"]), HAS_RESET=reset is not None, SOLVE=dots["SOLVE"],
            STATE=dots["STATE"], DT=dots["DT"], EMULATE=dots["EMULATE"], num_warps=STATE_TERMS["num_warps"],
            num_stages=STATE_TERMS["num_stages"], SU16=b16(U, do, states, dstates) and BF16_OPERANDS)
        dstates = dU = None   # freed before dq and dk exist: the split's peak is the scratch it adds
    # the key side: dq, dk, dg and dβ's key part
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    if not split:
        dqs = dks = dgs = dq
    _bwd_dqkg_kernel[(nkb, N, R)](
        q, k, g, beta, rst, x["M"], U, states, dstates if not split else dq, dU if not split else dq, do, dA, dL,
        dA_diag, dq, dk, dg, dbk, dqs, dks, dgs, T, H, K, V, N, float(scale), C=C, BC=SUB_CHUNK, BK=cfg["BK"],
        BV=cfg["BV"], HAS_RESET=reset is not None, WIDE=PAIRWISE == "wide", SPLIT=split, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **dots)
    if split:
        dbv = dbv + dbs.sum(0)
    db = (dbv + dbk.sum(0)).view(B, H, N * C)[:, :, :T].transpose(1, 2)
    return dq, dk, dv, dg, db.to(beta.dtype).contiguous(), dh0
