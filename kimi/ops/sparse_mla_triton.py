"""Triton kernels of the sparse attention contract `kimi::sparse_mla_gather` (+ `_bwd`), the absorbed latent form
(docs/numerics.md#sparse-attention-contract), beside their reference in `sparse_attention.py`.

    z[t, h, j] = σ q[t, h] · latent[idx[t, j]]     over the slots j with idx[t, j] >= 0
    o[t, h]    = Σ_j softmax_j(z) latent[idx[t, j], :d_v],    lse[t, h] = log Σ_j e^z  (natural log, fp32)

q [B, T, H, D], latent [B, S, D] (one head shared by all query heads), indices int32 [B, T, k]. The latent
columns split into the values [0, d_v) and the tail [d_v, D) (the rope part: 512 + 64 in the release); both
enter the scores, only the values the output. Widths are kernel parameters, padded to powers of two (16 at least)
and masked, so the tests run narrow latents through the interpreter.

**Forward** (`_fwd_chunks_kernel`). One program per (query, head tile[, key split]). It loads its head tile's
query once and walks the query's index row 64 (`block_k`) slots at a time: the slots' latent rows are gathered by
pointer arithmetic (Hopper has no TMA gather; the loads pipeline as cp.async), the scores are a chain of dots over
the value chunks and the tail, and an online softmax in base 2 (σ·log2 e folded into one factor) accumulates
p·values in fp32. Slots past the row's last valid index are never visited (one pass over the index row first),
so the short causal rows of a prefill cost what they hold. The output is divided once at the end. A row without a
valid index gives o = 0 and lse = −inf, as the reference's `logsumexp` does.

The value columns are gathered as `value_chunks` (1, 2 or 4) separate tiles, each with its own [heads, d_v /
chunks] accumulator: Triton lays a [64, 512] gathered tile out one 16-byte vector a row per thread, so every thread
forms 32 row addresses a step, where [64, 256] tiles take 16 and the chunks share them. Row offsets are 32-bit
when the latent has fewer than 2^31 elements. With `lazy_rescale` the accumulators are rescaled only when some
head's running max grew by more than 2^8 since the last rescale (one uniform branch a step); otherwise p is formed
against the older max (p ≤ 2^8, well inside bf16's range) and the final division by l cancels the difference.

Heads: Triton block dims are powers of two, so 96 heads run as tiles that cover them exactly: three 32-head tiles
in one launch (the default), or a 64-head and a 32-head launch. Every head tile gathers the query's rows again
(mostly from L2: the tiles of one query are neighbours in the grid), so per query the gathered traffic is
(tiles × k × D × 2 B): 3 × 2.4 MB at k = 2048 in bf16 for 32-head tiles, 2 × for 64 + 32, against
2·H·k·(D + d_v) = 0.43 GFLOP. Wider tiles read less but hold a wider fp32 accumulator beside a wider q (a 32-head
tile at 4 warps already fills 255 registers). Two earlier forwards, one [64, 512] value tile a step and the dots
transposed with the slots on wgmma's M side, were slower on Hopper and are gone (docs/performance.md, sparse
rounds 2-9).

**Decode** (`splits` > 1). With few queries (T = 1..4, batch 1..32) the programs above do not fill the GPU, so
the index row is split into `splits` key ranges; each writes a normalized partial output and its LSE in fp32, and
`_merge_kernel` combines them (weights e^{lse_i − lse}). Splits are chosen from the shapes alone and nothing is
read back to the host, so the launch can be captured in a CUDA graph.

**Backward**, two kernels, so that neither holds both gradients:

- `_bwd_dq_kernel`, per (query, head tile), the forward's tiling: recompute p = 2^{s·σ log2 e − lse log2 e}
  from the saved LSE, Δ = Σ_v do ⊙ o − dlse (computed here and saved for the next kernel), dp = do·vᵀ,
  ds = σ p ⊙ (dp − Δ); dq += ds·kv over the key blocks, written once in q's dtype.
- `_bwd_dkv_kernel`, per (query, block of `dkv_block_k` slots): gathers its latent rows once and loops over all
  heads in tiles, recomputing s, p, dp, ds, and accumulating dkv = dsᵀ q + pᵀ do (values) in fp32 for the whole
  head range; then one fp32 atomic add per element into a [B, S, D] fp32 buffer (rounded to the latent's dtype
  at the end). Summing all 96 heads before the atomics cuts them 3× against per-head-tile atomics; the price is
  s and dp computed in both kernels (1.4× the FLOPs of a fused backward: 2·(4·D + 3·d_v) per (head, slot)
  against 2·(3·D + 2·d_v)) and q, do re-read per key block (L2). This pair is the fp32 path's.
- `dkv_gemm=True`: no recomputation at all. The dq kernel also writes the ds and p it rounds for its dots
  (q's dtype, [rows, K, 2·H]: 2·H·2 bytes a slot, a chunk of queries at a time) and `_bwd_dkv_gemm_kernel`, per
  (query, block of slots, block of columns), forms dkv = [ds | p]·[q; do] (K = 2·H stacked heads) over the value
  columns and ds·q over the tail, then the same fp32 atomics (or the deterministic per-slot rows). The FLOPs are
  the minimal 2·(3·D + 2·d_v) per (head, slot); the price is the buffer's write and read (the default in
  16-bit). `gemm_dq`: one program per (query, block of columns) walking the query's slots instead, adding dkv as
  above and forming dq = dsᵀ·kv over its columns in registers (written once, no atomics; each selected row
  gathered once more, for all heads); the dq kernels then only compute and store ds and p, without the dq
  accumulator that made them spill. `pds_all_heads`: ds and p from `_bwd_pds_kernel` instead, one program per
  query for all heads (each selected row gathered once, not once per head tile), each step of slots a GEMM main
  loop over the latent's columns with the gathered rows, q and do streamed through shared memory; `pds_dlat`:
  that kernel also adds dlatent in a second pass over the columns (ds and p the register operand) and the GEMM
  forms dq only. That last arrangement is the 16-bit default up to 128 heads.
- `deterministic=True`: the dkv kernel writes each (query, slot)'s row to an fp32 buffer instead (queries in
  chunks of at most 2^28 elements, as the reference's blocks), the chunk's slots are sorted by key (stable), and
  `_dkv_reduce_kernel` (one program per latent row) sums its run in that fixed order and adds it to the row;
  chunks run in order. Bitwise reproducible, at twice the dkv memory traffic plus a sort per chunk.

**Transposed dq kernel** (`slot_major`: the default in 16-bit beyond 128 heads). A head tile of 32 rows is below
wgmma's M of 64 a warpgroup, so `_bwd_dq_kernel` runs mma.sync at 32 heads; `_bwd_dq_kernel_sm` puts the slots on M
instead (s^T = kv·q^T), with q^T, do^T, ds^T as shared-memory operands. Same contract and numerics up to fp32
summation order. Variants measured slower and retired (docs/performance.md): the dq kernel adding dlatent itself,
a transposed dlatent kernel, a dlatent GEMM walking the columns, and the per-query kernel's two passes merged
across steps.

Precision: fp32 accumulation everywhere. bf16 (fp16) inputs go to the tensor cores as they are; p and ds are
rounded to the input dtype before their second dot (as every flash kernel does), which is most of the ~1e-3
difference from the fp32 reference. fp32 inputs run IEEE fp32 dots (parity tests), as do bf16 inputs under the
interpreter, whose 16-bit dot is wrong (triton 3.9). Offsets are formed in 64 bits (indices widened first), but
the forward's latent row offsets are 32-bit when the latent has fewer than 2^31 elements. Indices outside
[0, S) count as empty slots (the reference would raise).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .registry import interpreted, sm_count, tl, triton, triton_available

LOG2E = 1.4426950408889634
DKV_CHUNK_ELEMENTS = 1 << 28
"""The deterministic backward's per-slot buffer holds at most this many fp32 elements (1 GiB) at a time."""
PDS_CHUNK_ELEMENTS = 1 << 28
"""`BwdConfig.dkv_gemm`'s ds and p buffer holds at most this many elements (512 MiB in bf16) at a time."""

if triton is not None:
    @triton.jit
    def _mm(a, b, acc, F32: tl.constexpr):
        """acc + a @ b: in IEEE fp32 when F32 (fp32 inputs, or 16-bit ones under the interpreter), else on the
        tensor cores in the inputs' dtype."""
        if F32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _key_end(idx_row, k_lo, k_hi, S, IB: tl.constexpr):
        """One past the last slot of [k_lo, k_hi) holding a valid index (k_lo when none holds one)."""
        best = tl.zeros([IB], tl.int32)
        for c0 in range(k_lo, k_hi, IB):
            sl = c0 + tl.arange(0, IB)
            ix = tl.load(idx_row + sl, mask=sl < k_hi, other=-1)
            best = tl.maximum(best, tl.where((ix >= 0) & (ix < S), sl + 1, 0))
        return tl.maximum(tl.max(best, 0), k_lo)

    @triton.jit
    def _gather_rows(b, idx_row, k0, k_end, S, D, BK: tl.constexpr, OFF64: tl.constexpr = True):
        """The slots [k0, k0 + BK) of batch row b: validity [BK] and the offsets of their latent rows in [B, S, D]
        (row 0 for empty slots), 64-bit, or 32-bit without OFF64 (a latent of fewer than 2^31 elements: fewer
        registers a row)."""
        slot = k0 + tl.arange(0, BK)
        ix = tl.load(idx_row + slot, mask=slot < k_end, other=-1)
        valid = (ix >= 0) & (ix < S)
        if OFF64:  # one return statement: Triton 3.6 checks every return's type, taken branch or not
            off = (b * S + tl.where(valid, ix, 0).to(tl.int64)) * D
        else:
            off = (b.to(tl.int32) * S + tl.where(valid, ix, 0)) * D
        return valid, off

    @triton.jit
    def _fwd_program(NT, NS):
        """This forward program's (head tile, key split, row = b·T + t), head tile fastest: the tiles of one query
        run side by side and share its gathered rows through L2."""
        pid = tl.program_id(0).to(tl.int64)
        rest = pid // NT
        return pid % NT, rest % NS, rest // NS

    @triton.jit
    def _cols(row_ptr, rows_ok, c, lim, FULL: tl.constexpr):
        """The columns c of the rows at row_ptr [rows] (zeros on rows not rows_ok and, unless FULL, at c >= lim)."""
        if FULL:
            return tl.load(row_ptr[:, None] + c[None, :], mask=rows_ok[:, None], other=0.0)
        return tl.load(row_ptr[:, None] + c[None, :], mask=rows_ok[:, None] & (c[None, :] < lim), other=0.0)

    @triton.jit
    def _fwd_chunks_kernel(q_ptr, lat_ptr, idx_ptr, o_ptr, lse_ptr, R, T, S, H, K, D, DV, h_start, NT, NS, KS,
                           scale2, BH: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NC: tl.constexpr,
                           DTP: tl.constexpr, IB: tl.constexpr, F32: tl.constexpr, LAZY: tl.constexpr,
                           FULL: tl.constexpr, OFF64: tl.constexpr):
        # program (query, head tile[, key split]) of the module docstring's forward, the value columns in NC (1, 2
        # or 4) chunks of CW: each chunk's gathered tile has a layout whose threads hold few rows (one offset serves
        # every chunk: [64, 256] tiles hold 16 rows a thread where one [64, 512] tile holds 32) and its own
        # accumulator. (The scores as two chains of dots summed compile to the same code: Triton folds a sum of dots
        # into one accumulator chain.)
        # LAZY: the accumulators are rescaled only when some head's running max grew by more than 2^8 (a uniform
        # branch); otherwise p is taken against the old max (p <= 2^8: exact in the dots' dtypes' range).
        # FULL: the widths are exactly BV and DTP (no column masks).
        CW: tl.constexpr = BV // NC
        tile, split, row = _fwd_program(NT, NS)
        h = h_start + tile * BH + tl.arange(0, BH)
        hm = h < H
        q_row = q_ptr + (row * H + h) * D
        idx_row = idx_ptr + row * K
        cw = tl.arange(0, CW)
        ct = DV + tl.arange(0, DTP)
        q_t = _cols(q_row, hm, ct, D, FULL)
        q0 = _cols(q_row, hm, cw, DV, FULL)
        q1 = q0
        q2 = q0
        q3 = q0
        if NC >= 2:
            q1 = _cols(q_row, hm, CW + cw, DV, FULL)
        if NC >= 4:
            q2 = _cols(q_row, hm, 2 * CW + cw, DV, FULL)
            q3 = _cols(q_row, hm, 3 * CW + cw, DV, FULL)
        k_lo = (split * KS).to(tl.int32)
        k_end = _key_end(idx_row, k_lo, tl.minimum(k_lo + KS, K), S, IB)
        m = tl.full([BH], float("-inf"), tl.float32)
        m_use = tl.zeros([BH], tl.float32)
        l = tl.zeros([BH], tl.float32)
        acc0 = tl.zeros([BH, CW], tl.float32)
        acc1 = tl.zeros([BH, CW], tl.float32)
        acc2 = tl.zeros([BH, CW], tl.float32)
        acc3 = tl.zeros([BH, CW], tl.float32)
        for k0 in range(k_lo, k_end, BK):
            valid, kv_off = _gather_rows(row // T, idx_row, k0, k_end, S, D, BK, OFF64)
            kv_row = lat_ptr + kv_off
            kt = _cols(kv_row, valid, ct, D, FULL)
            k0v = _cols(kv_row, valid, cw, DV, FULL)
            s = _mm(q0, tl.trans(k0v), _mm(q_t, tl.trans(kt), tl.zeros([BH, BK], tl.float32), F32), F32)
            k1v = k0v
            k2v = k0v
            k3v = k0v
            if NC >= 2:
                k1v = _cols(kv_row, valid, CW + cw, DV, FULL)
                s = _mm(q1, tl.trans(k1v), s, F32)
                if NC >= 4:
                    k2v = _cols(kv_row, valid, 2 * CW + cw, DV, FULL)
                    k3v = _cols(kv_row, valid, 3 * CW + cw, DV, FULL)
                    s = _mm(q3, tl.trans(k3v), _mm(q2, tl.trans(k2v), s, F32), F32)
            s = tl.where(valid[None, :], s * scale2, float("-inf"))     # scaled first: any sign of the scale
            m_new = tl.maximum(m, tl.max(s, 1))
            if LAZY:
                grow = m_new - m > 8.0      # exact near m (m + 8 may round up to the next float past 2^26)
                if tl.max(grow.to(tl.int32), 0) > 0:
                    m_next = tl.where(grow, m_new, m)
                    m_use, l, acc0, acc1, acc2, acc3 = _rescale(m, m_next, l, acc0, acc1, acc2, acc3, NC)
                    m = m_next
            else:
                m_use, l, acc0, acc1, acc2, acc3 = _rescale(m, m_new, l, acc0, acc1, acc2, acc3, NC)
                m = m_new
            p = tl.exp2(s - m_use[:, None])
            l = l + tl.sum(p, 1)
            p = p.to(k0v.dtype)
            acc0 = _mm(p, k0v, acc0, F32)
            if NC >= 2:
                acc1 = _mm(p, k1v, acc1, F32)
            if NC >= 4:
                acc2 = _mm(p, k2v, acc2, F32)
                acc3 = _mm(p, k3v, acc3, F32)
        ok = l > 0
        inv = tl.where(ok, 1.0 / tl.where(ok, l, 1.0), 0.0)[:, None]
        lse = tl.where(ok, (m + tl.log2(tl.where(ok, l, 1.0))) * 0.6931471805599453, float("-inf"))
        out = split * R + row
        o_row = o_ptr + (out * H + h) * DV
        _store_cols(o_row, hm, cw, DV, acc0 * inv, FULL)
        if NC >= 2:
            _store_cols(o_row, hm, CW + cw, DV, acc1 * inv, FULL)
        if NC >= 4:
            _store_cols(o_row, hm, 2 * CW + cw, DV, acc2 * inv, FULL)
            _store_cols(o_row, hm, 3 * CW + cw, DV, acc3 * inv, FULL)
        tl.store(lse_ptr + out * H + h, lse, mask=hm)

    @triton.jit
    def _rescale(m, m_next, l, acc0, acc1, acc2, acc3, NC: tl.constexpr):
        """The online softmax's move from the running max m to m_next: (the max p is taken against, 0 while no key
        has come; l and the NC accumulators scaled by 2^{m − m_next})."""
        m_use = tl.where(m_next == float("-inf"), 0.0, m_next)
        alpha = tl.exp2(m - m_use)
        acc0 = acc0 * alpha[:, None]
        if NC >= 2:
            acc1 = acc1 * alpha[:, None]
        if NC >= 4:
            acc2 = acc2 * alpha[:, None]
            acc3 = acc3 * alpha[:, None]
        return m_use, l * alpha, acc0, acc1, acc2, acc3

    @triton.jit
    def _store_cols(row_ptr, rows_ok, c, lim, x, FULL: tl.constexpr):
        if FULL:
            tl.store(row_ptr[:, None] + c[None, :], x.to(row_ptr.dtype.element_ty), mask=rows_ok[:, None])
        else:
            tl.store(row_ptr[:, None] + c[None, :], x.to(row_ptr.dtype.element_ty),
                     mask=rows_ok[:, None] & (c[None, :] < lim))

    @triton.jit
    def _merge_kernel(op_ptr, lp_ptr, o_ptr, lse_ptr, RH, NS, DV, NSP: tl.constexpr, BC: tl.constexpr,
                      NC: tl.constexpr):
        # one program per (row, head): the splits' normalized partials weighted by e^{lse_i − lse}
        r = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, NSP).to(tl.int64)
        jm = j < NS
        lj = tl.load(lp_ptr + j * RH + r, mask=jm, other=float("-inf"))
        mx = tl.max(lj, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp(lj - mx)
        tot = tl.sum(w, 0)
        ok = tot > 0
        tot = tl.where(ok, tot, 1.0)
        w = w * tl.where(ok, 1.0 / tot, 0.0)
        for c in tl.static_range(NC):
            cc = c * BC + tl.arange(0, BC)
            part = tl.load(op_ptr + (j * RH + r)[:, None] * DV + cc[None, :], mask=jm[:, None] & (cc[None, :] < DV),
                           other=0.0)
            tl.store(o_ptr + r * DV + cc, tl.sum(part * w[:, None], 0).to(o_ptr.dtype.element_ty), mask=cc < DV)
        tl.store(lse_ptr + r, tl.where(ok, mx + tl.log(tot), float("-inf")))

    @triton.jit
    def _delta_lse2(do, o, AXIS: tl.constexpr, dlse_ptr, delta_ptr, lse_ptr, qh, hm, HAS_DLSE: tl.constexpr):
        """The dq kernels' per-head Δ = Σ_v do ⊙ o − dlse (stored for the dlatent kernel; the value columns along
        AXIS of the do, o tiles) and the LSE in base 2 (0 for a row without keys)."""
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), AXIS)
        if HAS_DLSE:
            delta -= tl.load(dlse_ptr + qh, mask=hm, other=0.0).to(tl.float32)
        tl.store(delta_ptr + qh, delta, mask=hm)
        lse = tl.load(lse_ptr + qh, mask=hm, other=0.0)
        return delta, tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634

    @triton.jit
    def _bwd_dq_kernel(q_ptr, lat_ptr, idx_ptr, o_ptr, lse_ptr, do_ptr, dlse_ptr, dq_ptr, delta_ptr, pds_ptr,
                       row0, T, S, H, K, D, DV, h_start, NT, scale, scale2, BH: tl.constexpr, BK: tl.constexpr,
                       DVP: tl.constexpr, DTP: tl.constexpr, IB: tl.constexpr, HAS_DLSE: tl.constexpr,
                       PDS: tl.constexpr, DQ: tl.constexpr, F32: tl.constexpr):
        # PDS: also ds and p of every visited slot into the chunk's [rows, K, 2·H] buffer (rows from row0), for
        # `_bwd_dkv_gemm_kernel`
        pid = tl.program_id(0).to(tl.int64)
        tile = pid % NT
        local = pid // NT
        row = row0 + local
        h = h_start + tile * BH + tl.arange(0, BH)
        hm = h < H
        qh = row * H + h
        idx_row = idx_ptr + row * K
        cv = tl.arange(0, DVP)
        ct = DV + tl.arange(0, DTP)
        m_v = hm[:, None] & (cv[None, :] < DV)
        m_t = hm[:, None] & (ct[None, :] < D)
        q_v = tl.load(q_ptr + (qh * D)[:, None] + cv[None, :], mask=m_v, other=0.0)
        q_t = tl.load(q_ptr + (qh * D)[:, None] + ct[None, :], mask=m_t, other=0.0)
        do = tl.load(do_ptr + (qh * DV)[:, None] + cv[None, :], mask=m_v, other=0.0)
        o = tl.load(o_ptr + (qh * DV)[:, None] + cv[None, :], mask=m_v, other=0.0)
        delta, lse2 = _delta_lse2(do, o, 1, dlse_ptr, delta_ptr, lse_ptr, qh, hm, HAS_DLSE)
        dq_v = tl.zeros([BH, DVP], tl.float32)
        dq_t = tl.zeros([BH, DTP], tl.float32)
        k_end = _key_end(idx_row, 0, K, S, IB)
        for k0 in range(0, k_end, BK):
            valid, kv_off = _gather_rows(row // T, idx_row, k0, k_end, S, D, BK)
            kv_row = lat_ptr + kv_off
            kv_v = tl.load(kv_row[:, None] + cv[None, :], mask=valid[:, None] & (cv[None, :] < DV), other=0.0)
            kv_t = tl.load(kv_row[:, None] + ct[None, :], mask=valid[:, None] & (ct[None, :] < D), other=0.0)
            s = _mm(q_v, tl.trans(kv_v), _mm(q_t, tl.trans(kv_t), tl.zeros([BH, BK], tl.float32), F32), F32)
            keep = valid[None, :] & hm[:, None]
            p = tl.where(keep, tl.exp2(s * scale2 - lse2[:, None]), 0.0)
            dp = _mm(do, tl.trans(kv_v), tl.zeros([BH, BK], tl.float32), F32)
            ds = (p * (dp - delta[:, None]) * scale).to(kv_v.dtype)
            if DQ:
                dq_v = _mm(ds, kv_v, dq_v, F32)
                dq_t = _mm(ds, kv_t, dq_t, F32)
            if PDS:
                slot = k0 + tl.arange(0, BK)
                dst = pds_ptr + ((local * K + slot) * (2 * H))[None, :] + h[:, None]
                pm = hm[:, None] & (slot < K)[None, :]
                tl.store(dst, ds, mask=pm)
                tl.store(dst + H, p.to(ds.dtype), mask=pm)
        if DQ:
            tl.store(dq_ptr + (qh * D)[:, None] + cv[None, :], dq_v.to(dq_ptr.dtype.element_ty), mask=m_v)
            tl.store(dq_ptr + (qh * D)[:, None] + ct[None, :], dq_t.to(dq_ptr.dtype.element_ty), mask=m_t)

    @triton.jit
    def _bwd_dkv_kernel(q_ptr, lat_ptr, idx_ptr, lse_ptr, do_ptr, delta_ptr, out_ptr, row0, NKB, T, S, H, K, D, DV,
                        scale, scale2, BK: tl.constexpr, BH: tl.constexpr, DVP: tl.constexpr, DTP: tl.constexpr,
                        ATOMIC: tl.constexpr, F32: tl.constexpr):
        # program -> (row = row0 + local, key block), key block fastest: the programs of one query share its q, do
        local = tl.program_id(0).to(tl.int64)
        kb = local % NKB
        local = local // NKB
        row = row0 + local
        b = row // T
        slot = kb * BK + tl.arange(0, BK)
        ix = tl.load(idx_ptr + row * K + slot, mask=slot < K, other=-1)
        valid = (ix >= 0) & (ix < S)
        key = b * S + tl.where(valid, ix, 0).to(tl.int64)
        cv = tl.arange(0, DVP)
        ct = DV + tl.arange(0, DTP)
        m_v = valid[:, None] & (cv[None, :] < DV)
        m_t = valid[:, None] & (ct[None, :] < D)
        kv_v = tl.load(lat_ptr + (key * D)[:, None] + cv[None, :], mask=m_v, other=0.0)
        kv_t = tl.load(lat_ptr + (key * D)[:, None] + ct[None, :], mask=m_t, other=0.0)
        acc_v = tl.zeros([BK, DVP], tl.float32)
        acc_t = tl.zeros([BK, DTP], tl.float32)
        heads = tl.where(tl.max(valid.to(tl.int32), 0) > 0, H, 0)   # a block of empty slots skips the work
        for h0 in range(0, heads, BH):
            h = h0 + tl.arange(0, BH)
            hm = h < H
            qh = row * H + h
            q_v = tl.load(q_ptr + (qh * D)[:, None] + cv[None, :], mask=hm[:, None] & (cv[None, :] < DV), other=0.0)
            q_t = tl.load(q_ptr + (qh * D)[:, None] + ct[None, :], mask=hm[:, None] & (ct[None, :] < D), other=0.0)
            do = tl.load(do_ptr + (qh * DV)[:, None] + cv[None, :], mask=hm[:, None] & (cv[None, :] < DV),
                         other=0.0)
            lse = tl.load(lse_ptr + qh, mask=hm, other=0.0)
            lse2 = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634
            delta = tl.load(delta_ptr + qh, mask=hm, other=0.0)
            s = _mm(q_v, tl.trans(kv_v), _mm(q_t, tl.trans(kv_t), tl.zeros([BH, BK], tl.float32), F32), F32)
            p = tl.where(valid[None, :] & hm[:, None], tl.exp2(s * scale2 - lse2[:, None]), 0.0)
            dp = _mm(do, tl.trans(kv_v), tl.zeros([BH, BK], tl.float32), F32)
            ds_t = tl.trans(p * (dp - delta[:, None]) * scale).to(kv_v.dtype)     # [BK, BH]
            acc_v = _mm(tl.trans(p).to(kv_v.dtype), do, _mm(ds_t, q_v, acc_v, F32), F32)
            acc_t = _mm(ds_t, q_t, acc_t, F32)
        if ATOMIC:
            tl.atomic_add(out_ptr + (key * D)[:, None] + cv[None, :], acc_v, mask=m_v, sem="relaxed")
            tl.atomic_add(out_ptr + (key * D)[:, None] + ct[None, :], acc_t, mask=m_t, sem="relaxed")
        else:   # this chunk's row of the (query, slot) buffer
            e = local * K + slot
            tl.store(out_ptr + (e * D)[:, None] + cv[None, :], acc_v, mask=m_v)
            tl.store(out_ptr + (e * D)[:, None] + ct[None, :], acc_t, mask=m_t)

    @triton.jit
    def _bwd_dq_kernel_sm(q_ptr, lat_ptr, idx_ptr, o_ptr, lse_ptr, do_ptr, dlse_ptr, dq_ptr, delta_ptr, pds_ptr,
                          row0, T, S, H, K, D, DV, h_start, NT, scale, scale2, BH: tl.constexpr, BK: tl.constexpr,
                          DVP: tl.constexpr, DTP: tl.constexpr, IB: tl.constexpr, HAS_DLSE: tl.constexpr,
                          PDS: tl.constexpr, DQ: tl.constexpr, F32: tl.constexpr):
        # `_bwd_dq_kernel` transposed (`slot_major`): s^T, dp^T, ds^T [BK, BH] with the slots on M, and
        # dq^T += kv^T·ds^T [D, BH]; q^T, do^T and ds^T are the dots' shared-memory B operands
        pid = tl.program_id(0).to(tl.int64)
        tile = pid % NT
        local = pid // NT
        row = row0 + local
        h = h_start + tile * BH + tl.arange(0, BH)
        hm = h < H
        qh = row * H + h
        idx_row = idx_ptr + row * K
        cv = tl.arange(0, DVP)
        ct = DV + tl.arange(0, DTP)
        m_v = hm[None, :] & (cv[:, None] < DV)
        m_t = hm[None, :] & (ct[:, None] < D)
        qT_v = tl.load(q_ptr + (qh * D)[None, :] + cv[:, None], mask=m_v, other=0.0)      # [DVP, BH]
        qT_t = tl.load(q_ptr + (qh * D)[None, :] + ct[:, None], mask=m_t, other=0.0)
        doT = tl.load(do_ptr + (qh * DV)[None, :] + cv[:, None], mask=m_v, other=0.0)
        oT = tl.load(o_ptr + (qh * DV)[None, :] + cv[:, None], mask=m_v, other=0.0)
        delta, lse2 = _delta_lse2(doT, oT, 0, dlse_ptr, delta_ptr, lse_ptr, qh, hm, HAS_DLSE)
        dqT_v = tl.zeros([DVP, BH], tl.float32)
        dqT_t = tl.zeros([DTP, BH], tl.float32)
        k_end = _key_end(idx_row, 0, K, S, IB)
        for k0 in range(0, k_end, BK):
            valid, kv_off = _gather_rows(row // T, idx_row, k0, k_end, S, D, BK)
            kv_row = lat_ptr + kv_off
            kv_v = tl.load(kv_row[:, None] + cv[None, :], mask=valid[:, None] & (cv[None, :] < DV), other=0.0)
            kv_t = tl.load(kv_row[:, None] + ct[None, :], mask=valid[:, None] & (ct[None, :] < D), other=0.0)
            s = _mm(kv_v, qT_v, _mm(kv_t, qT_t, tl.zeros([BK, BH], tl.float32), F32), F32)
            keep = valid[:, None] & hm[None, :]
            p = tl.where(keep, tl.exp2(s * scale2 - lse2[None, :]), 0.0)
            dp = _mm(kv_v, doT, tl.zeros([BK, BH], tl.float32), F32)
            ds = (p * (dp - delta[None, :]) * scale).to(kv_v.dtype)                      # [BK, BH]
            if DQ:
                dqT_v = _mm(tl.trans(kv_v), ds, dqT_v, F32)
                dqT_t = _mm(tl.trans(kv_t), ds, dqT_t, F32)
            if PDS:     # this step's rows of the [rows, K, 2·H] buffer: ds, then p (see `_bwd_dq_kernel`)
                slot = k0 + tl.arange(0, BK)
                dst = pds_ptr + ((local * K + slot) * (2 * H))[:, None] + h[None, :]
                pm = (slot < K)[:, None] & hm[None, :]
                tl.store(dst, ds, mask=pm)
                tl.store(dst + H, p.to(ds.dtype), mask=pm)
        if DQ:
            # the store's mask and addresses formed here in their own terms: written as the loads' are, CSE would
            # merge them and hold them in registers across the loop
            hs = hm & (h >= 0)
            dst = dq_ptr + qh * D
            tl.store(dst[None, :] + cv[:, None], dqT_v.to(dq_ptr.dtype.element_ty),
                     mask=hs[None, :] & (cv[:, None] < DV))
            tl.store(dst[None, :] + ct[:, None], dqT_t.to(dq_ptr.dtype.element_ty),
                     mask=hs[None, :] & (ct[:, None] < D))

    @triton.jit
    def _bwd_dkv_gemm_kernel(pds_ptr, q_ptr, do_ptr, idx_ptr, out_ptr, row0, NKB, NCB, c_lo, c_hi, J, T, S, H, K, D,
                             DV, BK: tl.constexpr, BN: tl.constexpr, BJ: tl.constexpr, ATOMIC: tl.constexpr,
                             F32: tl.constexpr):
        # dlatent of BK slots of one query over the columns [c_lo, c_hi), from the dq kernels' ds and p (`PDS`):
        #   dkv[slot, c] = Σ_j a[slot, j] · b[j, c],   a = [ds | p] (a row of the [rows, K, 2·H] buffer),
        #                                               b = [q; do] (rows j < H: q of head j, else do of head j − H)
        # over j < J: 2·H for value columns, H for the tail (no do there). No scores are recomputed.
        # program -> (row = row0 + local, key block, column block), column block fastest (they share a, then b)
        pid = tl.program_id(0).to(tl.int64)
        cb = pid % NCB
        rest = pid // NCB
        kb = rest % NKB
        local = rest // NKB
        row = row0 + local
        slot = kb * BK + tl.arange(0, BK)
        ix = tl.load(idx_ptr + row * K + slot, mask=slot < K, other=-1)
        valid = (ix >= 0) & (ix < S)
        key = row // T * S + tl.where(valid, ix, 0).to(tl.int64)
        c = c_lo + cb * BN + tl.arange(0, BN)
        cm = c < c_hi
        a_row = pds_ptr + (local * K + slot) * (2 * H)
        acc = tl.zeros([BK, BN], tl.float32)
        for j0 in range(0, tl.where(tl.max(valid.to(tl.int32), 0) > 0, J, 0), BJ):    # empty blocks skip
            j = j0 + tl.arange(0, BJ)
            jm = j < J
            a = tl.load(a_row[:, None] + j[None, :], mask=valid[:, None] & jm[None, :], other=0.0)
            src = tl.where(j < H, q_ptr + (row * H + j) * D, do_ptr + (row * H + j - H) * DV)
            b = tl.load(src[:, None] + c[None, :], mask=jm[:, None] & cm[None, :], other=0.0)
            acc = _mm(a, b, acc, F32)
        ok = valid & (slot >= 0)        # formed here in their own terms (see `_bwd_dq_kernel_sm`'s dq store)
        om = ok[:, None] & (c[None, :] < c_hi)
        if ATOMIC:
            tl.atomic_add(out_ptr + (key * D)[:, None] + c[None, :], acc, mask=om, sem="relaxed")
        else:
            tl.store(out_ptr + ((local * K + slot) * D)[:, None] + c[None, :], acc, mask=om)

    @triton.jit
    def _delta_heads(o_ptr, do_ptr, dlse_ptr, lse_ptr, qh, hm, DV, BC: tl.constexpr, HAS_DLSE: tl.constexpr):
        """Δ = Σ_v do ⊙ o − dlse of the heads qh (rows of [R·H, DV]) over BC-wide column blocks, and the LSE in
        base 2 (0 for a row without keys)."""
        delta = tl.zeros(qh.shape, tl.float32)
        for c0 in range(0, DV, BC):
            c = c0 + tl.arange(0, BC)
            m = hm[:, None] & (c < DV)[None, :]
            do = tl.load(do_ptr + (qh * DV)[:, None] + c[None, :], mask=m, other=0.0)
            o = tl.load(o_ptr + (qh * DV)[:, None] + c[None, :], mask=m, other=0.0)
            delta += tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        if HAS_DLSE:
            delta -= tl.load(dlse_ptr + qh, mask=hm, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + qh, mask=hm, other=0.0)
        return delta, tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634

    @triton.jit
    def _bwd_pds_kernel(q_ptr, lat_ptr, idx_ptr, o_ptr, lse_ptr, do_ptr, dlse_ptr, pds_ptr, out_ptr, row0, T, S, H, K,
                        D, DV, scale, scale2, BK: tl.constexpr, BC: tl.constexpr, HA: tl.constexpr, HB: tl.constexpr,
                        IB: tl.constexpr, HAS_DLSE: tl.constexpr, DLAT: tl.constexpr, BN: tl.constexpr,
                        ONE_LOOP: tl.constexpr, ATOMIC: tl.constexpr, F32: tl.constexpr):
        # `pds_all_heads`: ds and p of every head of one query, BK slots a step, for `_bwd_dkv_dq_gemm_kernel`. Per
        # step a GEMM main loop over the latent's columns BC at a time, the slots on M:
        #   s^T[slot, h] += kv[slot, c]·q^T[c, h],   dp^T[slot, h] += kv[slot, c]·do^T[c, h]  (c < DV)
        # with the gathered rows, q^T and do^T all streamed through shared memory (nothing resident but the
        # [BK, heads] accumulators), the heads as a group of HA and one of HB (see `_bwd_dkv_dq_gemm_kernel`):
        # each selected row is gathered once for all heads. Then p, ds as the dq kernels form them, stored. DLAT
        # (`pds_dlat`): also these slots' dlatent, [ds | p]·[q; do] with [ds | p] the register A operand and q, do
        # streamed BN columns at a time, into out_ptr as `_bwd_dkv_dq_gemm_kernel` does (then p is not stored and
        # that kernel only forms dq).
        local = tl.program_id(0).to(tl.int64)
        row = row0 + local
        idx_row = idx_ptr + row * K
        ha = tl.arange(0, HA)
        ma = ha < H
        qa = row * H + ha
        delta_a, lse2_a = _delta_heads(o_ptr, do_ptr, dlse_ptr, lse_ptr, qa, ma, DV, BC, HAS_DLSE)
        if HB > 0:
            hb = HA + tl.arange(0, HB)
            mb = hb < H
            qb = row * H + hb
            delta_b, lse2_b = _delta_heads(o_ptr, do_ptr, dlse_ptr, lse_ptr, qb, mb, DV, BC, HAS_DLSE)
        k_end = _key_end(idx_row, 0, K, S, IB)
        for k0 in range(0, k_end, BK):
            valid, kv_off = _gather_rows(row // T, idx_row, k0, k_end, S, D, BK)
            s_a = tl.zeros([BK, HA], tl.float32)
            dp_a = tl.zeros([BK, HA], tl.float32)
            if HB > 0:
                s_b = tl.zeros([BK, HB], tl.float32)
                dp_b = tl.zeros([BK, HB], tl.float32)
            lim = DV
            if ONE_LOOP:        # one loop over all columns, dp's tail terms zero (do = 0 there)
                lim = D
            for c0 in range(0, lim, BC):        # value columns: scores and dp
                c = c0 + tl.arange(0, BC)
                cm = c < lim
                vm = c < DV
                kv = tl.load(lat_ptr + kv_off[:, None] + c[None, :], mask=valid[:, None] & cm[None, :], other=0.0)
                qT = tl.load(q_ptr + (qa * D)[None, :] + c[:, None], mask=ma[None, :] & cm[:, None], other=0.0)
                doT = tl.load(do_ptr + (qa * DV)[None, :] + c[:, None], mask=ma[None, :] & vm[:, None], other=0.0)
                s_a = _mm(kv, qT, s_a, F32)
                dp_a = _mm(kv, doT, dp_a, F32)
                if HB > 0:
                    qT = tl.load(q_ptr + (qb * D)[None, :] + c[:, None], mask=mb[None, :] & cm[:, None], other=0.0)
                    doT = tl.load(do_ptr + (qb * DV)[None, :] + c[:, None], mask=mb[None, :] & vm[:, None],
                                  other=0.0)
                    s_b = _mm(kv, qT, s_b, F32)
                    dp_b = _mm(kv, doT, dp_b, F32)
            if not ONE_LOOP:
                for c0 in range(DV, D, BC):     # the tail: scores only
                    c = c0 + tl.arange(0, BC)
                    cm = c < D
                    kv = tl.load(lat_ptr + kv_off[:, None] + c[None, :], mask=valid[:, None] & cm[None, :],
                                 other=0.0)
                    qT = tl.load(q_ptr + (qa * D)[None, :] + c[:, None], mask=ma[None, :] & cm[:, None], other=0.0)
                    s_a = _mm(kv, qT, s_a, F32)
                    if HB > 0:
                        qT = tl.load(q_ptr + (qb * D)[None, :] + c[:, None], mask=mb[None, :] & cm[:, None],
                                     other=0.0)
                        s_b = _mm(kv, qT, s_b, F32)
            slot = k0 + tl.arange(0, BK)
            dst = pds_ptr + ((local * K + slot) * (2 * H if not DLAT else H))[:, None]
            sm_ = (slot < K)[:, None]
            dt = pds_ptr.dtype.element_ty
            p_a = tl.where(valid[:, None] & ma[None, :], tl.exp2(s_a * scale2 - lse2_a[None, :]), 0.0)
            ds_a = (p_a * (dp_a - delta_a[None, :]) * scale).to(dt)
            p_a = p_a.to(dt)
            tl.store(dst + ha[None, :], ds_a, mask=sm_ & ma[None, :])
            if not DLAT:
                tl.store(dst + H + ha[None, :], p_a, mask=sm_ & ma[None, :])
            if HB > 0:
                p_b = tl.where(valid[:, None] & mb[None, :], tl.exp2(s_b * scale2 - lse2_b[None, :]), 0.0)
                ds_b = (p_b * (dp_b - delta_b[None, :]) * scale).to(dt)
                p_b = p_b.to(dt)
                tl.store(dst + hb[None, :], ds_b, mask=sm_ & mb[None, :])
                if not DLAT:
                    tl.store(dst + H + hb[None, :], p_b, mask=sm_ & mb[None, :])
            if DLAT:    # dkv of these slots, a second pass over the columns: [ds | p]·[q; do], q and do streamed
                ok = valid & (slot >= 0)
                for c0 in range(0, lim, BN):
                    c = c0 + tl.arange(0, BN)
                    cm = c < lim
                    vm = c < DV
                    q_c = tl.load(q_ptr + (qa * D)[:, None] + c[None, :], mask=ma[:, None] & cm[None, :], other=0.0)
                    do_c = tl.load(do_ptr + (qa * DV)[:, None] + c[None, :], mask=ma[:, None] & vm[None, :],
                                   other=0.0)
                    acc = _mm(p_a, do_c, _mm(ds_a, q_c, tl.zeros([BK, BN], tl.float32), F32), F32)
                    if HB > 0:
                        q_c = tl.load(q_ptr + (qb * D)[:, None] + c[None, :], mask=mb[:, None] & cm[None, :],
                                      other=0.0)
                        do_c = tl.load(do_ptr + (qb * DV)[:, None] + c[None, :], mask=mb[:, None] & vm[None, :],
                                       other=0.0)
                        acc = _mm(p_b, do_c, _mm(ds_b, q_c, acc, F32), F32)
                    _dkv_out(out_ptr, kv_off, local, K, D, slot, ok, c, cm, acc, ATOMIC)
                if not ONE_LOOP:
                    for c0 in range(DV, D, BN):     # the tail: ds·q only
                        c = c0 + tl.arange(0, BN)
                        cm = c < D
                        q_c = tl.load(q_ptr + (qa * D)[:, None] + c[None, :], mask=ma[:, None] & cm[None, :],
                                      other=0.0)
                        acc = _mm(ds_a, q_c, tl.zeros([BK, BN], tl.float32), F32)
                        if HB > 0:
                            q_c = tl.load(q_ptr + (qb * D)[:, None] + c[None, :], mask=mb[:, None] & cm[None, :],
                                          other=0.0)
                            acc = _mm(ds_b, q_c, acc, F32)
                        _dkv_out(out_ptr, kv_off, local, K, D, slot, ok, c, cm, acc, ATOMIC)

    @triton.jit
    def _dkv_out(out_ptr, kv_off, local, K, D, slot, ok, c, cm, acc, ATOMIC: tl.constexpr):
        """dkv [slots, columns c] of one row's slots: added into dlatent (fp32, rows at kv_off) or, not ATOMIC,
        stored as the (row, slot)'s rows of the deterministic buffer."""
        om = ok[:, None] & cm[None, :]
        if ATOMIC:
            tl.atomic_add(out_ptr + kv_off[:, None] + c[None, :], acc, mask=om, sem="relaxed")
        else:
            tl.store(out_ptr + ((local * K + slot) * D)[:, None] + c[None, :], acc, mask=om)

    @triton.jit
    def _gemm_dq_operands(q_ptr, do_ptr, row, H, D, DV, c, ha, hb, HB: tl.constexpr):
        """q and do of one row at the columns c ([heads, BN] for each head group; do = 0 past DV): the B operands
        `_bwd_dkv_dq_gemm_kernel` holds over its walk (group b: group a's when HB = 0, unused)."""
        cm = c < D
        vm = c < DV
        ma = ha < H
        q_a = tl.load(q_ptr + ((row * H + ha) * D)[:, None] + c[None, :], mask=ma[:, None] & cm[None, :], other=0.0)
        do_a = tl.load(do_ptr + ((row * H + ha) * DV)[:, None] + c[None, :], mask=ma[:, None] & vm[None, :],
                       other=0.0)
        q_b, do_b = q_a, do_a
        if HB > 0:
            mb = hb < H
            q_b = tl.load(q_ptr + ((row * H + hb) * D)[:, None] + c[None, :], mask=mb[:, None] & cm[None, :],
                          other=0.0)
            do_b = tl.load(do_ptr + ((row * H + hb) * DV)[:, None] + c[None, :], mask=mb[:, None] & vm[None, :],
                           other=0.0)
        return q_a, do_a, q_b, do_b

    @triton.jit
    def _gemm_dq_step(lat_ptr, out_ptr, kv_off, valid, slot, local, K, D, c, ds_a, p_a, ds_b, p_b, q_a, do_a, q_b,
                      do_b, dqT_a, dqT_b, HB: tl.constexpr, DLAT: tl.constexpr, ATOMIC: tl.constexpr,
                      F32: tl.constexpr):
        """One step of `_bwd_dkv_dq_gemm_kernel` at the columns c: dkv of the step's slots added (or stored; not
        without DLAT), the dq accumulators of both head groups updated and returned."""
        kv = tl.load(lat_ptr + kv_off[:, None] + c[None, :], mask=valid[:, None] & (c < D)[None, :], other=0.0)
        kvT = tl.trans(kv)
        dqT_a = _mm(kvT, ds_a, dqT_a, F32)
        if HB > 0:
            dqT_b = _mm(kvT, ds_b, dqT_b, F32)
        if DLAT:
            acc = _mm(p_a, do_a, _mm(ds_a, q_a, tl.zeros([slot.shape[0], c.shape[0]], tl.float32), F32), F32)
            if HB > 0:
                acc = _mm(p_b, do_b, _mm(ds_b, q_b, acc, F32), F32)
            ok = valid & (slot >= 0)        # formed here in their own terms (see `_bwd_dq_kernel_sm`'s dq store)
            _dkv_out(out_ptr, kv_off, local, K, D, slot, ok, c, c < D, acc, ATOMIC)
        return dqT_a, dqT_b

    @triton.jit
    def _gemm_dq_store(dq_ptr, row, H, D, c, ha, hb, dqT_a, dqT_b, HB: tl.constexpr):
        cs = (c < D) & (c >= 0)
        tl.store(dq_ptr + ((row * H + ha) * D)[None, :] + c[:, None], dqT_a.to(dq_ptr.dtype.element_ty),
                 mask=(ha < H)[None, :] & cs[:, None])
        if HB > 0:
            tl.store(dq_ptr + ((row * H + hb) * D)[None, :] + c[:, None], dqT_b.to(dq_ptr.dtype.element_ty),
                     mask=(hb < H)[None, :] & cs[:, None])

    @triton.jit
    def _bwd_dkv_dq_gemm_kernel(pds_ptr, q_ptr, do_ptr, lat_ptr, idx_ptr, out_ptr, dq_ptr, row0, NCB, T, S, H, K, D,
                                DV, BK: tl.constexpr, BN: tl.constexpr, NSUB: tl.constexpr, HA: tl.constexpr,
                                HB: tl.constexpr, IB: tl.constexpr, DLAT: tl.constexpr, ATOMIC: tl.constexpr,
                                F32: tl.constexpr):
        # `gemm_dq`: one program per (row, NSUB consecutive blocks of BN latent columns) walking the row's slots BK
        # at a time, from the ds and p stored before (`PDS` of the dq kernels computing no dq, or `_bwd_pds_kernel`):
        #   dkv[slot, c] = ds[slot, :]·q[:, c] + p[slot, :]·do[:, c]      added atomically (or stored per slot)
        #   dq^T[c, h]  += kv[slot, c]^T·ds[slot, h]                       held, written once at the end
        # q and do of its columns are loaded once and held (B operands of every step); a step's ds and p are
        # loaded once for its NSUB column blocks. The heads run as a group of HA and one of HB (0: none), powers of
        # two covering H (96 = 64 + 32: nothing padded). Columns at or past DV see do = 0 (the tail has no
        # values). The row's programs run side by side (column blocks fastest) and share its ds, p through L2;
        # each gathers its own columns of the selected rows. Without DLAT (`pds_dlat`: dlatent added before) dq only.
        pid = tl.program_id(0).to(tl.int64)
        cb = pid % NCB
        local = pid // NCB
        row = row0 + local
        idx_row = idx_ptr + row * K
        ha = tl.arange(0, HA)
        hb = HA + tl.arange(0, HB if HB > 0 else HA)
        ma = ha < H
        mb = hb < H
        c0 = cb * NSUB * BN + tl.arange(0, BN)
        q0a, do0a, q0b, do0b = _gemm_dq_operands(q_ptr, do_ptr, row, H, D, DV, c0, ha, hb, HB)
        dq0a = tl.zeros([BN, HA], tl.float32)
        dq0b = tl.zeros([BN, HB if HB > 0 else HA], tl.float32)
        if NSUB > 1:
            c1 = c0 + BN
            q1a, do1a, q1b, do1b = _gemm_dq_operands(q_ptr, do_ptr, row, H, D, DV, c1, ha, hb, HB)
            dq1a = tl.zeros([BN, HA], tl.float32)
            dq1b = tl.zeros([BN, HB if HB > 0 else HA], tl.float32)
        if NSUB > 2:
            c2 = c0 + 2 * BN
            q2a, do2a, q2b, do2b = _gemm_dq_operands(q_ptr, do_ptr, row, H, D, DV, c2, ha, hb, HB)
            dq2a = tl.zeros([BN, HA], tl.float32)
            dq2b = tl.zeros([BN, HB if HB > 0 else HA], tl.float32)
        k_end = _key_end(idx_row, 0, K, S, IB)
        for k0 in range(0, k_end, BK):
            valid, kv_off = _gather_rows(row // T, idx_row, k0, k_end, S, D, BK)
            slot = k0 + tl.arange(0, BK)
            a_row = pds_ptr + (local * K + slot) * (2 * H if DLAT else H)
            am = valid[:, None] & ma[None, :]
            ds_a = tl.load(a_row[:, None] + ha[None, :], mask=am, other=0.0)
            p_a = ds_a
            if DLAT:
                p_a = tl.load(a_row[:, None] + H + ha[None, :], mask=am, other=0.0)
            ds_b, p_b = ds_a, p_a
            if HB > 0:
                bm = valid[:, None] & mb[None, :]
                ds_b = tl.load(a_row[:, None] + hb[None, :], mask=bm, other=0.0)
                p_b = ds_b
                if DLAT:
                    p_b = tl.load(a_row[:, None] + H + hb[None, :], mask=bm, other=0.0)
            dq0a, dq0b = _gemm_dq_step(lat_ptr, out_ptr, kv_off, valid, slot, local, K, D, c0, ds_a, p_a, ds_b, p_b,
                                       q0a, do0a, q0b, do0b, dq0a, dq0b, HB, DLAT, ATOMIC, F32)
            if NSUB > 1:
                dq1a, dq1b = _gemm_dq_step(lat_ptr, out_ptr, kv_off, valid, slot, local, K, D, c1, ds_a, p_a, ds_b,
                                           p_b, q1a, do1a, q1b, do1b, dq1a, dq1b, HB, DLAT, ATOMIC, F32)
            if NSUB > 2:
                dq2a, dq2b = _gemm_dq_step(lat_ptr, out_ptr, kv_off, valid, slot, local, K, D, c2, ds_a, p_a, ds_b,
                                           p_b, q2a, do2a, q2b, do2b, dq2a, dq2b, HB, DLAT, ATOMIC, F32)
        _gemm_dq_store(dq_ptr, row, H, D, c0, ha, hb, dq0a, dq0b, HB)
        if NSUB > 1:
            _gemm_dq_store(dq_ptr, row, H, D, c1, ha, hb, dq1a, dq1b, HB)
        if NSUB > 2:
            _gemm_dq_store(dq_ptr, row, H, D, c2, ha, hb, dq2a, dq2b, HB)

    @triton.jit
    def _dkv_reduce_kernel(part_ptr, order_ptr, starts_ptr, ends_ptr, dlat_ptr, D, BR: tl.constexpr,
                           BC: tl.constexpr):
        # program -> (latent row b·S + s, column block): its run of this chunk's sorted slots, summed in order
        key = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        start = tl.load(starts_ptr + key)
        end = tl.load(ends_ptr + key)
        acc = tl.zeros([BC], tl.float32)
        for j0 in range(start, end, BR):
            j = j0 + tl.arange(0, BR)
            jm = j < end
            src = tl.load(order_ptr + j, mask=jm, other=0)
            acc += tl.sum(tl.load(part_ptr + (src * D)[:, None] + c[None, :], mask=jm[:, None] & (c[None, :] < D),
                                  other=0.0), 0)
        cm = c < tl.where(end > start, D, 0)     # rows this chunk did not select are left alone (a vector
        dst = dlat_ptr + key * D + c             # compare: the interpreter rejects a scalar mask in `&`)
        tl.store(dst, tl.load(dst, mask=cm, other=0.0) + acc, mask=cm)


# ---------------------------------------------------------------------------------------------- launch configs

@dataclasses.dataclass(frozen=True)
class FwdConfig:
    heads: tuple[int, ...]
    """Head tiles in order (powers of two >= 16) covering H; runs of equal tiles share one launch."""
    block_k: int = 64
    """Index slots (gathered latent rows) per step."""
    splits: int = 1
    """Key ranges of each index row (decode), merged by `_merge_kernel`."""
    value_chunks: int = 2
    """The value columns as this many gathered tiles (1, 2 or 4), each with its own accumulator."""
    lazy_rescale: bool = True
    """Rescale the accumulators only when a head's running max grew by more than 2^8."""
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    heads: tuple[int, ...]
    """Head tiles of the dq kernel."""
    block_k: int = 32
    """Slots per step of the dq kernel."""
    dkv_block_k: int = 32
    """Slots per program of the dkv kernel (its fp32 accumulator is dkv_block_k × D)."""
    dkv_block_h: int = 32
    """Heads per step of the dkv kernel's loop over all heads (64 needs more shared memory than an H200 has at
    576 / 512 widths: q and do are staged in two layouts each)."""
    slot_major: bool = False
    """Run `_bwd_dq_kernel_sm`: s^T, dp^T, ds^T [block_k, heads] with the slots on the MMA's M side and
    dq^T += kv^T·ds^T, q^T, do^T and ds^T as shared-memory B operands (wgmma for a 32-head tile once block_k
    >= 64: wgmma's M is 64 rows a warpgroup, more than a 32-head tile has)."""
    dkv_gemm: bool = False
    """dlatent without recomputing the scores: the dq kernels also store ds and p (q's dtype, a chunk of queries
    at a time: `gemm_rows`, or by `PDS_CHUNK_ELEMENTS`) and `_bwd_dkv_gemm_kernel` forms [ds | p]·[q; do] from
    them, the minimal FLOPs of a backward (2·(3·D + 2·d_v) per head and slot) for a buffer round trip of
    2·H·2 bytes per slot; replaces the dkv kernel (`dkv_block_*` unused)."""
    gemm_block_k: int = 64
    """Slots per program of the dkv GEMM (its M)."""
    gemm_block_n: int = 128
    """Latent columns per program of the dkv GEMM (the tail, D − d_v columns, has programs of its own)."""
    gemm_block_j: int = 64
    """Stacked heads per step of the dkv GEMM (its K: 2·H for the value columns, H for the tail)."""
    gemm_dq: bool = False
    """Run `_bwd_dkv_dq_gemm_kernel`: one program per (query, block of `gemm_block_n` latent columns) walking the
    query's slots `gemm_block_k` at a time, adding dlatent = [ds | p]·[q; do] as `_bwd_dkv_gemm_kernel` does
    (unless `pds_dlat` added it already) and forming dq = dsᵀ·kv over its columns in registers, written once
    (no atomics): the dq kernels (or `_bwd_pds_kernel`) then compute and store ds and p only (no dq accumulator,
    no dq dot), and each selected latent row is gathered once more for all heads, column block by column block
    (`gemm_block_j` unused)."""
    gemm_dq_blocks: int = 1
    """With `gemm_dq`: column blocks per program (1 to 3), each with its own held q, do and dq accumulator, sharing
    the step's loads of ds and p (the buffer is read cdiv(D, gemm_block_n · gemm_dq_blocks) times, not once per
    column block)."""
    pds_all_heads: bool = False
    """With `gemm_dq`: ds and p from `_bwd_pds_kernel` instead of the dq kernels: one program per query for all
    heads (each selected row gathered once, not once per head tile), `block_k` slots a step, each step a main
    loop over `pds_block_c` latent columns streaming the gathered rows, q and do through shared memory (`heads`,
    `slot_major` unused)."""
    pds_dlat: bool = False
    """With `pds_all_heads`: that kernel also adds dlatent, [ds | p]·[q; do] over the columns in a second pass
    (`gemm_block_n` at a time, q and do streamed, ds and p the register operand), stores ds only (a [rows, K, H]
    buffer: twice the queries a chunk), and `_bwd_dkv_dq_gemm_kernel` only forms dq."""
    pds_one_loop: bool = False
    """`_bwd_pds_kernel` walks all columns in one loop (per pass) instead of the values and then the tail: fewer
    pipelined loops a step, for dp's (and, with `pds_dlat`, p·do's) tail terms multiplied by zeros."""
    pds_block_c: int = 64
    """Latent columns per step of `_bwd_pds_kernel`'s inner loop."""
    gemm_rows: int | None = None
    """Queries per chunk of the dkv GEMM path (None: as many as `PDS_CHUNK_ELEMENTS` allow)."""
    dkv_num_warps: int | None = None
    """Warps of the dkv kernel or GEMM (None: num_warps)."""
    dkv_num_stages: int | None = None
    """Pipeline stages of the dkv kernel or GEMM (None: num_stages)."""
    num_warps: int = 8
    num_stages: int = 2


def head_tiles(H: int, widest: int) -> tuple[int, ...]:
    """Power-of-two tiles (16 to `widest`) covering H heads, the last one shrunk to the rest: 96 -> (32, 32, 32)
    for widest 32, (64, 32) for 64; 3 -> (16,) (masked)."""
    tiles, left = [], H
    while left > 0:
        t = widest
        while t > 16 and t // 2 >= left:
            t //= 2
        tiles.append(t)
        left -= t
    return tuple(tiles)


def fwd_config(B: int, T: int, H: int, k: int, D: int, d_v: int, device: torch.device,
               dtype: torch.dtype = torch.bfloat16) -> FwdConfig:
    """The forward's launch for a shape. 16-bit: 32-head tiles (96 heads: three, no padding), 4 warps (the
    sweeps of tests/bench/sparse_tune.py: faster than 8 and than 64 + 32 head tiles), 64 slots a step in two stages
    (two [64, 576] bf16 tiles of gathered rows fit beside q), the value columns in two chunks with the lazy rescale
    (faster than one or four chunks, docs/performance.md). fp32 (the parity path; its IEEE dots run on FMA units
    with fp32 operands staged in shared memory): 16-head tiles, 32 slots, one stage.
    Key splits when the (query, head tile) programs would not fill the GPU twice over, each split at least two
    steps long."""
    if dtype == torch.float32:
        cfg = FwdConfig(heads=head_tiles(H, 16), block_k=32, num_warps=8, num_stages=1)
    else:
        cfg = FwdConfig(heads=head_tiles(H, 32), block_k=32 if k <= 32 else 64)
    programs = B * T * len(cfg.heads)
    target = 2 * sm_count(device)
    if 0 < programs < target and k > 2 * cfg.block_k:
        want = triton.next_power_of_2(triton.cdiv(target, programs))
        cfg = dataclasses.replace(cfg, splits=max(1, min(want, 16, k // (2 * cfg.block_k))))
    return cfg


def bwd_config(B: int, T: int, H: int, k: int, D: int, d_v: int, device: torch.device,
               dtype: torch.dtype = torch.bfloat16) -> BwdConfig:
    """The backward's launch for a shape (from the H200 sweeps of tests/bench/sparse_tune.py at T = 8K, H = 96,
    top 2048; docs/performance.md). 16-bit, up to 128 heads: ds and p of all heads of a query from
    `_bwd_pds_kernel` (128 slots a step, 8 warps, 3 stages, the columns in one loop a pass), which also adds
    dlatent (`pds_dlat`), and dq from `_bwd_dkv_dq_gemm_kernel` (64 slots × three 64-column blocks a program,
    4 warps). More heads: the dq kernel transposed (`slot_major`: 64 slots a step on wgmma, 32-head tiles,
    4 warps) storing ds and p, and dlatent as the GEMM over them (128 slots × 64 columns a program). fp32: the
    recomputing kernels, 16 everywhere, one stage."""
    if dtype == torch.float32:
        return BwdConfig(heads=head_tiles(H, 16), block_k=16, dkv_block_k=16, dkv_block_h=16, num_stages=1)
    wide = k > 32
    if H <= 128:
        return BwdConfig(heads=head_tiles(H, 32), block_k=128 if k > 64 else 64 if wide else 32, slot_major=True,
                         num_warps=8, num_stages=3, dkv_gemm=True, gemm_dq=True, gemm_dq_blocks=3,
                         pds_all_heads=True, pds_dlat=True, pds_one_loop=True, gemm_block_k=64 if wide else 32,
                         gemm_block_n=64, dkv_num_warps=4, dkv_num_stages=2)
    return BwdConfig(heads=head_tiles(H, 32), block_k=64 if wide else 32, slot_major=True, num_warps=4,
                     dkv_gemm=True, gemm_block_k=128 if wide else 32, gemm_block_n=64)


# ---------------------------------------------------------------------------------------------- entries

def _check_attention(name: str, q: Tensor, latent: Tensor, indices: Tensor, d_v: int, **more: Tensor | None):
    if q.dim() != 4 or latent.dim() != 3 or indices.dim() != 3:
        raise ValueError(f"{name}: expected q [B, T, H, D], latent [B, S, D], indices [B, T, k], got "
                         f"{list(q.shape)}, {list(latent.shape)}, {list(indices.shape)}")
    B, T, H, D = q.shape
    if latent.shape[0] != B or latent.shape[2] != D or tuple(indices.shape[:2]) != (B, T):
        raise ValueError(f"{name}: shapes disagree: q {list(q.shape)}, latent {list(latent.shape)}, indices "
                         f"{list(indices.shape)} (q [B, T, H, D], latent [B, S, D], indices [B, T, k])")
    if not 0 < d_v <= D:
        raise ValueError(f"{name}: d_v={d_v} must be in 1..D={D} (the values are the latent's first d_v columns)")
    if indices.dtype != torch.int32:
        raise ValueError(f"{name}: indices must be int32, got {indices.dtype}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or latent.dtype != q.dtype:
        raise ValueError(f"{name}: q and latent must share a bfloat16/float16/float32 dtype, got {q.dtype}, "
                         f"{latent.dtype}; the float64 reference is `sparse_mla_gather`")
    want = dict(o=(B, T, H, d_v), do=(B, T, H, d_v), lse=(B, T, H), dlse=(B, T, H))
    for n, t in more.items():
        if t is not None and tuple(t.shape) != want[n]:
            raise ValueError(f"{name}: {n} has shape {list(t.shape)}, expected {list(want[n])}")
    tensors = dict(q=q, latent=latent, indices=indices, **{n: t for n, t in more.items() if t is not None})
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1 or not triton_available(next(iter(devices))):
        raise RuntimeError(f"{name} needs Triton and its tensors on one CUDA device (or TRITON_INTERPRET=1), got "
                           f"{ {n: str(t.device) for n, t in tensors.items()} }")


def _widths(D: int, d_v: int) -> tuple[int, int]:
    pow2 = triton.next_power_of_2
    return max(16, pow2(d_v)), max(16, pow2(max(D - d_v, 1)))


def _index_block(K: int) -> int:
    return min(256, max(16, triton.next_power_of_2(max(K, 1))))


def _f32_dots(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or interpreted()


def _head_launches(heads: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first head, tile, tiles) per run of equal tiles."""
    out, h0 = [], 0
    for t in heads:
        if out and out[-1][1] == t:
            out[-1] = (out[-1][0], t, out[-1][2] + 1)
        else:
            out.append((h0, t, 1))
        h0 += t
    return out


def sparse_mla_fwd_triton(q: Tensor, latent: Tensor, indices: Tensor, *, scale: float,
                          d_v: int) -> tuple[Tensor, Tensor]:
    """The Triton kernels of `sparse_mla_gather`'s forward: q [B, T, H, D], latent [B, S, D], indices int32
    [B, T, k] (-1 = empty slot) -> (o [B, T, H, d_v] in q's dtype, lse [B, T, H] fp32, natural log; o = 0 and
    lse = -inf on a row without keys). Launch from `fwd_config`: few queries (decode) take the key-split path."""
    _check_attention("sparse_mla_fwd_triton", q, latent, indices, d_v)
    B, T, H, _ = q.shape
    cfg = fwd_config(B, T, H, indices.shape[-1], q.shape[-1], d_v, q.device, q.dtype)
    return sparse_mla_fwd_launch(q, latent, indices, scale=scale, d_v=d_v, cfg=cfg)


def sparse_mla_decode_triton(q: Tensor, latent: Tensor, indices: Tensor, *, scale: float, d_v: int,
                             splits: int | None = None) -> tuple[Tensor, Tensor]:
    """The forward with each index row split into `splits` key ranges (default: `fwd_config`'s choice, at least
    2), the partials merged by their LSE: for decoding, T = 1..4 queries per row. Same contract as
    `sparse_mla_fwd_triton`; the launch depends on the shapes only (CUDA-graph capturable)."""
    _check_attention("sparse_mla_decode_triton", q, latent, indices, d_v)
    B, T, H, _ = q.shape
    cfg = fwd_config(B, T, H, indices.shape[-1], q.shape[-1], d_v, q.device, q.dtype)
    splits = max(2, cfg.splits) if splits is None else max(1, splits)
    return sparse_mla_fwd_launch(q, latent, indices, scale=scale, d_v=d_v, cfg=dataclasses.replace(cfg, splits=splits))


def sparse_mla_fwd_launch(q: Tensor, latent: Tensor, indices: Tensor, *, scale: float, d_v: int,
                          cfg: FwdConfig) -> tuple[Tensor, Tensor]:
    """`sparse_mla_fwd_triton` with an explicit launch `cfg` (tests run every tiling through it)."""
    B, T, H, D = q.shape
    S, K = latent.shape[1], indices.shape[-1]
    DVP, DTP = _widths(D, d_v)
    if sum(cfg.heads) < H or any(t < 16 or t & (t - 1) for t in cfg.heads):
        raise ValueError(f"sparse_mla: head tiles {cfg.heads} must be powers of two >= 16 covering H={H}")
    if cfg.value_chunks not in (1, 2, 4):
        raise ValueError(f"sparse_mla: value_chunks={cfg.value_chunks} must be 1, 2 or 4")
    if cfg.block_k < 16 or cfg.block_k & (cfg.block_k - 1):
        raise ValueError(f"sparse_mla: block_k={cfg.block_k} must be a power of two >= 16")
    q, latent, indices = q.contiguous(), latent.contiguous(), indices.contiguous()
    o = q.new_empty(B, T, H, d_v)
    lse = q.new_empty(B, T, H, dtype=torch.float32)
    R = B * T
    if R == 0 or H == 0 or K == 0:        # nothing to launch (and no index storage to point at)
        return o.zero_(), lse.fill_(float("-inf"))
    KS = triton.cdiv(triton.cdiv(K, cfg.splits), cfg.block_k) * cfg.block_k
    NS = triton.cdiv(K, KS)
    if NS > 1:
        o_out = torch.empty(NS, R, H, d_v, dtype=torch.float32, device=q.device)
        lse_out = torch.empty(NS, R, H, dtype=torch.float32, device=q.device)
    else:
        o_out, lse_out = o, lse
    BV = max(DVP, 16 * cfg.value_chunks)            # chunks of 16 columns at least
    for h0, bh, nt in _head_launches(cfg.heads):
        _fwd_chunks_kernel[(R * NS * nt,)](
            q, latent, indices, o_out, lse_out, R, T, S, H, K, D, d_v, h0, nt, NS, KS, scale * LOG2E,
            BH=bh, BK=cfg.block_k, BV=BV, NC=cfg.value_chunks, DTP=DTP, IB=_index_block(K), F32=_f32_dots(q.dtype),
            LAZY=cfg.lazy_rescale, FULL=BV == d_v and DTP == D - d_v, OFF64=latent.numel() >= 2**31,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if NS > 1:
        BC = min(DVP, 128)
        _merge_kernel[(R * H,)](o_out, lse_out, o, lse, R * H, NS, d_v, NSP=triton.next_power_of_2(NS), BC=BC,
                                NC=DVP // BC, num_warps=4)
    return o, lse


def sparse_mla_bwd_triton(q: Tensor, latent: Tensor, indices: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                          dlse: Tensor | None, *, scale: float, d_v: int,
                          deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """The Triton kernels of `sparse_mla_gather_bwd`: (dq in q's dtype, dlatent in the latent's dtype) from the
    inputs, the forward's o and lse, the output gradient do [B, T, H, d_v] and, when the LSE is used, its gradient
    dlse [B, T, H] (or None). dlatent is accumulated in fp32 over every query that selected a key: by atomics,
    or with `deterministic` in a fixed order (bitwise reproducible, twice the memory traffic)."""
    _check_attention("sparse_mla_bwd_triton", q, latent, indices, d_v, o=o, lse=lse, do=do, dlse=dlse)
    B, T, H, D = q.shape
    cfg = bwd_config(B, T, H, indices.shape[-1], D, d_v, q.device, q.dtype)
    return sparse_mla_bwd_launch(q, latent, indices, o, lse, do, dlse, scale=scale, d_v=d_v,
                                 deterministic=deterministic, cfg=cfg)


def sparse_mla_bwd_launch(q: Tensor, latent: Tensor, indices: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                          dlse: Tensor | None, *, scale: float, d_v: int, deterministic: bool = False,
                          cfg: BwdConfig, chunk_rows: int | None = None) -> tuple[Tensor, Tensor]:
    """`sparse_mla_bwd_triton` with an explicit launch `cfg`; `chunk_rows`: queries a chunk of the deterministic
    path (default: by `DKV_CHUNK_ELEMENTS`)."""
    B, T, H, D = q.shape
    S, K = latent.shape[1], indices.shape[-1]
    DVP, DTP = _widths(D, d_v)
    for name, t in (("heads", min(cfg.heads, default=0)), ("block_k", cfg.block_k), ("dkv_block_k", cfg.dkv_block_k),
                    ("dkv_block_h", cfg.dkv_block_h), ("gemm_block_k", cfg.gemm_block_k),
                    ("gemm_block_n", cfg.gemm_block_n), ("gemm_block_j", cfg.gemm_block_j)):
        if t < 16 or t & (t - 1):
            raise ValueError(f"sparse_mla: {name} {t} must be a power of two >= 16")
    if not 1 <= cfg.gemm_dq_blocks <= 3:
        raise ValueError(f"sparse_mla: gemm_dq_blocks {cfg.gemm_dq_blocks} must be 1, 2 or 3")
    if cfg.pds_block_c < 16 or cfg.pds_block_c & (cfg.pds_block_c - 1):
        raise ValueError(f"sparse_mla: pds_block_c {cfg.pds_block_c} must be a power of two >= 16")
    if sum(cfg.heads) < H:
        raise ValueError(f"sparse_mla: head tiles {cfg.heads} do not cover H={H}")
    # o and do enter dots with q and the latent: one dtype (autograd hands do in o's); the LSE in fp32
    q, latent, indices = q.contiguous(), latent.contiguous(), indices.contiguous()
    o, do, lse = o.to(q.dtype).contiguous(), do.to(q.dtype).contiguous(), lse.float().contiguous()
    dlse = None if dlse is None else dlse.contiguous()
    dq = torch.empty_like(q)
    dlat = torch.zeros(B, S, D, dtype=torch.float32, device=q.device)
    R = B * T
    if R == 0 or H == 0 or K == 0:
        return dq.zero_(), dlat.to(latent.dtype)
    delta = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    f32 = _f32_dots(q.dtype)

    def dq_pass(r0: int, r1: int, pds: Tensor | None, with_dq: bool = True, out: Tensor | None = None):
        """The dq kernels over the queries [r0, r1) (with `pds`: storing their ds and p there; without `with_dq`
        nothing else: dq is left to the dlatent kernel; `out`: where `pds_dlat` adds dlatent)."""
        if cfg.pds_all_heads and pds is not None and not with_dq:
            HA, HB = _head_groups(H)
            wide = max(16, triton.next_power_of_2(D))
            fuse = cfg.pds_dlat and cfg.gemm_dq      # dlatent here (else by the GEMM after)
            _bwd_pds_kernel[(r1 - r0,)](
                q, latent, indices, o, lse, do, lse if dlse is None else dlse, pds, dlat if out is None else out, r0,
                T, S, H, K, D, d_v, scale, scale * LOG2E, BK=cfg.block_k, BC=min(cfg.pds_block_c, wide), HA=HA,
                HB=HB, IB=_index_block(K), HAS_DLSE=dlse is not None, DLAT=fuse,
                BN=min(cfg.gemm_block_n, wide), ONE_LOOP=cfg.pds_one_loop, ATOMIC=not deterministic, F32=f32,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            return
        for h0, bh, nt in _head_launches(cfg.heads):
            (_bwd_dq_kernel_sm if cfg.slot_major else _bwd_dq_kernel)[((r1 - r0) * nt,)](
                q, latent, indices, o, lse, do, lse if dlse is None else dlse, dq, delta,
                dq if pds is None else pds, r0, T, S, H, K, D, d_v, h0, nt, scale, scale * LOG2E, BH=bh,
                BK=cfg.block_k, DVP=DVP, DTP=DTP, IB=_index_block(K), HAS_DLSE=dlse is not None,
                PDS=pds is not None, DQ=with_dq, F32=f32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    warps = dict(num_warps=cfg.num_warps if cfg.dkv_num_warps is None else cfg.dkv_num_warps,
                 num_stages=cfg.num_stages if cfg.dkv_num_stages is None else cfg.dkv_num_stages)
    if cfg.dkv_gemm:
        _bwd_via_gemm(q, latent, indices, do, dq, dlat, d_v, cfg, warps, f32, deterministic, chunk_rows, dq_pass)
        return dq, dlat if latent.dtype == torch.float32 else dlat.to(latent.dtype)
    dq_pass(0, R, None)
    NKB = triton.cdiv(K, cfg.dkv_block_k)
    dkv = dict(BK=cfg.dkv_block_k, BH=cfg.dkv_block_h, DVP=DVP, DTP=DTP, F32=f32, **warps)
    if not deterministic:
        _bwd_dkv_kernel[(R * NKB,)](q, latent, indices, lse, do, delta, dlat, 0, NKB, T, S, H, K, D, d_v, scale,
                                    scale * LOG2E, ATOMIC=True, **dkv)
    else:
        rows = chunk_rows or max(1, DKV_CHUNK_ELEMENTS // (K * D))
        for r0 in range(0, R, rows):
            r1 = min(R, r0 + rows)
            part = torch.empty((r1 - r0) * K, D, dtype=torch.float32, device=q.device)
            _bwd_dkv_kernel[((r1 - r0) * NKB,)](q, latent, indices, lse, do, delta, part, r0, NKB, T, S, H, K, D,
                                                d_v, scale, scale * LOG2E, ATOMIC=False, **dkv)
            _reduce_by_key(part, indices, r0, r1, S, dlat)
    return dq, dlat if latent.dtype == torch.float32 else dlat.to(latent.dtype)


def _bwd_via_gemm(q, latent, indices, do, dq, dlat, d_v, cfg, warps, f32, deterministic, chunk_rows, dq_pass):
    """dlatent from stored ds and p (`BwdConfig.dkv_gemm`): per chunk of queries, the dq kernels write ds and p of
    every visited slot to a [rows, K, 2·H] buffer in q's dtype (the values the recomputing dkv kernels round to
    before their dots), then `_bwd_dkv_gemm_kernel` forms [ds | p]·[q; do] over the value columns and ds·q over
    the tail (or `_bwd_dkv_dq_gemm_kernel` that and dq, with `gemm_dq`), added atomically (or, deterministic,
    written per slot and reduced by key)."""
    B, T, H, D = q.shape
    S, K = latent.shape[1], indices.shape[-1]
    R = B * T
    width = H if cfg.gemm_dq and cfg.pds_all_heads and cfg.pds_dlat else 2 * H      # ds alone, or ds and p
    budget = max(1, PDS_CHUNK_ELEMENTS // (K * width))
    if deterministic:
        budget = min(budget, max(1, DKV_CHUNK_ELEMENTS // (K * D)))
    if cfg.pds_all_heads and budget >= sm_count(q.device):     # whole waves of its one program per query
        budget -= budget % sm_count(q.device)
    rows = chunk_rows or cfg.gemm_rows or budget
    pds = q.new_empty(min(rows, R) * K * width)
    BK = cfg.gemm_block_k
    NKB = triton.cdiv(K, BK)
    DVP, DTP = _widths(D, d_v)
    # (first column, end, column block, stacked heads j): the value columns take [ds | p]·[q; do], the tail ds·q
    parts = [(0, d_v, min(cfg.gemm_block_n, DVP), 2 * H)] + ([(d_v, D, min(cfg.gemm_block_n, DTP), H)] if D > d_v
                                                              else [])
    for r0 in range(0, R, rows):
        r1 = min(R, r0 + rows)
        out = dlat if not deterministic else torch.empty((r1 - r0) * K, D, dtype=torch.float32, device=q.device)
        dq_pass(r0, r1, pds, not cfg.gemm_dq, out)
        if cfg.gemm_dq:
            BN = min(cfg.gemm_block_n, max(16, triton.next_power_of_2(D)))
            HA, HB = _head_groups(H)
            nsub = min(cfg.gemm_dq_blocks, triton.cdiv(D, BN))
            NCB = triton.cdiv(triton.cdiv(D, BN), nsub)
            _bwd_dkv_dq_gemm_kernel[((r1 - r0) * NCB,)](
                pds, q, do, latent, indices, out, dq, r0, NCB, T, S, H, K, D, d_v, BK=BK, BN=BN, NSUB=nsub, HA=HA,
                HB=HB, IB=_index_block(K), DLAT=not (cfg.pds_all_heads and cfg.pds_dlat), ATOMIC=not deterministic,
                F32=f32, **warps)
        else:
            for c_lo, c_hi, bn, J in parts:
                ncb = triton.cdiv(c_hi - c_lo, bn)
                _bwd_dkv_gemm_kernel[((r1 - r0) * NKB * ncb,)](
                    pds, q, do, indices, out, r0, NKB, ncb, c_lo, c_hi, J, T, S, H, K, D, d_v, BK=BK, BN=bn,
                    BJ=cfg.gemm_block_j, ATOMIC=not deterministic, F32=f32, **warps)
        if deterministic:
            _reduce_by_key(out, indices, r0, r1, S, dlat)


def _head_groups(H: int) -> tuple[int, int]:
    """Two power-of-two head groups (16 at least) covering H, the second 0 when the first does: 96 -> (64, 32),
    128 -> (128, 0), 40 -> (32, 16), 3 -> (16, 0)."""
    pow2 = triton.next_power_of_2
    if H <= 16 or pow2(H) == H:
        return max(16, H), 0
    first = pow2(H) // 2
    return first, max(16, pow2(H - first))


def _reduce_by_key(part, indices, r0, r1, S, dlat):
    """The deterministic dlatent's reduction of one chunk of queries [r0, r1): `part` holds every (query, slot)'s
    gradient row; the chunk's valid slots are sorted by key (stable: query order within a key), each key's run
    summed in that order and added to its row. Static shapes, no host reads."""
    B, T, K = indices.shape
    D = dlat.shape[-1]
    nkeys = B * S
    BC = min(128, triton.next_power_of_2(D))
    idx = indices.view(B * T, K)[r0:r1].long()
    b = torch.arange(r0, r1, device=idx.device) // T
    keys = torch.where((idx >= 0) & (idx < S), b[:, None] * S + idx, nkeys).flatten()
    keys, order = torch.sort(keys, stable=True)
    every_key = torch.arange(nkeys, device=idx.device)
    starts = torch.searchsorted(keys, every_key)
    ends = torch.searchsorted(keys, every_key, right=True)
    _dkv_reduce_kernel[(nkeys, triton.cdiv(D, BC))](part, order, starts, ends, dlat, D, BR=16, BC=BC, num_warps=4)

