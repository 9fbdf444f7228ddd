"""The Triton indexer (kimi/ops/indexer_triton.py): scores fused with a streaming top-k, and scores then selection
(`select_rows`), against the blocked reference `lightning_index.indexer_topk_blocked` (the `kimi::indexer_topk`
contract). Exact on integer-valued inputs, whose scores every summation order computes exactly (heavy ties included);
on random bf16 inputs a valid top-k of the float64 scores within the fp32 rounding bound. Without a GPU through
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at small shapes; the `gpu` tests run the release's
sizes on the H200."""

import pytest
import torch

from kimi.ops import indexer_triton as it
from kimi.ops import lightning_index
from kimi.ops.lightning_index import topk_reference
from kimi.ops.registry import tl, triton
from kimi.ranges import cache_ranges, document_ranges, range_mask

from helpers import LargestTensor

pytestmark = pytest.mark.skipif(triton is None, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _config(**changes) -> "it.IndexerLaunch":
    """A small explicit launch (several key blocks, chunks, tasks a program) with `changes`."""
    base = it.IndexerLaunch(block_q=4, block_k=32, chunk=64, programs=3, split=0, merge_block=64, num_warps=4,
                            num_stages=1, merge_warps=4)
    return base._replace(**changes)


SMALL = [_config(block_q=1, block_k=16, chunk=16, programs=1, scan_counts=False, order="snake"),
         _config(block_q=2, programs=5, histogram=True, histogram_compactions=True, move_stages=2, order="dynamic",
                 overlap=True)]
"""One query a program with 16-entry chunks (one persistent program for every query, selecting by trial keys,
tasks in snake order), and two queries a program over five programs, selecting by histograms, each program taking
the next task free, each key block's dot issued before the previous block is taken; None below is the
configuration `indexer_topk_triton` chooses (the final selection by histograms, two half dots a block, tasks to
the first free program)."""
SELECT = _config(block_q=2, select_rows=6, key_split=64, sample=16, sample_run=4, select_chunk=16,
                 select_capacity=32, select_programs=4, select_segments=4, select_step=4, halves=True)
"""Scores then selection (`select_rows`): chunks of 6 queries (a ragged last chunk), key splits of two blocks,
four selection programs each taking several queries; rows of more than 16 candidates selected through a sampled
threshold, the row's pass in 4 segments of 4-key steps, at most 32 entries kept at it, so longer rows take the
fallback (more entries at the threshold than that)."""
SELECT_SAMPLED = SELECT._replace(sample=4, sample_run=2, halves=False, select_align=4)
"""Scores then selection with a sample of 4 keys (rows of more than 4 candidates through the sampled threshold),
each key block scored as one dot, rows read in blocks of 4 keys (SELECT's: 16)."""
SELECT_WARP = SELECT._replace(select_warps=1, select_segments=1, select_chunk=32, select_align=1)
"""The selection as programs of one warp: one segment, rows read from lo exactly (no blocks)."""
PREFILL = [(None, 1), (None, 30), (SMALL[0], 7), (SMALL[1], 7), (SMALL[1], 30), (SELECT, 3), (SELECT, 12),
           (SELECT_WARP, 5)]


def _ints(*shape, dtype=torch.float32):
    """Integer values in [-2, 2]: every partial sum of the scores is exact, and equal scores are frequent."""
    return torch.randint(-2, 3, shape, dtype=torch.int64).to(dtype=dtype, device=DEVICE)


def _inputs(B, T, S, n=4, d=16):
    return _ints(B, T, n, d), _ints(B, S, d), _ints(B, T, n)


def _packed(B, T):
    """Document ids [B, T]: random document lengths (down to 1), the first row right-padded (-1)."""
    rows = []
    for b in range(B):
        lengths = torch.randint(1, T, (T,)).tolist()
        ids = sum(([i] * n for i, n in enumerate(lengths)), [])[:T]
        if b == 0:
            pad = int(torch.randint(1, T // 3, ()))
            ids = ids[:T - pad] + [-1] * pad
        rows.append(ids)
    return torch.tensor(rows, device=DEVICE)


def _run(q, k, w, lo, hi, topk, causal, config):
    if config is None:
        return it.indexer_topk_triton(q, k, w, lo, hi, topk=topk, causal=causal)
    return it.indexer_topk_launch(q, k, w, lo, hi, topk=topk, causal=causal, config=config)


def _expected(q, k, w, lo, hi, topk, causal):
    """The op's blocked reference (blocks of 32 queries), checked against the sorting oracle on the op's ranking:
    NaN ties with +inf, and a candidate scoring -inf is still a candidate (the oracle alone would sort NaN above
    +inf, and a candidate's -inf among the masked keys' -inf, behind smaller non-candidate positions)."""
    want = lightning_index.indexer_topk_blocked(q, k, w, lo, hi, topk=topk, causal=causal, block=32)
    ranked = lightning_index.scores(q, k, w)
    ranked = ranked.nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=torch.finfo(ranked.dtype).min)
    oracle = topk_reference(ranked, range_mask(lo, hi, k.shape[1]), topk)
    assert torch.equal(want, oracle)
    return want


def _assert_exact(q, k, w, lo, hi, topk, causal, config):
    got = _run(q, k, w, lo, hi, topk, causal, config)
    assert got.dtype == torch.int32 and got.shape == (*q.shape[:2], topk) and got.is_contiguous()
    want = _expected(q, k, w, lo, hi, topk, causal)
    bad = (got != want).any(-1).nonzero()
    assert not len(bad), (config, topk, bad[:4].tolist(), got[tuple(bad[0])].tolist(), want[tuple(bad[0])].tolist())


@pytest.mark.parametrize("config, topk", PREFILL)
def test_exact_on_packed_documents(config, topk):
    """Causal packed documents with padding (lo > 0, lo == hi), integer scores full of ties: equal to the
    reference for topk 1, one not a multiple of any block, and one above most documents' lengths (short rows keep
    every candidate)."""
    B, T = 2, 40
    r = document_ranges(_packed(B, T))
    q, k, w = _inputs(B, T, T)
    _assert_exact(q, k, w, r.lo, r.hi, topk, True, config)


@pytest.mark.parametrize("config", [None, *SMALL, SELECT, SELECT_SAMPLED, SELECT_WARP])
def test_exact_on_cached_and_arbitrary_ranges(config):
    """Without `causal` (a prefill chunk on a cache: rows starting at different slots, queries before a row's
    start are padding) and on arbitrary ranges, empty, reversed or past the keys on either side."""
    B, T, S = 2, 12, 150
    q, k, w = _inputs(B, T, S)
    r = cache_ranges(torch.arange(130, 130 + T, device=DEVICE), torch.tensor([3, 135], device=DEVICE), S)
    _assert_exact(q, k, w, r.lo, r.hi, 9, False, config)
    lo = torch.randint(-5, S + 5, (B, T), device=DEVICE)
    hi = torch.randint(-5, S + 5, (B, T), device=DEVICE)
    _assert_exact(q, k, w, lo, hi, 21, False, config)


@pytest.mark.parametrize("order", ["increasing", "decreasing", "constant", "random"])
def test_exact_through_many_compactions(order):
    """S far above the buffer: with scores increasing along the keys every key enters and the buffer is compacted
    every block; decreasing, nothing enters after the first topk; constant, every score ties and the first topk
    candidates win; random, a few compactions. Queries start at different keys (no key block alignment). The
    histogram selection meets there its fallbacks (a K-th key's bin too large to copy behind the entries). The
    first launch scores each key block as two dots (`halves`)."""
    B, T, S, n, d = 1, 5, 192, 2, 16
    q, k, w = _inputs(B, T, S, n, d)
    s = torch.arange(S, device=DEVICE, dtype=torch.float32)
    if order != "random":
        q, w = q.abs() + 1, w.abs() + 1
        k = {"increasing": s, "decreasing": S - s, "constant": torch.ones_like(s)}[order][None, :, None].expand(B, S, d)
    lo = torch.randint(0, 30, (B, T), device=DEVICE)
    hi = torch.full((B, T), S, device=DEVICE)
    hist = _config(block_k=16, chunk=16, histogram=True, histogram_compactions=True, histogram_bins=16)
    for topk, config in ((5, _config(block_k=16, chunk=16, halves=True)), (37, None), (11, hist)):
        assert it._capacity(topk, 32 if config is None else 16, S) < S - 30     # compactions are needed
        _assert_exact(q, k.contiguous(), w, lo, hi, topk, False, config)
    for select in (SELECT, SELECT_WARP):
        _assert_exact(q, k.contiguous(), w, lo, hi, 9, False, select._replace(block_k=16, key_split=48,
                                                                              select_capacity=128))


def _sampled(n, m, run, align):
    """The positions of a row of n candidates starting at 0 that `_indexer_select_kernel` samples (m keys in runs
    of `run`, from the row's blocks of `align` keys; positions past n are the blocks' padding)."""
    i = torch.arange(m)
    span = -(-n // align) * align
    pos = (i // run) * (span - run) // (m // run - 1) // align * align + i % run
    return pos[pos < n]


@pytest.mark.parametrize("config", [SELECT, SELECT_SAMPLED, SELECT_WARP])
def test_rows_never_take_slots_past_their_range(config):
    """A row whose sampled threshold is the least possible key (a sample of 4 keys, one of them its block's
    padding, and more of the best wanted than the sample holds) after the same workspace row held a longer row's
    high keys past this row's range: only its own candidates are taken."""
    B, T, S = 1, 12, 40
    q, k, w = _inputs(B, T, S)
    q, w = q.abs() + 1, w.abs() + 1
    k = k.abs()
    k[:, 8:16] += 2                                   # the longer rows' best keys lie past the shorter rows' range
    lo = torch.zeros(B, T, dtype=torch.int64, device=DEVICE)
    hi = torch.tensor([[S] * 6 + [5] * 6], device=DEVICE)
    for topk in (1, 3):
        _assert_exact(q, k, w, lo, hi, topk, False, config)


@pytest.mark.parametrize("warp", [False, True])
@pytest.mark.parametrize("sample_is", ["best", "worst", "tied"])
def test_exact_when_the_sample_misleads(sample_is, warp):
    """Rows whose sampled keys are their best (the threshold keeps fewer than topk: the exact search over the row),
    their worst (it keeps more than the capacity and more than topk lie above it: the same search), or tied with
    all but three late keys (the threshold is the topk-th key, kept with its earliest ties in one pass over the
    row): still the reference's selection, through the scores-then-selection path, with rows read in blocks of 16
    keys or (programs of one warp) from lo exactly."""
    B, T, S, n, d, topk = 1, 4, 200, 2, 16, 8
    config = (SELECT_WARP if warp else SELECT)._replace(select_capacity=32, sample=32, sample_run=4)
    picked = torch.zeros(S, dtype=torch.bool)
    picked[_sampled(S, 32, 4, config.select_align)] = True
    if sample_is == "tied":
        value = torch.ones(S)
        late = (~picked).nonzero()[-12::4, 0]
        value[late] = torch.tensor([5.0, 3.0, 4.0])
    else:
        value = torch.randperm(S).float()
        value[picked] += S if sample_is == "best" else -S
    k = (value[None, :, None].expand(B, S, d) / d).contiguous().to(DEVICE)
    q, w = torch.ones(B, T, n, d, device=DEVICE), torch.ones(B, T, n, device=DEVICE)
    lo, hi = torch.zeros(B, T, dtype=torch.int64, device=DEVICE), torch.full((B, T), S, device=DEVICE)
    _assert_exact(q, k, w, lo, hi, topk, False, config)


@pytest.mark.parametrize("capacity", [0, 256])
@pytest.mark.parametrize("histogram", [False, True])
def test_exact_final_selection_over_distinct_scores(capacity, histogram):
    """Scores all distinct, in random order, over more keys than the buffer holds (capacity 0: compactions along
    the way) or fewer (256: one selection at the end; with `histogram` through the two histograms of `_select`,
    the K-th key's bin copied behind the entries, the path a buffer with room takes): exactly the reference's."""
    B, T, S, n, d = 2, 6, 200, 2, 16
    q, w = torch.ones(B, T, n, d, device=DEVICE), torch.ones(B, T, n, device=DEVICE)
    k = torch.stack([torch.randperm(S, device=DEVICE) for _ in range(B)]).float()[..., None].expand(B, S, d) / d
    lo = torch.randint(0, 20, (B, T), device=DEVICE)
    hi = torch.full((B, T), S, device=DEVICE)
    for topk in (7, 40):
        _assert_exact(q, k.contiguous(), w, lo, hi, topk, False,
                      _config(capacity=capacity, histogram=histogram, histogram_compactions=histogram))


DECODE = [(None, 5), (None, 300), (_config(split=32, block_k=16, chunk=16, merge_block=16), 5),
          (_config(split=32, block_k=16, chunk=16, merge_block=16, histogram=True, histogram_compactions=True), 50),
          (_config(split=96, merge_block=128), 50)]


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("config, topk", DECODE)
def test_decode_exact(T, config, topk):
    """The decode path: the cache split over programs, each keeping its piece's top-k, then the merge. A few
    queries against 250 slots (the last piece ragged), rows starting at slot 0, mid-cache and after the queries
    (padding); topk below and above the piece size (pieces that select, pieces that keep everything) and above the
    candidates."""
    B, S = 3, 250
    q, k, w = _inputs(B, T, S)
    r = cache_ranges(torch.arange(220, 220 + T, device=DEVICE), torch.tensor([0, 77, 222], device=DEVICE), S)
    if config is None:
        assert it.launch_config(B, T, S, 4, 16, topk, causal=False, sms=1, interpret=True).split
    else:
        config = config._replace(block_q=triton.next_power_of_2(T))
    _assert_exact(q, k, w, r.lo, r.hi, topk, False, config)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the interpreter's numpy
def test_nan_and_inf_scores_rank_first():
    """A NaN score (a NaN key, query or head weight) ranks above every finite number and ties with +inf, as
    `select_topk` ranks them, so ties among them go to the smaller position; a candidate scoring -inf is still a
    candidate. Prefill and decode paths."""
    B, T, S = 2, 20, 120
    q, k, w = _inputs(B, T, S)
    k[0, [3, 50, 51]] = float("nan")
    q[0, 5, 1, 0] = float("nan")                     # every score of query (0, 5) is NaN
    w[0, 17, 3] = float("nan")
    k[1, 9, 3], k[1, 11, 0], k[1, 6, 2] = float("inf"), float("nan"), float("inf")
    q[1, 12], w[1, 12] = 1.0, 1.0                    # query (1, 12): +inf at key 9, NaN at key 11: a tie
    q[1, 12, :, 2] = -1.0                            # (and a finite score at key 6)
    q[1, 6], w[1, 6] = 1.0, -1.0                     # query (1, 6): two candidates, key 6 scoring -inf
    doc = torch.tensor([[0] * 8 + [1] * 12, [0] * 5 + [1] * 15], device=DEVICE)
    r = document_ranges(doc)
    for topk in (1, 2, 6):
        _assert_exact(q, k, w, r.lo, r.hi, topk, True, None)
        _assert_exact(q, k, w, r.lo, r.hi, topk, True, SELECT_SAMPLED)
    got = it.indexer_topk_triton(q, k, w, r.lo, r.hi, topk=2, causal=True)
    assert got[1, 12].tolist() == [9, 11] and got[1, 6].tolist() == [5, 6]
    assert it.indexer_topk_triton(q, k, w, r.lo, r.hi, topk=1, causal=True)[1, 12].item() == 9
    r = cache_ranges(torch.arange(110, 112, device=DEVICE), torch.tensor([0, 8], device=DEVICE), S)
    _assert_exact(q[:, :2].contiguous(), k, w[:, :2].contiguous(), r.lo, r.hi, 4, False, None)
    _assert_exact(q[:, :2].contiguous(), k, w[:, :2].contiguous(), r.lo, r.hi, 4, False, SELECT_SAMPLED)


if triton is not None:
    @triton.jit
    def _keys_kernel(x_ptr, y_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(y_ptr + i, it._score_key(tl.load(x_ptr + i)))


if triton is not None:
    @triton.jit
    def _kth_kernel(x_ptr, out_ptr, N: tl.constexpr):
        r = tl.program_id(0) + 1
        kth, room = it._kth_key(tl.load(x_ptr + tl.arange(0, N)), r)
        tl.store(out_ptr + 2 * r - 2, kth)
        tl.store(out_ptr + 2 * r - 1, room)


def _clustered_keys():
    """52 real int32 keys clustered in a few values across every bit range (ties, both signs, the extremes), and
    the same keys shuffled into a 64-slot tile with INT32_MIN padding."""
    spots = torch.tensor([-2 ** 31 + 1, -2 ** 24, -257, -256, -1, 0, 1, 255, 256, 2 ** 16 + 3, 2 ** 24, 2 ** 31 - 1])
    real = torch.cat([spots, spots[torch.randint(0, len(spots), (40,))] + torch.randint(0, 2, (40,))]).clamp(
        -2 ** 31 + 1, 2 ** 31 - 1)
    x = torch.full((64,), -2 ** 31, dtype=torch.int64)
    x[:len(real)] = real
    return real, x[torch.randperm(64)].to(torch.int32).to(DEVICE)


def test_kth_key_for_every_rank():
    """`_kth_key` (the selection kernel's search of a tile) on int32 keys clustered in a few values across every bit
    range (ties, both signs, the extremes) with INT32_MIN padding: for every r from 1 to the number of real keys,
    the r-th largest key and how many of its ties are among the r largest, as sorting gives them."""
    real, x = _clustered_keys()
    out = torch.empty(2 * len(real), dtype=torch.int32, device=DEVICE)
    _kth_kernel[(len(real),)](x, out, N=64)
    desc = real.sort(descending=True).values
    r = torch.arange(1, len(real) + 1)
    kth = desc[r - 1]
    room = r - (real[None, :] > kth[:, None]).sum(-1)
    assert torch.equal(out.view(-1, 2).cpu().long(), torch.stack([kth, room], -1))


if triton is not None:
    @triton.jit
    def _kth_above_kernel(x_ptr, low_ptr, out_ptr, N: tl.constexpr, BITS: tl.constexpr):
        r = tl.program_id(0) + 1
        x = tl.load(x_ptr + tl.arange(0, N))
        kth, room = it._kth_key_above(x, r, tl.load(low_ptr + r - 1))
        tl.store(out_ptr + 3 * r - 3, kth)
        tl.store(out_ptr + 3 * r - 2, room)
        tl.store(out_ptr + 3 * r - 1, it._key_at_least(x, r, BITS))


@pytest.mark.parametrize("bits", [1, 9, 20])
def test_narrowed_searches_for_every_rank(bits):
    """`_kth_key_above` (the K-th key of the kept entries, searched below the bits its lower bound and the tile's
    largest key share) for every rank r, each with a lower bound at most the r-th largest key: equal to it, just
    below, far below, INT32_MIN, of either sign; and `_key_at_least` (the sample's threshold): the r-th largest
    key's first `bits` bits, the rest 0."""
    real, x = _clustered_keys()
    desc = real.sort(descending=True).values
    r = torch.arange(1, len(real) + 1)
    kth = desc[r - 1]
    gap = torch.stack([torch.zeros_like(kth), torch.randint(0, 3, kth.shape), torch.randint(0, 2 ** 20, kth.shape),
                       kth + 2 ** 31, kth - desc[-1]])[torch.randint(0, 5, kth.shape), r - 1]
    low = (kth - gap).clamp(min=-2 ** 31)
    out = torch.empty(3 * len(real), dtype=torch.int32, device=DEVICE)
    _kth_above_kernel[(len(real),)](x, low.to(torch.int32).to(DEVICE), out, N=64, BITS=bits)
    room = r - (real[None, :] > kth[:, None]).sum(-1)
    prefix = kth & ~((1 << (32 - bits)) - 1)
    assert torch.equal(out.view(-1, 3).cpu().long(), torch.stack([kth, room, prefix], -1))


def test_score_keys_order_as_the_scores():
    """The int32 keys the selection compares order every fp32 value as the scores rank: NaN of either sign equal to
    +inf, -0 equal to +0, denormals and infinities in place."""
    values = [float("-inf"), -3e38, -3.5, -1.0, -1e-40, -0.0, 0.0, 1e-45, 1e-40, 1.0, 2.0, 3e38, float("inf"),
              float("nan")]
    x = torch.tensor(values + [0.0, 0.5], dtype=torch.float32)
    x[-2] = torch.tensor(-4194304, dtype=torch.int32).view(torch.float32)      # a NaN with the sign bit set
    x = torch.cat([x, torch.randn(16) * 10.0 ** torch.randint(-40, 38, (16,))]).to(DEVICE)
    keys = torch.empty(x.shape, dtype=torch.int32, device=DEVICE)
    _keys_kernel[(1,)](x, keys, N=x.numel())
    ranked = x.double().nan_to_num(nan=float("inf"), posinf=float("inf"))
    assert torch.equal(torch.sign(keys[:, None].long() - keys[None, :].long()),
                       torch.sign(ranked[:, None] - ranked[None, :]).nan_to_num(0.0).long())


def _assert_valid_topk(idx, q, k, w, lo, hi, topk):
    """idx is a top-k of the float64 scores of the same (bf16) inputs, up to the kernel's fp32 rounding: counts
    exact, ascending valid prefix, -1 suffix, only candidates; every selected key's score at least the k-th
    largest minus the bound and every unselected candidate's at most the k-th plus it. The bound: an fp32 sum of
    m terms errs by at most m·u·Σ|terms| (exact bf16 products), over the d-term dots and the weighted n-term sum;
    with u = 2^-22, four fp32 roundings (tensor-core accumulation need not round to nearest)."""
    ref = lightning_index.scores(q.double(), k.double(), w.double())
    B, T, S = ref.shape
    n, d = q.shape[2], q.shape[3]
    absum = torch.einsum("btnd,bsd->btns", q.double().abs(), k.double().abs())
    bound = 2 * (n + d + 2) * 2.0 ** -22 * torch.einsum("btns,btn->bts", absum, w.double().abs())
    valid = range_mask(lo, hi, S)
    count = valid.sum(-1)
    chosen = idx >= 0
    assert torch.equal(chosen.sum(-1), count.clamp(max=topk))
    assert torch.equal(chosen, torch.arange(topk, device=idx.device) < chosen.sum(-1, keepdim=True))
    pref = torch.where(chosen, idx, torch.iinfo(torch.int32).max)
    assert bool((pref[..., 1:] > pref[..., :-1]).logical_or(~chosen[..., 1:]).all())
    sel = torch.zeros(B, T, S + 1, dtype=torch.bool, device=idx.device).scatter(
        -1, torch.where(chosen, idx, S).long(), True)[..., :S]
    assert not bool((sel & ~valid).any())
    tau = bound.masked_fill(~valid, 0).amax(-1)                          # the row's largest error bound
    kk = min(topk, S)
    kth = ref.masked_fill(~valid, float("-inf")).topk(kk, dim=-1).values[..., -1]
    full = count > topk
    low = ref.masked_fill(~sel, float("inf")).amin(-1)                  # the worst selected score
    high = ref.masked_fill(sel | ~valid, float("-inf")).amax(-1)        # the best unselected candidate
    assert bool((low[full] >= kth[full] - 2 * tau[full]).all()), (low - kth + 2 * tau)[full].min()
    assert bool((high[full] <= kth[full] + 2 * tau[full]).all()), (high - kth - 2 * tau)[full].max()
    exact = topk_reference(ref, valid, topk)                              # overlap with the float64 selection
    hits = torch.zeros_like(sel).scatter(-1, torch.where(exact >= 0, exact, S).long().clamp(max=S - 1), True) & sel
    overlap = hits.sum(-1)[full].double() / topk
    assert not len(overlap) or overlap.mean() >= 0.97


def _bf16(B, T, S, n=4, d=16):
    return (torch.randn(B, T, n, d, device=DEVICE).bfloat16(), torch.randn(B, S, d, device=DEVICE).bfloat16(),
            torch.randn(B, T, n, device=DEVICE))


def test_bf16_selection_is_a_valid_topk():
    """Random bf16 q and k, fp32 head weights of both signs: prefill on packed documents, a cached prefill chunk
    and the decode path, each a valid top-k of the float64 scores."""
    B, T, topk = 2, 48, 9
    q, k, w = _bf16(B, T, T)
    r = document_ranges(_packed(B, T))
    _assert_valid_topk(it.indexer_topk_triton(q, k, w, r.lo, r.hi, topk=topk, causal=True), q, k, w, r.lo, r.hi,
                       topk)
    S = 300
    q, k, w = _bf16(B, 8, S)
    r = cache_ranges(torch.arange(290, 298, device=DEVICE), torch.tensor([0, 40], device=DEVICE), S)
    _assert_valid_topk(it.indexer_topk_triton(q, k, w, r.lo, r.hi, topk=12, causal=False), q, k, w, r.lo, r.hi, 12)
    q, w = q[:, :2].contiguous(), w[:, :2].contiguous()
    r = cache_ranges(torch.arange(290, 292, device=DEVICE), torch.tensor([0, 40], device=DEVICE), S)
    assert it.launch_config(B, 2, S, 4, 16, 12, causal=False, sms=1, interpret=True).split
    _assert_valid_topk(it.indexer_topk_triton(q, k, w, r.lo, r.hi, topk=12, causal=False), q, k, w, r.lo, r.hi, 12)


def test_launch_configs_and_memory():
    """The configurations the H200 (132 SMs) gets, computed on the CPU: the prefill workspace is independent of T
    and S (persistent programs) and far below one [T, S] score matrix; decode splits are static functions of the
    shapes, multiples of the key block, enough programs for the SMs; causal or long query sets never split."""
    sms = 132
    c = it.launch_config(1, 131072, 131072, 64, 128, 2048, causal=True, sms=sms, interpret=False)
    assert not c.split and c.programs == 2 * sms
    cap = it._capacity(2048, c.block_k, 131072, c.capacity)
    assert cap == 3 * 2048
    assert c.programs * c.block_q * cap * 8 <= 50 * 2 ** 20                 # 51.9 MB, vs 64 GiB of fp32 scores
    # the causal prefill's default, scores then selection: its workspace no larger than the output
    assert c.select_rows and c.select_rows * 131072 * 4 <= 131072 * 2048 * 4
    assert c.select_rows % c.block_q == 0 and c.key_split % c.block_k == 0
    for S, rows in ((8192, 8192), (16384, 4096), (20000, 2048), (65536, 2048)):     # larger chunks on short rows,
        short = it.launch_config(1, S, S, 64, 128, 2048, causal=True, sms=sms, interpret=False)  # within 256 MiB
        assert short.select_rows == rows and rows * S * 4 <= max(2 ** 28, S * 2048 * 4)
    scratch = 2 * c.programs * c.select_segments * it._select_capacity(2048, c.sample, 131072) * 4
    assert scratch <= 150 * 2 ** 20, scratch
    assert not it.launch_config(1, 8192, 131072, 64, 128, 2048, causal=False, sms=sms, interpret=False).select_rows
    assert not it.launch_config(1, 8192, 8192, 64, 128, 2048, causal=True, sms=sms, interpret=False,
                                dtype=torch.float32).select_rows
    for B, S in ((1, 131072), (32, 131072), (4, 8192), (1, 4096)):
        c = it.launch_config(B, 1, S, 64, 128, 2048, causal=False, sms=sms, interpret=False)
        assert c.split and c.split % c.block_k == 0 and c.block_q == 1
        assert B * triton.cdiv(S, c.split) >= min(sms, B * S // (4 * c.block_k))
    assert not it.launch_config(1, 1, 4096, 64, 128, 2048, causal=True, sms=sms, interpret=False).split
    assert not it.launch_config(1, 64, 131072, 64, 128, 2048, causal=False, sms=sms, interpret=False).split
    assert not it.launch_config(1, 4, 256, 64, 128, 2048, causal=False, sms=sms, interpret=False).split


def test_allocates_nothing_of_size_t_by_s():
    """No tensor created during the call (workspaces, the interpreter's byte copies of the inputs) is as large as
    one [T, S] matrix of fp32 scores."""
    T = 96
    q, k, w = _inputs(1, T, T, n=2)
    t = torch.arange(T, device=DEVICE)[None]
    for config in (None, SELECT._replace(block_q=4, select_rows=32, select_capacity=128)):
        with LargestTensor() as largest:
            idx = _run(q, k, w, torch.zeros_like(t), t + 1, 8, True, config)
        assert 0 < largest.bytes < T * T * 4, largest.bytes
        assert torch.equal(idx, _expected(q, k, w, torch.zeros_like(t), t + 1, 8, True))


def test_edge_shapes_and_errors():
    """No queries, topk 0, an empty cache (every slot -1), topk above S; float64 and mismatched shapes refused
    with the fix in the message."""
    q, k, w = _inputs(2, 5, 9)
    lo, hi = torch.zeros(2, 5, dtype=torch.int64, device=DEVICE), torch.full((2, 5), 9, device=DEVICE)
    assert it.indexer_topk_triton(q[:, :0], k, w[:, :0], lo[:, :0], hi[:, :0], topk=4).shape == (2, 0, 4)
    assert it.indexer_topk_triton(q, k, w, lo, hi, topk=0).shape == (2, 5, 0)
    empty = it.indexer_topk_triton(q, k[:, :0], w, lo * 0, hi * 0, topk=3)
    assert torch.equal(empty, torch.full((2, 5, 3), -1, dtype=torch.int32, device=DEVICE))
    _assert_exact(q, k, w, lo, hi, 20, False, None)
    with pytest.raises(ValueError, match="float64 runs on the reference"):
        it.indexer_topk_triton(q.double(), k.double(), w, lo, hi, topk=3)
    with pytest.raises(ValueError, match=r"expected q \[B, T, n, d\]"):
        it.indexer_topk_triton(q, k[:, :, :8], w, lo, hi, topk=3)
    for bad, match in ((SELECT._replace(sample=24, sample_run=4), "a power of two"),
                       (SELECT._replace(sample=16, sample_run=16), "2 · sample_run"),
                       (SELECT._replace(select_rows=5), "multiple of block_q"),
                       (SELECT._replace(select_align=3), "select_align"),
                       (SELECT._replace(select_align=16, block_k=8), "divide block_k"),
                       (SELECT._replace(sample_bits=0), "sample_bits"),
                       (SELECT._replace(select_step=48), "select_step=48 must be powers of two"),
                       (SELECT._replace(select_capacity=48), "select_capacity=48 must be powers of two"),
                       (SELECT._replace(select_segments=3), "select_segments=3")):
        with pytest.raises(ValueError, match=match):
            _run(q, k, w, lo, hi, 3, False, bad)


# ------------------------------------------------------------------------------------------ the release's sizes

ONE_DOT = None if triton is None else it.launch_config(
    1, 6144, 6144, 64, 128, 2048, causal=True, sms=132, interpret=False)._replace(halves=False, order="cyclic",
                                                                                 num_stages=2)
"""The release's launch as it was before the default took two half dots a key block, the dynamic task order and
three key stages: one dot a block, tasks in turn, two stages."""


STREAM_RELEASE = None if triton is None else it.launch_config(
    1, 6144, 6144, 64, 128, 2048, causal=True, sms=132, interpret=False)._replace(select_rows=0)
"""The release's causal launch with the streaming top-k instead of its default scores then selection."""


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, _config(block_q=2, block_k=64, chunk=512, programs=264), ONE_DOT,
                                    STREAM_RELEASE])
def test_gpu_exact_release_shapes(config):
    """64 heads of 128, topk 2048, 6,144 tokens in two packed documents and a padded tail: equal to the reference
    on integer bf16 inputs (exact products and sums on the tensor cores), ties everywhere."""
    B, T, n, d = 1, 6144, 64, 128
    q, k, w = _ints(B, T, n, d, dtype=torch.bfloat16), _ints(B, T, d, dtype=torch.bfloat16), _ints(B, T, n)
    r = document_ranges(torch.tensor([[0] * 4000 + [1] * 2100 + [-1] * 44], device=DEVICE))
    got = _run(q, k, w, r.lo, r.hi, 2048, True, config)
    assert torch.equal(got, lightning_index.indexer_topk_blocked(q, k, w, r.lo, r.hi, topk=2048, causal=True))


@pytest.mark.gpu
def test_gpu_bf16_long_prefill_is_a_valid_topk():
    """16K tokens causal in bf16 with the release's heads and topk: every row's counts and order, and 192 sampled
    rows against their float64 scores."""
    B, T, n, d, topk = 1, 16384, 64, 128, 2048
    q, k, w = _bf16(B, T, T, n, d)
    w = w * (n * d) ** -0.5
    lo, hi = torch.zeros(B, T, dtype=torch.int64, device=DEVICE), torch.arange(1, T + 1, device=DEVICE)[None]
    idx = it.indexer_topk_triton(q, k, w, lo, hi, topk=topk, causal=True)
    chosen = idx >= 0
    assert torch.equal(chosen.sum(-1), hi.clamp(max=topk))
    rows = torch.cat([torch.arange(2040, 2060, device=DEVICE), torch.randint(2048, T, (172,), device=DEVICE)])
    _assert_valid_topk(idx[:, rows], q[:, rows], k, w[:, rows], lo[:, rows], hi[:, rows], topk)
    config = it.launch_config(B, T, T, n, d, topk, causal=True, sms=132, interpret=False)
    assert config.select_rows                                            # the default scores then selects
    for other in (config._replace(select_rows=0), config._replace(select_rows=4096, sample=8192),
                  config._replace(select_align=1)):
        assert torch.equal(it.indexer_topk_launch(q, k, w, lo, hi, topk=topk, causal=True, config=other), idx)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
def test_gpu_decode_long_cache(T):
    """Decode over 131,072 cached slots (batch 2, one row starting mid-cache): exact on integer inputs, a valid
    top-k on random ones."""
    B, S, n, d, topk = 2, 131072, 64, 128, 2048
    r = cache_ranges(torch.arange(S - T, S, device=DEVICE), torch.tensor([0, 70000], device=DEVICE), S)
    assert it.launch_config(B, T, S, n, d, topk, causal=False, sms=132, interpret=False).split
    q, k, w = _ints(B, T, n, d, dtype=torch.bfloat16), _ints(B, S, d, dtype=torch.bfloat16), _ints(B, T, n)
    assert torch.equal(it.indexer_topk_triton(q, k, w, r.lo, r.hi, topk=topk),
                       lightning_index.indexer_topk_blocked(q, k, w, r.lo, r.hi, topk=topk))
    q, k, w = _bf16(B, T, S, n, d)
    _assert_valid_topk(it.indexer_topk_triton(q, k, w, r.lo, r.hi, topk=topk), q, k, w, r.lo, r.hi, topk)


@pytest.mark.gpu
def test_gpu_decode_step_replays_in_a_cuda_graph():
    """The decode path captured once in a CUDA graph (no host read of lo/hi) and replayed after the ranges move
    in place, as a decode step's do: every replay equals an eager call on the new ranges."""
    B, T, S, n, d, topk = 2, 1, 32768, 64, 128, 2048
    q, k, w = _bf16(B, T, S, n, d)
    lo = torch.zeros(B, T, dtype=torch.int64, device=DEVICE)
    hi = torch.full((B, T), 100, dtype=torch.int64, device=DEVICE)
    it.indexer_topk_triton(q, k, w, lo, hi, topk=topk)                 # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = it.indexer_topk_triton(q, k, w, lo, hi, topk=topk)
    for step in (3000, 17000, S):
        hi.fill_(step)
        lo[1] = step // 3
        graph.replay()
        assert torch.equal(out, it.indexer_topk_triton(q, k, w, lo, hi, topk=topk))
