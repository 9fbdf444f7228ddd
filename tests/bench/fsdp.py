"""FSDP2 on several processes against one: train.py run once as one process and once under torchrun with `--nproc`
processes on the same global batch (same data, seed and schedule), then per step the loss and gradient norm of
both, and the training tokens/s of each (median over steps 3 on, so compilation is left out).

    python tests/bench/fsdp.py                                          # 2 GPUs: medium preset, 20 steps
    python tests/bench/fsdp.py --device cpu --model tiny --steps 3 --seq-len 32 --batch-size 4 --micro-batch-size 2
    python tests/bench/fsdp.py --compile off --dtype float32 --no-tf32         # 2 GPUs, fp32

The single process takes the global batch in batch_size / micro_batch_size micro-batches; each of the N processes
takes batch_size / (micro_batch_size · N). The two runs sum the gradients in different orders, so after the first
step the losses agree to rounding, not bitwise, and the training amplifies it (the CPU test in tests/test_train.py
checks fp32 equality over 2 steps); fp32 without TF32 keeps them together for longer than bf16 compute. Measured
agreement: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(out: Path, nproc: int, a) -> list[dict]:
    args = [str(ROOT / "train.py"), "--model", a.model, "--out", str(out), "--steps", str(a.steps),
            "--lr", str(a.lr), "--warmup-steps", "2", "--batch-size", str(a.batch_size),
            "--micro-batch-size", str(a.micro_batch_size), "--data.seq-len", str(a.seq_len),
            "--log.every", "1", "--eval-every", "0", "--ckpt-every", "0", "--no-export", "--device", a.device,
            "--compile", a.compile, "--dtype", a.dtype, "--tf32" if a.tf32 else "--no-tf32"]
    cmd = [sys.executable, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if a.device == "cuda":
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    print(f"$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="medium", help="a preset (fresh weights) or a checkpoint folder")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="train.py's --compile")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="train.py's compute dtype: float32 with --no-tf32 keeps the runs within fp32 rounding for "
                         "longer (with bf16 they part after a few steps at a high learning rate)")
    ap.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True, help="train.py's --tf32")
    a = ap.parse_args()
    if a.batch_size % (a.micro_batch_size * a.nproc):
        ap.error(f"--batch-size {a.batch_size} must be a multiple of --micro-batch-size x --nproc "
                 f"({a.micro_batch_size} x {a.nproc})")
    with tempfile.TemporaryDirectory() as tmp:
        one = run(Path(tmp) / "one", 1, a)
        many = run(Path(tmp) / "many", a.nproc, a)
    if len(one) != len(many):
        sys.exit(f"the runs logged {len(one)} and {len(many)} steps")
    print(f"\n| step | loss, 1 process | loss, {a.nproc} processes | rel. diff | grad norm, 1 | grad norm, "
          f"{a.nproc} |")
    print("|---|---|---|---|---|---|")
    for m1, mn in zip(one, many):
        diff = abs(mn["loss"] - m1["loss"]) / abs(m1["loss"])
        print(f"| {m1['step']} | {m1['loss']:.6f} | {mn['loss']:.6f} | {diff:.1e} | {m1['grad_norm']:.4f} | "
              f"{mn['grad_norm']:.4f} |")
    tps = [statistics.median(m["tokens_per_s"] for m in ms[2:] or ms) for ms in (one, many)]
    print(f"\n| processes | tokens/s (median, steps 3 on) | speedup |\n|---|---|---|\n| 1 | {tps[0]:,.0f} | 1.00x |\n"
          f"| {a.nproc} | {tps[1]:,.0f} | {tps[1] / tps[0]:.2f}x |")


if __name__ == "__main__":
    main()
