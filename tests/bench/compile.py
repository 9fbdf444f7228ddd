"""Eager vs torch.compile(fullgraph=True) for the whole model: forward and forward+backward time, compile time.

    python tests/bench/compile.py                              # tiny and medium on CPU (and CUDA if present)
    python tests/bench/compile.py --presets medium --devices cuda --batch 2 --seq 2048

Prints one table: per preset and device, eager ms, compiled ms, speedup (eager / compiled) and the first-call
compile seconds. Timing: warm-up calls first, then the median of `--iters` calls, synchronized on CUDA.
Parameters are bfloat16 on CUDA and float32 on the CPU; the backend is `kimi.Backend(kda=...)` for each `--kda`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kimi


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, iters):
    times = []
    for _ in range(iters):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def bench(preset: str, device: str, batch: int, seq: int, iters: int, regional: bool = False,
          passes: tuple[str, ...] = ("forward", "forward+backward"), kda: str = "chunk") -> list[dict]:
    cfg = kimi.preset(preset)
    dtype = "bfloat16" if device == "cuda" else "float32"
    params = kimi.init_params(cfg, seed=0, dtype=dtype, device=device)
    leaves = [p for _, p in kimi.params.tree_items(params) if p.requires_grad]
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    backend = kimi.Backend(kda=kda)

    def fwd(f):
        with torch.no_grad():
            return f(params, ids, cfg, backend)

    def fwd_bwd(f):
        for p in leaves:
            p.grad = None
        f(params, ids, cfg, backend).float().logsumexp(-1).mean().backward()

    rows = []
    torch._dynamo.reset()
    compiled = (kimi.compile_layers(fullgraph=True, dynamic=False) if regional
                else torch.compile(kimi.forward, fullgraph=True, dynamic=False))
    for name, step in (("forward", fwd), ("forward+backward", fwd_bwd)):
        if name not in passes:
            continue
        step(kimi.forward)                                      # eager warm-up
        eager = _time(lambda: step(kimi.forward), device, iters)
        _sync(device)
        t = time.perf_counter()
        step(compiled)                                          # compiles (the backward graph on first backward)
        _sync(device)
        compile_s = time.perf_counter() - t
        step(compiled)
        comp = _time(lambda: step(compiled), device, iters)
        rows.append(dict(preset=f"{preset} kda={kda}", device=device, shape=f"{batch}x{seq}", pass_=name, eager=eager, compiled=comp,
                         speedup=eager / comp, compile_s=compile_s))
        print(f"  {preset} {device} {name}: eager {eager:.1f} ms, compiled {comp:.1f} ms "
              f"({eager / comp:.2f}x), compile {compile_s:.0f} s", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["tiny", "medium"])
    ap.add_argument("--devices", nargs="+", default=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    ap.add_argument("--batch", type=int, default=None, help="default: 2 (CPU) / 4 (CUDA)")
    ap.add_argument("--seq", type=int, default=None, help="default: 128 (CPU) / 2048 (CUDA)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--regional", action="store_true",
                    help="kimi.compile_layers (one graph per distinct layer) instead of one whole-model graph")
    ap.add_argument("--kda", nargs="+", default=["chunk"], choices=["chunk", "chunk_opaque", "chunk_triton"],
                    help="KDA backends to compare (chunk: traced by Inductor; chunk_opaque: one opaque op; "
                         "chunk_triton: chunk with the state pass in Triton)")
    ap.add_argument("--passes", nargs="+", default=["forward", "forward+backward"],
                    choices=["forward", "forward+backward"])
    a = ap.parse_args()
    rows = []
    for device in a.devices:
        for preset in a.presets:
            batch = a.batch or (4 if device == "cuda" else 2)
            seq = a.seq or (2048 if device == "cuda" else 128)
            for kda in a.kda:
                rows += bench(preset, device, batch, seq, a.iters, a.regional, tuple(a.passes), kda)
    print()
    print(f"| preset | device | B x T | pass | eager ms | compiled ms | speedup | compile s |")
    print(f"|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['device']} | {r['shape']} | {r['pass_']} | {r['eager']:.1f} | "
              f"{r['compiled']:.1f} | {r['speedup']:.2f}x | {r['compile_s']:.0f} |")


if __name__ == "__main__":
    main()
