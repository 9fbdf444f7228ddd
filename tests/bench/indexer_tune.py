"""Variants of the Triton indexer's launch (selection strategies, buffer sizes) timed side by side, with cuDNN's
scores + top-k in the same run when cuDNN Frontend's DSA module imports.

    PYTHONPATH=. python tests/bench/indexer_tune.py                          # H200: T = 8K, 32K, 64K
    PYTHONPATH=. python tests/bench/indexer_tune.py --tokens 8192 65536 --variants default search move3
    PYTHONPATH=. python tests/bench/indexer_tune.py --tokens 8192 65536 --variants default stream select-w4

The shape of `tests/bench/sparse_kernels.py`'s indexer rows: 64 heads × 128, bf16 q and k, fp32 head weights of both
signs, causal, top 2048, B = 1. Every variant's selection is compared with the first variant's (rows identical;
the selections are exact on fp32 scores, so they agree unless two scores tie). TFLOP/s count the causal half,
2·n·d·T²/2. Times are medians of `--iters` calls after a warm-up.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kimi.ops import indexer_triton as it  # noqa: E402
from kimi.ops.registry import sm_count  # noqa: E402
from sparse_kernels import cudnn_dsa, measure  # noqa: E402

NI, DI = 64, 128

STREAM = {
    "round3": dict(halves=False, order="cyclic", num_stages=2),
    "round2": dict(halves=False, order="cyclic", num_stages=2, histogram=False, scan_counts=False),
    "one-dot": dict(halves=False),
    "cyclic": dict(order="cyclic"),
    "snake": dict(order="snake"),
    "stages2": dict(num_stages=2),
    "score-only": dict(score_only=True),
    "search": dict(histogram=False),
    "histogram-all": dict(histogram_compactions=True),
    "move3": dict(move_stages=3),
    "chunk64": dict(chunk=64),
    "cap2k": dict(capacity=2 * 2048 + 128),
    "cap4k": dict(capacity=4 * 2048),
    "bq2-stages4": dict(block_q=2, chunk=256, num_stages=4, halves=False),
    "bq2-3sm": dict(block_q=2, chunk=256, per_sm=3, max_registers=168, num_stages=2, halves=False),
    "w8": dict(num_warps=8, per_sm=1, halves=False),
    "w8-2sm": dict(num_warps=8, max_registers=128, num_stages=2, halves=False),
    "w8-overlap": dict(num_warps=8, per_sm=1, halves=False, overlap=True),
}
"""The streaming top-k's launches (`_indexer_stream_kernel`): changes to `launch_config`'s streaming fields
(`per_sm`: persistent programs an SM). `round3` is the launch before two half dots, dynamic task order and three
stages became the default; `score-only` times the scoring loop without any key taken (its rows differ from the
others by design)."""

SELECT = {
    "select-4k": dict(select_rows=4096),
    "select-8k": dict(select_rows=8192),
    "select-sample4k": dict(sample=4096),
    "select-no-cap": dict(select_registers=0),
    "select-w4": dict(select_warps=4, select_segments=4),
    "select-sample2k": dict(sample=2048),
    "select-sample8k": dict(sample=8192),
    "select-align1": dict(select_align=1),
    "select-w4-s512": dict(select_warps=4, select_segments=4, select_step=512),
    "select-1wave": dict(select_programs=264),
    "select-step128": dict(select_step=128),
    "select-step512": dict(select_step=512),
    "select-bits32": dict(sample_bits=32),
    "select-bits16": dict(sample_bits=16),
}
"""Changes to the causal default, scores then selection in chunks of `select_rows` queries (`_scores_then_select`)."""

VARIANTS = {"default": {}, "stream": dict(select_rows=0, select_registers=0),
            **{name: dict(v, select_rows=0, select_registers=0) for name, v in STREAM.items()}, **SELECT}
"""Every variant by name: the default, `stream` (the streaming top-k's default launch), the streaming launches,
the selection's."""

KERNELS = ("_indexer_stream_kernel", "_indexer_scores_kernel", "_indexer_select_kernel")


def blocks_per_sm(kernel) -> str:
    """How many programs of a compiled Triton kernel an SM holds at once (the CUDA occupancy API), with its
    registers, spills and shared memory."""
    try:
        n = ctypes.c_int(0)
        cuda = ctypes.CDLL("libcuda.so.1")
        err = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(kernel.function),
                                                               kernel.metadata.num_warps * 32,
                                                               ctypes.c_size_t(kernel.metadata.shared))
        blocks = n.value if err == 0 else f"error {err}"
    except (OSError, AttributeError) as e:
        blocks = f"? ({type(e).__name__})"
    return f"{blocks} ({kernel.n_regs} regs, {kernel.n_spills} spills, {kernel.metadata.shared // 1024} KiB)"


def compiled(device) -> set:
    """The compiled kernels of the indexer's Triton functions so far on `device`."""
    fns = [getattr(it, name) for name in KERNELS]
    return {kern for fn in fns if device in fn.device_caches for kern in fn.device_caches[device][0].values()}


def kernel_split(run) -> str:
    """GPU ms of one call by indexer kernel (torch.profiler), e.g. "scores 50.1 + select 6.2"."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    ms = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = next((n.split("_")[2] for n in KERNELS if n in e.name), "other")
            ms[name] = ms.get(name, 0.0) + e.device_time / 1e3
    return " + ".join(f"{n} {t:.2f}" for n, t in sorted(ms.items(), key=lambda kv: -kv[1]))


def variant(base: "it.IndexerLaunch", changes: dict, T: int, sms: int) -> "it.IndexerLaunch":
    changes = dict(changes)
    per_sm = changes.pop("per_sm", 2)
    cfg = base._replace(**changes)
    return cfg._replace(programs=max(1, min(-(-T // cfg.block_q), per_sm * sms)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="*", default=[8192, 32768, 65536])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--cudnn", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                    help="profile one call of each variant: GPU time by indexer kernel")
    a = ap.parse_args()
    dev = torch.device("cuda")
    dsa = cudnn_dsa() if a.cudnn else None
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for T in a.tokens:
        k = a.topk
        q = torch.randn(1, T, NI, DI, device=dev).bfloat16()
        kk = torch.randn(1, T, DI, device=dev).bfloat16()
        w = torch.randn(1, T, NI, device=dev) * (NI ** -0.5 * DI ** -0.5)
        lo = torch.zeros(1, T, dtype=torch.long, device=dev)
        hi = torch.arange(1, T + 1, device=dev)[None]
        flops = 2 * NI * DI * T * T / 2
        base = it.launch_config(1, T, T, NI, DI, k, causal=True, sms=sm_count(dev), interpret=False)
        print(f"\nT = {T:,}, top-{k}, causal ({flops / 1e12:.2f} TFLOP); default {base}", flush=True)
        print("| variant | ms | TFLOP/s | peak GiB | rows identical to the first | vs cuDNN | kernels ms | programs an "
              "SM |", flush=True)
        print("|---|---|---|---|---|---|---|---|", flush=True)
        c_ms = None
        if dsa is not None:
            def cudnn():
                s = dsa.indexer_forward_wrapper(q, kk[:, :, None], w, ratio=1, sm_scale=1.0)["scores"]
                return dsa.indexer_top_k_wrapper(s[0], hi[0].to(torch.int32), k, return_val=False)
            try:
                c_ms, peak = measure(cudnn, a.iters)
                print(f"| cuDNN scores + top-k | {c_ms:.2f} | {flops / c_ms / 1e9:.0f} | {peak:.2f} | | 1.00 | | |",
                      flush=True)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                print("| cuDNN scores + top-k | out of memory | | | | |", flush=True)
        ref = None
        for name in a.variants:
            cfg = variant(base, VARIANTS[name], T, sm_count(dev))
            run = lambda: it.indexer_topk_launch(q, kk, w, lo, hi, topk=k, causal=True, config=cfg)
            try:
                before = compiled(dev.index or 0)
                out = run()
                new = compiled(dev.index or 0) - before
                occupancy = ", ".join(blocks_per_sm(kern) for kern in new)
                ref = out if ref is None else ref
                same = float((out == ref).all(-1).float().mean())
                ms, peak = measure(run, a.iters)
                ratio = f"{ms / c_ms:.2f}" if c_ms else ""
                split = kernel_split(run) if a.kernels else ""
                print(f"| {name} | {ms:.2f} | {flops / ms / 1e9:.0f} | {peak:.2f} | {same:.2%} | {ratio} | {split} "
                      f"| {occupancy} |", flush=True)
                del out
            except Exception as e:   # a variant that does not compile or fit: report it, go on
                print(f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | | |", flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
