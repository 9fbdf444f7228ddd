"""The per-kernel GPU-time table the benchmarks print with `--profile` (decode.py, train.py, dsa.py)."""

from __future__ import annotations

from typing import Callable

import torch


def profile_kernels(run: Callable[[], None], steps: int, title: str, top: int = 30, ops: int = 0):
    """Run `run` (`steps` steps, synchronized at its end) under the CUDA profiler, then print the kernels per step,
    their summed time, and the `top` kernels grouped by name, largest first, per step. `ops` > 0: the CPU side is
    recorded too, and a second table gives the `ops` operators (aten ops, custom ops, compiled regions) whose own
    kernels took the most device time, with their calls per step: who launched the many small kernels."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if ops else [])
    with profile(activities=activities) as prof:
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
    if ops:
        rows = [a for a in prof.key_averages() if a.device_type == torch.autograd.DeviceType.CPU
                and a.self_device_time_total > 0]
        print(f"\n{title}, by operator (the device time of the kernels each launched itself):")
        print("| operator | calls/step | ms/step | share |")
        print("|---|---|---|---|")
        for a in sorted(rows, key=lambda a: -a.self_device_time_total)[:ops]:
            t = a.self_device_time_total / steps
            print(f"| {a.key[:100]} | {a.count / steps:.0f} | {t / 1e3:.3f} | {t / total:.1%} |")
