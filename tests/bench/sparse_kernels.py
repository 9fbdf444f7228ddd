"""The sparse-attention and indexer kernels alone, against the torch references and cuDNN, in one run.

    PYTHONPATH=. python tests/bench/sparse_kernels.py                       # H200: T = 8K and 32K
    PYTHONPATH=. python tests/bench/sparse_kernels.py --tokens 4096 --no-indexer

Attention (the contract of `kimi::sparse_mla_gather`): B = 1, H = 96 heads, q [T, H, 576] (W_UK absorbed), one
latent [T, 576] (values: its first 512 columns), each query t attending to min(t + 1, k) keys drawn at random
from [0, t] (k = 2048; -1 padded), bf16, scale 192^-1/2. Rows: the torch reference (`gather`), the Triton kernels
(`triton`, forward, backward alone and forward+backward) and, when cuDNN Frontend's DSA module imports, cuDNN's
SM90 sparse backward on the same o and LSE (its forward is SM100-only). TFLOP/s count the selected pairs:
forward 2·H·pairs·(576 + 512), backward 2·H·pairs·(3·576 + 2·512) (the recomputed scores included).

Indexer (the contract of `kimi::indexer_topk`): 64 heads × 128, bf16 q and k, fp32 weights, causal, top 2048.
Rows: the blocked torch reference, the Triton kernel (streaming top-k, no score buffer) and cuDNN's dense scores
plus its radix top-k (an fp32 [T, T] buffer). TFLOP/s count the causal half: 2·n·d·T²/2.

Each time is the median of `--iters` calls after a warm-up (the first call compiles the Triton kernels); "peak"
is the most memory allocated during the call above what was allocated before it. Outputs are compared with the
reference in the same run (relative error of o, dq, dlatent; for the indexer, the share of selected keys that
agree and whether every disagreement is a near-tie). `--profile`: after each T's attention rows, the Triton
backward's CUDA time per kernel, dlatent by atomics and in the fixed order (`deterministic=True`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kimi  # noqa: E402,F401  (registers the kimi:: ops)
from kimi.ops import lightning_index  # noqa: E402
from kimi.ops import sparse_mla_triton as smt  # noqa: E402

D, DV, NI, DI = 576, 512, 64, 128


def measure(fn, iters: int) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**30


def kernel_times(name, fn, iters=3):
    """CUDA time per kernel name of `fn` (averaged over `iters` calls after a warm-up)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    print(f"\n{name}\n| kernel | ms a call | calls a call |\n|---|---|---|")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total > 0:
            print(f"| {e.key[:70]} | {e.device_time_total / iters / 1e3:.2f} | {e.count / iters:g} |", flush=True)


def causal_selection(T: int, k: int, device) -> torch.Tensor:
    """int32 [1, T, k]: for query t, min(t + 1, k) distinct random keys of [0, t], ascending, then -1."""
    out = torch.empty(T, k, dtype=torch.int32, device=device)
    for t0 in range(0, T, 1024):
        t1 = min(t0 + 1024, T)
        r = torch.rand(t1 - t0, t1, device=device)
        r = r.masked_fill(torch.arange(t1, device=device)[None] > torch.arange(t0, t1, device=device)[:, None], -1)
        v, i = r.topk(min(k, t1), dim=-1)
        i = torch.where(v >= 0, i, t1).sort(-1).values
        i = torch.where(i == t1, -1, i).to(torch.int32)
        out[t0:t1] = torch.nn.functional.pad(i, (0, k - i.shape[1]), value=-1)
    return out[None]


def timed_row(cells: list[str], fn, flops: float, iters: int) -> float | None:
    """Print one table row: the given cells, then ms, TFLOP/s and peak GiB of `fn` (or out of memory)."""
    try:
        ms, peak = measure(fn, iters)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        print(f"| {' | '.join(cells)} | out of memory | | |", flush=True)
        return None
    print(f"| {' | '.join(cells)} | {ms:,.2f} | {flops / ms / 1e9:,.0f} | {peak:.2f} |", flush=True)
    return ms


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def cudnn_dsa():
    try:
        from cudnn import DSA
        DSA.sparse_attention_backward_wrapper
        return DSA
    except Exception as e:   # not installed, or its CUTLASS DSL runtime missing
        print(f"(cuDNN DSA unavailable: {type(e).__name__}: {str(e)[:120]})")
        return None


def attention_inputs(T: int, H: int, k: int, dev) -> tuple[torch.Tensor, ...]:
    """bf16 q [1, T, H, 576], latent [1, T, 576], a causal selection of k, the output gradient [1, T, H, 512]."""
    q = (torch.randn(1, T, H, D, device=dev) * 0.5).bfloat16()
    lat = torch.randn(1, T, D, device=dev).bfloat16()
    return q, lat, causal_selection(T, k, dev), torch.randn(1, T, H, DV, device=dev).bfloat16()


def attention_rows(T: int, H: int, k: int, iters: int, dsa, profile: bool = False) -> None:
    dev = torch.device("cuda")
    scale = 192 ** -0.5
    q, lat, idx, do = attention_inputs(T, H, k, dev)
    pairs = int((idx >= 0).sum())
    f_fwd, f_bwd = 2 * H * pairs * (D + DV), 2 * H * pairs * (3 * D + 2 * DV)
    print(f"\nattention, T = {T:,}, H = {H}, top-{k}: {pairs:,} selected pairs; forward {f_fwd / 1e12:.2f} TFLOP, "
          f"backward {f_bwd / 1e12:.2f} TFLOP", flush=True)
    print("| path | pass | ms | TFLOP/s | peak GiB |\n|---|---|---|---|---|", flush=True)

    def row(name, pas, fn, flops):
        return timed_row([name, pas], fn, flops, iters)

    def fwd_bwd(op):
        qq, ll = q.detach().requires_grad_(), lat.detach().requires_grad_()
        o, _ = op(qq, ll, idx, scale=scale, d_v=DV)
        o.backward(do)
        return o, qq.grad, ll.grad

    ref = torch.ops.kimi.sparse_mla_gather
    tri = torch.ops.kimi.sparse_mla_triton
    o_t, lse_t = tri(q, lat, idx, scale=scale, d_v=DV)
    with torch.no_grad():
        o_r, lse_r = ref(q, lat, idx, scale=scale, d_v=DV)
    _, dq_t, dl_t = fwd_bwd(tri)
    _, dq_r, dl_r = fwd_bwd(ref)
    print(f"triton vs gather (bf16): o {rel(o_t, o_r):.2e}, lse {rel(lse_t, lse_r):.2e}, dq {rel(dq_t, dq_r):.2e}, "
          f"dlatent {rel(dl_t, dl_r):.2e}", flush=True)
    del dq_r, dl_r, o_r, lse_r
    with torch.no_grad():
        row("gather (torch)", "forward", lambda: ref(q, lat, idx, scale=scale, d_v=DV), f_fwd)
    row("gather (torch)", "forward+backward", lambda: fwd_bwd(ref), f_fwd + f_bwd)
    t_fwd = row("triton", "forward", lambda: tri(q, lat, idx, scale=scale, d_v=DV), f_fwd)
    t_bwd = row("triton", "backward", lambda: smt.sparse_mla_bwd_triton(q, lat, idx, o_t, lse_t, do, None,
                                                                        scale=scale, d_v=DV), f_bwd)
    row("triton", "forward+backward", lambda: fwd_bwd(tri), f_fwd + f_bwd)
    if dsa is not None:
        sink = torch.full((H,), float("-inf"), device=dev)
        length = (idx[0] >= 0).sum(-1).to(torch.int32)

        def cudnn_bwd():
            return dsa.sparse_attention_backward_wrapper(q[0], lat[0], o_t[0], do[0], lse_t[0], sink, idx[0],
                                                         softmax_scale=scale, topk_length=length)
        c = cudnn_bwd()
        print(f"cuDNN backward vs triton: dq {rel(c['dq'], dq_t[0]):.2e}, dlatent {rel(c['dkv'], dl_t[0]):.2e}",
              flush=True)
        c_bwd = row("cuDNN SM90", "backward", cudnn_bwd, f_bwd)
        if c_bwd and t_bwd:
            print(f"backward: triton / cuDNN = {t_bwd / c_bwd:.2f}", flush=True)
    if t_fwd:
        print(f"forward: triton {t_fwd:.2f} ms (FlashMLA, measured 2026-11-30 with 96 heads padded to 128: 7.62 ms "
              f"at 8K, 31.41 ms at 32K; not installable here)", flush=True)
    if profile:     # where the backward's time goes, dlatent by atomics and in a fixed order
        for det in (False, True):
            kernel_times(f"triton backward kernels, T = {T:,}, deterministic={det}", lambda: smt.sparse_mla_bwd_triton(
                q, lat, idx, o_t, lse_t, do, None, scale=scale, d_v=DV, deterministic=det), iters=2)


def indexer_rows(T: int, k: int, iters: int, dsa, reference_max: int) -> None:
    dev = torch.device("cuda")
    from kimi.ops import indexer_triton
    q = torch.randn(1, T, NI, DI, device=dev).bfloat16()
    kk = torch.randn(1, T, DI, device=dev).bfloat16()
    w = torch.randn(1, T, NI, device=dev) * (NI ** -0.5 * DI ** -0.5)
    lo = torch.zeros(1, T, dtype=torch.long, device=dev)
    hi = torch.arange(1, T + 1, device=dev)[None]
    flops = 2 * NI * DI * T * T / 2
    print(f"\nindexer, T = {T:,}, {NI} x {DI} heads, top-{k}, causal: {flops / 1e12:.2f} TFLOP (the causal half)",
          flush=True)
    print("| path | ms | TFLOP/s | peak GiB |\n|---|---|---|---|", flush=True)

    def row(name, fn):
        return timed_row([name], fn, flops, iters)

    ref = lambda: lightning_index.indexer_topk_blocked(q, kk, w, lo, hi, topk=k, causal=True)
    tri = lambda: indexer_triton.indexer_topk_triton(q, kk, w, lo, hi, topk=k, causal=True)
    a = tri()
    chosen = (a >= 0).sum(-1)
    assert torch.equal(chosen, hi.clamp(max=k).to(chosen.dtype)), "triton: a row has the wrong number of keys"
    if T <= reference_max:     # the blocked torch reference takes seconds past 32K: compared up to --reference-max
        b = ref()
        same = float((a == b).all(-1).float().mean())
        # agreement as sets, per row: |a ∩ b| / |b|, over the rows' valid entries
        rows = slice(None, None, max(1, T // 256))
        inter = sum(len((set(x.tolist()) & set(y.tolist())) - {-1}) for x, y in zip(a[0, rows], b[0, rows]))
        total = sum(int((y >= 0).sum()) for y in b[0, rows])
        print(f"triton vs blocked reference: {same:.1%} of rows identical, {inter / max(total, 1):.4%} of sampled "
              "selected keys shared (bf16 inputs: the fp32 sums differ in order, near-ties may flip)", flush=True)
        row("blocked torch reference", ref)
    t = row("triton (streaming top-k)", tri)
    if dsa is not None:
        def cudnn():
            s = dsa.indexer_forward_wrapper(q, kk[:, :, None], w, ratio=1, sm_scale=1.0)["scores"]
            return dsa.indexer_top_k_wrapper(s[0], hi[0].to(torch.int32), k, return_val=False)
        c = row("cuDNN scores + top-k (fp32 [T, T] buffer)", cudnn)
        if c and t:
            print(f"indexer: triton / cuDNN = {t / c:.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--indexer", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--attention", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--reference-max", type=int, default=32768,
                    help="longest T at which the indexer is also run through the blocked torch reference")
    ap.add_argument("--profile", action="store_true",
                    help="then the Triton backward's time per kernel, atomic and deterministic (torch.profiler)")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    dsa = cudnn_dsa()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for T in a.tokens:
        if a.attention:
            attention_rows(T, a.heads, a.topk, a.iters, dsa, a.profile)
        if a.indexer:
            indexer_rows(T, a.topk, a.iters, dsa, a.reference_max)


if __name__ == "__main__":
    main()
