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

**Kernels.** `_intra_kernel`, one program per (chunk, sequence × head), writes w, u, q̃, k̃, d and Aqk to fp32
scratch. It walks the chunk in sub-blocks of BC = 16 query rows; for sub-block a (first row n_a) every factor is
anchored at n_a: queries carry e^{g(n_a, r]} ≤ 1, earlier keys e^{g(j, n_a]} ≤ 1 (a [16, C] strip, one dot), keys
of the sub-block itself e^{−g(n_a, j]} ≤ e^{15·5} (a [16, 16] dot). Each exponent is a sum over exactly the tokens
it spans (gates are ≤ 0, so these sums do not cancel), never a difference of two chunk prefix sums. The solve is
forward substitution by sub-blocks: the diagonal 16 × 16 block (I + L_aa) is inverted by substitution in fp32,
then w_a = (I + L_aa)⁻¹ (rhs_a − L_{a,<a} w_{<a}), the earlier rows read back from the output it already wrote.
`_state_kernel`, one program per (sequence × head, block of state columns), carries its block of S through the
chunks in fp32 registers and writes the outputs O directly.

**Kernels, "v2"** (`FORWARD`, `V2`; impl="v2"). `_intra2_kernel` (same grid) computes the chunk's L and Aqk
as whole [C, C] accumulators: per piece of key channels one pass builds q̃, k̃, d and, by blocks of BC rows
(first row n_b, last m_b), f = g(n_b, r] and g(j, m_b] with one segmented cumsum each; for every anchor block a
the key side k_j e^{g(j, n_a]} (earlier blocks: g(j, n_a] built up block by block as g(j, m_b] plus the gates
between, all ≤ 0, so still a sum over exactly the tokens spanned) and k_j e^{−f_j} (block a) meets the rows of
block a in one [C, C] dot. (I + L)⁻¹ then comes by doubling: with Mi inverting the diagonal blocks of size s
and E the coupling of each 2s-block's halves, (D + E)⁻¹ = Mi − Mi E Mi exactly (block forward substitution), so
log2(C) levels of two [C, C] dots replace the serial row loop; w = (I + L)⁻¹ R_w and u = (I + L)⁻¹ R_u are
dots with it. The sequential pass (`_state_kernel` storing S_n and U_n, 64 state columns a program) carries only
the state, and `_output_kernel`, one program per (chunk, sequence × head, column block), forms
O_n = q̃_n S_n + Aqk_n U_n from the stored S_n in parallel. Scratch w, q̃, k̃ and the states may be bf16
(`V2`); the backward recomputes with `_intra2_kernel` and fp32 scratch.

**Kernels, "v3"** (the default, `FORWARD`, `V3`). `_intra3_kernel` (same grid) builds L and Aqk by strips:
for each query block a, its BC rows against every key of the chunk in one [BC, C] dot per key piece, the keys
anchored at n_a as in `_intra_kernel` (no rows computed that are thrown away, as v2's masked [C, C] dots do), and
writes Aqk and β·L out (`_strip3`). Each strip then inverts its own diagonal block, I + L_aa with L_aa nilpotent:
(I + N)⁻¹ = (I − N)(I + N²)(I + N⁴)(I + N⁸), three squarings and three products of [BC, BC] blocks, written in
place of L_aa. After one barrier `_solve3` reads that back as (I + L_aa)⁻¹ on the diagonal and L below it and
finishes (I + L)⁻¹ with the doubling's last log2(C / BC) levels (two at C = 64, where v2 runs six), then w, u, q̃,
k̃, d as v2 does. The sequential pass and `_output_kernel` are v2's, with bf16 w, q̃, k̃ and S_n for 16-bit inputs
by default; q̃_n S_n then takes 16-bit operands (the same products as TF32 ones of bf16 values). `V3["split"]`
runs the strips as their own launch (`_strips3_kernel`, one program per query block) before `_solve3_kernel`.
Documents, initial and final state, fp32 inputs (IEEE dots throughout) and the backward's (I + L)⁻¹ (`inverse`)
are handled as in v1 and v2; `kda_cp_prepass_triton` runs whichever forward `FORWARD` names.

**Gates.** The anchored diagonal block needs e^{−g(n_a, j]} to stay finite over 15 tokens: the kernels take the
bounded gate of K3, g ∈ [−5, 0] (as FLA's `safe_gate`); unbounded softplus gates belong to `delta_rule.kda_chunk`.

**Precision.** fp32 inputs: IEEE fp32 dots throughout. 16-bit inputs (the fast path, `PRECISION`): the pairwise
strips of L / Aqk take 16-bit operands on the tensor cores, the triangular solve and the state pass TF32 ones
(16-bit operands there double the error: the state rounded to bf16 costs ~2e-3 of the final state alone); sums
are fp32, and so are the state, the scratch and every exponential. Under Triton's interpreter the 16-bit dot is
wrong and TF32 is full fp32 (triton 3.9), so `_dot` rounds the operands as the tensor cores take them (16-bit:
to nearest even; TF32: low 13 bits dropped, the coarser of the hardware's choices) and multiplies exactly: the
CPU tests measure the GPU's rounding.

**Backward.** `kda_chunk_bwd_triton` recomputes the intra-chunk scratch (with (I + L)⁻¹), reruns the state pass
storing each chunk's entering state and U_n, runs the state recurrence's adjoint in reverse (`_state_bwd_kernel`:
dU_n = Aqk_nᵀ dO_n + k̃_n dS_{n+1}, dS_n = q̃_nᵀ dO_n + diag(d_n) dS_{n+1} − w_nᵀ dU_n) and then forms every token
gradient per chunk in one program (`_intra_bwd_kernel`, steps in the function's docstring), with the forward's
anchoring of every exponential.

**Context parallelism.** A slice of a sequence maps a start state S to M S + S_zero (the chunk step is affine in
S: S_{n+1} = (diag(d_n) − k̃_nᵀ w_n) S_n + k̃_nᵀ u_n). `kda_cp_prepass_triton` returns S_zero (the state pass
from zero) and M (the same pass with u = 0 from S = I); a document start inside the slice zeroes M. Running a
slice from a given start state is `kda_chunk_fwd_triton(..., initial_state=S)`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import interpreted, tl, triton, triton_available

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
        bf16 / fp16). Under the interpreter (EMULATE), whose 16-bit dot is wrong and whose TF32 is full fp32, the
        operands are rounded as the tensor cores take them (TF32: low 13 bits dropped) and multiplied exactly."""
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
        else:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return acc

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
    def _intra_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, reset_ptr, w_ptr, u_ptr, qd_ptr, kd_ptr, A_ptr, d_ptr,
                      M_ptr, T, H, K, V, N, scale,
                      C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_RESET: tl.constexpr, INVERSE: tl.constexpr, PAIR: tl.constexpr, SOLVE: tl.constexpr,
                      DT: tl.constexpr, EMULATE: tl.constexpr):
        # program (chunk n, row bh = b·H + h). Inputs [B, T, H, ·] dense; scratch [B·H, N, C, ·] dense,
        # d [B·H, N, K]. INVERSE: also (I + L)⁻¹ into M [B·H, N, C, C] (the backward's transposed solves).
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        rows = tl.arange(0, C)
        t, valid, tok, rst, seg, n_seg = _chunk_rows(reset_ptr, n, bh, T, H, C, HAS_RESET)
        first = seg == 0                                            # rows that see the entering state
        last = seg == n_seg                                         # rows that write the leaving state
        out = (bh * N + n) * C + rows                               # scratch rows of this chunk  [C]

        # chunk-level factors: q̃, k̃ and the state decay d
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            m = valid[:, None] & (kk[None, :] < K)
            g = tl.load(g_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            kt = tl.load(k_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            gam = tl.cumsum(g, 0)                                   # Γ_r
            suffix = tl.cumsum(g, 0, reverse=True) - g              # g(j, C−1]
            qd = tl.where(first[:, None], scale * q * tl.exp(gam), 0.0)
            kd = tl.where(last[:, None], kt * tl.exp(suffix), 0.0)
            ms = kk[None, :] < K
            tl.store(qd_ptr + out[:, None] * K + kk[None, :], qd, mask=ms)
            tl.store(kd_ptr + out[:, None] * K + kk[None, :], kd, mask=ms)
            dn = tl.where(n_seg == 0, tl.exp(tl.sum(g, 0)), 0.0)
            tl.store(d_ptr + (bh * N + n) * K + kk, dn, mask=kk < K)

        lr = tl.arange(0, BC)
        for a in range(C // BC):                                    # query sub-blocks, in order (the solve)
            na = a * BC
            ra = na + lr
            ta = n * C + ra
            va = ta < T
            toka = (b * T + ta) * H + h
            seg_a = tl.sum(tl.where(rows[None, :] <= ra[:, None], rst[None, :], 0), 1)
            beta_a = tl.load(beta_ptr + toka, mask=va, other=0.0).to(tl.float32)
            before = rows < na                                       # keys of earlier sub-blocks
            s_kk = tl.zeros([BC, C], dtype=tl.float32)              # strips against earlier keys
            s_qk = tl.zeros([BC, C], dtype=tl.float32)
            d_kk = tl.zeros([BC, BC], dtype=tl.float32)             # diagonal blocks
            d_qk = tl.zeros([BC, BC], dtype=tl.float32)
            for k0 in range(0, K, BK):
                kk = k0 + tl.arange(0, BK)
                m = valid[:, None] & (kk[None, :] < K)
                g = tl.load(g_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
                kt = tl.load(k_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
                g_in = tl.where(rows[:, None] <= na, g, 0.0)
                to_anchor = tl.cumsum(g_in, 0, reverse=True) - g_in  # g(j, n_a] for j < n_a
                k_off = tl.where(before[:, None], kt * tl.exp(tl.where(before[:, None], to_anchor, 0.0)), 0.0)
                ma = va[:, None] & (kk[None, :] < K)
                g_a = tl.load(g_ptr + toka[:, None] * K + kk[None, :], mask=ma, other=0.0).to(tl.float32)
                q_a = tl.load(q_ptr + toka[:, None] * K + kk[None, :], mask=ma, other=0.0).to(tl.float32)
                k_a = tl.load(k_ptr + toka[:, None] * K + kk[None, :], mask=ma, other=0.0).to(tl.float32)
                f = tl.cumsum(tl.where(lr[:, None] > 0, g_a, 0.0), 0)  # g(n_a, r]
                e = tl.exp(f)
                qf = q_a * e
                kf = k_a * e
                k_back = k_a * tl.exp(-f)                            # ≤ e^{75} for gates ≥ −5
                s_kk = _dot(kf, tl.trans(k_off), s_kk, PAIR, DT, EMULATE)
                s_qk = _dot(qf, tl.trans(k_off), s_qk, PAIR, DT, EMULATE)
                d_kk = _dot(kf, tl.trans(k_back), d_kk, PAIR, DT, EMULATE)
                d_qk = _dot(qf, tl.trans(k_back), d_qk, PAIR, DT, EMULATE)
            same = seg_a[:, None] == seg[None, :]
            same_d = seg_a[:, None] == seg_a[None, :]
            a_rows = (bh * N + n) * C + ra
            # Aqk: the strip (keys before the sub-block; zeros after it) and the diagonal block
            tl.store(A_ptr + a_rows[:, None] * C + rows[None, :], tl.where(same, s_qk * scale, 0.0),
                     mask=(rows[None, :] < na) | (rows[None, :] >= na + BC))
            tl.store(A_ptr + a_rows[:, None] * C + ra[None, :],
                     tl.where(same_d & (lr[None, :] <= lr[:, None]), d_qk * scale, 0.0))
            l_off = tl.where(same, s_kk, 0.0) * beta_a[:, None]
            l_diag = tl.where(same_d & (lr[None, :] < lr[:, None]), d_kk, 0.0) * beta_a[:, None]
            # (I + L_aa)^{-1} by forward substitution: row i = e_i − Σ_{j<i} L[i, j] row j
            inv = (lr[:, None] == lr[None, :]).to(tl.float32)
            for i in range(1, BC):
                l_i = tl.sum(tl.where(lr[:, None] == i, l_diag, 0.0), 0)
                inv = tl.where(lr[:, None] == i, inv - tl.sum(l_i[:, None] * inv, 0)[None, :], inv)
            first_a = (seg_a == 0)[:, None]
            for k0 in range(0, K, BK):
                kk = k0 + tl.arange(0, BK)
                mk = kk[None, :] < K
                m = valid[:, None] & mk
                g = tl.load(g_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
                g_a = tl.load(g_ptr + toka[:, None] * K + kk[None, :], mask=va[:, None] & mk,
                              other=0.0).to(tl.float32)
                k_a = tl.load(k_ptr + toka[:, None] * K + kk[None, :], mask=va[:, None] & mk,
                              other=0.0).to(tl.float32)
                gam_a = tl.sum(tl.where(before[:, None], g, 0.0), 0)[None, :] + tl.cumsum(g_a, 0)
                rhs = tl.where(first_a, beta_a[:, None] * k_a * tl.exp(gam_a), 0.0)
                w_prev = tl.load(w_ptr + out[:, None] * K + kk[None, :], mask=before[:, None] & mk, other=0.0)
                x = rhs - _dot(l_off, w_prev, tl.zeros([BC, BK], dtype=tl.float32), SOLVE, DT, EMULATE)
                w_a = _dot(inv, x, tl.zeros([BC, BK], dtype=tl.float32), SOLVE, DT, EMULATE)
                tl.store(w_ptr + a_rows[:, None] * K + kk[None, :], w_a, mask=mk)
            for v0 in range(0, V, BV):
                vv = v0 + tl.arange(0, BV)
                mv = vv[None, :] < V
                v_a = tl.load(v_ptr + toka[:, None] * V + vv[None, :], mask=va[:, None] & mv,
                              other=0.0).to(tl.float32)
                u_prev = tl.load(u_ptr + out[:, None] * V + vv[None, :], mask=before[:, None] & mv, other=0.0)
                x = beta_a[:, None] * v_a - _dot(l_off, u_prev, tl.zeros([BC, BV], dtype=tl.float32), SOLVE, DT,
                                                 EMULATE)
                u_a = _dot(inv, x, tl.zeros([BC, BV], dtype=tl.float32), SOLVE, DT, EMULATE)
                tl.store(u_ptr + a_rows[:, None] * V + vv[None, :], u_a, mask=mv)
            if INVERSE:   # the same substitution with the identity's rows on the right
                m_prev = tl.load(M_ptr + out[:, None] * C + rows[None, :], mask=before[:, None], other=0.0)
                x = (ra[:, None] == rows[None, :]).to(tl.float32) - _dot(
                    l_off, m_prev, tl.zeros([BC, C], dtype=tl.float32), SOLVE, DT, EMULATE)
                tl.store(M_ptr + a_rows[:, None] * C + rows[None, :],
                         _dot(inv, x, tl.zeros([BC, C], dtype=tl.float32), SOLVE, DT, EMULATE))
            tl.debug_barrier()   # the next sub-block reads these rows back

    @triton.jit
    def _state_kernel(w_ptr, u_ptr, qd_ptr, kd_ptr, A_ptr, d_ptr, s0_ptr, o_ptr, sN_ptr, h_ptr, T, H, K, V, N,
                      C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, S0: tl.constexpr, HAS_U: tl.constexpr,
                      OUT: tl.constexpr, STORE: tl.constexpr, STATE: tl.constexpr, DT: tl.constexpr,
                      EMULATE: tl.constexpr):
        # program (row bh, block of BV state columns); the state's K rows and BV columns stay in fp32 registers
        # through all chunks. S0: 0 zeros, 1 loaded from s0 [B·H, K, V], 2 the identity (the transition, V = K).
        # HAS_U False: u = 0. OUT: write O into o [B, T, H, V]. STORE (the backward's pass): the state entering
        # every chunk into h [B·H, N, K, V], and U_n over u_n.
        bh = tl.program_id(0).to(tl.int64)
        b = bh // H
        h = bh % H
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
                U += tl.load(u_ptr + rws[:, None] * V + vv[None, :], mask=mv[None, :], other=0.0)
            if STORE:
                tl.store(u_ptr + rws[:, None] * V + vv[None, :], U, mask=mv[None, :])
            if OUT:
                qd = tl.load(qd_ptr + rws[:, None] * K + kk[None, :], mask=mk[None, :], other=0.0)
                A = tl.load(A_ptr + rws[:, None] * C + c[None, :])
                o = _dot(A, U, _dot(qd, S, tl.zeros([C, BV], dtype=tl.float32), STATE, DT, EMULATE), STATE, DT, EMULATE)
                t = n * C + c
                tl.store(o_ptr + ((b * T + t) * H + h)[:, None] * V + vv[None, :],
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
    def _intra_bwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, reset_ptr, M_ptr, U_ptr, h_ptr, dh_ptr, dU_ptr,
                          do_ptr, dq_ptr, dk_ptr, dv_ptr, dg_ptr, db_ptr, T, H, K, V, N, scale,
                          C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          HAS_RESET: tl.constexpr, PAIR: tl.constexpr, SOLVE: tl.constexpr, STATE: tl.constexpr,
                          DT: tl.constexpr, EMULATE: tl.constexpr):
        # program (chunk n, row bh): every gradient of the chunk's tokens from the scratch of the state passes
        # (S_n in h, dS_{n+1} in dh, U, dU) and (I + L)⁻¹ in M; the steps are kda_chunk_bwd_triton's docstring.
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        rows = tl.arange(0, C)
        t, valid, tok, rst, seg, n_seg = _chunk_rows(reset_ptr, n, bh, T, H, C, HAS_RESET)
        first = (seg == 0)[:, None]
        last = (seg == n_seg)[:, None]
        same = seg[:, None] == seg[None, :]
        out = (bh * N + n) * C + rows
        st = bh * N + n
        Mt = tl.trans(tl.load(M_ptr + out[:, None] * C + rows[None, :]))          # (I + L)⁻ᵀ
        beta = tl.load(beta_ptr + tok, mask=valid, other=0.0).to(tl.float32)
        # the V side: dAqk = dO Uᵀ, dR_u = (I + L)⁻ᵀ dU, dL = −dR_u Uᵀ, dv = β dR_u
        dA = tl.zeros([C, C], dtype=tl.float32)
        dL = tl.zeros([C, C], dtype=tl.float32)
        db = tl.zeros([C], dtype=tl.float32)
        for v0 in range(0, V, BV):
            vv = v0 + tl.arange(0, BV)
            mv = vv[None, :] < V
            U = tl.load(U_ptr + out[:, None] * V + vv[None, :], mask=mv, other=0.0)
            dU = tl.load(dU_ptr + out[:, None] * V + vv[None, :], mask=mv, other=0.0)
            do = tl.load(do_ptr + tok[:, None] * V + vv[None, :], mask=valid[:, None] & mv, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + tok[:, None] * V + vv[None, :], mask=valid[:, None] & mv, other=0.0).to(tl.float32)
            dA = _dot(do, tl.trans(U), dA, STATE, DT, EMULATE)
            dR = _dot(Mt, dU, tl.zeros([C, BV], dtype=tl.float32), SOLVE, DT, EMULATE)
            dL = _dot(dR, tl.trans(U), dL, SOLVE, DT, EMULATE)
            db += tl.sum(dR * v, 1)
            tl.store(dv_ptr + tok[:, None] * V + vv[None, :], _to16(beta[:, None] * dR, dv_ptr.dtype.element_ty,
                                                                     EMULATE), mask=valid[:, None] & mv)
        # dAqk · s, its diagonal apart: e^{g(r,r]} = 1 exactly, and it leaves dΓ alone (its two terms, ±q_r k_r,
        # cancel), where as anchored products they would cancel only to rounding, against a dg of O(e^{−5})
        strict = same & (rows[None, :] < rows[:, None])
        dA_diag = tl.sum(tl.where(rows[:, None] == rows[None, :], dA, 0.0), 1) * scale
        dA = tl.where(strict, dA * scale, 0.0)
        dL = tl.where(strict, -dL, 0.0)
        blk = rows // BC
        tri = (rows[None, :] < rows[:, None]).to(tl.float32)                  # Σ_{j<t} as a dot
        # the K side, one block of key channels at a time
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            mk = kk[None, :] < K
            m = valid[:, None] & mk
            g = tl.load(g_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            kt = tl.load(k_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            e_first = tl.where(first, tl.exp(tl.cumsum(g, 0)), 0.0)                # e^{Γ_r}, first segment
            e_last = tl.where(last, tl.exp(tl.cumsum(g, 0, reverse=True) - g), 0.0)  # e^{g(j, C−1]}, last one
            # through the state: dq̃ = dO S_nᵀ, dk̃ = U dS_{n+1}ᵀ, dw = −dU S_nᵀ, dd = Σ_v S_n ⊙ dS_{n+1}
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
                dd += tl.sum(S * dS, 1)
            dRw = -_dot(Mt, dw, tl.zeros([C, BK], dtype=tl.float32), SOLVE, DT, EMULATE)   # through the solve
            # the pairwise terms, by query sub-block a with the forward's anchor n_a (its first row): query rows
            # carry e^{g(n_a, r]}, earlier keys e^{g(j, n_a]}, its own keys e^{−g(n_a, j]}. Both sides of each pair
            # (the query row's gradient and the key row's) come from the same rounded dot operands, and dΓ takes
            # those operands too: a pair's +/− terms in dΓ are then one product, and cancel in dg's suffix sums
            # to fp32 accumulation error rather than to the operands' 16-bit rounding.
            dqa = tl.zeros([C, BK], dtype=tl.float32)       # Σ_{j<r} dAqk_rj k_j e^{g(j,r]}  (· s)
            dkq = tl.zeros([C, BK], dtype=tl.float32)       # Σ_{j<r} dL_rj k_j e^{g(j,r]}
            dkk = tl.zeros([C, BK], dtype=tl.float32)       # Σ_{r>j} (dAqk_rj q_r + dL_rj β_r k_r) e^{g(j,r]}
            dgam = tl.zeros([C, BK], dtype=tl.float32)      # their part of dΓ
            z = tl.zeros([C, BK], dtype=tl.float32)
            for a in range(C // BC):
                na = a * BC
                in_a = (blk == a)[:, None]
                upto = rows[:, None] < na + BC
                g_in = tl.where(rows[:, None] <= na, g, 0.0)
                to_anchor = tl.cumsum(g_in, 0, reverse=True) - g_in             # g(j, n_a] for j < n_a
                f = tl.cumsum(tl.where(in_a & (rows[:, None] > na), g, 0.0), 0)  # g(n_a, r] on a
                phi = tl.where(rows[:, None] < na, to_anchor, tl.where(upto, -f, 0.0))
                e_k = tl.where(upto, tl.exp(phi), 0.0)                           # ≤ 1 before a, ≤ e^75 on a
                e_q = tl.where(in_a, tl.exp(tl.where(in_a, f, 0.0)), 0.0)
                k_anc = _operand(kt * e_k, PAIR, DT, EMULATE)
                q_anc = _operand(q * e_q, PAIR, DT, EMULATE)
                b_anc = _operand(beta[:, None] * kt * e_q, PAIR, DT, EMULATE)
                dA_a = tl.where(in_a, dA, 0.0)
                dL_a = tl.where(in_a, dL, 0.0)
                xq = _dot(dA_a, k_anc, z, PAIR, DT, EMULATE)                    # rows of a
                xl = _dot(dL_a, k_anc, z, PAIR, DT, EMULATE)
                yk = _dot(tl.trans(dL_a), b_anc, _dot(tl.trans(dA_a), q_anc, z, PAIR, DT, EMULATE), PAIR, DT,
                          EMULATE)                                               # keys up to a's last row
                dqa += e_q * xq
                dkq += e_q * xl
                dkk += e_k * yk
                dgam += q_anc * xq + b_anc * xl - k_anc * yk
            bk = beta[:, None] * kt
            dq = scale * e_first * dqd + dqa + dA_diag[:, None] * kt
            dk = beta[:, None] * (e_first * dRw + dkq) + e_last * dkd + dkk + dA_diag[:, None] * q
            db += tl.sum(kt * (e_first * dRw + dkq), 1)
            # dΓ_r: each factor x·e^{±Γ} gives ±x·e^{±Γ}·(its gradient); k̃ and d depend on Γ_{C−1} − Γ_j and
            # Γ_{C−1}, summed here directly over the gates they span
            # The pairwise part of dΓ sums to zero over the chunk (each pair gives ±): Σ_{r≥t} = −Σ_{r<t}, and the
            # shorter of the two sums cancels over fewer pairs (and the first row's is exactly 0). Exclusive prefix
            # sums are a dot with the strict lower triangle, not cumsum(x) − x: at the chunk's end k̃'s own term
            # is O(1) against an O(e^{−5}) sum.
            late = (2 * rows >= tl.minimum(T - n * C, C))[:, None]
            kdk = dkd * kt * e_last
            dg = tl.where(late, tl.cumsum(dgam, 0, reverse=True), -_dot(tri, dgam, z, "ieee", DT, EMULATE))
            dn = tl.where(n_seg == 0, tl.exp(tl.sum(g, 0)), 0.0)
            dg += (tl.cumsum(bk * e_first * dRw + scale * q * e_first * dqd, 0, reverse=True)
                   + _dot(tri, kdk, z, "ieee", DT, EMULATE) + (dd * dn)[None, :])
            tl.store(dq_ptr + tok[:, None] * K + kk[None, :], _to16(dq, dq_ptr.dtype.element_ty, EMULATE), mask=m)
            tl.store(dk_ptr + tok[:, None] * K + kk[None, :], _to16(dk, dk_ptr.dtype.element_ty, EMULATE), mask=m)
            tl.store(dg_ptr + tok[:, None] * K + kk[None, :], _to16(dg, dg_ptr.dtype.element_ty, EMULATE), mask=m)
        tl.store(db_ptr + tok, _to16(db, db_ptr.dtype.element_ty, EMULATE), mask=valid)

    # ------------------------------------------------------------------------------------------ forward "v2"

    @triton.jit
    def _row(x, rows, i):
        """Row i of x [C, BK] as a [BK] vector."""
        return tl.sum(tl.where(rows[:, None] == i, x, 0.0), 0)

    @triton.jit
    def _block_cumsum(x, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr):
        """Inclusive sums of x [C, BK] down its rows (up them: REVERSE), restarting at every block of BC rows."""
        return tl.reshape(tl.cumsum(tl.reshape(x, [C // BC, BC, BK]), 1, reverse=REVERSE), [C, BK])

    @triton.jit
    def _intra2_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, reset_ptr, w_ptr, u_ptr, qd_ptr, kd_ptr, A_ptr, d_ptr,
                       M_ptr, T, H, K, V, N, scale,
                       C: tl.constexpr, BC: tl.constexpr, LEVELS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       HAS_RESET: tl.constexpr, INVERSE: tl.constexpr, PAIR: tl.constexpr, SOLVE: tl.constexpr,
                       DT: tl.constexpr, EMULATE: tl.constexpr):
        # program (chunk n, row bh), layouts as _intra_kernel's; w, q̃, k̃ stored in their pointers' dtype, u fp32.
        # Pass 1 (per key piece): the whole chunk's L and Aqk as [C, C] accumulators, one dot pair per anchor.
        # Then (I + L)⁻¹ by doubling, and pass 2: w and u as dots with it.
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        rows = tl.arange(0, C)
        t, valid, tok, rst, seg, n_seg = _chunk_rows(reset_ptr, n, bh, T, H, C, HAS_RESET)
        first = (seg == 0)[:, None]
        last = (seg == n_seg)[:, None]
        out = (bh * N + n) * C + rows
        blk = (rows // BC)[:, None]
        lr = (rows % BC)[:, None]
        Akk = tl.zeros([C, C], dtype=tl.float32)
        Aqk = tl.zeros([C, C], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            mk = kk[None, :] < K
            m = valid[:, None] & mk
            g = tl.load(g_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            kt = tl.load(k_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            qd = tl.where(first, scale * q * tl.exp(tl.cumsum(g, 0)), 0.0)
            kd = tl.where(last, kt * tl.exp(tl.cumsum(g, 0, reverse=True) - g), 0.0)
            tl.store(qd_ptr + out[:, None] * K + kk[None, :], _to16(qd, qd_ptr.dtype.element_ty, EMULATE), mask=mk)
            tl.store(kd_ptr + out[:, None] * K + kk[None, :], _to16(kd, kd_ptr.dtype.element_ty, EMULATE), mask=mk)
            tl.store(d_ptr + (bh * N + n) * K + kk, tl.where(n_seg == 0, tl.exp(tl.sum(g, 0)), 0.0), mask=kk < K)
            # per block of BC rows (first row n_b, last m_b): f = g(n_b, r], tail = g(j, m_b]; sums of the gates
            # they span, as every exponent below
            f = _block_cumsum(tl.where(lr > 0, g, 0.0), C, BC, BK, False)
            tail = _block_cumsum(g, C, BC, BK, True) - g
            e = tl.exp(f)
            qf = q * e                                               # queries of block a: e^{g(n_a, r]} ≤ 1
            kf = kt * e
            kb = kt * tl.exp(-f)                                     # keys of block a: e^{−g(n_a, j]} ≤ e^{75}
            phi = tl.zeros([C, BK], dtype=tl.float32)                # g(j, n_a] for keys of earlier blocks
            for a in tl.static_range(C // BC):
                if a > 0:
                    gn = _row(g, rows, a * BC)
                    step = _row(f, rows, a * BC - 1) + gn            # g(n_{a−1}, n_a]
                    phi = tl.where(blk < a - 1, phi + step[None, :], tl.where(blk == a - 1, tail + gn[None, :], 0.0))
                k_an = tl.where(blk < a, kt * tl.exp(phi), tl.where(blk == a, kb, 0.0))
                ina = blk == a
                Akk = _dot(tl.where(ina, kf, 0.0), tl.trans(k_an), Akk, PAIR, DT, EMULATE)
                Aqk = _dot(tl.where(ina, qf, 0.0), tl.trans(k_an), Aqk, PAIR, DT, EMULATE)
        r2 = rows[:, None]
        c2 = rows[None, :]
        same = seg[:, None] == seg[None, :]
        tl.store(A_ptr + out[:, None] * C + c2, tl.where(same & (c2 <= r2), Aqk * scale, 0.0))
        beta = tl.load(beta_ptr + tok, mask=valid, other=0.0).to(tl.float32)
        L = tl.where(same & (c2 < r2), Akk, 0.0) * beta[:, None]
        # (I + L)⁻¹ by doubling: Mi inverts the diagonal blocks of size s; with E the coupling of each 2s-block's
        # second half to its first, (D + E)⁻¹ = D⁻¹ − D⁻¹ E D⁻¹ exactly (block substitution), log2(C) levels
        Mi = (r2 == c2).to(tl.float32)
        z = tl.zeros([C, C], dtype=tl.float32)
        for lvl in tl.static_range(LEVELS):
            s = 1 << lvl
            E = tl.where((r2 // (2 * s) == c2 // (2 * s)) & ((r2 // s) % 2 == 1) & ((c2 // s) % 2 == 0), L, 0.0)
            Mi = Mi - _dot(Mi, _dot(E, Mi, z, SOLVE, DT, EMULATE), z, SOLVE, DT, EMULATE)
        if INVERSE:
            tl.store(M_ptr + out[:, None] * C + c2, Mi)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            mk = kk[None, :] < K
            m = valid[:, None] & mk
            g = tl.load(g_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            kt = tl.load(k_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            rhs = tl.where(first, beta[:, None] * kt * tl.exp(tl.cumsum(g, 0)), 0.0)
            w = _dot(Mi, rhs, tl.zeros([C, BK], dtype=tl.float32), SOLVE, DT, EMULATE)
            tl.store(w_ptr + out[:, None] * K + kk[None, :], _to16(w, w_ptr.dtype.element_ty, EMULATE), mask=mk)
        for v0 in range(0, V, BV):
            vv = v0 + tl.arange(0, BV)
            mv = vv[None, :] < V
            v = tl.load(v_ptr + tok[:, None] * V + vv[None, :], mask=valid[:, None] & mv, other=0.0).to(tl.float32)
            u = _dot(Mi, beta[:, None] * v, tl.zeros([C, BV], dtype=tl.float32), SOLVE, DT, EMULATE)
            tl.store(u_ptr + out[:, None] * V + vv[None, :], u, mask=mv)

    @triton.jit
    def _output_kernel(qd_ptr, A_ptr, U_ptr, h_ptr, o_ptr, T, H, K, V, N, C: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, STATE: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr,
                       QS: tl.constexpr = ""):
        # program (chunk n, row bh, block of BV output columns): O_n = q̃_n S_n + Aqk_n U_n from the state pass's
        # S_n (h [B·H, N, K, V]) and U_n; chunk-parallel. QS "16": q̃_n S_n with 16-bit operands (both stored
        # in 16 bits: the same products as TF32's, at the 16-bit rate); "": STATE's.
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
        o = _dot(A, U, o, STATE, DT, EMULATE)
        t = n * C + c
        tl.store(o_ptr + ((b * T + t) * H + h)[:, None] * V + vv[None, :], _to16(o, o_ptr.dtype.element_ty, EMULATE),
                 mask=(t < T)[:, None] & mv[None, :])

    # ------------------------------------------------------------------------------------------ forward "v3"

    @triton.jit
    def _strip3(q_ptr, k_ptr, g_ptr, beta_ptr, A_ptr, M_ptr, n, bh, a, T, H, K, N, scale, rst, seg, valid, tok,
                C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DIAG: tl.constexpr, PAIR: tl.constexpr,
                SOLVE: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr):
        """Rows n_a..n_a+BC−1 (query block a) of chunk n's Aqk (into A) and β·L (into M) as [BC, C] strips, one dot
        each per key piece: earlier keys carry e^{g(j, n_a]} ≤ 1, block a's own e^{−g(n_a, j]} ≤ e^{75}, later
        ones 0, queries e^{g(n_a, r]} ≤ 1; each exponent a sum of exactly the gates it spans. DIAG: M's diagonal
        block takes (I + L_aa)⁻¹ instead of L_aa: with N = L_aa nilpotent (N^BC = 0),
        (I + N)⁻¹ = (I − N)(I + N²)(I + N⁴)(I + N⁸), three squarings and three products."""
        b = bh // H
        h = bh % H
        rows = tl.arange(0, C)
        lr = tl.arange(0, BC)
        na = a * BC
        ra = na + lr
        ta = n * C + ra
        va = ta < T
        toka = (b * T + ta) * H + h
        seg_a = tl.sum(tl.where(rows[None, :] <= ra[:, None], rst[None, :], 0), 1)
        before = (rows < na)[:, None]
        in_a = (rows >= na) & (rows < na + BC)
        upto = (valid & (rows < na + BC))[:, None]                    # the keys the strip meets
        s_kk = tl.zeros([BC, C], dtype=tl.float32)
        s_qk = tl.zeros([BC, C], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            mk = kk[None, :] < K
            m = upto & mk
            g = tl.load(g_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            kt = tl.load(k_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            g_to = tl.where(rows[:, None] <= na, g, 0.0)
            g_in = tl.where(in_a[:, None] & (rows[:, None] > na), g, 0.0)
            phi = tl.where(before, tl.cumsum(g_to, 0, reverse=True) - g_to, -tl.cumsum(g_in, 0))
            k_an = tl.where(before | in_a[:, None], kt * tl.exp(phi), 0.0)
            ma = va[:, None] & mk
            g_a = tl.load(g_ptr + toka[:, None] * K + kk[None, :], mask=ma, other=0.0).to(tl.float32)
            q_a = tl.load(q_ptr + toka[:, None] * K + kk[None, :], mask=ma, other=0.0).to(tl.float32)
            k_a = tl.load(k_ptr + toka[:, None] * K + kk[None, :], mask=ma, other=0.0).to(tl.float32)
            e = tl.exp(tl.cumsum(tl.where(lr[:, None] > 0, g_a, 0.0), 0))
            s_kk = _dot(k_a * e, tl.trans(k_an), s_kk, PAIR, DT, EMULATE)
            s_qk = _dot(q_a * e, tl.trans(k_an), s_qk, PAIR, DT, EMULATE)
        beta_a = tl.load(beta_ptr + toka, mask=va, other=0.0).to(tl.float32)
        same = seg_a[:, None] == seg[None, :]
        a_rows = (bh * N + n) * C + ra
        tl.store(A_ptr + a_rows[:, None] * C + rows[None, :],
                 tl.where(same & (rows[None, :] <= ra[:, None]), s_qk * scale, 0.0))
        tl.store(M_ptr + a_rows[:, None] * C + rows[None, :],
                 tl.where(same & (rows[None, :] < ra[:, None]), s_kk * beta_a[:, None], 0.0))
        if DIAG:
            tl.debug_barrier()   # L_aa back as one [BC, BC] block
            nil = tl.load(M_ptr + a_rows[:, None] * C + ra[None, :])
            zb = tl.zeros([BC, BC], dtype=tl.float32)
            inv = (lr[:, None] == lr[None, :]).to(tl.float32) - nil
            pw = nil
            tl.static_assert(BC == 16)
            for i in tl.static_range(3):   # N², N⁴, N⁸
                pw = _dot(pw, pw, zb, SOLVE, DT, EMULATE)
                inv = _dot(inv, pw, inv, SOLVE, DT, EMULATE)
            tl.debug_barrier()   # every thread has read L_aa
            tl.store(M_ptr + a_rows[:, None] * C + ra[None, :], inv)

    @triton.jit
    def _solve3(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, qd_ptr, kd_ptr, d_ptr, M_ptr, n, bh, K, V, N,
                scale, valid, tok, first, last, n_seg, C: tl.constexpr, BC: tl.constexpr, LOG_BC: tl.constexpr,
                LEVELS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, INVERSE: tl.constexpr, SOLVE: tl.constexpr,
                DT: tl.constexpr, EMULATE: tl.constexpr):
        """Chunk n's (I + L)⁻¹ from `_strip3`'s M (β·L, with (I + L_aa)⁻¹ on the diagonal blocks if LOG_BC > 0):
        the doubling of `_intra2_kernel` from level LOG_BC = log2(BC) on (or from the identity at level 0), each
        level reading its coupling afresh; written over M if INVERSE. Then w and u as dots with it, q̃, k̃, d."""
        rows = tl.arange(0, C)
        out = (bh * N + n) * C + rows
        r2 = rows[:, None]
        c2 = rows[None, :]
        if LOG_BC > 0:
            Mi = tl.load(M_ptr + out[:, None] * C + c2, mask=r2 // BC == c2 // BC, other=0.0)
        else:
            Mi = (r2 == c2).to(tl.float32)
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
            g = tl.load(g_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            kt = tl.load(k_ptr + tok[:, None] * K + kk[None, :], mask=m, other=0.0).to(tl.float32)
            eg = tl.exp(tl.cumsum(g, 0))                                          # e^{Γ_r}
            qd = tl.where(first, scale * q * eg, 0.0)
            kd = tl.where(last, kt * tl.exp(tl.cumsum(g, 0, reverse=True) - g), 0.0)
            tl.store(qd_ptr + out[:, None] * K + kk[None, :], _to16(qd, qd_ptr.dtype.element_ty, EMULATE), mask=mk)
            tl.store(kd_ptr + out[:, None] * K + kk[None, :], _to16(kd, kd_ptr.dtype.element_ty, EMULATE), mask=mk)
            tl.store(d_ptr + (bh * N + n) * K + kk, tl.where(n_seg == 0, tl.exp(tl.sum(g, 0)), 0.0), mask=kk < K)
            rhs = tl.where(first, beta[:, None] * kt * eg, 0.0)
            w = _dot(Mi, rhs, tl.zeros([C, BK], dtype=tl.float32), SOLVE, DT, EMULATE)
            tl.store(w_ptr + out[:, None] * K + kk[None, :], _to16(w, w_ptr.dtype.element_ty, EMULATE), mask=mk)
        for v0 in range(0, V, BV):
            vv = v0 + tl.arange(0, BV)
            mv = vv[None, :] < V
            v = tl.load(v_ptr + tok[:, None] * V + vv[None, :], mask=valid[:, None] & mv, other=0.0).to(tl.float32)
            u = _dot(Mi, beta[:, None] * v, tl.zeros([C, BV], dtype=tl.float32), SOLVE, DT, EMULATE)
            tl.store(u_ptr + out[:, None] * V + vv[None, :], u, mask=mv)

    @triton.jit
    def _intra3_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, reset_ptr, w_ptr, u_ptr, qd_ptr, kd_ptr, A_ptr, d_ptr,
                       M_ptr, T, H, K, V, N, scale,
                       C: tl.constexpr, BC: tl.constexpr, LOG_BC: tl.constexpr, LEVELS: tl.constexpr,
                       BK: tl.constexpr, BKW: tl.constexpr, BV: tl.constexpr, HAS_RESET: tl.constexpr,
                       INVERSE: tl.constexpr, PAIR: tl.constexpr, SOLVE: tl.constexpr, DT: tl.constexpr,
                       EMULATE: tl.constexpr):
        # program (chunk n, row bh), layouts as _intra_kernel's; w, q̃, k̃ in their pointers' dtype, u, Aqk, M fp32.
        # The strips of every query block (`_strip3`), then, once L is in M, `_solve3`.
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        t, valid, tok, rst, seg, n_seg = _chunk_rows(reset_ptr, n, bh, T, H, C, HAS_RESET)
        for a in range(C // BC):
            _strip3(q_ptr, k_ptr, g_ptr, beta_ptr, A_ptr, M_ptr, n, bh, a, T, H, K, N, scale, rst, seg, valid, tok,
                    C, BC, BK, LOG_BC > 0, PAIR, SOLVE, DT, EMULATE)
        tl.debug_barrier()   # the solve reads L back whole
        _solve3(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, qd_ptr, kd_ptr, d_ptr, M_ptr, n, bh, K, V, N,
                scale, valid, tok, (seg == 0)[:, None], (seg == n_seg)[:, None], n_seg, C, BC, LOG_BC, LEVELS, BKW,
                BV, INVERSE, SOLVE,
                DT, EMULATE)

    @triton.jit
    def _strips3_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, reset_ptr, A_ptr, M_ptr, T, H, K, N, scale,
                        C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DIAG: tl.constexpr,
                        HAS_RESET: tl.constexpr, PAIR: tl.constexpr, SOLVE: tl.constexpr, DT: tl.constexpr,
                        EMULATE: tl.constexpr):
        # program (chunk n × query block a, row bh): `_strip3` alone (`V3["split"]`: the query blocks in parallel)
        n = tl.program_id(0) // (C // BC)
        a = tl.program_id(0) % (C // BC)
        bh = tl.program_id(1).to(tl.int64)
        t, valid, tok, rst, seg, n_seg = _chunk_rows(reset_ptr, n, bh, T, H, C, HAS_RESET)
        _strip3(q_ptr, k_ptr, g_ptr, beta_ptr, A_ptr, M_ptr, n, bh, a, T, H, K, N, scale, rst, seg, valid, tok, C,
                BC, BK, DIAG, PAIR, SOLVE, DT, EMULATE)

    @triton.jit
    def _solve3_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, reset_ptr, w_ptr, u_ptr, qd_ptr, kd_ptr, d_ptr, M_ptr,
                       T, H, K, V, N, scale, C: tl.constexpr, BC: tl.constexpr, LOG_BC: tl.constexpr,
                       LEVELS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_RESET: tl.constexpr,
                       INVERSE: tl.constexpr, SOLVE: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr):
        # program (chunk n, row bh): `_solve3` after `_strips3_kernel`
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        t, valid, tok, rst, seg, n_seg = _chunk_rows(reset_ptr, n, bh, T, H, C, HAS_RESET)
        _solve3(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, qd_ptr, kd_ptr, d_ptr, M_ptr, n, bh, K, V, N,
                scale, valid, tok, (seg == 0)[:, None], (seg == n_seg)[:, None], n_seg, C, BC, LOG_BC, LEVELS, BK,
                BV, INVERSE, SOLVE,
                DT, EMULATE)

_DT16 = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _pow2(x: int) -> int:
    return max(16, 1 << (x - 1).bit_length())


def intra_config(C: int, K: int, V: int) -> dict:
    """The intra-chunk kernel's launch config from the shapes: K and V in pieces of at most 64 columns, 8 warps for
    64-column pieces."""
    BK, BV = min(_pow2(K), 64), min(_pow2(V), 64)
    return dict(BK=BK, BV=BV, num_warps=8 if max(BK, BV) >= 64 else 4, num_stages=2)


def state_config(K: int, V: int, ieee: bool, block_v: int | None = None) -> dict:
    """The state pass's launch config: the whole key dim, state columns in blocks (32 at K = 128: a [128, 32]
    fp32 state is 32 registers a thread at 4 warps). One stage at K = 128: pipelined, the fp32 [C, K] tiles it
    reads per chunk need more shared memory than Hopper has (385 KB at three stages, 262 KB at two). IEEE dots
    (fp32 inputs) run on the CUDA cores with both operands in registers: 16 columns and 8 warps at K = 128 (sm_90
    offline compile: 0.9 KB of spills a thread, against 11 KB at 32 columns and 4 warps)."""
    BK = _pow2(K)
    if ieee and BK > 64:
        return dict(BK=BK, BV=min(_pow2(V), 16), num_warps=8, num_stages=1)
    if block_v is not None:   # "v2" (V2["state_block"]): the pass stores S_n and U_n and leaves O to _output_kernel
        # 4 warps at 64 columns: 255 registers (8 B of spills), so two programs an SM and K3's 192 in one wave
        return dict(BK=BK, BV=min(_pow2(V), block_v), num_warps=4, num_stages=1)
    return dict(BK=BK, BV=min(_pow2(V), 64 if BK <= 64 else 32), num_warps=4, num_stages=2 if BK <= 64 else 1)


def intra2_config(C: int, K: int, V: int, ieee: bool) -> dict:
    """The "v2" intra-chunk kernel's launch config: key channels in pieces of 32 (16 for IEEE dots, whose operands
    sit in registers; pass 1 keeps about ten [C, BK] fp32 tiles live beside the [C, C] accumulators), value
    channels in pieces of 64, 8 warps at C = 64 (sm_90 offline compile at K = V = 128: bf16 250 registers and no
    spills, against 160 B a thread at 4 warps; fp32 0.75 KB of spills)."""
    return dict(BK=min(_pow2(K), 16 if ieee else 32), BV=min(_pow2(V), 64), num_warps=8 if C >= 64 else 4,
                num_stages=1)


def intra3_config(C: int, K: int, V: int, ieee: bool) -> dict:
    """The "v3" intra-chunk kernels' launch config: key channels in pieces of `V3["block_k"]` for the strips and
    `V3["block_kw"]` for w, value channels in pieces of 64, `V3["num_warps"]` warps, `V3["stages"]` (sm_90 offline
    compile at K = V = 128, bf16 with the defaults: 255 registers, no spills, the loads as cp.async); IEEE dots
    (fp32 inputs, whose operands sit in registers) 16-column key pieces and 8 warps at C = 64 (1.1 KB of spills a
    thread, against 5.6 KB at 4 warps)."""
    if ieee:
        return dict(BK=min(_pow2(K), 16), BKW=min(_pow2(K), 16), BV=min(_pow2(V), 64),
                    num_warps=8 if C >= 64 else 4, num_stages=1)
    return dict(BK=min(_pow2(K), V3["block_k"]), BKW=min(_pow2(K), V3["block_kw"]), BV=min(_pow2(V), 64),
                num_warps=V3["num_warps"], num_stages=V3["stages"])


def output_config(K: int, V: int, ieee: bool) -> dict:
    """The "v2" output kernel's launch config: up to 128 output columns a program (q̃ and Aqk read once a chunk),
    the key dim in pieces of 64, 8 warps, two stages (sm_90 offline compile at K = V = 128: 76 registers, 96 KB of
    shared memory); IEEE dots 64 columns and key pieces of 32 (no spills)."""
    if ieee:
        return dict(BK=min(_pow2(K), 32), BV=min(_pow2(V), 64), num_warps=8, num_stages=2)
    return dict(BK=min(_pow2(K), 64), BV=min(_pow2(V), 128), num_warps=8, num_stages=2)


def intra_bwd_config(C: int, K: int, V: int) -> dict:
    """The intra-chunk backward's launch config: key channels in pieces of 16 and value channels of at most 32
    (the program keeps (I + L)⁻ᵀ, dAqk and dL [C, C] and about a dozen [C, BK] fp32 tiles live), 8 warps at
    C = 64 (sm_90 offline compile at K = V = 128: 0.8 KB of spills a thread for bf16, 1.4 KB for fp32, against
    1.9 / 3.2 KB with 32-column key pieces; 4 or 16 warps spill more)."""
    return dict(BK=16, BV=min(_pow2(V), 32), num_warps=8 if C >= 64 else 4, num_stages=1)


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


FORWARD = "v3"
"""The kernels `kda_chunk_fwd_triton`, `kda_chunk_bwd_triton` and `kda_intra_triton` run when called with
impl=None: "v1" (`_intra_kernel` by sub-blocks, `_state_kernel` writing O inside the chunk loop), "v2"
(`_intra2_kernel`: L and Aqk of the whole chunk at once, (I + L)⁻¹ by doubling; the sequential pass only carries
the state, storing S_n and U_n; `_output_kernel` forms O chunk-parallel) or "v3" (`_intra3_kernel`: L and Aqk by
strips of one query block, the diagonal blocks inverted there, two doubling levels; then v2's state pass and output
kernel, with bf16 scratch and states by default, `V3`)."""

V2 = {"state_block": 64, "scratch": "fp32", "states": "fp32"}
"""Options of the "v2" forward for 16-bit inputs: "state_block" the state columns of one sequential program (32 or
64); "scratch" the dtype of w, q̃ and k̃ between the kernels and "states" that of the stored S_n: "fp32", or "16"
(bf16; the state and output dots round their operands to TF32 from there). The backward's recompute keeps fp32."""


V3 = {"state_block": 64, "scratch": "16", "states": "16", "block_k": 64, "block_kw": 32, "num_warps": 4,
      "stages": 2, "split": False, "diag_inverse": True, "state_stages": 1, "state_warps": 4}
"""Options of the "v3" forward: "state_block", "scratch" and "states" as `V2`'s (here bf16 by default, for 16-bit
inputs); for its intra-chunk kernel (16-bit inputs): "block_k" the key piece of the strips' dots, "block_kw" that
of w, "num_warps", "stages" (software pipelining of the loads), "split" (strips and solve as two launches, the
query blocks in parallel), "diag_inverse" (the strips invert their diagonal blocks, leaving the solve two doubling
levels instead of six); "state_stages", "state_warps" the state pass's launch."""


def _impl(impl: str | None) -> str:
    impl = FORWARD if impl is None else impl
    if impl not in ("v1", "v2", "v3"):
        raise ValueError(f"kda_triton: impl={impl!r} must be 'v1', 'v2' or 'v3' (or None: kda_triton.FORWARD)")
    return impl


def _dots(dtype: torch.dtype, *which: str) -> dict:
    """The dot operands of `which` ("pair", "solve", "state") for inputs of `dtype` (fp32: "ieee" everywhere), the
    16-bit operand type and whether the interpreter emulates the tensor cores' rounding. fp16 inputs take bf16
    operands: the anchored diagonal blocks' factors reach e^{75} with gates of −5, past fp16's range."""
    prec = {w.upper(): PRECISION[w] if dtype in _DT16 else "ieee" for w in which}
    return dict(prec, DT=tl.bfloat16 if dtype in _DT16 else tl.float32, EMULATE=interpreted())


def kda_intra_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, reset: Tensor | None = None, *,
                     scale: float, chunk_size: int = 64, inverse: bool = False, impl: str | None = None,
                     scratch: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """The intra-chunk quantities of every chunk (module docstring), one program per (chunk, sequence × head).

    q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], reset [B, T] bool or None. Returns tensors over rows
    R = B·H (b-major) and chunks N = ⌈T / C⌉ (the last chunk zero-padded): w, q̃ ("qd"), k̃ ("kd") [R, N, C, K]
    (in `scratch`: fp32, or bf16 with impl "v2" or "v3"), u [R, N, C, V], Aqk ("A") [R, N, C, C], d [R, N, K] (fp32);
    with `inverse` also (I + L)⁻¹ ("M") [R, N, C, C] fp32 (the backward's). impl: `FORWARD`."""
    _check(q, k, v, g, beta, None, reset, chunk_size, "kda_intra_triton")
    impl = _impl(impl)
    if scratch != torch.float32 and (impl == "v1" or scratch != torch.bfloat16):
        raise ValueError(f"kda_intra_triton: scratch={scratch} needs impl='v2' or 'v3' and bfloat16 (or float32)")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    N = -(-T // C)
    R = B * H
    f32 = dict(dtype=torch.float32, device=q.device)
    s16 = dict(dtype=scratch, device=q.device)
    x = dict(w=torch.empty(R, N, C, K, **s16), u=torch.empty(R, N, C, V, **f32), qd=torch.empty(R, N, C, K, **s16),
             kd=torch.empty(R, N, C, K, **s16), A=torch.empty(R, N, C, C, **f32), d=torch.empty(R, N, K, **f32))
    if inverse or impl == "v3":   # "v3" passes L through M on its way to (I + L)⁻¹
        x["M"] = torch.empty(R, N, C, C, **f32)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    rst = reset.to(torch.int32).contiguous() if reset is not None else q   # q: a pointer never read
    args = (q, k, v, g, beta, rst, x["w"], x["u"], x["qd"], x["kd"], x["A"], x["d"], x.get("M", x["A"]), T, H, K,
            V, N, float(scale))
    if impl == "v1":
        cfg = intra_config(C, K, V)
        _intra_kernel[(N, R)](*args, C=C, BC=SUB_CHUNK, BK=cfg["BK"], BV=cfg["BV"], HAS_RESET=reset is not None,
                              INVERSE=inverse, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                              **_dots(q.dtype, "pair", "solve"))
    elif impl == "v2":
        cfg = intra2_config(C, K, V, ieee=q.dtype not in _DT16)
        _intra2_kernel[(N, R)](*args, C=C, BC=SUB_CHUNK, LEVELS=C.bit_length() - 1, BK=cfg["BK"], BV=cfg["BV"],
                               HAS_RESET=reset is not None, INVERSE=inverse, num_warps=cfg["num_warps"],
                               num_stages=cfg["num_stages"], **_dots(q.dtype, "pair", "solve"))
    else:
        cfg = intra3_config(C, K, V, ieee=q.dtype not in _DT16)
        dots = _dots(q.dtype, "pair", "solve")
        blocks = dict(C=C, BC=SUB_CHUNK, HAS_RESET=reset is not None, num_stages=cfg["num_stages"], **dots)
        levels = dict(LOG_BC=SUB_CHUNK.bit_length() - 1 if V3["diag_inverse"] else 0, LEVELS=C.bit_length() - 1)
        if V3["split"]:
            _strips3_kernel[(N * (C // SUB_CHUNK), R)](q, k, g, beta, rst, x["A"], x["M"], T, H, K, N, float(scale),
                                                       BK=cfg["BK"], DIAG=V3["diag_inverse"], num_warps=4, **blocks)
            _solve3_kernel[(N, R)](q, k, v, g, beta, rst, x["w"], x["u"], x["qd"], x["kd"], x["d"], x["M"], T, H, K,
                                   V, N, float(scale), BK=cfg["BKW"], BV=cfg["BV"], num_warps=cfg["num_warps"],
                                   INVERSE=inverse, **levels, **{n: w for n, w in blocks.items() if n != "PAIR"})
        else:
            _intra3_kernel[(N, R)](*args, BK=cfg["BK"], BKW=cfg["BKW"], BV=cfg["BV"], num_warps=cfg["num_warps"],
                                   INVERSE=inverse, **levels, **blocks)
        if not inverse:
            del x["M"]
    return x


def _state_pass(x: dict[str, Tensor], B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, *,
                s0: Tensor | None, identity: bool, with_u: bool, out: Tensor | None,
                states: Tensor | None = None, block_v: int | None = None, launch: dict | None = None) -> Tensor:
    """Run `_state_kernel` over the scratch `x` of `kda_intra_triton`; returns the final state [B, H, K, V].
    `states` [R, N, K, V]: also store the state entering every chunk there, and U_n = u_n − w_n S_n over x["u"].
    block_v: the state columns of a program for 16-bit inputs ("v2"; None: `state_config`'s own); launch: num_warps
    and num_stages over `state_config`'s ("v3")."""
    R, N, C = x["w"].shape[:3]
    cfg = {**state_config(K, V, ieee=dtype not in _DT16, block_v=block_v), **(launch or {})}
    sN = torch.empty(B, H, K, V, dtype=torch.float32, device=x["w"].device)
    s0_ptr = s0.contiguous() if s0 is not None else sN
    mode = 2 if identity else (1 if s0 is not None else 0)
    _state_kernel[(R, triton.cdiv(V, cfg["BV"]))](
        x["w"], x["u"], x["qd"], x["kd"], x["A"], x["d"], s0_ptr, out if out is not None else sN, sN,
        states if states is not None else sN, T, H, K, V, N, C=C, BK=cfg["BK"], BV=cfg["BV"], S0=mode,
        HAS_U=with_u, OUT=out is not None, STORE=states is not None, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **_dots(dtype, "state"))
    return sN


def kda_chunk_fwd_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         initial_state: Tensor | None = None, reset: Tensor | None = None, *, scale: float,
                         chunk_size: int = 64, impl: str | None = None) -> tuple[Tensor, Tensor]:
    """KDA forward as Triton kernels: the contract of `delta_rule.kda_chunk` / `kda_recurrent` for float32 and
    16-bit inputs with bounded gates (g ∈ [−5, 0], module docstring).

    q, k [B, T, H, K] (L2-normalized), v [B, T, H, V] (one dtype: float32, bfloat16 or float16), g [B, T, H, K]
    log-decay, beta [B, T, H], initial_state [B, H, K, V] float32 or None, reset [B, T] bool (the state is zeroed
    before each True token). Returns o [B, T, H, V] in v.dtype and the final state [B, H, K, V] float32.
    impl: "v1", "v2", "v3" or None (`FORWARD`); "v2" takes its options from `V2`, "v3" from `V3`."""
    _check(q, k, v, g, beta, initial_state, reset, chunk_size, "kda_chunk_fwd_triton")
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    if _impl(impl) == "v1":
        x = kda_intra_triton(q, k, v, g, beta, reset, scale=scale, chunk_size=chunk_size, impl="v1")
        sN = _state_pass(x, B, T, H, K, V, q.dtype, s0=initial_state, identity=False, with_u=True, out=o)
        return o, sN
    s16 = q.dtype in _DT16
    opts = V2 if _impl(impl) == "v2" else V3
    scratch = torch.bfloat16 if s16 and opts["scratch"] == "16" else torch.float32
    x = kda_intra_triton(q, k, v, g, beta, reset, scale=scale, chunk_size=chunk_size, impl=_impl(impl),
                         scratch=scratch)
    R, N, C = x["w"].shape[:3]
    states = torch.empty(R, N, K, V, dtype=torch.bfloat16 if s16 and opts["states"] == "16" else torch.float32,
                         device=q.device)
    launch = dict(num_warps=V3["state_warps"], num_stages=V3["state_stages"]) if opts is V3 and s16 else None
    sN = _state_pass(x, B, T, H, K, V, q.dtype, s0=initial_state, identity=False, with_u=True, out=None,
                     states=states, block_v=opts["state_block"], launch=launch)
    _output_pass(x, states, o, q.dtype)
    return o, sN


def _output_pass(x: dict[str, Tensor], states: Tensor, o: Tensor, dtype: torch.dtype) -> None:
    """O_n = q̃_n S_n + Aqk_n U_n into o [B, T, H, V] (`_output_kernel`), from the scratch `x` after a state pass
    that stored S_n into `states` [R, N, K, V] and U_n over x["u"]."""
    R, N, C, K = x["qd"].shape
    B, T, H, V = o.shape
    cfg = output_config(K, V, ieee=dtype not in _DT16)
    dots = _dots(dtype, "state")
    qs = "16" if dtype in _DT16 and x["qd"].dtype == states.dtype == torch.bfloat16 else ""
    _output_kernel[(N, R, triton.cdiv(V, cfg["BV"]))](
        x["qd"], x["A"], x["u"], states, o, T, H, K, V, N, C=C, BK=cfg["BK"], BV=cfg["BV"], QS=qs,
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
    s_zero = _state_pass(x, B, T, H, K, V, q.dtype, s0=None, identity=False, with_u=True, out=None)
    M = _state_pass(x, B, T, H, K, K, q.dtype, s0=None, identity=True, with_u=False, out=None)
    return s_zero, M


def kda_chunk_bwd_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                         reset: Tensor | None, do: Tensor, dsN: Tensor | None, *, scale: float,
                         chunk_size: int = 64, impl: str | None = None
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The gradients of `kda_chunk_fwd_triton`'s (o, final state) w.r.t. q, k, v, g, beta and the initial state,
    given do [B, T, H, V] (the output's gradient) and dsN [B, H, K, V] float32 or None (the final state's).

    Inputs as the forward's (same contract: bounded gates, resets, fp32 / 16-bit). Returns (dq, dk, dv, dg, dbeta,
    dh0), each gradient in its input's dtype (dq, dk, dv in q's; dg and dbeta in g's and beta's, fp32 in the
    layer) and dh0 [B, H, K, V] float32, None without an initial state. Four launches, all state math in fp32:

    1. `kda_intra_triton` again, with (I + L)⁻¹ (M) as well.
    2. The forward state pass, storing every chunk's entering state S_n [R, N, K, V] and U_n over u.
    3. The reverse state pass, per (row, block of state columns), chunks n = N−1..0 from dS_N = dsN:
           dU_n = Aqk_nᵀ dO_n + k̃_n dS_{n+1},    dS_n = q̃_nᵀ dO_n + diag(d_n) dS_{n+1} − w_nᵀ dU_n,
       storing dS_{n+1} and dU_n; dh0 = dS_0.
    4. Per (chunk, row), every token gradient. Through the state: dq̃ = dO S_nᵀ, dk̃ = U dS_{n+1}ᵀ,
       dw = −dU S_nᵀ, dd = Σ_v S_n ⊙ dS_{n+1}, dAqk = dO Uᵀ (on Aqk's pattern). Through the solves
       X = (I + L)⁻¹ R: dR = (I + L)⁻ᵀ dX; dL = −(dR_w wᵀ + dR_u uᵀ) collapses to −dR_u Uᵀ, because
       u = U + w S_n and dR_w = −dR_u S_nᵀ (on L's pattern). Then dv = β dR_u, and the factors
       R_w = β K e^{Γ}, q̃ = s Q e^{Γ}, k̃ = K e^{g(j,C−1]}, d = e^{Γ_{C−1}} and the pairwise sums of L and Aqk give
       dq, dk, dβ and dΓ (the gradient w.r.t. the prefix sums Γ_r: a factor x e^{±Γ} contributes ±x e^{±Γ} times
       its own gradient); dg_t = Σ_{r≥t} dΓ_r, except that the terms of k̃ and d, which span the gates after j
       and all gates, are summed over exactly those (a prefix and a constant), not as differences.
       The pairwise gradients keep the forward's anchoring: query rows of sub-block a meet earlier keys through
       e^{g(n_a, r]} · e^{g(j, n_a]} and its own keys through e^{g(n_a, r]} · e^{−g(n_a, j]} (n_a its first row);
       the transposed sums (key rows of sub-block a against later queries) are the mirror image, anchored at
       its last row m_a: e^{g(j, m_a]} · e^{g(m_a, r]} and e^{g(j, m_a]} · e^{−g(r, m_a]}. Each dot takes the
       whole chunk's dAqk or dL with the rows (or columns) of one sub-block kept, so all of a chunk's gradients
       stay in registers (no scratch round trip), at 4x the minimal pairwise dot work.

    Precision as the forward (`PRECISION`): the pairwise dots "pair", the dots with (I + L)⁻ᵀ and dL "solve",
    those with states, dO, U and dU "state". Scratch: the forward's (w, u, q̃, k̃, Aqk, d) plus M [R, N, C, C],
    S_n and dS_{n+1} [R, N, K, V] and dU [R, N, C, V], all fp32. impl ("v1", "v2", "v3", None: `FORWARD`) picks
    the recompute's intra-chunk kernel and, for "v2" / "v3", the state pass's column blocks (`V2` / `V3`
    ["state_block"])."""
    _check(q, k, v, g, beta, initial_state, reset, chunk_size, "kda_chunk_bwd_triton")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if do.shape != v.shape:
        raise ValueError(f"kda_chunk_bwd_triton: do must be [B, T, H, V] = {list(v.shape)}, got {list(do.shape)}")
    if dsN is not None and (dsN.shape != (B, H, K, V) or dsN.dtype != torch.float32):
        raise ValueError(f"kda_chunk_bwd_triton: dsN must be float32 [B, H, K, V] = {[B, H, K, V]}, got "
                         f"{dsN.dtype} {list(dsN.shape)}")
    impl = _impl(impl)
    x = kda_intra_triton(q, k, v, g, beta, reset, scale=scale, chunk_size=chunk_size, inverse=True, impl=impl)
    R, N, C = x["w"].shape[:3]
    f32 = dict(dtype=torch.float32, device=q.device)
    states = torch.empty(R, N, K, V, **f32)
    _state_pass(x, B, T, H, K, V, q.dtype, s0=initial_state, identity=False, with_u=True, out=None, states=states,
                block_v={"v2": V2, "v3": V3}[impl]["state_block"] if impl != "v1" else None)
    U = x["u"]                                                    # U_n now (the pass wrote it over u)

    dstates = torch.empty(R, N, K, V, **f32)
    dU = torch.empty(R, N, C, V, **f32)
    dh0 = torch.empty(B, H, K, V, **f32) if initial_state is not None else None
    do = do.contiguous()
    dsN = dsN.contiguous() if dsN is not None else None
    cfg = state_config(K, V, ieee=q.dtype not in _DT16)
    _state_bwd_kernel[(R, triton.cdiv(V, cfg["BV"]))](
        x["qd"], x["kd"], x["w"], x["A"], x["d"], do, dsN if dsN is not None else dstates, dstates, dU,
        dh0 if dh0 is not None else dstates, T, H, K, V, N, C=C, BK=cfg["BK"], BV=cfg["BV"],
        HAS_DSN=dsN is not None, HAS_DH0=dh0 is not None, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **_dots(q.dtype, "state"))

    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    dq, dk, dv, dg, dbeta = (torch.empty_like(t) for t in (q, k, v, g, beta))
    rst = reset.to(torch.int32).contiguous() if reset is not None else q
    cfg = intra_bwd_config(C, K, V)
    _intra_bwd_kernel[(N, R)](
        q, k, v, g, beta, rst, x["M"], U, states, dstates, dU, do, dq, dk, dv, dg, dbeta, T, H, K, V, N,
        float(scale), C=C, BC=SUB_CHUNK, BK=cfg["BK"], BV=cfg["BV"], HAS_RESET=reset is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_dots(q.dtype, "pair", "solve", "state"))
    return dq, dk, dv, dg, dbeta, dh0
