"""Triton kernels of the indexer contract (`kimi::indexer_topk`, reference `lightning_index.indexer_topk_blocked`):
scores fused with a streaming top-k, or (a causal prefill's default on a GPU) scores then selection over chunks of
queries: no [T, S] score buffer beyond one chunk's [select_rows, S] (docs/numerics.md#indexer-scores, #top-k,
#sparse-attention-contract).

    I[t, s] = Σ_j w[t, j] · ReLU(<q[t, j], k[s]>)       fp32 accumulation, over the candidates lo_t <= s < hi_t

**Scores.** A task owns BM queries (a query block). Their heads form one [d, BM·n] operand, loaded once; per step
the task loads a block of BN keys [BN, d] and takes one dot, [BN, d] x [d, BM·n] -> [BN, BM·n] (fp32 accumulation;
bf16 products are exact): the keys are the MMA's M side, so the heads of a query lie along a row of the
accumulator and the ReLU, the head weights and the sum over heads stay within a thread and its lane quad
(a free reshape, no shared-memory round trip), giving the scores [BM, BN] in fp32. Keys are visited in ascending
position, only within the block's [min lo, max hi) (and, without a cache, not past the block's last query): the
causal half is never computed. A block whose rows all have at most topk candidates writes them without scores.
Options: `halves` takes each key block as two dots of BM/2 queries ([d, BM·n/2] operands), so a thread holds
half the accumulator and half the weights at a time (the registers that otherwise spill at 4 warps); `overlap`
issues each block's dot before the previous block's scores are taken (two accumulators; a tiny dot waited at
once, `_dot_fence`, is where Triton waits for the previous one).

**Order keys.** Each score becomes an int32 whose signed order is the order of the scores: NaN is mapped to +inf
first (a NaN ranks above every number and ties with +inf, as `select_topk` ranks them) and -0 to +0 (equal scores,
equal keys). Every real key is above INT32_MIN, the "no threshold" value.

**Streaming top-k.** Each query has a buffer of CAP >= topk + BN (key, position) pairs and a threshold. A scored
key enters when it is a candidate and its key is strictly above the threshold, appended after the buffer's
`count` entries (an exclusive prefix sum over the keep mask), so the buffer stays in ascending position order; the
new counts are the prefix sums' last entries (`scan_counts`), which keeps the counts, and with them every pass of
the selection, out of the score tile's layout (replicated over each lane quad: four times the work a pass). The
keys are scored in segments of blocks that cannot overflow any buffer of the block (so the scoring loop has no
branch and its key loads are software-pipelined); between segments a buffer holding more than CAP - BN entries
is compacted *loosely*: a key V with K <= #(keys >= V) <= K + SLACK is searched (SLACK = half the room left), every
entry >= V is kept, stably moved down, and V becomes the threshold (a later key equal to V loses the tie to the K
earlier ones, so "strictly above" stays exact). The search counts the keys >= a trial key in passes over the
buffer (chunks folded elementwise, one cross-thread reduction a pass, loads pipelined); the bounds snap to keys
present, and two of every three trials interpolate between the bounds' counts, the third bisects. At the end the
buffer is compacted loosely to topk + topk/4, then exactly: the topk-th largest key V, every entry above it and,
of those equal to V, the earliest up to topk in total; positions are already ascending; the row is padded with -1.
With `histogram` (the prefill's default launch) the final selection takes fewer passes: two histograms of the
keys' place above the row's least key (256 power-of-two bins, then 256 within the K-th key's bin; shifts, no
division) locate a bin of about cnt / 256^2 keys holding V, those keys are copied behind the row's entries and
searched alone (`histogram_compactions`: the compactions along the way too, where keeping the whole bin usually
stays within the slack, so no copy or search is needed, and the new threshold is close to the K-th key).

**Memory.** Besides the output [B, T, topk], the prefill path holds one buffer per program of a persistent grid
(about 2 programs per SM, each looping over query blocks, the longest first): programs × BM × CAP × 8 bytes, 52 MB
on an H200 at topk = 2048 (BM = 4, CAP = 3·topk), whatever T and S. The query blocks are handed out longest
first, to each program in turn (`order="cyclic"`), in rounds alternating direction (`"snake"`), or to whichever
program is free next through a counter (`"dynamic"`: the longest remaining task to the first free program).

**Scores then selection** (`IndexerLaunch.select_rows` > 0; the default of a causal prefill in 16 bits on a GPU). The
queries are taken in chunks of select_rows (2,048; up to 8,192 on short rows) of every batch row, two kernels a chunk.
The scores kernel (`_indexer_scores_kernel`, one program per block_q queries and key_split keys, the same dots and head
sums as the streaming kernel) writes each candidate's order key at its position in the query's workspace row:
[B·select_rows, S] int32, 1 GiB at S = 131,072, no more than the [T, topk] output of a causal prefill at topk = 2048; no
key past the chunk's last query is scored, and the slots of the row's 16-key blocks outside its range get INT32_MIN, so
that the selection reads whole aligned blocks (16-byte loads). The selection kernel (`_indexer_select_kernel`, programs
looping over queries) takes each query's row: at most topk candidates are all kept; a row of at most `sample` keys is
loaded into registers and its topk-th key found by bisection on the key's bits (`_kth_key`, one reduction a bit); a
longer row takes a threshold from a sample (runs of keys spread evenly over the row; the sample's r-th key to 20 bits, r
set so that about topk·(1 + 4/sqrt(e)) keys pass, e the sample's expected share of the best), one pass compacts the
positions of the keys at or above it, in order, into the program's scratch (the row cut into segments, one a warp, each
compacted by prefix sums within its warp into its own part of the scratch), their keys are gathered back from the row,
and the topk-th key is found among them in registers, searching only the bits below those the threshold and the largest
key share. Register tiles give each lane consecutive keys, so a prefix sum costs one shuffle scan a lane, not one a key.
Exact whatever the sample: when the threshold keeps fewer than topk, or more than the scratch holds with topk above it,
the topk-th key is searched over the row (one pass a bit). The scoring loop holds no selection bookkeeping, which is
what made the streaming kernel's loop slower than its dots (docs/performance.md, indexer rounds 6 to 8).

**Decode.** Few queries (T <= 16, no `causal`) against a long cache: the key range is split into `cdiv(S, split)`
pieces (split a multiple of BN, fixed by B, S and the SM count); program (b, piece) runs the same streaming top-k
over its piece for a block of at most 4 queries and leaves its buffer (at most topk entries, ascending) and count
in a workspace where each query's pieces lie side by side. A merge program per query then streams the candidates
of the pieces its range reaches, in piece order (ascending positions), in large chunks through the same
selection. Launch shapes depend on the shapes only: lengths come from lo/hi on the device, so the step can be
captured in a CUDA graph. Workspace: B × T' × pieces × min(split, CAP) × 8 bytes (at most the cache's slots × 8
bytes a query when split <= topk; T' is T rounded up to the query block) plus B × T × CAP' × 8 bytes for the
merge's buffers.

On the CPU the kernels run through Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI tests them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .registry import fp32_matmuls_in_tf32, interpreted, sm_count, tl, triton, triton_available

HIST_BINS = 256
"""Bins of each of the final selection's two histograms (`_select`): the K-th key's bin of the second holds
about cnt / HIST_BINS^2 entries on smooth scores."""

TASK_ORDERS = {"cyclic": 0, "snake": 1, "dynamic": 2}
"""`IndexerLaunch.order`: the prefill programs' task orders (the kernel's ORDER)."""

DECODE_MAX_QUERIES = 16
"""Without `causal`, at most this many queries a row run on the split (decode) path when the keys span several
splits; more run on the prefill path (one program per BM queries is enough parallelism)."""

if triton is not None:
    _FLOOR = tl.constexpr(-2147483648)     # INT32_MIN: below the key of every score, -inf included

    @triton.jit
    def _score_key(s):
        """fp32 scores -> int32 keys in the same order (integer ops only); NaN ranks as +inf, -0 as +0."""
        bits = s.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7F800000, key)
        return tl.where(key == -1, 0, key)

    @triton.jit
    def _append(kb, pb, key, pos, keep, cnt, SCAN_COUNT: tl.constexpr):
        """Append the kept (key, position) pairs of a [R, N] tile behind each row's `cnt` entries, in tile order.
        kb, pb: [R, 1] pointers to the rows' buffers. SCAN_COUNT: the new counts from the prefix sums (their
        last entries), so that the counts, and every [R, CH] pass of the selection that reads them, take the
        prefix sum's layout rather than the score tile's (which the scoring dot's lane quads replicate 4 times)."""
        ki = keep.to(tl.int32)
        csum = tl.cumsum(ki, axis=1)
        dest = cnt[:, None] + csum - ki
        tl.store(kb + dest, key, mask=keep)
        tl.store(pb + dest, pos, mask=keep)
        if SCAN_COUNT:
            return cnt + tl.max(csum, axis=1)
        else:
            return cnt + tl.sum(ki, axis=1)

    @triton.jit
    def _bounds(kb, cnt, R: tl.constexpr, CH: tl.constexpr):
        """The least and the largest of each row's first cnt keys (kb [R, 1] pointers), one pipelined pass folded
        elementwise, one cross-thread reduction."""
        j = tl.arange(0, CH)[None, :]
        top = tl.full([R, CH], _FLOOR, tl.int32)
        least = tl.full([R, CH], 2147483647, tl.int32)
        for c0 in tl.range(0, tl.max(cnt), CH, num_stages=3):
            m = c0 + j < cnt[:, None]
            key = tl.load(kb + c0 + j, mask=m, other=_FLOOR)
            top = tl.maximum(top, key)
            least = tl.minimum(least, tl.where(m, key, 2147483647))
        return tl.min(least, axis=1), tl.max(top, axis=1)

    @triton.jit
    def _search(kb, cnt, act, lo, hi, K, SLACK, R: tl.constexpr, CH: tl.constexpr):
        """For the `act` rows (the others must have lo = hi): a key V with K <= #(keys >= V) among the row's first
        cnt keys, and #(keys > V) < K, searched in [lo, hi] (lo the least key, hi the largest). K may differ by
        row. Returns (V, #(keys > V), whole): `whole` where #(keys >= V) <= K + SLACK was met early (every key >= V
        stays); else V is the K-th largest key exactly. The bounds snap to keys present (the least key >= mid, the
        largest below), so it ends once [lo, hi] holds one distinct key; two of every three trials interpolate mid
        between the bounds' counts (the keys' order is the scores', smooth enough that this lands near the K-th),
        the third bisects (at most three times bisection's passes whatever the data); 64-bit arithmetic, as
        [lo, hi] spans up to 2^32 keys. Each pass: the keys in pipelined chunks, folded elementwise."""
        j = tl.arange(0, CH)[None, :]
        n = tl.max(cnt)
        at_lo = cnt                            # keys >= lo
        above = tl.zeros([R], tl.int32)        # keys > hi
        whole = tl.zeros([R], tl.int1)
        step = 0
        while tl.max(hi.to(tl.int64) - lo) > 0:
            span = hi.to(tl.int64) - lo
            if step % 3 == 2:
                mid = (lo + (span + 1) // 2).to(tl.int32)
            else:                              # where the counts, linear between the bounds, reach K + SLACK / 2
                f = (at_lo - (K + SLACK // 2)).to(tl.float32) / tl.maximum(at_lo - above, 1).to(tl.float32)
                f = tl.minimum(tl.maximum(f, 0.0), 1.0)
                mid = (lo + tl.minimum(tl.maximum((f * span.to(tl.float32)).to(tl.int64) + 1, 1), span)).to(tl.int32)
            step += 1
            ge = tl.zeros([R, CH], tl.int32)
            up = tl.full([R, CH], 2147483647, tl.int32)
            down = tl.full([R, CH], _FLOOR, tl.int32)
            for c0 in tl.range(0, n, CH, num_stages=3):
                m = c0 + j < cnt[:, None]
                key = tl.load(kb + c0 + j, mask=m, other=_FLOOR)
                over = m & (key >= mid[:, None])
                ge += over.to(tl.int32)
                up = tl.minimum(up, tl.where(over, key, 2147483647))
                down = tl.maximum(down, tl.where(m & ~over, key, _FLOOR))
            ge = tl.sum(ge, axis=1)
            up = tl.min(up, axis=1)
            down = tl.max(down, axis=1)
            ok = ge >= K
            enough = act & ok & (ge <= K + SLACK)       # every key >= up stays: the row is done
            lo = tl.where(act & ok, up, lo)
            at_lo = tl.where(act & ok, ge, at_lo)
            hi = tl.where(enough, up, hi)
            whole = whole | enough
            above = tl.where(act & ~ok, ge, above)      # no key lies between `down` and mid
            hi = tl.where(act & ~ok, down, hi)
        return lo, above, whole

    @triton.jit
    def _keep(kb, pb, cnt, act, kth, room, R: tl.constexpr, CH: tl.constexpr, MS: tl.constexpr):
        """Move down, stably in place, every entry of an `act` row above kth and the first `room` equal to it;
        returns the kept counts (the other rows keep cnt). An entry moves only below its own chunk's end, so the
        loads of later chunks may run ahead of the stores (MS pipeline stages)."""
        j = tl.arange(0, CH)[None, :]
        kept = tl.zeros([R], tl.int32)
        ties = tl.zeros([R], tl.int32)
        for c0 in tl.range(0, tl.max(cnt), CH, num_stages=MS):
            m = c0 + j < cnt[:, None]
            key = tl.load(kb + c0 + j, mask=m, other=_FLOOR)
            pos = tl.load(pb + c0 + j, mask=m, other=0)
            eq = (m & (key == kth[:, None])).to(tl.int32)
            rank = ties[:, None] + tl.cumsum(eq, axis=1) - eq
            keep = act[:, None] & m & ((key > kth[:, None]) | ((eq != 0) & (rank < room[:, None])))
            ki = keep.to(tl.int32)
            dest = kept[:, None] + tl.cumsum(ki, axis=1) - ki
            tl.debug_barrier()                 # the chunk is read by every thread before its slots are rewritten
            tl.store(kb + dest, key, mask=keep)
            tl.store(pb + dest, pos, mask=keep)
            kept += tl.sum(ki, axis=1)
            ties += tl.sum(eq, axis=1)
        tl.debug_barrier()
        return tl.where(act, kept, cnt)

    @triton.jit
    def _compact(kb, pb, cnt, thr, K, SLACK, R: tl.constexpr, CH: tl.constexpr, MS: tl.constexpr):
        """Reduce every row holding more than K entries to its K best (largest key, then earliest entry), stably in
        place; returns the new counts and thresholds. With SLACK > 0 a row may keep up to K + SLACK entries: every
        entry >= some key V of which at least K are kept (V the new threshold: a later key equal to V loses the tie
        to K earlier ones), which the search meets after a few passes instead of narrowing to the K-th key.
        SLACK = 0: exactly K, the last of them the K-th key. Every entry of a buffer is >= its row's threshold."""
        tl.debug_barrier()                     # the appended entries are visible to every thread
        least, top = _bounds(kb, cnt, R, CH)
        return _compact_within(kb, pb, cnt, thr, K, SLACK, least, top, R, CH, MS)

    @triton.jit
    def _compact_within(kb, pb, cnt, thr, K, SLACK, least, top, R: tl.constexpr, CH: tl.constexpr,
                        MS: tl.constexpr):
        """`_compact` given each row's least and largest key."""
        act = cnt > K
        kth, above, whole = _search(kb, cnt, act, tl.where(act, least, _FLOOR), tl.where(act, top, _FLOOR), K, SLACK,
                                    R, CH)
        room = tl.where(whole, 2147483647, K - above)   # keys equal to the K-th that stay: the earliest ones
        return _keep(kb, pb, cnt, act, kth, room, R, CH, MS), tl.where(act, kth, thr)

    @triton.jit
    def _bit_length(x):
        """Bits of each non-negative int64 x, or one more where x rounds up to a power of two in fp32 (an upper
        bound: x < 2^bit_length); 0 for 0."""
        e = (x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF
        return tl.where(x > 0, e - 126, 0)

    @triton.jit
    def _digits(key, least, shift1, shift2, NB: tl.constexpr):
        """Two base-NB digits of a key's place x = key - least: the bin x >> shift1 (NB power-of-two bins over the
        row's keys) and, within it, (x >> shift2) & (NB - 1) (shift2 = shift1 - log2 NB, or 0: the bins of a bin
        of fewer than NB keys are single keys, in order). Shifts of int64, no division."""
        x = key.to(tl.int64) - least
        return (x >> shift1).to(tl.int32), ((x >> shift2) & (NB - 1)).to(tl.int32)

    @triton.jit
    def _histogram(bk_ptr, buf, cnt, act, least, shift1, shift2, b1, SECOND: tl.constexpr, R: tl.constexpr,
                   HC: tl.constexpr, NB: tl.constexpr):
        """[R, NB] counts of each `act` row's keys by first digit or, with SECOND, by second digit among the keys
        whose first digit is b1 (`_digits`). tl.histogram counts a 1-D tensor: one row at a time, HC keys a step."""
        rr = tl.arange(0, R)
        j = tl.arange(0, HC)
        hist = tl.zeros([R, NB], tl.int32)
        for r in tl.static_range(R):
            pick = rr == r
            off = tl.sum(tl.where(pick, buf, 0))
            n = tl.sum(tl.where(pick & act, cnt, 0))
            lo = tl.sum(tl.where(pick, least, 0).to(tl.int64))
            s1 = tl.sum(tl.where(pick, shift1, 0))
            s2 = tl.sum(tl.where(pick, shift2, 0))
            want = tl.sum(tl.where(pick, b1, 0))
            h = tl.zeros([NB], tl.int32)
            for c0 in tl.range(0, n, HC, num_stages=3):
                m = c0 + j < n
                first, second = _digits(tl.load(bk_ptr + off + c0 + j, mask=m, other=0), lo, s1, s2, NB)
                if SECOND:
                    h += tl.histogram(second, NB, mask=m & (first == want))
                else:
                    h += tl.histogram(first, NB, mask=m)
            hist = tl.where(pick[:, None], h[None, :], hist)
        return hist

    @triton.jit
    def _kth_bin(hist, K, NB: tl.constexpr):
        """The bin holding the K-th largest of each row's counted keys, how many keys lie in it and how many in
        the bins above it."""
        bins = tl.arange(0, NB)[None, :]
        suffix = tl.sum(hist, axis=1)[:, None] - tl.cumsum(hist, axis=1) + hist        # keys in bins >= b
        b = tl.max(tl.where(suffix >= K[:, None], bins, -1), axis=1)
        return b, tl.sum(tl.where(bins == b[:, None], hist, 0), axis=1), tl.sum(tl.where(bins > b[:, None], hist, 0),
                                                                                 axis=1)

    @triton.jit
    def _select(bk_ptr, kb, pb, buf, cnt, thr, K, SLACK, CAP, R: tl.constexpr, CH: tl.constexpr,
                NB: tl.constexpr, MS: tl.constexpr):
        """`_compact` in fewer passes over the buffers: two histogram passes (NB power-of-two bins of key - least,
        then NB bins within the bin of the K-th key) locate a bin of about cnt / NB^2 keys that holds the K-th
        key. When keeping all of that bin stays within K + SLACK, every entry >= the bin's least key value is kept
        (that value the threshold: at least K kept entries are >= it); otherwise the bin's keys are copied behind
        the row's entries (one pass) and the search runs over them alone. One pass keeps the winners. When such a
        bin does not fit behind its row's entries (heavy ties, a full buffer), the block takes `_compact`.
        buf [R]: the rows' buffer offsets from bk_ptr (kb = bk_ptr + buf[:, None])."""
        tl.debug_barrier()
        act = cnt > K
        least, top = _bounds(kb, cnt, R, CH)
        nbits = _bit_length(tl.zeros([R], tl.int64) + (NB - 1))
        shift1 = tl.maximum(_bit_length(tl.where(act, top.to(tl.int64) - least, 0)) - nbits, 0)
        shift2 = tl.maximum(shift1 - nbits, 0)
        need = tl.where(act, K, 0) + tl.zeros([R], tl.int32)
        b1, _, above1 = _kth_bin(_histogram(bk_ptr, buf, cnt, act, least, shift1, shift2, need, False, R, R * CH,
                                            NB), need, NB)
        need = need - above1
        b2, in_b, above2 = _kth_bin(_histogram(bk_ptr, buf, cnt, act, least, shift1, shift2, b1, True, R, R * CH,
                                               NB), need, NB)
        need = need - above2                   # of that bin's keys, the largest `need` are among the K best
        whole_bin = act & (in_b - need <= SLACK)
        side = act & ~whole_bin
        if tl.max((side & (in_b > CAP - cnt)).to(tl.int32)) > 0:
            kept, kth = _compact_within(kb, pb, cnt, thr, K, SLACK, least, top, R, CH, MS)   # bounds known
        else:
            # the bin's least key value: x >> shift2 is the bin's prefix; its low digit is b2
            x2 = ((b1.to(tl.int64) << (shift1 - shift2)) & ~(NB - 1)) | b2
            kth = (least + (x2 << shift2)).to(tl.int32)
            room = tl.full([R], 2147483647, tl.int32)
            if tl.max(side.to(tl.int32)) > 0:
                j = tl.arange(0, CH)[None, :]
                nside = tl.zeros([R], tl.int32)
                for c0 in tl.range(0, tl.max(tl.where(side, cnt, 0)), CH, num_stages=MS):
                    m = c0 + j < cnt[:, None]
                    key = tl.load(kb + c0 + j, mask=m, other=_FLOOR)
                    first, second = _digits(key, least[:, None], shift1[:, None], shift2[:, None], NB)
                    ii = (m & side[:, None] & (first == b1[:, None]) & (second == b2[:, None])).to(tl.int32)
                    tl.store(kb + cnt[:, None] + nside[:, None] + tl.cumsum(ii, axis=1) - ii, key, mask=ii != 0)
                    nside += tl.sum(ii, axis=1)
                tl.debug_barrier()
                skb = kb + cnt[:, None]
                s_least, s_top = _bounds(skb, nside, R, CH)
                s_kth, above_s, whole = _search(skb, nside, side, tl.where(side, s_least, _FLOOR),
                                                tl.where(side, s_top, _FLOOR), need, SLACK, R, CH)
                kth = tl.where(side, s_kth, kth)
                room = tl.where(side & ~whole, need - above_s, room)
            kept = _keep(kb, pb, cnt, act, kth, room, R, CH, MS)
            kth = tl.where(act, kth, thr)
        return kept, kth

    @triton.jit
    def _write_rows(out_row, pb, cnt, rmask, K, CH: tl.constexpr, MS: tl.constexpr):
        """Each row's first min(cnt, K) buffered positions, then -1, into its output row (out_row [R, 1])."""
        tl.debug_barrier()
        j = tl.arange(0, CH)[None, :]
        for c0 in tl.range(0, K, CH, num_stages=MS):
            m = rmask[:, None] & (c0 + j < K)
            p = tl.load(pb + c0 + j, mask=m & (c0 + j < cnt[:, None]), other=-1)
            tl.store(out_row + c0 + j, p, mask=m)

    @triton.jit
    def _block_keys(k_row, s, S, D, k_mask, dd, UPCAST: tl.constexpr):
        """The keys at positions s [BN] as a [BN, d] tile (past S: zeros)."""
        kt = tl.load(k_row + s[:, None].to(tl.int64) * D + dd[None, :], mask=k_mask & (s[:, None] < S), other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        return kt

    @triton.jit
    def _block_dot(k_row, s, qt, S, D, k_mask, dd, PREC: tl.constexpr, UPCAST: tl.constexpr):
        """The keys at positions s [BN] against the block's queries (qt [d, BM·n]): one [BN, d] x [d, BM·n]
        dot, fp32 accumulation."""
        return tl.dot(_block_keys(k_row, s, S, D, k_mask, dd, UPCAST), qt, input_precision=PREC)

    @triton.jit
    def _head_sum(x, wc, c_mask, BM: tl.constexpr, BN: tl.constexpr, HP: tl.constexpr, PAD_HEADS: tl.constexpr):
        """fp32 scores [BM, BN] from a block's dot [BN, BM·n]: the ReLU, the weights wc, the sum over heads."""
        # a ReLU that keeps NaN, one max.NaN instruction an element
        x = tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL) * wc[None, :]
        if PAD_HEADS:
            x = tl.where(c_mask[None, :], x, 0.0)
        return tl.trans(tl.sum(tl.reshape(x, [BN, BM, HP]), axis=2))

    @triton.jit
    def _take_scores(sc, s, lo, hi, thr, kb, pb, cnt, BM: tl.constexpr, BN: tl.constexpr, SCAN_COUNT: tl.constexpr,
                     SCORE_ONLY: tl.constexpr):
        """Append the candidates of one key block (scores sc [BM, BN], positions s) scoring above the threshold.
        SCORE_ONLY (timing only): a candidate is taken only when its score is NaN, which random inputs never give."""
        key = _score_key(sc)
        keep = (s[None, :] >= lo[:, None]) & (s[None, :] < hi[:, None]) & (key > thr[:, None])
        if SCORE_ONLY:
            keep = keep & (sc != sc)
        return _append(kb, pb, key, tl.broadcast_to(s[None, :], (BM, BN)), keep, cnt, SCAN_COUNT)

    @triton.jit
    def _take(x, s, wc, c_mask, lo, hi, thr, kb, pb, cnt, BM: tl.constexpr, BN: tl.constexpr, HP: tl.constexpr,
              PAD_HEADS: tl.constexpr, SCAN_COUNT: tl.constexpr, SCORE_ONLY: tl.constexpr):
        """`_take_scores` from the block's dot x [BN, BM·n]."""
        return _take_scores(_head_sum(x, wc, c_mask, BM, BN, HP, PAD_HEADS), s, lo, hi, thr, kb, pb, cnt, BM, BN,
                            SCAN_COUNT, SCORE_ONLY)

    @triton.jit
    def _halves_scores(kt, qa, qb, wa, wb, c_mask, BM: tl.constexpr, BN: tl.constexpr, HP: tl.constexpr,
                       PAD_HEADS: tl.constexpr, PREC: tl.constexpr):
        """Scores [BM, BN] as two dots, [BN, d] x [d, BM·n/2] each (the block's first and second half of
        queries): half the accumulator a thread holds at a time."""
        xa = tl.dot(kt, qa, input_precision=PREC)
        xb = tl.dot(kt, qb, input_precision=PREC)
        sa = _head_sum(xa, wa, c_mask, BM // 2, BN, HP, PAD_HEADS)
        sb = _head_sum(xb, wb, c_mask, BM // 2, BN, HP, PAD_HEADS)
        return tl.reshape(tl.permute(tl.join(sa, sb), (2, 0, 1)), [BM, BN])

    @triton.jit
    def _query_operand(q_ptr, w_ptr, b, t0, T, H, D, dd, NQ: tl.constexpr, HP: tl.constexpr, UPCAST: tl.constexpr):
        """Queries t0 .. t0 + NQ - 1 of batch row b as one [d, NQ·n] operand (column: query, head; queries past T
        read the last one) and their head weights [NQ·n]."""
        ch = tl.arange(0, NQ * HP)
        head = ch % HP
        h_mask = head < H
        r = b.to(tl.int64) * T + tl.minimum(t0 + ch // HP, T - 1)
        qt = tl.load(q_ptr + ((r * H + head) * D)[None, :] + dd[:, None], mask=h_mask[None, :] & (dd[:, None] < D),
                     other=0.0)
        if UPCAST:                             # the interpreter's 16-bit dot is wrong; fp32 products are exact
            qt = qt.to(tl.float32)
        return qt, tl.load(w_ptr + r * H + head, mask=h_mask, other=0.0)

    @triton.jit
    def _dot_fence(never_ptr, never, BN: tl.constexpr):
        """A dot waited for at once: Triton's wait for it also waits for every dot issued before, which lets the
        previous key block's dot run on while the next block's scores are taken (a dot whose result only the next
        iteration reads is left in flight up to such a wait). `never` is false; the store keeps the dot."""
        f = tl.dot(tl.zeros([BN, 16], tl.bfloat16), tl.zeros([16, 16], tl.bfloat16))
        tl.store(never_ptr + tl.arange(0, BN)[:, None] * 16 + tl.arange(0, 16)[None, :], f, mask=never)

    @triton.jit
    def _indexer_stream_kernel(q_ptr, k_ptr, w_ptr, lo_ptr, hi_ptr, out_ptr, bk_ptr, bp_ptr, bn_ptr, next_ptr,
                               B, T, S, H, D, K, NTB, NSPLIT, SPLIT, CAP, SLACK, ORDER: tl.constexpr,
                               BM: tl.constexpr, BN: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                               CH: tl.constexpr, NB: tl.constexpr, HIST: tl.constexpr, HIST_COMPACT: tl.constexpr,
                               CAUSAL: tl.constexpr, SPLIT_OUT: tl.constexpr, MS: tl.constexpr,
                               SCAN_COUNT: tl.constexpr, OVERLAP: tl.constexpr, HALVES: tl.constexpr,
                               SCORE_ONLY: tl.constexpr,
                               PREC: tl.constexpr, UPCAST: tl.constexpr, PAD_HEADS: tl.constexpr):
        # tasks (b, query block, key split), the query blocks in descending order (the causal ones get longer);
        # a prefill program loops over tasks with its own buffer, a split program (SPLIT_OUT) does one task and
        # leaves its buffer and counts (bn) for the merge. ORDER, how a prefill program takes its next task:
        # 0 every programs-th (cyclic), 1 cyclic with every second round reversed (snake: the rounds' long and
        # short tasks pair up), 2 the next one not yet taken (a counter at next_ptr, zero at the launch: the
        # longest remaining task goes to the first program free)
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        tasks = B * NTB * NSPLIT
        rm = tl.arange(0, BM)
        cn = tl.arange(0, BN)
        dd = tl.arange(0, DP)
        c_mask = tl.arange(0, BM * HP) % HP < H   # the dot's columns: (query of the block, head)
        k_mask = dd[None, :] < D
        if ORDER == 2:
            task = tl.atomic_add(next_ptr, 1)
        else:
            task = pid
        rnd = 0
        while task < tasks:
            sp = task % NSPLIT
            b = (task // NSPLIT) % B
            t0 = (NTB - 1 - task // (NSPLIT * B)) * BM
            rows = t0 + rm
            rmask = rows < T
            bt = b.to(tl.int64) * T + rows
            lo = tl.minimum(tl.maximum(tl.load(lo_ptr + bt, mask=rmask, other=0), 0), S).to(tl.int32)
            hi = tl.minimum(tl.maximum(tl.load(hi_ptr + bt, mask=rmask, other=0), 0), S).to(tl.int32)
            if not SPLIT_OUT and tl.max(hi - lo) <= K:
                # every row keeps all its candidates: no scores needed
                j = tl.arange(0, CH)[None, :]
                for c0 in range(0, K, CH):
                    p = lo[:, None] + c0 + j
                    tl.store(out_ptr + (bt * K)[:, None] + c0 + j, tl.where(p < hi[:, None], p, -1),
                             mask=rmask[:, None] & (c0 + j < K))
            else:
                has = hi > lo
                s_lo = tl.maximum(tl.min(tl.where(has, lo, S)), sp * SPLIT)
                s_hi = tl.minimum(tl.max(tl.where(has, hi, 0)), sp * SPLIT + SPLIT)
                if CAUSAL:                     # query t is key t: nothing past the block's last query
                    s_hi = tl.minimum(s_hi, t0 + BM)
                if SPLIT_OUT:                  # [B, NTB·BM, NSPLIT, CAP]: a query's pieces side by side
                    slot = (b.to(tl.int64) * NTB * BM + rows) * NSPLIT + sp
                else:                          # [programs, BM, CAP]
                    slot = pid.to(tl.int64) * BM + rm
                buf = slot * CAP
                kb = (bk_ptr + buf)[:, None]
                pb = (bp_ptr + buf)[:, None]
                cnt = tl.zeros([BM], tl.int32)
                thr = tl.full([BM], _FLOOR, tl.int32)
                # the block's queries as one [d, BM·n] operand (rows past T read the last query: no candidates),
                # so each key block is one [BN, d] x [d, BM·n] dot: the heads lie along the accumulator's rows,
                # and the sum over them stays within a thread and its lane quad
                if HALVES:                     # two operands of BM/2 queries each
                    h_mask = tl.arange(0, BM * HP // 2) % HP < H
                    qa, wa = _query_operand(q_ptr, w_ptr, b, t0, T, H, D, dd, BM // 2, HP, UPCAST)
                    qb, wb = _query_operand(q_ptr, w_ptr, b, t0 + BM // 2, T, H, D, dd, BM // 2, HP, UPCAST)
                else:
                    qt, wc = _query_operand(q_ptr, w_ptr, b, t0, T, H, D, dd, BM, HP, UPCAST)
                k_row = k_ptr + b.to(tl.int64) * S * D
                # segments of key blocks that cannot overflow a buffer, compactions between them: the inner loop
                # holds no branch, so its key loads are software-pipelined
                seg = s_lo // BN * BN
                while seg < s_hi:
                    most = tl.max(cnt)
                    if most > CAP - BN:
                        if HIST_COMPACT:
                            cnt, thr = _select(bk_ptr, kb, pb, buf, cnt, thr, K, SLACK, CAP, BM, CH, NB, MS)
                        else:
                            cnt, thr = _compact(kb, pb, cnt, thr, K, SLACK, BM, CH, MS)
                        most = tl.max(cnt)
                    seg_end = tl.minimum(s_hi, seg + (CAP - most) // BN * BN)
                    if HALVES:
                        for s0 in range(seg, seg_end, BN):
                            sc = _halves_scores(_block_keys(k_row, s0 + cn, S, D, k_mask, dd, UPCAST), qa, qb, wa, wb,
                                                h_mask, BM, BN, HP, PAD_HEADS, PREC)
                            cnt = _take_scores(sc, s0 + cn, lo, hi, thr, kb, pb, cnt, BM, BN, SCAN_COUNT, SCORE_ONLY)
                    elif OVERLAP:              # each block's dot runs while the previous block's scores are taken
                        x = _block_dot(k_row, seg + cn, qt, S, D, k_mask, dd, PREC, UPCAST)
                        for s0 in range(seg + BN, seg_end, BN):
                            x_next = _block_dot(k_row, s0 + cn, qt, S, D, k_mask, dd, PREC, UPCAST)
                            cnt = _take(x, s0 - BN + cn, wc, c_mask, lo, hi, thr, kb, pb, cnt, BM, BN, HP, PAD_HEADS,
                                        SCAN_COUNT, SCORE_ONLY)
                            _dot_fence(bp_ptr, s0 < 0, BN)
                            x = x_next
                        last = seg + (seg_end - seg - 1) // BN * BN
                        cnt = _take(x, last + cn, wc, c_mask, lo, hi, thr, kb, pb, cnt, BM, BN, HP, PAD_HEADS,
                                    SCAN_COUNT, SCORE_ONLY)
                    else:
                        for s0 in range(seg, seg_end, BN):
                            cnt = _take(_block_dot(k_row, s0 + cn, qt, S, D, k_mask, dd, PREC, UPCAST), s0 + cn, wc,
                                        c_mask, lo, hi, thr, kb, pb, cnt, BM, BN, HP, PAD_HEADS, SCAN_COUNT,
                                        SCORE_ONLY)
                    seg = seg_end
                if tl.max(cnt) > K:
                    if HIST:                   # two histograms, then the exact search over one bin's keys
                        cnt, thr = _select(bk_ptr, kb, pb, buf, cnt, thr, K, 0, CAP, BM, CH, NB, MS)
                    else:                      # loosely to K + K/4 first: the exact passes read fewer entries
                        cnt, thr = _compact(kb, pb, cnt, thr, K, K // 4, BM, CH, MS)
                        cnt, thr = _compact(kb, pb, cnt, thr, K, 0, BM, CH, MS)
                if SPLIT_OUT:
                    tl.store(bn_ptr + slot, cnt, mask=rmask)
                else:
                    _write_rows(out_ptr + (bt * K)[:, None], pb, cnt, rmask, K, CH, MS)
                tl.debug_barrier()             # the buffer is read before the next task overwrites it
            rnd += 1
            if ORDER == 2:
                task = tl.atomic_add(next_ptr, 1)
            elif ORDER == 1:
                task = rnd * nprog + tl.where(rnd % 2 == 1, nprog - 1 - pid, pid)
            else:
                task = rnd * nprog + pid

    @triton.jit
    def _indexer_merge_kernel(sk_ptr, spos_ptr, sn_ptr, lo_ptr, hi_ptr, out_ptr, bk_ptr, bp_ptr, T, S, K, NSPLIT,
                              SPLIT, BMS, CAPS, CAP, SLACK, MB: tl.constexpr, CH: tl.constexpr):
        # one query (b, t): the candidates its split programs left (pieces side by side, each holding its first
        # count entries), in chunks of MB across pieces (ascending positions), through the same selection; only
        # the pieces its own range reaches
        row = tl.program_id(0)
        b = row // T
        src = (b.to(tl.int64) * BMS + row % T) * NSPLIT          # the query's first piece
        lo = tl.minimum(tl.maximum(tl.load(lo_ptr + row), 0), S).to(tl.int32)
        hi = tl.minimum(tl.maximum(tl.load(hi_ptr + row), 0), S).to(tl.int32)
        first = tl.where(hi > lo, lo // SPLIT, 0) * CAPS
        last = tl.where(hi > lo, (hi + SPLIT - 1) // SPLIT, 0) * CAPS
        buf = row.to(tl.int64) * CAP + tl.zeros([1], tl.int64)
        kb = (bk_ptr + buf)[:, None]
        pb = (bp_ptr + buf)[:, None]
        cnt = tl.zeros([1], tl.int32)
        thr = tl.full([1], _FLOOR, tl.int32)
        j = tl.arange(0, MB)[None, :]
        for e0 in range(first, last, MB):
            e = e0 + j
            m = (e < last) & (e % CAPS < tl.load(sn_ptr + src + e // CAPS, mask=e < last, other=0))
            key = tl.load(sk_ptr + src * CAPS + e, mask=m, other=_FLOOR)
            if tl.max(((cnt > K) & (cnt > CAP - MB)).to(tl.int32)) > 0:
                cnt, thr = _compact(kb, pb, cnt, thr, K, SLACK, 1, CH, 1)
            keep = m & (key > thr[:, None])
            if tl.max(tl.sum(keep.to(tl.int32), axis=1)) > 0:       # most chunks, once the threshold is high
                pos = tl.load(spos_ptr + src * CAPS + e, mask=keep, other=0)
                cnt = _append(kb, pb, key, pos, keep, cnt, False)
        if tl.max(cnt) > K:
            cnt, thr = _compact(kb, pb, cnt, thr, K, 0, 1, CH, 1)
        _write_rows(out_ptr + row.to(tl.int64) * K + tl.zeros([1, 1], tl.int64), pb, cnt,
                    tl.zeros([1], tl.int32) == 0, K, CH, 1)

    @triton.jit
    def _indexer_scores_kernel(q_ptr, k_ptr, w_ptr, lo_ptr, hi_ptr, ws_ptr, T, S, H, D, K, C0, CT, WS, SPLIT,
                               BM: tl.constexpr, BN: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                               CAUSAL: tl.constexpr, HALVES: tl.constexpr, PREC: tl.constexpr,
                               UPCAST: tl.constexpr, PAD_HEADS: tl.constexpr, ALIGN: tl.constexpr):
        # program (query block, key split) of the chunk of queries C0 <= t < C0 + CT of every batch row: the order
        # keys of its queries' candidates within the split, each at its position in the query's workspace row
        # (b·CT + t - C0 of [B·CT, WS]). A block whose rows all have at most K candidates scores nothing: the
        # selection writes those rows from their ranges alone. The slots of a row's ALIGN-key blocks outside its
        # range, [lo rounded down to ALIGN, lo) and [hi, hi rounded up), get _FLOOR: the selection reads whole blocks.
        blk = tl.program_id(0)
        sp = tl.program_id(1)
        nqb = CT // BM
        b = blk // nqb
        t0 = C0 + (blk % nqb) * BM
        rows = t0 + tl.arange(0, BM)
        rmask = rows < T
        bt = b.to(tl.int64) * T + rows
        lo = tl.minimum(tl.maximum(tl.load(lo_ptr + bt, mask=rmask, other=0), 0), S).to(tl.int32)
        hi = tl.minimum(tl.maximum(tl.load(hi_ptr + bt, mask=rmask, other=0), 0), S).to(tl.int32)
        has = hi > lo
        lo_a = (lo // ALIGN * ALIGN)[:, None]
        hi_a = ((hi + ALIGN - 1) // ALIGN * ALIGN)[:, None]
        s_lo = tl.maximum(tl.min(tl.where(has, lo, S)), sp * SPLIT)
        s_hi = tl.minimum(tl.max(tl.where(has, hi, 0)), sp * SPLIT + SPLIT)
        if CAUSAL:                             # query t is key t: nothing past the block's last query
            s_hi = tl.minimum(s_hi, t0 + BM)
        if (tl.max(hi - lo) > K) & (s_lo < s_hi):
            cn = tl.arange(0, BN)
            dd = tl.arange(0, DP)
            k_mask = dd[None, :] < D
            c_mask = tl.arange(0, BM * HP) % HP < H
            k_row = k_ptr + b.to(tl.int64) * S * D
            wrow = ws_ptr + ((b * CT + rows - C0).to(tl.int64) * WS)[:, None]
            if HALVES:
                h_mask = tl.arange(0, BM * HP // 2) % HP < H
                qa, wa = _query_operand(q_ptr, w_ptr, b, t0, T, H, D, dd, BM // 2, HP, UPCAST)
                qb, wb = _query_operand(q_ptr, w_ptr, b, t0 + BM // 2, T, H, D, dd, BM // 2, HP, UPCAST)
                for s0 in range(s_lo // BN * BN, s_hi, BN):
                    s = s0 + cn
                    sc = _halves_scores(_block_keys(k_row, s, S, D, k_mask, dd, UPCAST), qa, qb, wa, wb, h_mask, BM,
                                        BN, HP, PAD_HEADS, PREC)
                    _store_keys(wrow, s, sc, lo, hi, lo_a, hi_a)
            else:
                qt, wc = _query_operand(q_ptr, w_ptr, b, t0, T, H, D, dd, BM, HP, UPCAST)
                for s0 in range(s_lo // BN * BN, s_hi, BN):
                    s = s0 + cn
                    sc = _head_sum(_block_dot(k_row, s, qt, S, D, k_mask, dd, PREC, UPCAST), wc, c_mask, BM, BN, HP,
                                   PAD_HEADS)
                    _store_keys(wrow, s, sc, lo, hi, lo_a, hi_a)

    @triton.jit
    def _store_keys(wrow, s, sc, lo, hi, lo_a, hi_a):
        """The order keys of scores sc [rows, keys s] into the rows' workspace: the candidates [lo, hi) their keys,
        the other slots of the aligned blocks [lo_a, hi_a) _FLOOR."""
        cand = (s[None, :] >= lo[:, None]) & (s[None, :] < hi[:, None])
        tl.store(wrow + s[None, :], tl.where(cand, _score_key(sc), _FLOOR),
                 mask=(s[None, :] >= lo_a) & (s[None, :] < hi_a))

    @triton.jit
    def _key_at_least(key, r, BITS: tl.constexpr):
        """A key V with #(keys >= V) >= r whose first BITS bits (the sign first) are those of the r-th largest of the
        int32 keys of a tile and whose other bits are 0 (1 <= r <= the number of keys above _FLOOR): the r-th
        largest itself at 32 bits, decided bit by bit from the sign down, one reduction a bit. (Radix select by
        tl.histogram, and seven trial keys a reduction, measured slower on the H100: docs/performance.md, indexer
        round 7.)"""
        v = tl.where(tl.sum((key >= 0).to(tl.int32)) >= r, 0, _FLOOR)
        for i in tl.static_range(BITS - 1):
            cand = v | (1 << (30 - i))
            v = tl.where(tl.sum((key >= cand).to(tl.int32)) >= r, cand, v)
        return v

    @triton.jit
    def _kth_key(key, r):
        """The r-th largest of the int32 keys of a tile (1 <= r <= the number of keys above _FLOOR) and how many
        keys equal to it are among the r largest (r minus the keys above it)."""
        v = _key_at_least(key, r, 32)
        return v, r - tl.sum((key > v).to(tl.int32))

    @triton.jit
    def _kth_key_above(key, r, low):
        """`_kth_key` of a tile whose r-th largest key is known to be at least `low`: when low and the tile's
        largest key have the same sign, the bits they share are the r-th largest's too, and only the bits below
        them are searched (one reduction a bit, one more for the largest)."""
        high = tl.max(key)
        same = (low ^ high) >= 0
        nb = tl.minimum(tl.where(same, _bit_length((low ^ high).to(tl.int64)), 31), 31)   # (an upper bound)
        v = tl.where(same, low & ~((1 << nb) - 1), tl.where(tl.sum((key >= 0).to(tl.int32)) >= r, 0, _FLOOR))
        for i in range(nb):
            cand = v | (1 << (nb - 1 - i))
            v = tl.where(tl.sum((key >= cand).to(tl.int32)) >= r, cand, v)
        return v, r - tl.sum((key > v).to(tl.int32))

    @triton.jit
    def _count_at_least(row, n, v, CH: tl.constexpr, MS: tl.constexpr):
        """#(keys >= v) among a row's first n keys, one pipelined pass."""
        j = tl.arange(0, CH)
        ge = tl.zeros([CH], tl.int32)
        for c0 in tl.range(0, n, CH, num_stages=MS):
            ge += (tl.load(row + c0 + j, mask=c0 + j < n, other=_FLOOR) >= v).to(tl.int32)
        return tl.sum(ge)

    @triton.jit
    def _kth_key_in_row(row, n, r, CH: tl.constexpr, MS: tl.constexpr):
        """The r-th largest of a row's n keys in memory, decided bit by bit from the sign down, one pass a bit (the
        selection's last resort)."""
        v = tl.where(_count_at_least(row, n, 0, CH, MS) >= r, 0, _FLOOR)
        for i in range(31):
            cand = v | (1 << (30 - i))
            v = tl.where(_count_at_least(row, n, cand, CH, MS) >= r, cand, v)
        return v

    @triton.jit
    def _exclusive_sums(x):
        """Exclusive prefix sums of an [R, L] tile in the order l·R + u (a thread's R consecutive entries in
        registers when the tile's layout gives dim 0 to registers and dim 1 to lanes: one shuffle scan over L,
        not one a key)."""
        tot = tl.sum(x, 0)
        return (tl.cumsum(tot, 0) - tot)[None, :] + tl.cumsum(x, 0) - x

    @triton.jit
    def _emit(out_row, key, pos, kth, room):
        """The positions of an [R, L] tile's best keys, in the tile's order l·R + u, into out_row: every key above
        kth and the first `room` of those equal to it."""
        eq = (key == kth).to(tl.int32)
        if tl.sum(eq) > room:                  # ties at the threshold beyond the room: the earliest stay
            keep = (key > kth) | ((eq != 0) & (_exclusive_sums(eq) < room))
        else:
            keep = key >= kth
        tl.store(out_row + _exclusive_sums(keep.to(tl.int32)), pos, mask=keep)

    @triton.jit
    def _emit_row(out_row, row, lo, n, kth, room, CH: tl.constexpr, MS: tl.constexpr):
        """`_emit` over a workspace row's n keys in memory (positions lo + i): every key above kth and the first
        `room` equal to it."""
        j = tl.arange(0, CH)
        kept = 0
        ties = 0
        for c0 in tl.range(0, n, CH, num_stages=MS):
            key = tl.load(row + c0 + j, mask=c0 + j < n, other=_FLOOR)
            eq = (key == kth).to(tl.int32)
            keep = (key > kth) | ((eq != 0) & (ties + tl.cumsum(eq, 0) - eq < room))
            ki = keep.to(tl.int32)
            tl.store(out_row + kept + tl.cumsum(ki, 0) - ki, lo + c0 + j, mask=keep)
            kept += tl.sum(ki)
            ties += tl.sum(eq)

    @triton.jit
    def _indexer_select_kernel(ws_ptr, lo_ptr, hi_ptr, out_ptr, pb_ptr, T, S, K, C0, CT, WS, ROWS,
                               M: tl.constexpr, SC: tl.constexpr, CAP: tl.constexpr, CH: tl.constexpr,
                               MS: tl.constexpr, SEG: tl.constexpr, CW: tl.constexpr, ALIGN: tl.constexpr,
                               ML: tl.constexpr, CL: tl.constexpr, SW: tl.constexpr, SB: tl.constexpr):
        # a program looping over the queries (b, C0 + i % CT) of workspace rows i = pid, pid + programs, ... <
        # ROWS: each query's K best candidates, positions ascending. Its scratch: SEG segments of CAP positions.
        # MS: pipeline stages of the passes over a row. A row's workspace is read in whole ALIGN-key blocks, from
        # lo rounded down to the end of hi's block (the scores kernel wrote _FLOOR in the blocks' slots outside
        # [lo, hi)), so that at 16 the loads are 16-byte vectors and each thread holds consecutive keys. ML, CL,
        # SW: lanes of the register tiles ([M / ML, ML] keys of a row or of the sample, [CAP / CL, CL] kept
        # entries, [CW / SW, SEG, SW] keys a step of the pass), each lane's keys consecutive along dim 0, so that
        # a prefix sum takes one shuffle scan a lane (`_exclusive_sums`), not one a key.
        pid = tl.program_id(0)
        pb = pb_ptr + pid.to(tl.int64) * SEG * CAP
        for i_row in range(pid, ROWS, tl.num_programs(0)):
            b = i_row // CT
            t = C0 + i_row % CT
            if t < T:
                bt = b.to(tl.int64) * T + t
                lo = tl.minimum(tl.maximum(tl.load(lo_ptr + bt), 0), S).to(tl.int32)
                hi = tl.minimum(tl.maximum(tl.load(hi_ptr + bt), 0), S).to(tl.int32)
                n = hi - lo
                out_row = out_ptr + bt * K
                row = ws_ptr + tl.cast(i_row, tl.int64) * WS + lo
                base = lo // ALIGN * ALIGN     # the blocks [base, base + span) hold [lo, hi)
                span = (hi + ALIGN - 1) // ALIGN * ALIGN - base
                rowa = ws_ptr + tl.cast(i_row, tl.int64) * WS + base
                # (each branch names its own tiles: Triton merges same-named variables across branches)
                if n <= K:                     # every candidate, then -1
                    jk = tl.arange(0, CH)
                    for c0 in range(0, K, CH):
                        p = lo + c0 + jk
                        tl.store(out_row + c0 + jk, tl.where(p < hi, p, -1), mask=c0 + jk < K)
                elif span <= M:                # the whole row in registers
                    jm = tl.arange(0, ML)[None, :] * (M // ML) + tl.arange(0, M // ML)[:, None]
                    mkey = tl.load(rowa + jm, mask=jm < span, other=_FLOOR)
                    mkth, mroom = _kth_key(mkey, K)
                    _emit(out_row, mkey, base + jm, mkth, mroom)
                else:
                    # a threshold from a sample (M keys in M / SC runs of SC, evenly spread): V0, the first SB bits
                    # of its r-th largest key (the rest 0, so at most that key), r set so that about
                    # K·(1 + 4/sqrt(e)) of the row's keys are >= V0 (e = K·M/n, the sample's expected share of the
                    # K best). One pass keeps the positions of the keys >= V0 in order: the row cut into SEG
                    # segments, each step of a segment compacted by a prefix sum within the warp that holds it into
                    # the segment's own part of the scratch, so no step waits for another segment; the segments'
                    # entries are then read back joined, in position order, when at least K and at most CAP were
                    # kept, their keys gathered from the row, and the K-th largest found among them in registers.
                    i = tl.arange(0, ML)[None, :] * (M // ML) + tl.arange(0, M // ML)[:, None]
                    soff = (((i // SC).to(tl.int64) * (span - SC)) // (M // SC - 1)).to(tl.int32) // ALIGN * ALIGN \
                        + i % SC
                    e = (K * M).to(tl.float32) / n.to(tl.float32)
                    r = tl.minimum((e + 4.0 * tl.sqrt(e)).to(tl.int32) + 2, M)
                    # (above _FLOOR: the blocks' padding and the slots past them are never kept)
                    v0 = tl.maximum(_key_at_least(tl.load(rowa + soff), r, SB), _FLOOR + 1)
                    sg = tl.arange(0, SEG)
                    # a step's [CW / SW, SEG, SW] tile: segment s, lane l, its (CW / SW) consecutive keys u
                    jw = tl.arange(0, SW)[None, None, :] * (CW // SW) + tl.arange(0, CW // SW)[:, None, None]
                    seg_len = tl.cdiv(span, SEG * CW) * CW
                    kept = tl.zeros([SEG], tl.int32)
                    for c0 in tl.range(0, seg_len, CW, num_stages=MS):
                        idx = sg[None, :, None] * seg_len + c0 + jw
                        skeep = tl.load(rowa + idx, mask=idx < span, other=_FLOOR) >= v0
                        ski = skeep.to(tl.int32)
                        tot = tl.sum(ski, 0)   # [SEG, SW]: a lane's kept keys; scanned within the segment's warp
                        dest = (kept[:, None] + tl.cumsum(tot, 1) - tot)[None, :, :] + tl.cumsum(ski, 0) - ski
                        tl.store(pb + sg[None, :, None] * CAP + dest, base + idx, mask=skeep & (dest < CAP))
                        kept += tl.sum(tot, 1)
                    cnt = tl.sum(kept)
                    if (cnt >= K) & (cnt <= CAP):
                        tl.debug_barrier()     # the kept entries are visible to every thread
                        first = tl.cumsum(kept, 0) - kept          # each segment's first slot, joined
                        jb = tl.arange(0, CL)[None, :] * (CAP // CL) + tl.arange(0, CAP // CL)[:, None]
                        src = jb
                        for w in tl.static_range(1, SEG):
                            fw = tl.sum(tl.where(sg == w, first, 0))
                            src = tl.where(jb >= fw, w * CAP + jb - fw, src)
                        bpos = tl.load(pb + src, mask=jb < cnt, other=0)
                        bkey = tl.load(rowa + bpos - base, mask=jb < cnt, other=_FLOOR)
                        bkth, broom = _kth_key_above(bkey, K, v0)
                        _emit(out_row, bkey, bpos, bkth, broom)
                    else:
                        # V0 is the K-th key when fewer than K keys lie above it (ties at V0 past CAP); otherwise
                        # the sample misled (the row's order is far from random): the K-th key searched in the row
                        kth = v0
                        above = 0
                        if cnt >= K:
                            above = _count_at_least(row, n, v0 + 1, CH, MS)
                        if (cnt < K) | (above >= K):
                            kth = _kth_key_in_row(row, n, K, CH, MS)
                            above = _count_at_least(row, n, kth + 1, CH, MS)
                        _emit_row(out_row, row, lo, n, kth, K - above, CH, MS)
            tl.debug_barrier()                 # this row's scratch is read before the next row's is written


class IndexerLaunch(NamedTuple):
    """Launch configuration of `indexer_topk_triton` (chosen per shape by `launch_config`)."""
    block_q: int        # BM: queries a task (one [BN, d] x [d, BM·n] dot a key block)
    block_k: int        # BN: keys a step
    chunk: int          # CH: buffer entries a step of a compaction and of the output
    programs: int       # prefill: persistent programs, one buffer each
    split: int          # decode: keys a split program (a multiple of block_k); 0: the prefill path
    merge_block: int    # decode: candidates a step of the merge
    num_warps: int
    num_stages: int
    merge_warps: int
    capacity: int = 0   # buffer entries a query (0: `_capacity`'s choice)
    histogram: bool = False  # the final selection by two histograms (`_select`), not by trial keys (`_compact`)
    histogram_compactions: bool = False  # the compactions along the way by two histograms too
    max_registers: int = 0  # prefill and split kernels: a register cap a thread (more programs an SM), 0: none
    move_stages: int = 1  # pipeline stages of the passes that move entries (keep, copy, output); 1: none
    scan_counts: bool = True  # the buffer counts from the appends' prefix sums (`_append`: unreplicated passes)
    histogram_bins: int = HIST_BINS  # bins of each histogram level (a power of two)
    order: str = "cyclic"  # prefill: how a program takes its next task, one of `TASK_ORDERS`
    halves: bool = False  # each key block as two dots of block_q / 2 queries (half the accumulator registers)
    score_only: bool = False  # timing only: the scores and the keep test, but no key is taken (the selection
    #                            is wrong: every row keeps its first candidates)
    overlap: bool = False  # each key block's dot issued before the previous block's scores are taken (two
    #                        accumulators live: for 8 warps, where each thread holds half of 4 queries' heads)
    select_rows: int = 0  # > 0: scores then selection (`_indexer_scores_kernel`, `_indexer_select_kernel`) over
    #                       chunks of this many queries of every batch row (a multiple of block_q); 0: the
    #                       streaming top-k (`_indexer_stream_kernel`)
    key_split: int = 4096  # scores then selection: keys a scores program (a multiple of block_k)
    sample: int = 4096    # scores then selection: rows of at most this many candidates are selected in registers;
    #                       longer ones take a threshold from a sample of this many keys (a power of two)
    sample_run: int = 32  # keys a run of the sample (consecutive keys; sample // sample_run runs)
    select_capacity: int = 0  # entries a row keeps at its threshold for the exact selection (a power of two at
    #                           least topk; 0: `_select_capacity`'s choice)
    select_chunk: int = 1024  # scores then selection: entries a step of the selection's plain passes (a row's
    #                           output when it keeps everything, the fallbacks)
    select_stages: int = 3  # scores then selection: pipeline stages of the passes over a row
    select_warps: int = 8  # scores then selection: warps of a selection program
    select_registers: int = 0  # scores then selection: a register cap a thread of the selection (0: none)
    select_programs: int = 0  # scores then selection: selection programs, each looping over its queries (0:
    #                           twice `programs`; more than fit the GPU at once run in waves)
    select_segments: int = 8  # scores then selection: segments a long row's pass is cut into (a power of two; as
    #                           many as warps, each segment's prefix sums stay within a warp)
    select_step: int = 256  # scores then selection: keys a step of each segment (a power of two)
    sample_bits: int = 20  # scores then selection: leading bits of the sample's threshold key searched (the rest
    #                        0: a threshold at most 2^-(sample_bits - 9) relatively below the sample's r-th score)
    select_align: int = 16  # scores then selection: a row's workspace read in blocks of this many keys (1, 2, 4,
    #                         8 or 16) from lo rounded down (vector loads, consecutive keys a thread)


def launch_config(B: int, T: int, S: int, H: int, D: int, topk: int, *, causal: bool, sms: int,
                  interpret: bool, dtype: torch.dtype = torch.bfloat16) -> IndexerLaunch:
    """The configuration for one shape (no autotuning: the kernels keep state in global workspaces). `sms`: the
    device's SM count (sizes the persistent grid and the decode splits). Under the interpreter the blocks are
    small so that CPU tests cover several blocks, chunks and compactions."""
    pow2 = triton.next_power_of_2
    bm = min(4, pow2(max(T, 1)))
    capacity = 0
    if interpret:
        bn, chunk, merge_block, warps, stages = 32, 64, 64, 4, 1
        split = 64 if not causal and T <= 4 and S > 64 else 0
    else:
        # 16-bit: 64 keys a step against 4 queries x 64 heads, as two dots of 2 queries (`halves`: wgmma M = 64 keys,
        # N = 128; a thread holds half the accumulator and weights at a time, so the scoring loop does not spill and
        # two programs share an SM), three stages of key tiles in flight (two programs an SM still fit), the
        # longest task left to the first free program (`order="dynamic"`), buffers of 3·topk entries (fewer
        # compactions than 2·topk), the prefill's final selection by histograms. The decode pieces keep one dot,
        # two stages and trial keys until timed; fp32 (the parity path): 2 queries, 32 keys, one stage, one dot.
        bn, chunk, merge_block, warps, stages = 64, 0, 4096, 4, 3
        capacity = 3 * topk
        if dtype == torch.float32:
            bm, bn, stages = min(2, bm), 32, 1
        split = 0
        if not causal and T <= DECODE_MAX_QUERIES:
            # about two programs an SM over the batch's pieces, each piece at least 4 key blocks
            split = min(8192, max(4 * bn, pow2(triton.cdiv(S * B * triton.cdiv(T, bm), 2 * sms))))
            split = split if triton.cdiv(S, split) > 1 else 0
        if split:
            stages = min(stages, 2)
    chunk = chunk or 512 // bm                  # [BM, CH] compaction tiles: 4 entries a thread at 4 warps
    programs = 0 if split else max(1, min(B * triton.cdiv(T, bm), 3 if interpret else 2 * sms))
    halves = not split and (interpret or dtype != torch.float32)
    # a causal prefill in 16 bits scores then selects, in chunks of 2,048 queries (a workspace of 2,048 x S int32
    # keys: at topk = 2048 no larger than the output), or of up to 8,192 while the workspace stays within 256 MiB
    # (S <= 16,384: fewer, fuller launches), the selection at 128 registers a thread (two programs of 8 warps fit
    # an SM; the grid of 4 an SM runs in two waves), rows of up to 8,192 keys selected in registers when S allows
    # it, else a sample of 4,096: measured faster than the streaming top-k from 8K to 128K. With a cache the
    # streaming top-k stays until measured there.
    select = not interpret and causal and not split and dtype != torch.float32
    rows = max(2048, min(8192, 1 << max(0, (2 ** 26 // max(S, 1)).bit_length() - 1)))
    return IndexerLaunch(block_q=bm, block_k=bn, chunk=chunk, programs=programs, split=split,
                         merge_block=merge_block, num_warps=warps, num_stages=stages,
                         merge_warps=4 if interpret else 8, capacity=0 if split else capacity,
                         histogram=not split, order="dynamic", halves=halves, select_rows=rows if select else 0,
                         select_registers=128 if select else 0, sample=8192 if S <= 8192 else 4096)


def _capacity(topk: int, block: int, most: int, want: int = 0) -> int:
    """Buffer entries a row: topk plus room for at least one block and half of topk (compactions are rare), a
    power of two (or `want`, at least topk + block); never more than the row can receive (`most`, rounded up to
    the block)."""
    cap = max(want, topk + block) if want else triton.next_power_of_2(topk + max(block, topk // 2))
    return max(block, min(cap, triton.cdiv(most, block) * block))


def _slack(cap: int, topk: int, block: int) -> int:
    """Entries above topk a compaction before the end may keep: half the room a compacted buffer has left."""
    return max(0, (cap - block - topk) // 2)


def _select_capacity(topk: int, sample: int, most: int) -> int:
    """Entries a row keeps at its sampled threshold (`_indexer_select_kernel`): the expected count of keys at or
    above the threshold for the longest row (`most` candidates; the count grows with the row) plus six standard
    deviations, as a power of two at least topk. A row that keeps more takes the slower exact fallback."""
    if most <= sample:
        return triton.next_power_of_2(max(topk, 1))
    e = topk * sample / most
    r = min(e + 4 * math.sqrt(e) + 2, sample)
    mean, sd = r * most / sample, math.sqrt(r) * most / sample
    return triton.next_power_of_2(max(topk, int(mean + 6 * sd) + 1))


def _select_flags(c: IndexerLaunch, cap: int) -> dict:
    """`_indexer_select_kernel`'s constexprs and compile options for launch `c` and a scratch capacity `cap`."""
    lanes = 32 * c.select_warps
    flags = dict(M=c.sample, SC=c.sample_run, CAP=cap, CH=c.select_chunk, MS=c.select_stages, SEG=c.select_segments,
                 CW=c.select_step, ALIGN=c.select_align, ML=min(c.sample, lanes), CL=min(cap, lanes),
                 SW=min(c.select_step, 32), SB=c.sample_bits, num_warps=c.select_warps)
    if c.select_registers:
        flags["maxnreg"] = c.select_registers
    return flags


def _stream_flags(c: IndexerLaunch, HP: int, DP: int, prec, upcast: bool, pad_heads: bool) -> dict:
    """`_indexer_stream_kernel`'s constexprs and compile options for launch `c` (heads padded to HP, head width to
    DP), but for CAUSAL, SPLIT_OUT and ORDER, which depend on the path."""
    flags = dict(BM=c.block_q, BN=c.block_k, HP=HP, DP=DP, CH=c.chunk, NB=c.histogram_bins, HIST=c.histogram,
                 HIST_COMPACT=c.histogram_compactions, MS=c.move_stages, SCAN_COUNT=c.scan_counts, OVERLAP=c.overlap,
                 HALVES=c.halves and c.block_q > 1, SCORE_ONLY=c.score_only, PREC=prec, UPCAST=upcast,
                 PAD_HEADS=pad_heads, num_warps=c.num_warps, num_stages=c.num_stages)
    if c.max_registers:
        flags["maxnreg"] = c.max_registers
    return flags


def _check_indexer(q: Tensor, k: Tensor, w: Tensor, lo: Tensor, hi: Tensor, topk: int):
    if q.dim() != 4 or k.dim() != 3 or w.shape != q.shape[:3] or k.shape[0] != q.shape[0] or \
            k.shape[2] != q.shape[3] or lo.shape != q.shape[:2] or hi.shape != q.shape[:2]:
        raise ValueError(f"indexer_topk_triton: expected q [B, T, n, d], k [B, S, d], w [B, T, n], lo/hi [B, T]; "
                         f"got q {list(q.shape)}, k {list(k.shape)}, w {list(w.shape)}, lo {list(lo.shape)}, "
                         f"hi {list(hi.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k.dtype != q.dtype:
        raise ValueError(f"indexer_topk_triton: q and k must share a bfloat16/float16/float32 dtype, got {q.dtype}, "
                         f"{k.dtype} (float64 runs on the reference, lightning_index.indexer_topk_blocked)")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
        raise ValueError(f"indexer_topk_triton: topk={topk!r} must be a non-negative integer")
    devices = {t.device for t in (q, k, w, lo, hi)}
    if len(devices) > 1 or not triton_available(next(iter(devices))):
        raise RuntimeError(f"indexer_topk_triton needs Triton and its tensors on one CUDA device (or "
                           f"TRITON_INTERPRET=1), got {sorted(str(d) for d in devices)}; the reference "
                           f"lightning_index.indexer_topk_blocked runs anywhere")


def indexer_topk_triton(q: Tensor, k: Tensor, w: Tensor, lo: Tensor, hi: Tensor, *, topk: int,
                        causal: bool = False) -> Tensor:
    """`lightning_index.indexer_topk_blocked`'s contract in Triton: q [B, T, n, d], k [B, S, d] (bf16, fp16 or
    fp32, the same dtype), w [B, T, n] (fp32, scales folded in), lo, hi [B, T] int64 -> int32 [B, T, topk],
    contiguous: per query min(topk, #candidates) key positions of [lo_t, hi_t) ascending, then -1; ties to the
    smaller position, NaN scores above every number. `causal`: query t is key t (no cache; the ranges satisfy
    hi_t <= t + 1), so no key past a query block's last query is scored. fp32 dots run in TF32 when torch's fp32
    matmuls do (as the reference's einsum on the same GPU). Never reads a device value on the host."""
    _check_indexer(q, k, w, lo, hi, topk)
    B, T, H, D = q.shape
    if q.device.type == "cuda":
        sms, interpret = sm_count(q.device), interpreted()
    else:
        sms, interpret = 1, True
    config = launch_config(B, T, k.shape[1], H, D, topk, causal=causal, sms=sms, interpret=interpret,
                           dtype=q.dtype)
    return indexer_topk_launch(q, k, w, lo, hi, topk=topk, causal=causal, config=config)


def indexer_topk_launch(q: Tensor, k: Tensor, w: Tensor, lo: Tensor, hi: Tensor, *, topk: int, causal: bool,
                        config: IndexerLaunch) -> Tensor:
    """`indexer_topk_triton` with a given launch configuration (`config.split` > 0: the decode path)."""
    _check_indexer(q, k, w, lo, hi, topk)
    B, T, H, D = q.shape
    S = k.shape[1]
    out = torch.empty(B, T, topk, dtype=torch.int32, device=q.device)
    if out.numel() == 0:
        return out
    c = config
    if c.split and (causal or c.split % c.block_k):
        raise ValueError(f"indexer_topk_launch: the decode path takes no `causal` and a split ({c.split}) that is "
                         f"a multiple of block_k ({c.block_k}); got causal={causal}")
    q, k = q.contiguous(), k.contiguous()
    w = w.to(torch.float32).contiguous()
    lo, hi = lo.to(torch.int64).contiguous(), hi.to(torch.int64).contiguous()
    pow2 = triton.next_power_of_2
    HP, DP = max(16, pow2(H)), max(16, pow2(D))
    interp = q.device.type != "cuda" or interpreted()
    upcast = interp and q.dtype != torch.float32
    if q.dtype == torch.float32 or upcast:     # fp32 dots as torch's fp32 matmuls run (full fp32 interpreted)
        prec = "tf32" if not interp and fp32_matmuls_in_tf32() else "ieee"
    else:
        prec = None                            # 16-bit products, exact in the fp32 accumulator
    flags = _stream_flags(c, HP, DP, prec, upcast, HP != H)
    i32 = dict(dtype=torch.int32, device=q.device)
    ntb = triton.cdiv(T, c.block_q)
    if not c.split and c.select_rows:
        _scores_then_select(q, k, w, lo, hi, out, topk, causal, c, flags)
        return out
    if not c.split:
        cap = _capacity(topk, c.block_k, S, c.capacity)
        bk = torch.empty(c.programs, c.block_q, cap, **i32)
        bp = torch.empty_like(bk)
        if c.order not in TASK_ORDERS:
            raise ValueError(f"indexer_topk_launch: order={c.order!r}, expected one of {list(TASK_ORDERS)}")
        nxt = torch.zeros(1, **i32) if c.order == "dynamic" else bk
        _indexer_stream_kernel[(c.programs,)](q, k, w, lo, hi, out, bk, bp, bk, nxt, B, T, S, H, D, topk, ntb, 1,
                                              max(S, 1), cap, _slack(cap, topk, c.block_k), TASK_ORDERS[c.order],
                                              CAUSAL=causal, SPLIT_OUT=False, **flags)
        return out
    nsplit = triton.cdiv(S, c.split)
    caps = _capacity(topk, c.block_k, c.split, c.capacity)
    rows = ntb * c.block_q
    sk = torch.empty(B, rows, nsplit, caps, **i32)
    spos = torch.empty_like(sk)
    sn = torch.empty(B, rows, nsplit, **i32)
    _indexer_stream_kernel[(B * ntb * nsplit,)](q, k, w, lo, hi, out, sk, spos, sn, sn, B, T, S, H, D, topk, ntb,
                                                nsplit, c.split, caps, _slack(caps, topk, c.block_k), 0, CAUSAL=False,
                                                SPLIT_OUT=True, **flags)
    cap = _capacity(topk, c.merge_block, nsplit * min(topk, caps))
    mk = torch.empty(B * T, cap, **i32)
    mp = torch.empty_like(mk)
    _indexer_merge_kernel[(B * T,)](sk, spos, sn, lo, hi, out, mk, mp, T, S, topk, nsplit, c.split, rows, caps,
                                    cap, _slack(cap, topk, c.merge_block), MB=c.merge_block, CH=c.merge_block,
                                    num_warps=c.merge_warps)
    return out


def _scores_then_select(q: Tensor, k: Tensor, w: Tensor, lo: Tensor, hi: Tensor, out: Tensor, topk: int,
                        causal: bool, c: IndexerLaunch, flags: dict):
    """The prefill path in two kernels a chunk of `c.select_rows` queries of every batch row: the order keys of
    each query's candidates into a workspace row [S] (`_indexer_scores_kernel`, programs of block_q queries by
    `key_split` keys; with `causal` no key past the chunk's last query), then each query's topk best of its row
    (`_indexer_select_kernel`, programs looping over the queries). Workspace: B · select_rows · S · 4 bytes plus
    the selection's scratch, programs · segments · capacity · 4 bytes, whatever T."""
    B, T, H, D = q.shape
    S = k.shape[1]
    bm = c.block_q
    if not 1 <= c.sample_bits <= 32:
        raise ValueError(f"indexer_topk_launch: sample_bits must be in [1, 32], got {c.sample_bits}")
    if c.select_align not in (1, 2, 4, 8, 16) or c.block_k % c.select_align:
        raise ValueError(f"indexer_topk_launch: select_align must be 1, 2, 4, 8 or 16 and divide block_k "
                         f"({c.block_k}), got {c.select_align}")
    pow2 = {name: getattr(c, name) for name in ("select_step", "select_segments", "select_warps", "select_chunk")}
    if c.select_capacity:
        pow2["select_capacity"] = c.select_capacity
    odd = {name: v for name, v in pow2.items() if v < 1 or v != triton.next_power_of_2(v)}
    if odd:
        raise ValueError(f"indexer_topk_launch: {', '.join(f'{n}={v}' for n, v in odd.items())} must be powers of "
                         f"two (the selection's tiles)")
    if c.select_rows % bm or c.key_split % c.block_k or c.sample_run < 1 or c.sample % (2 * c.sample_run) or \
            c.sample != triton.next_power_of_2(c.sample):
        raise ValueError(f"indexer_topk_launch: select_rows ({c.select_rows}) must be a multiple of block_q ({bm}), "
                         f"key_split ({c.key_split}) of block_k ({c.block_k}), sample ({c.sample}) a power of two "
                         f"and a multiple of 2 · sample_run ({c.sample_run})")
    ct = min(c.select_rows, triton.cdiv(T, bm) * bm)
    cols = max(16, triton.cdiv(S, 16) * 16)        # 64-byte aligned workspace rows
    cap = max(c.select_capacity or _select_capacity(topk, c.sample, S), triton.next_power_of_2(topk))
    i32 = dict(dtype=torch.int32, device=q.device)
    ws = torch.empty(B * ct, cols, **i32)
    programs = min(B * ct, c.select_programs or 2 * max(c.programs, 1))
    pb = torch.empty(programs, c.select_segments, cap, **i32)
    score_flags = {name: flags[name] for name in ("BM", "BN", "HP", "DP", "HALVES", "PREC", "UPCAST", "PAD_HEADS",
                                                  "num_warps", "num_stages")}
    if "maxnreg" in flags:
        score_flags["maxnreg"] = flags["maxnreg"]
    select_flags = _select_flags(c, cap)
    for c0 in range(0, T, ct):
        keys = min(S, c0 + ct) if causal else S
        grid = (B * ct // bm, max(1, triton.cdiv(keys, c.key_split)))
        _indexer_scores_kernel[grid](q, k, w, lo, hi, ws, T, S, H, D, topk, c0, ct, cols, c.key_split,
                                     CAUSAL=causal, ALIGN=c.select_align, **score_flags)
        _indexer_select_kernel[(programs,)](ws, lo, hi, out, pb, T, S, topk, c0, ct, cols, B * ct,
                                            **select_flags)
