"""Per-kernel GPU time of the KDA core, ours and fla's, forward and forward+backward, in one run: where each
implementation spends its time at one shape (default B = 1, T = 8192, H = 96, D = 128; the inputs of
tests/bench/kda.py).

    PYTHONPATH=. python tests/bench/kda_profile.py                   # ours (kda="triton"'s kernels) and fla's
    PYTHONPATH=. python tests/bench/kda_profile.py --no-fla --shape 65536x8   # ours only, another shape
    PYTHONPATH=. python tests/bench/kda_profile.py --no-fla --forward-only --v3 strips=v4 state_dots=x2

fla autotunes its kernels on the first call at a shape (a minute or more of device time); `--no-fla` skips it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kda import inputs, parse_v3  # noqa: E402
from kernel_profile import profile_kernels  # noqa: E402

import kimi  # noqa: E402,F401  (registers the kimi:: ops)
from kimi.ops import IMPLEMENTATIONS  # noqa: E402
from kimi.ops import kda_triton as kt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8192x96", help="TxH")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--forward-only", action="store_true", help="no forward+backward rows")
    ap.add_argument("--v3", nargs="*", default=[], metavar="KEY=VALUE",
                    help="options of kda_triton.V3 for ours (values as Python literals: split=True block_k=16)")
    a = ap.parse_args()
    try:
        kt.V3.update(parse_v3(a.v3))
    except ValueError as e:
        ap.error(f"--v3 {e}")
    T, H = (int(s) for s in a.shape.split("x"))
    x = inputs(T, H, 128, torch.device("cuda"))
    scale = 128 ** -0.5
    do = torch.randn_like(x["v"])

    def ours_fwd():
        kt.kda_chunk_fwd_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"], scale=scale)

    core = IMPLEMENTATIONS["kda"]["triton"]   # the op Backend(kda="triton") runs: its backward from the forward's
    # scratch (kda_bwd_triton.SAVE), as tests/bench/kda.py times it

    def ours_fwd_bwd():
        q, k, v, g, beta, h0 = (x[n].detach().requires_grad_() for n in ("q", "k", "v", "g", "beta", "h0"))
        core(q, k, v, g, beta, h0, None, scale=scale)[0].backward(do)

    tag = f", V3 {' '.join(a.v3)}" if a.v3 else ""
    runs = [(f"ours{tag}, forward", ours_fwd)]
    if not a.forward_only:
        runs.append((f"ours{tag}, forward+backward", ours_fwd_bwd))
    if not a.no_fla:
        try:
            from fla.ops.kda import chunk_kda
        except ImportError as e:
            print(f"(no fla rows: {e})")
        else:
            leaves = {n: x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "h0")}

            def fla_fwd():
                return chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=scale,
                                 initial_state=leaves["h0"], output_final_state=True, safe_gate=True,
                                 lower_bound=-5.0)

            def fla_fwd_bwd():
                o, _ = fla_fwd()
                o.backward(do)

            def fla_fwd_only():
                with torch.no_grad():
                    fla_fwd()

            runs += [("fla safe gate, forward", fla_fwd_only)]
            if not a.forward_only:
                runs.append(("fla safe gate, forward+backward", fla_fwd_bwd))
    for title, fn in runs:
        fn()
        fn()
        torch.cuda.synchronize()

        def steps(fn=fn):
            for _ in range(a.steps):
                fn()
            torch.cuda.synchronize()
        profile_kernels(steps, a.steps, f"{title} (T={T}, H={H})", top=15)


if __name__ == "__main__":
    main()
