"""Launch-configuration sweep of the Triton sparse-attention and indexer kernels at one shape (run once per tuning
round; the chosen configurations are then fixed in `fwd_config`, `bwd_config` and `launch_config`).

    PYTHONPATH=. python tests/bench/sparse_tune.py --tokens 8192

Each configuration is compiled, checked against the default configuration's output (relative error; the indexer:
identical selections) and timed (median of 3 after a warm-up). A configuration that does not compile or does not
fit (shared memory, registers) prints its error and the sweep goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kimi.ops import indexer_triton as it  # noqa: E402
from kimi.ops import sparse_mla_triton as sm  # noqa: E402
from kimi.ops.sparse_attention import sparse_mla_gather  # noqa: E402
from kimi.ops.registry import sm_count  # noqa: E402
from sparse_kernels import attention_inputs, kernel_times, measure, rel  # noqa: E402


def short(cfg) -> str:
    """A launch configuration by the fields that differ from their defaults (the head tiles always)."""
    if not dataclasses.is_dataclass(cfg):
        return str(cfg)
    more = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
            if f.name != "heads" and getattr(cfg, f.name) != f.default]
    return f"{type(cfg).__name__}({', '.join([str(cfg.heads)] + more)})"


def sweep(name, configs, run, check):
    print(f"\n{name}\n| config | ms | check |\n|---|---|---|", flush=True)
    for cfg in configs:
        try:
            ms = measure(lambda: run(cfg), 3)[0]
            print(f"| {short(cfg)} | {ms:.2f} | {check(run(cfg))} |", flush=True)
        except Exception as e:   # a configuration that does not compile or fit: report it, go on
            print(f"| {short(cfg)} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | |", flush=True)
            torch.cuda.empty_cache()


ROUND3 = sm.BwdConfig((32, 32, 32), block_k=64, slot_major=True, num_warps=4, dkv_gemm=True, gemm_block_k=128,
                      gemm_block_n=64)
"""The backward's default before `gemm_dq` / `pds_all_heads`: the transposed dq kernel storing ds and p, then the
dlatent GEMM over them."""


def bwd_variants(now):
    """Named backward launches (`--bwd-variants`): `default` is `now`, the rest are built on `ROUND3` (also named
    `round3`), so that their names keep their meaning when the default changes. `gemm-dq`: the dq kernels store ds
    and p only and `_bwd_dkv_dq_gemm_kernel` forms dlatent and dq from them (a program per query and 64 columns);
    `pds`: ds and p from `_bwd_pds_kernel` (a program per query for all 96 heads) instead of the dq kernels."""
    r = functools.partial(dataclasses.replace, ROUND3)
    g = functools.partial(r, gemm_dq=True, gemm_block_k=64, gemm_block_n=64, dkv_num_warps=4, dkv_num_stages=2)
    p = functools.partial(g, pds_all_heads=True, block_k=128, num_warps=8, num_stages=3)
    return {
        "default": now,
        "round3": ROUND3,
        "gemm-dq": g(),
        "gemm-dq-s3": g(dkv_num_stages=3),
        "gemm-dq-bk128": g(gemm_block_k=128),
        "gemm-dq-w8": g(dkv_num_warps=8),
        "gemm-dq-dsp-s1": g(num_stages=1),
        "gemm-dq-dsp-w8": g(num_warps=8),
        "gemm-dq-64+32": g(heads=(64, 32), num_stages=1),
        "gemm-dq-bn128": g(gemm_block_n=128, dkv_num_warps=8),
        "pds": g(pds_all_heads=True, num_warps=8, num_stages=3),
        "pds-bk128": g(pds_all_heads=True, block_k=128, num_warps=8, num_stages=3),
        "pds-w4": g(pds_all_heads=True, num_warps=4, num_stages=2),
        "pds-bn128": g(pds_all_heads=True, num_warps=8, num_stages=3, gemm_block_n=128, dkv_num_warps=8),
        "pds-x2": g(pds_all_heads=True, num_warps=8, num_stages=3, gemm_dq_blocks=2, dkv_num_warps=8),
        "pds-x3": g(pds_all_heads=True, num_warps=8, num_stages=3, gemm_dq_blocks=3, dkv_num_warps=8),
        # round 2: ds, p by `_bwd_pds_kernel` at 128 slots a step (the first round's best), the GEMM's launch varied
        "pds128-g128w8": p(gemm_block_k=128, dkv_num_warps=8),
        "pds128-g128": p(gemm_block_k=128),
        "pds128-g32": p(gemm_block_k=32),
        "pds128-s3": p(dkv_num_stages=3),
        "pds128-rows1584": p(gemm_rows=1584),
        "pds128-g128w8-rows1584": p(gemm_block_k=128, dkv_num_warps=8, gemm_rows=1584),
        "pds128-p4": p(num_stages=4),
        "pds128-c32": p(pds_block_c=32, num_stages=6),
        # `pds_dlat`: dlatent in the ds, p kernel (a second pass over the columns), the GEMM forming dq only
        "pdsd128": p(pds_dlat=True, num_stages=2),
        "pdsd128-s3": p(pds_dlat=True),
        "pdsd64": p(pds_dlat=True, block_k=64),
        "pdsd128-x3": p(pds_dlat=True, num_stages=2, gemm_dq_blocks=3),
        "pdsd64-x3": p(pds_dlat=True, block_k=64, gemm_dq_blocks=3),
        # round 3: around pdsd128-s3 (the second round's best), its columns in one loop a pass (`pds_one_loop`)
        "pdsd128-s3-x3": p(pds_dlat=True, gemm_dq_blocks=3),
        "pdsd1": p(pds_dlat=True, pds_one_loop=True),
        "pdsd1-x3": p(pds_dlat=True, pds_one_loop=True, gemm_dq_blocks=3),
        "pdsd1-s4": p(pds_dlat=True, pds_one_loop=True, num_stages=4),
        "pdsd1-g3": p(pds_dlat=True, pds_one_loop=True, dkv_num_stages=3),
        "pdsd1-x3-g3": p(pds_dlat=True, pds_one_loop=True, gemm_dq_blocks=3, dkv_num_stages=3),
        "pdsd1-rows2640": p(pds_dlat=True, pds_one_loop=True, gemm_rows=2640),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--parts", nargs="*", default=["fwd", "bwd", "indexer"])
    ap.add_argument("--profile", action="store_true",
                    help="first the backward's time per kernel (torch.profiler) for its first three rows")
    ap.add_argument("--bwd-rows", default=":", help="a slice of the backward's rows, e.g. 0:10 (default: all)")
    ap.add_argument("--bwd-variants", nargs="*", default=None,
                    help="named backward launches instead of the sweep's rows (see BWD_VARIANTS; default first)")
    a = ap.parse_args()
    T, H, k, DV = a.tokens, 96, 2048, 512
    dev = torch.device("cuda")
    scale = 192 ** -0.5
    q, lat, idx, do = attention_inputs(T, H, k, dev)
    F, B = sm.FwdConfig, sm.BwdConfig
    t32, t64 = (32, 32, 32), (64, 32)
    if "fwd" in a.parts:
        ref = sm.sparse_mla_fwd_triton(q, lat, idx, scale=scale, d_v=DV)[0]
        c = functools.partial(dataclasses.replace, F(t32, block_k=64))      # the default: 2 chunks, lazy rescale
        configs = [c(), c(value_chunks=4), c(value_chunks=2, lazy_rescale=False), c(num_stages=3),
                   c(value_chunks=4, num_stages=3), c(value_chunks=1), c(block_k=128, num_stages=1),
                   c(block_k=32, num_stages=3), c(heads=t64, block_k=32, value_chunks=4, num_warps=8),
                   c(value_chunks=4, num_warps=8)]
        sweep(f"forward, T = {T:,}", configs,
              lambda c: sm.sparse_mla_fwd_launch(q, lat, idx, scale=scale, d_v=DV, cfg=c)[0],
              lambda o: f"{rel(o, ref):.1e}")
    if "bwd" in a.parts:    # o, lse from the torch reference: no forward kernel to compile for a backward sweep
        with torch.no_grad():
            o, lse = sparse_mla_gather(q, lat, idx, scale=scale, d_v=DV)
        ref = sm.sparse_mla_bwd_triton(q, lat, idx, o, lse, do, None, scale=scale, d_v=DV)
        base = B(t32, num_warps=4)
        r = functools.partial(dataclasses.replace, base)
        dq64 = dict(block_k=64, slot_major=True)
        g = functools.partial(r, **dq64, dkv_gemm=True)     # dlatent from the stored ds, p (no recomputed scores)
        now = sm.bwd_config(1, T, H, k, 576, DV, dev)
        configs = [now, ROUND3, r(**dq64, dkv_block_k=32, dkv_block_h=32), g(), g(gemm_block_k=64),
                   g(dkv_num_stages=3), g(gemm_block_k=64, gemm_rows=2048)]
        lo, hi = (int(x) if x else None for x in a.bwd_rows.split(":"))
        configs = configs[lo:hi]
        if a.bwd_variants is not None:
            named = bwd_variants(now)
            configs = [named[v] for v in ["default"] + [v for v in a.bwd_variants if v != "default"]]
        run = lambda c: sm.sparse_mla_bwd_launch(q, lat, idx, o, lse, do, None, scale=scale, d_v=DV, cfg=c)
        if a.profile:       # first: the kernels compiled here are reused by the sweep
            for c in configs[:3]:
                kernel_times(f"backward kernels, {short(c)}", lambda: run(c))
        sweep(f"backward, T = {T:,}", configs, run,
              lambda g: f"dq {rel(g[0], ref[0]):.1e}, dlatent {rel(g[1], ref[1]):.1e}")
    if "indexer" in a.parts:
        qi = torch.randn(1, T, 64, 128, device=dev).bfloat16()
        ki = torch.randn(1, T, 128, device=dev).bfloat16()
        w = torch.randn(1, T, 64, device=dev) * (64 ** -0.5 * 128 ** -0.5)
        lo = torch.zeros(1, T, dtype=torch.long, device=dev)
        hi = torch.arange(1, T + 1, device=dev)[None]
        base = it.launch_config(1, T, T, 64, 128, k, causal=True, sms=sm_count(dev), interpret=False)
        ref = it.indexer_topk_launch(qi, ki, w, lo, hi, topk=k, causal=True, config=base)

        def launch(bm, bn, warps, stages, chunk, capacity=3 * k, per_sm=2, histogram=False):
            return base._replace(block_q=bm, block_k=bn, chunk=chunk, num_warps=warps, num_stages=stages,
                                 capacity=capacity, programs=min(T // bm, per_sm * sm_count(dev)), histogram=histogram)
        configs = [base, base._replace(histogram=True), launch(4, 64, 4, 2, 64, histogram=True),
                   launch(4, 64, 4, 2, 128, capacity=4 * k, histogram=True), launch(2, 64, 4, 3, 256, histogram=True),
                   launch(4, 64, 4, 2, 128, capacity=4 * k), launch(2, 64, 4, 3, 128)]
        sweep(f"indexer, T = {T:,}", configs,
              lambda c: it.indexer_topk_launch(qi, ki, w, lo, hi, topk=k, causal=True, config=c),
              lambda s: f"{float((s == ref).all(-1).float().mean()):.1%} rows identical")


if __name__ == "__main__":
    main()
