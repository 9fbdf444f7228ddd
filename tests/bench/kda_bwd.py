"""The chunked KDA backward (`kda_bwd_triton.kda_chunk_bwd_triton`) and its launch variants, and fla's `chunk_kda`
with `--fla`.

    PYTHONPATH=. python tests/bench/kda_bwd.py                  # H200: B = 1, T = 8192, H = 96, K = V = 128
    PYTHONPATH=. python tests/bench/kda_bwd.py --fla            # with fla's safe-gate chunk_kda (autotunes minutes)

Inputs are tests/bench/kda.py's (bf16 q, k, v; fp32 bounded gates in [-5, 0], beta and initial state), the final
state returned and its gradient absent (the layer's case). Rows: each backward alone and after the forward: the
default, the state passes the other way (`kda_bwd_triton.OVERLAP`) and the dq/dk/dg kernel at 8 warps; time is the
median of `--iters` calls after two warm-ups, peak the memory allocated during the call above what was allocated
before (kda.py's `measure`). Then each variant's gradients against the default's, and (without `--quick`) each
backward's kernels per call (CUDA profiler).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kda import inputs, measure, rel  # noqa: E402
from kernel_profile import profile_kernels  # noqa: E402

from kimi.ops import kda_bwd_triton as kb  # noqa: E402
from kimi.ops import kda_triton as kt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8192x96", help="TxH")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fla", action="store_true", help="also fla's chunk_kda (safe gate), forward+backward")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--quick", action="store_true", help="no per-kernel profile")
    a = ap.parse_args()
    T, H = (int(s) for s in a.shape.split("x"))
    x = inputs(T, H, 128, torch.device("cuda"))
    scale = 128 ** -0.5
    do = torch.randn_like(x["v"])
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"])
    backwards = {"default": lambda: kb.kda_chunk_bwd_triton(*args, None, do, None, scale=scale)}

    def variant(overlap=kb.OVERLAP, dqkg=None):
        def run():
            before, config = kb.OVERLAP, kb.dqkg_config
            kb.OVERLAP = overlap
            if dqkg is not None:
                kb.dqkg_config = lambda *a, **k: {**config(*a, **k), **dqkg}
            try:
                return kb.kda_chunk_bwd_triton(*args, None, do, None, scale=scale)
            finally:
                kb.OVERLAP, kb.dqkg_config = before, config
        return run
    backwards[f"state passes {'in turn' if kb.OVERLAP else 'on two streams'}"] = variant(overlap=not kb.OVERLAP)
    backwards["dq/dk/dg at 8 warps, 64 value columns"] = variant(dqkg=dict(num_warps=8, BV=64))

    def fwd():
        kt.kda_chunk_fwd_triton(*args, scale=scale)

    print(f"KDA backward, B = 1, T = {T:,}, H = {H}, K = V = 128, bf16\n| backward | pass | ms | peak GiB |\n"
          "|---|---|---|---|", flush=True)
    ms, peak = measure(fwd, a.iters)
    print(f"| (the forward) | forward | {ms:.2f} | {peak:.2f} |", flush=True)
    for name, bwd in list(backwards.items()):
        try:
            ms, peak = measure(bwd, a.iters)
        except Exception as e:   # a row that cannot run leaves the rest
            print(f"| {name} | backward | failed: {type(e).__name__}: {str(e)[:100]} | |", flush=True)
            del backwards[name]
            continue
        print(f"| {name} | backward | {ms:.2f} | {peak:.2f} |", flush=True)
        ms, peak = measure(lambda bwd=bwd: (fwd(), bwd()), a.iters)
        print(f"| {name} | forward+backward | {ms:.2f} | {peak:.2f} |", flush=True)
    if a.fla:
        from fla.ops.kda import chunk_kda
        leaves = [t.detach().clone().requires_grad_(True) for t in args]

        def fla_fwd_bwd():
            q, k, v, g, beta, h0 = leaves
            o, _ = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                             safe_gate=True, lower_bound=-5.0)
            o.backward(do)
        ms, peak = measure(fla_fwd_bwd, a.iters)
        print(f"| fla chunk_kda, safe gate -5 | forward+backward | {ms:.2f} | {peak:.2f} |", flush=True)

    grads = {name: fn() for name, fn in backwards.items()}
    base = grads.pop("default", None)
    for name, new in grads.items() if base is not None else ():
        print(f"{name} against the default: " + ", ".join(
            f"d{n} {rel(b, o):.1e}" for n, o, b in zip(("q", "k", "v", "g", "beta", "h0"), base, new)), flush=True)
    if not (a.no_profile or a.quick):
        for name, bwd in backwards.items():
            def steps(bwd=bwd):
                for _ in range(3):
                    bwd()
                torch.cuda.synchronize()
            profile_kernels(steps, 3, f"{name} backward (T={T}, H={H})", top=12)


if __name__ == "__main__":
    main()
