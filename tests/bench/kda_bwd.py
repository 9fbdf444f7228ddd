"""The chunked KDA backward (`kda_bwd_triton.kda_chunk_bwd_triton`) and its variants side by side, and fla's
`chunk_kda` with `--fla`.

    PYTHONPATH=. python tests/bench/kda_bwd.py                  # H200: B = 1, T = 8192, H = 96, K = V = 128
    PYTHONPATH=. python tests/bench/kda_bwd.py --quick --shape 32768x32 --variants '^saved$|pairwise'
    PYTHONPATH=. python tests/bench/kda_bwd.py --fla            # with fla's safe-gate chunk_kda (autotunes minutes)

Inputs are tests/bench/kda.py's (bf16 q, k, v; fp32 bounded gates in [-5, 0], beta and initial state), the final
state returned and its gradient absent (the layer's case). Rows (`VARIANTS`, `--variants` keeps those whose name
the expression matches): each backward alone and after its forward, the default (recomputing the forward's
scratch) against the backward from the forward's scratch (`saved`: `kda_chunk_fwd_saving` and
`kda_chunk_bwd_triton(saved=...)`, as `kda_bwd_triton.SAVE = "forward"` runs it) with the reverse state pass's
options (`REVERSE`); time is the median of `--iters` calls after two warm-ups, peak the memory allocated during
the call above what was allocated before (kda.py's `measure`; with `saved` the backward's row starts with the
scratch allocated, the forward+backward row counts it). Then each variant's gradients against the default's, and
(without `--quick`) each backward's kernels per call (CUDA profiler).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kda import inputs, measure, rel  # noqa: E402
from kernel_profile import profile_kernels  # noqa: E402

from kimi.ops import kda_bwd_triton as kb  # noqa: E402
from kimi.ops import kda_triton as kt  # noqa: E402


VARIANTS = {   # name: the backward's scratch ("saved": the forward's), `kda_bwd_triton.REVERSE` overrides,
    #             `PAIRWISE`, `dqkg_config` and `STATE_TERMS` overrides
    "default": dict(),
    "recompute, own reverse pass": dict(reverse=dict(kernel="own")),
    "saved": dict(saved=True),
    "saved, reverse 64 columns": dict(saved=True, reverse=dict(block_v=64)),
    "saved, reverse 16 columns": dict(saved=True, reverse=dict(block_v=16)),
    "saved, reverse auto columns": dict(saved=True, reverse=dict(block_v="auto")),
    "saved, reverse 2 stages": dict(saved=True, reverse=dict(num_stages=2)),
    "saved, reverse 2 warps": dict(saved=True, reverse=dict(num_warps=2)),
    "saved, reverse 2 warps, 2 stages": dict(saved=True, reverse=dict(num_warps=2, num_stages=2)),
    "saved, reverse bf16 dS": dict(saved=True, reverse=dict(dstates="16")),
    "saved, reverse q~ dO on bf16 operands": dict(saved=True, reverse=dict(qd16=True)),
    "saved, reverse TF32 chain, one stage (the default before KDA round 8)": dict(saved=True, reverse=dict(
        dots=None, num_stages=1)),
    "saved, reverse x2n dots, 2 stages": dict(saved=True, reverse=dict(dots="x2n", num_stages=2)),
    "saved, reverse x2n dots, 16 columns, 2 stages": dict(saved=True, reverse=dict(dots="x2n", num_stages=2,
                                                                                   block_v=16)),
    "saved, reverse x2n dots, 8 columns, 2 stages": dict(saved=True, reverse=dict(dots="x2n", num_stages=2,
                                                                                  block_v=8)),
    "saved, wide pairwise": dict(saved=True, pairwise="wide"),
    "saved, wide pairwise, 8 warps": dict(saved=True, pairwise="wide", dqkg=dict(num_warps=8)),
    "saved, wide pairwise, reverse auto columns": dict(saved=True, pairwise="wide", reverse=dict(block_v="auto")),
    "saved, wide pairwise, reverse auto columns, bf16 dS": dict(saved=True, pairwise="wide",
                                                                reverse=dict(block_v="auto", dstates="16")),
    "saved, split state terms": dict(saved=True, state=dict(split=True)),
    "saved, split state terms, wide pairwise": dict(saved=True, pairwise="wide", state=dict(split=True)),
    "saved, split state terms (32 key channels, 4 warps), wide pairwise": dict(
        saved=True, pairwise="wide", state=dict(split=True, block_k=32, num_warps=4)),
    "saved, split state terms, wide pairwise, reverse auto columns, bf16 dS": dict(
        saved=True, pairwise="wide", state=dict(split=True), reverse=dict(block_v="auto", dstates="16")),
}


def _variant(args, do, scale, saved=False, reverse=None, pairwise=None, dqkg=None, state=None):
    """(the backward alone, forward and backward) of one `VARIANTS` row; with `saved` the backward alone takes one
    forward's scratch, made here."""
    def options(fn):
        def run():
            before, pair, config, terms = dict(kb.REVERSE), kb.PAIRWISE, kb.dqkg_config, dict(kb.STATE_TERMS)
            kb.REVERSE.update(reverse or {})
            kb.STATE_TERMS.update(state or {})
            kb.PAIRWISE = pairwise or pair
            if dqkg is not None:
                kb.dqkg_config = lambda *a, **k: {**config(*a, **k), **dqkg}
            try:
                return fn()
            finally:
                kb.REVERSE.clear()
                kb.REVERSE.update(before)
                kb.STATE_TERMS.clear()
                kb.STATE_TERMS.update(terms)
                kb.PAIRWISE, kb.dqkg_config = pair, config
        return run
    if not saved:
        bwd = options(lambda: kb.kda_chunk_bwd_triton(*args, None, do, None, scale=scale))
        return bwd, lambda: (kt.kda_chunk_fwd_triton(*args, scale=scale), bwd())
    scratch = {}

    def bwd_alone():
        if not scratch:
            scratch.update(kb.kda_chunk_fwd_saving(*args, scale=scale)[2])
        return kb.kda_chunk_bwd_triton(*args, None, do, None, scale=scale, saved=scratch)

    def fwd_bwd():
        kept = kb.kda_chunk_fwd_saving(*args, scale=scale)[2]
        return kb.kda_chunk_bwd_triton(*args, None, do, None, scale=scale, saved=kept)
    return options(bwd_alone), options(fwd_bwd)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8192x96", help="TxH")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fla", action="store_true", help="also fla's chunk_kda (safe gate), forward+backward")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--quick", action="store_true", help="no per-kernel profile")
    ap.add_argument("--variants", default="", help="a regular expression: the rows whose names it matches (and the "
                    "default)")
    a = ap.parse_args()
    T, H = (int(s) for s in a.shape.split("x"))
    x = inputs(T, H, 128, torch.device("cuda"))
    scale = 128 ** -0.5
    do = torch.randn_like(x["v"])
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"])
    variants = {name: v for name, v in VARIANTS.items()
                if name == "default" or re.search(a.variants, name)}
    backwards, forwards = {}, {}
    for name, v in variants.items():
        backwards[name], forwards[name] = _variant(args, do, scale, **v)

    print(f"KDA backward, B = 1, T = {T:,}, H = {H}, K = V = 128, bf16\n| backward | pass | ms | peak GiB |\n"
          "|---|---|---|---|", flush=True)
    ms, peak = measure(lambda: kt.kda_chunk_fwd_triton(*args, scale=scale), a.iters)
    print(f"| (the forward) | forward | {ms:.2f} | {peak:.2f} |", flush=True)
    for name, bwd in list(backwards.items()):
        try:
            ms, peak = measure(bwd, a.iters)
        except Exception as e:   # a row that cannot run leaves the rest
            print(f"| {name} | backward | failed: {type(e).__name__}: {str(e)[:100]} | |", flush=True)
            del backwards[name]
            continue
        print(f"| {name} | backward | {ms:.2f} | {peak:.2f} |", flush=True)
        ms, peak = measure(forwards[name], a.iters)
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
