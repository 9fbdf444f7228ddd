"""The per-kernel GPU-time table the benchmarks print with `--profile` (decode.py, train.py)."""

from __future__ import annotations

from typing import Callable

import torch


def profile_kernels(run: Callable[[], None], steps: int, title: str, top: int = 30):
    """Run `run` (`steps` steps, synchronized at its end) under the CUDA profiler, then print the kernels per step,
    their summed time, and the `top` kernels grouped by name, largest first, per step."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    per: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per.setdefault(e.name, []).append(e.device_time)
    total = sum(sum(v) for v in per.values()) / steps
    n = sum(len(v) for v in per.values()) / steps
    print(f"\n{title}: {n:.0f} kernels per step, {total / 1e3:.3f} ms of kernel time per step")
    print("| kernel | calls/step | ms/step | share |")
    print("|---|---|---|---|")
    for name, v in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"| {name[:100]} | {len(v) / steps:.0f} | {sum(v) / steps / 1e3:.3f} | {sum(v) / steps / total:.1%} |")
