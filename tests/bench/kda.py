"""The KDA core (the delta rule over a sequence, and one decode step) against fla in one run.

    PYTHONPATH=. python tests/bench/kda.py                         # H200: T = 8192, H = 96 and the decode step
    PYTHONPATH=. python tests/bench/kda.py --shapes 8192x96 32768x32 65536x8 --chunk-triton
    PYTHONPATH=. python tests/bench/kda.py --no-decode --no-fla-chunk --variants defaults v4
    PYTHONPATH=. python tests/bench/kda.py --no-decode --no-fla-chunk --only-variants --variants defaults v6-4w --rounds 5
    PYTHONPATH=. python tests/bench/kda.py --shapes 32768x32 --no-decode --fla-safe-only --v3 out=kernel
    PYTHONPATH=. python tests/bench/kda.py --shapes 32768x32 --no-decode --no-fla-chunk --only-variants \
        --variants defaults --bwd-variants defaults reverse-x2 pairwise-batched --rounds 5

fla autotunes its kernels at every new shape (minutes of device time per shape on the first call), hence one shape
by default.

Chunked rows, B = 1, D = K = V = 128 at (T, H) = (8192, 96), (32768, 32), (65536, 8): bf16 q, k (unit rows) and v,
fp32 log-decay g from K3's bounded gate (lower bound -5), fp32 beta, an fp32 initial state, the final state
returned. Rows: fla's `chunk_kda` with its defaults and with `safe_gate=True, lower_bound=-5` (when fla imports),
the project's `Backend(kda="triton")` (the op `kimi::kda_triton`: forward, its three kernels timed apart, and
forward+backward), the forward with each of `VARIANTS`' options of kda_triton.V3 (`--variants` picking some;
`--only-variants`: only those; `--rounds`: also their forwards in interleaved rounds, the fair comparison on a GPU
whose timings drift; `--bwd-variants`: the op's forward+backward under `BWD_VARIANTS`' kda_bwd_triton options, in
interleaved rounds too; `--v3`: options over the defaults for every row of ours) and, with
`--chunk-triton`, `Backend(kda="chunk_triton")` under torch.compile (minutes of compile).

Decode rows, B = 64, H = 96, K = V = 128, one token against an fp32 state: fla's `fused_recurrent_kda` (state in,
final state out) against the project's in-place step (`kda_step_inplace_triton`, q and k already normalized) and
the fused step from the raw projections (`kda_decode_step_triton`: the three short convs, the norms and the step).

Each time is the median of `--iters` calls after two warm-ups, each call synchronized (host work included); the
decode rows also time `--iters` calls queued back to back between CUDA events (the GPU's time a step, as in the
CUDA graph generate.py replays; TB/s from that one), medians of five interleaved rounds; "peak" is
`torch.cuda.max_memory_allocated()` during the call above what was allocated before it (inputs and the output
gradient allocated beforehand). Floors: FLOPs of the chunked form at C = 64 per token and head, triangles counted
half (L and Aqk 2·C·K, the solve C·(K+V), the state pass 6·K·V, Aqk·U C·V: 139 KFLOP at K = V = 128;
forward+backward counted as 3x the forward), and the bytes a pass must move: forward q, k, v, o in bf16, g and
beta in fp32 (1.54 KB per token and head); forward+backward also do in, dq, dk, dv out in bf16 and dg, dbeta in
fp32 (4.36 KB in all). The decode floor is the fp32 state read and written once (805 MB at B = 64, H = 96).

fla's autotuning results are kept on disk (`TRITON_CACHE_AUTOTUNING=1`, unless set otherwise): a later call on the
same machine skips the minutes of tuning a shape costs the first time.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")   # read when fla's kernels are decorated, so before its import

import kimi  # noqa: E402,F401  (registers the kimi:: ops)
from kimi import kda  # noqa: E402
from kimi.ops import IMPLEMENTATIONS, kda_decode_triton  # noqa: E402

PEAK_TFLOPS, PEAK_TBS = 790.0, 4.8


def measure(fn, iters: int) -> tuple[float, float]:
    fn()
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


def measure_queued(fn, calls: int = 20) -> float:
    """ms a call of `calls` calls queued back to back between two CUDA events (no synchronization between them):
    the GPU's time a call once the host runs ahead, as in a CUDA graph (generate.py replays the decode step as one),
    where `measure`'s synchronized call also counts the host's launch work (tens of µs in Python)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def inputs(T: int, H: int, D: int, dev, *, B: int = 1) -> dict:
    g = kda.kda_gate(torch.randn(B, T, H, D, device=dev), (1 + 15 * torch.rand(H, device=dev)).log(),
                     torch.randn(H * D, device=dev), -5.0)
    return dict(q=kda.l2norm(torch.randn(B, T, H, D, device=dev)).bfloat16(),
                k=kda.l2norm(torch.randn(B, T, H, D, device=dev)).bfloat16(),
                v=torch.randn(B, T, H, D, device=dev).bfloat16(), g=g.float(),
                beta=torch.sigmoid(torch.randn(B, T, H, device=dev)), h0=torch.randn(B, H, D, D, device=dev))


def fla_module():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
        return chunk_kda, fused_recurrent_kda
    except Exception as e:
        print(f"(fla unavailable: {type(e).__name__}: {str(e)[:120]})")
        return None, None


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def chunk_rows(T: int, H: int, D: int, iters: int, chunk_kda, with_chunk_triton: bool, only_variants: bool = False,
               variants: list | None = None, fla_safe_only: bool = False) -> None:
    dev = torch.device("cuda")
    x = inputs(T, H, D, dev)
    do = torch.randn_like(x["v"])
    scale = D ** -0.5
    flops = 139.264e3 * (D / 128) ** 2 * T * H
    io_fwd, io_all = 1540 * T * H * D / 128, 4364 * T * H * D / 128
    print(f"\nKDA core, B = 1, T = {T:,}, H = {H}, D = {D}: forward {flops / 1e12:.3f} TFLOP, floor "
          f"{flops / PEAK_TFLOPS / 1e9:.3f} ms compute, {io_fwd / PEAK_TBS / 1e9:.3f} ms I/O", flush=True)
    print("| implementation | pass | ms | TFLOP/s | TB/s | peak GiB | vs fla safe gate |", flush=True)
    print("|---|---|---|---|---|---|---|", flush=True)
    ref = {}

    def row(name, pas, fn):
        try:
            ms, peak = measure(fn, iters)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            print(f"| {name} | {pas} | out of memory | | | | |", flush=True)
            return
        f, io = (flops, io_fwd) if pas == "forward" else (3 * flops, io_all)
        base = ref.get(pas)
        if name.startswith("fla") and "safe" in name:
            ref[pas] = ms
        ratio = f"{ms / base:.2f}" if base else ""
        print(f"| {name} | {pas} | {ms:,.2f} | {f / ms / 1e9:,.1f} | {io / ms / 1e9:,.2f} | {peak:.2f} | {ratio} |",
              flush=True)

    def grads(*ts):
        return [t.detach().requires_grad_() for t in ts]

    outs = {}
    if only_variants:
        variant_rows(x, T, H, D, scale, row, outs, variants)
        first = next(iter(outs.values()))
        print("output difference against the first row: " + ", ".join(
            f"{n} {rel(o, first):.1e}" for n, o in list(outs.items())[1:]), flush=True)
        return
    if chunk_kda is not None:
        configs = (("fla chunk_kda, safe gate -5", dict(safe_gate=True, lower_bound=-5.0)),
                   ("fla chunk_kda, defaults", {}))
        for name, kw in configs[:1] if fla_safe_only else configs:
            def fwd(kw=kw):
                with torch.no_grad():
                    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, initial_state=x["h0"],
                                     output_final_state=True, **kw)

            def fwd_bwd(kw=kw):
                q, k, v, g, beta, h0 = grads(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"])
                o, s = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True, **kw)
                o.backward(do)
            outs[name] = fwd()[0]
            row(name, "forward", fwd)
            row(name, "forward+backward", fwd_bwd)

    core = IMPLEMENTATIONS["kda"]["triton"]
    name = 'ours, kda="triton"'

    def ours_fwd():
        with torch.no_grad():
            return core(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"], None, scale=scale)

    def ours_fwd_bwd():
        q, k, v, g, beta, h0 = grads(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"])
        o, s = core(q, k, v, g, beta, h0, None, scale=scale)
        o.backward(do)
    outs[name] = ours_fwd()[0]
    row(name, "forward", ours_fwd)
    kernel_rows(x, T, H, D, scale, row, name)
    row(name, "forward+backward", ours_fwd_bwd)
    variant_rows(x, T, H, D, scale, row, outs, variants)

    if with_chunk_triton:
        from kimi.config import Backend
        from kimi.ops import kda_core
        fn = torch.compile(lambda q, k, v, g, beta, h0: kda_core(q, k, v, g, beta, h0, scale=scale,
                                                                  backend=Backend(kda="chunk_triton")),
                           fullgraph=True)
        row('ours, kda="chunk_triton" compiled', "forward",
            lambda: fn(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"]))

        def ct_fwd_bwd():
            q, k, v, g, beta, h0 = grads(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"])
            fn(q, k, v, g, beta, h0)[0].backward(do)
        row('ours, kda="chunk_triton" compiled', "forward+backward", ct_fwd_bwd)
    if len(outs) > 1:
        first = next(iter(outs.values()))
        print("output difference against the first row: " + ", ".join(
            f"{n} {rel(o, first):.1e}" for n, o in list(outs.items())[1:]), flush=True)


def decode_rows(B: int, H: int, D: int, iters: int, fused_recurrent_kda, sweep: bool = False) -> None:
    dev = torch.device("cuda")
    x = inputs(1, H, D, dev, B=B)
    state = torch.randn(B, H, D, D, device=dev)
    scale = D ** -0.5
    nbytes = 2 * state.numel() * 4
    print(f"\nKDA decode step, B = {B}, H = {H}, K = V = {D}: fp32 state {nbytes / 2 / 1e6:.0f} MB, read and written "
          f"once {nbytes / 1e6:.0f} MB = {nbytes / PEAK_TBS / 1e9 * 1e3:.0f} us at {PEAK_TBS} TB/s", flush=True)
    print("| implementation | µs queued | TB/s (state r+w) | µs one synchronized call | peak GiB |\n"
          "|---|---|---|---|---|", flush=True)

    q, k, v, g, beta = (x[n][:, 0] for n in ("q", "k", "v", "g", "beta"))
    s = state.clone()
    W = 4
    raw = [torch.randn(B, H * D, device=dev).bfloat16() for _ in range(3)]
    weights = [torch.randn(H * D, 1, W, device=dev).bfloat16() for _ in range(3)]
    tails = [torch.randn(B, W - 1, H * D, device=dev).bfloat16() for _ in range(3)]
    conv_reset = torch.zeros(B, W, dtype=torch.bool, device=dev)
    rows = {}
    if fused_recurrent_kda is not None:
        rows["fla fused_recurrent_kda (new final state)"] = lambda: fused_recurrent_kda(
            x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, initial_state=state, output_final_state=True)
    rows["ours kda_step_inplace_triton (state in place)"] = (
        lambda: kda_decode_triton.kda_step_inplace_triton(q, k, v, g, beta, s, scale=scale))
    rows["ours kda_step_inplace_triton, streaming cache hints"] = (
        lambda: kda_decode_triton.kda_step_inplace_triton(q, k, v, g, beta, s, scale=scale, stream=True))
    rows["ours kda_decode_step_triton (convs + norms + step, in place)"] = (
        lambda: kda_decode_triton.kda_decode_step_triton(*raw, *weights, *tails, conv_reset, g, beta, s,
                                                         scale=scale))
    rows["ours kda_decode_step_triton, streaming cache hints"] = (
        lambda: kda_decode_triton.kda_decode_step_triton(*raw, *weights, *tails, conv_reset, g, beta, s,
                                                         scale=scale, stream=True))
    rows["ours kda_decode_step_triton, the convs in turn, no state ahead (round 15's default)"] = (
        lambda: kda_decode_triton.kda_decode_step_triton(*raw, *weights, *tails, conv_reset, g, beta, s,
                                                         scale=scale, hoist=False, state_ahead=False))
    rows["ours kda_decode_step_triton, no state ahead"] = (
        lambda: kda_decode_triton.kda_decode_step_triton(*raw, *weights, *tails, conv_reset, g, beta, s,
                                                         scale=scale, state_ahead=False))
    rows["ours kda_decode_step_triton, v's conv in the loop (round 14's default), [128, 32] on 2 warps"] = (
        lambda: kda_decode_triton.kda_decode_step_triton(*raw, *weights, *tails, conv_reset, g, beta, s,
                                                         scale=scale, v_first=False, block_v=32, num_warps=2))
    res = {name: [] for name in rows}
    queued = {name: [] for name in rows}
    for _ in range(5):   # interleaved rounds: the GPU's drift (±15 % between calls) lands on every row alike
        for name, fn in rows.items():
            res[name].append(measure(fn, iters))
            queued[name].append(measure_queued(fn, iters))
    for name, ms_peak in res.items():
        ms, peak = sorted(ms_peak)[2]
        mq = sorted(queued[name])[2]
        print(f"| {name} | {mq * 1e3:,.0f} | {nbytes / mq / 1e9:.2f} | {ms * 1e3:,.0f} | {peak:.2f} |", flush=True)
    if sweep:   # launch sweep of both kernels, interleaved rounds
        ip, fu = kda_decode_triton.kda_step_inplace_triton, kda_decode_triton.kda_decode_step_triton
        configs = {}
        # register caps: more programs an SM hold more of the state in flight (spilling the rest); stages are not
        # swept: the fused step's column loop compiles to no cp.async at any (tests/bench/sm90_compile.py)
        variants = ((False, None), (True, None), (False, 168), (False, 128))
        for bv in (32, 64):
            for warps in (2, 4, 8):
                for stream, cap in variants:
                    configs[f"in place, block_v={bv}, {warps} warps, stream={stream}, registers {cap or 'any'}"] = (
                        lambda bv=bv, warps=warps, stream=stream, cap=cap: ip(
                            q, k, v, g, beta, s, scale=scale, block_v=bv, num_warps=warps, stream=stream,
                            max_registers=cap))
        # the fused step: (block_v, warps, v's conv before the loop, the state loaded a block ahead)
        fused = ([(32, w, False, False) for w in (2, 4)] + [(bv, w, True, False) for bv in (16, 32, 64)
                                                            for w in (2, 4, 8)]
                 + [(bv, w, True, True) for bv in (16, 32) for w in (2, 4)] + [(128, 8, True, False)])
        for bv, warps, v_first, ahead in fused:
            for stream, cap in variants:
                configs[f"fused, block_v={bv}, {warps} warps, v first {v_first}, ahead {ahead}, stream={stream}, "
                        f"registers {cap or 'any'}"] = (
                    lambda bv=bv, warps=warps, v_first=v_first, ahead=ahead, stream=stream, cap=cap: fu(
                        *raw, *weights, *tails, conv_reset, g, beta, s, scale=scale, block_v=bv, num_warps=warps,
                        stream=stream, max_registers=cap, v_first=v_first, state_ahead=ahead))
        times: dict[str, list[float]] = {name: [] for name in configs}
        print(f"\nsweep of {len(configs)} launches, first round as it goes (each launch compiled at its first call)"
              "\n| launch | µs |\n|---|---|", flush=True)
        for r in range(3):   # rounds over all configs: the GPU's drift lands on every config alike
            for name, fn in configs.items():
                times[name].append(measure_queued(fn, iters))
                if r == 0:
                    print(f"| {name} | {times[name][0] * 1e3:,.0f} |", flush=True)
        print("\nsweep, calls queued back to back, median of 3 interleaved rounds\n| launch | µs | TB/s |\n"
              "|---|---|---|", flush=True)
        for name, ts in sorted(times.items(), key=lambda kv: sorted(kv[1])[1]):
            ms = sorted(ts)[1]
            print(f"| {name} | {ms * 1e3:,.0f} | {nbytes / ms / 1e9:.2f} |", flush=True)


VARIANTS = {"defaults": {}, "one stage": dict(stages=1), "three stages": dict(stages=3),
            "w pieces of 16": dict(block_kw=16), "w pieces of 64": dict(block_kw=64),
            "state pass two stages": dict(state_block=64, state_stages=2), "32 state columns": dict(state_block=32),
            "fp32 scratch and S_n": dict(scratch="fp32", states="fp32"),
            # the state pass: dots ("x2": S_n and U_n as two bf16 parts; "16": rounded to bf16), columns, warps, stages
            "state-auto": dict(state_block="auto"),
            "state-tf32-64c-4w-2s": dict(state_block=64, state_warps=4, state_stages=2),
            "state-x2": dict(state_dots="x2", state_block=64),
            "state-x2-64c-8w-2s": dict(state_dots="x2", state_block=64, state_warps=8, state_stages=2),
            "state-x2-64c-4w-2s": dict(state_dots="x2", state_block=64, state_warps=4, state_stages=2),
            "state-x2-32c-8w-2s": dict(state_dots="x2", state_block=32, state_warps=8, state_stages=2),
            "state-x2-16c-8w-2s": dict(state_dots="x2", state_block=16, state_warps=8, state_stages=2),
            "state-x2-16c-4w-2s": dict(state_dots="x2", state_block=16, state_warps=4, state_stages=2),
            "state-x2-16c-8w-3s": dict(state_dots="x2", state_block=16, state_warps=8, state_stages=3),
            "state-x2-32c-4w-2s": dict(state_dots="x2", state_block=32, state_warps=4, state_stages=2),
            "state-x2-auto-8w-2s": dict(state_dots="x2", state_block="auto", state_warps=8, state_stages=2),
            "state-tf32-16c-8w-2s": dict(state_block=16, state_warps=8, state_stages=2),
            "state-bf16-32c-8w-2s": dict(state_dots="16", state_block=32, state_warps=8, state_stages=2),
            "state-bf16-16c-8w-2s": dict(state_dots="16", state_block=16, state_warps=8, state_stages=2),
            # fewer warps a program (fla's state pass runs 2 or 4): for few sequences × heads
            "state-x2-16c-2w-3s": dict(state_dots="x2", state_block=16, state_warps=2, state_stages=3),
            "state-x2-16c-4w-3s": dict(state_dots="x2", state_block=16, state_warps=4, state_stages=3),
            # "x2n": the two bf16 parts of S_n and U_n side by side in one dot (half the wgmma groups a chunk)
            "state-x2n-16c-8w-3s": dict(state_dots="x2n", state_block=16, state_warps=8, state_stages=3),
            "state-x2n-16c-4w-3s": dict(state_dots="x2n", state_block=16, state_warps=4, state_stages=3),
            "state-x2n-16c-4w-2s": dict(state_dots="x2n", state_block=16, state_warps=4, state_stages=2),
            "state-x2n-64c-4w-2s": dict(state_dots="x2n", state_block=64, state_warps=4, state_stages=2),
            "state-x2n-64c-8w-2s": dict(state_dots="x2n", state_block=64, state_warps=8, state_stages=2),
            # 8 columns a program (x2n's dots are then 16 wide): twice the programs at few sequences x heads
            "state-x2n-8c-8w-3s": dict(state_dots="x2n", state_block=8, state_warps=8, state_stages=3),
            # 32 columns: one program an SM at 32 heads
            "state-x2n-32c-8w-3s": dict(state_dots="x2n", state_block=32, state_warps=8, state_stages=3),
            "state-x2n-32c-4w-2s": dict(state_dots="x2n", state_block=32, state_warps=4, state_stages=2),
            # the output kernel's whole key dim in one piece (one stage): its wgmma not serialized (sm_90 offline)
            "output-bk128": dict(output_bk=128),
            # the intra-chunk kernels: v4's strips (one key block at a time) or v6's (the default), and the solve
            "v4": dict(strips="v4"), "v4-4w": dict(strips="v4", strip_warps=4),
            "v4-bk64": dict(strips="v4", block_k4=64), "v4-bk128": dict(strips="v4", block_k4=128),
            "v4-solve8w-kw64": dict(strips="v4", solve_warps=8, block_kw=64),
            "v4-solve8w-kw32": dict(strips="v4", solve_warps=8),
            "v4-solve8w-kw64-1s": dict(strips="v4", solve_warps=8, block_kw=64, stages=1),
            "v6": dict(strips="v6"), "v6-bk64": dict(strips="v6", block_k6=64),
            "v6-4w": dict(strips="v6", strip_warps=4), "v6-1w": dict(strips="v6", strip_warps=1),
            "solve-bf16": dict(solve_dots="16"), "solve-8w": dict(solve_warps=8),
            "solve-2w-kw16": dict(solve_warps=2, block_kw=16),
            # round 5: fp32 u, U_n and Aqk, q̃ / k̃ / d in the solve (the defaults before it); each change alone
            "round4": dict(u16=False, a16=False, strips_qkd=False), "u-and-U-bf16": dict(u16=True),
            "fp32-U": dict(u16=False), "fp32-Aqk": dict(a16=False), "qkd-in-solve": dict(strips_qkd=False),
            # the v6 strips' key pieces (16 from KDA round 6, 32 again since round 11's ex2 exponentials)
            "bk16": dict(block_k6=16),
            # where O_n is formed: the output kernel (the default before KDA round 10) or the state pass at every
            # shape (the default "auto": where the pass is one program an SM in at most four column blocks)
            "out-kernel": dict(out="kernel"), "out-state": dict(out="state")}


def kernel_rows(x: dict, T: int, H: int, D: int, scale: float, row, name: str) -> None:
    """The forward's three kernels (kda_triton.V3 as it stands) timed apart."""
    from kimi.ops import kda_triton as kt
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    R, N = H, -(-T // 64)
    scratch = torch.bfloat16 if kt.V3["scratch"] == "16" else torch.float32
    sd = torch.bfloat16 if kt.V3["states"] == "16" else torch.float32
    row(f"{name}: its intra-chunk kernels", "forward",
        lambda: kt.kda_intra_triton(*args, scale=scale, scratch=scratch))
    xs = kt.kda_intra_triton(*args, scale=scale, scratch=scratch)
    states = torch.empty(R, N, D, D, dtype=sd, device=x["q"].device)
    U = kt.u_out_buffer(xs)   # U_n into its own bf16 buffer where the forward writes it there
    row(f"{name}: its state pass (S_n, U_n)", "forward",
        lambda: kt._state_pass(xs, 1, T, H, D, D, x["q"].dtype, s0=x["h0"], identity=False, with_u=True,
                               states=states, U=U, **kt.forward_state_options(x["q"].dtype, scratch)))
    if U is not None:
        xs["u"] = U
    o = torch.empty_like(x["v"])
    row(f"{name}: its output kernel", "forward", lambda: kt._output_pass(xs, states, o, x["q"].dtype))


@contextlib.contextmanager
def v3_options(options: dict):
    """kda_triton.V3 with `options` over it for the block, as it was afterwards."""
    from kimi.ops import kda_triton as kt
    saved = dict(kt.V3)
    kt.V3.update(options)
    try:
        yield
    finally:
        kt.V3.clear()
        kt.V3.update(saved)


def parse_v3(pairs: list[str]) -> dict:
    """`OPTION=VALUE` strings as kda_triton.V3 options, values as Python literals (2, False, None) or else bare
    strings (strips=v4); ValueError for an option V3 does not have or a value `_check_v3` refuses."""
    from kimi.ops import kda_triton as kt
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in kt.V3:
            raise ValueError(f"{pair}: {key!r} is not an option of kda_triton.V3 ({sorted(kt.V3)})")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    with v3_options(options):
        kt._check_v3()
    return options


def variant_rows(x: dict, T: int, H: int, D: int, scale: float, row, outs: dict, variants: list | None) -> None:
    """The forward with kda_triton.V3's options (`variants`: names of VARIANTS; None: all but "defaults"), whole
    and, for the intra-chunk options, its intra-chunk kernels."""
    from kimi.ops import kda_triton as kt
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    for variant, options in VARIANTS.items():
        if (variants is None and variant == "defaults") or (variants is not None and variant not in variants):
            continue
        with v3_options(options):
            name = f"ours, V3 {variant}"

            def fwd():
                with torch.no_grad():
                    return kt.kda_chunk_fwd_triton(*args, x["h0"], scale=scale)
            outs[name] = fwd()[0]
            row(name, "forward", fwd)
            if "scratch" in variant:
                continue
            if not options:
                kernel_rows(x, T, H, D, scale, row, name)
                continue
            if all(n.startswith("state_") for n in options):
                xs = kt.kda_intra_triton(*args, scale=scale, scratch=torch.bfloat16)
                states = torch.empty(H, -(-T // 64), D, D, dtype=torch.bfloat16, device=x["q"].device)
                U = kt.u_out_buffer(xs)
                row(f"{name}: its state pass (S_n, U_n)", "forward",
                    lambda: kt._state_pass(xs, 1, T, H, D, D, x["q"].dtype, s0=x["h0"], identity=False, with_u=True,
                                           states=states, U=U,
                                           **kt.forward_state_options(x["q"].dtype, torch.bfloat16)))
                del xs, states
                continue
            row(f"{name}: its intra-chunk kernels", "forward",
                lambda: kt.kda_intra_triton(*args, scale=scale, scratch=torch.bfloat16))


def interleaved_rows(x: dict, scale: float, variants: list, rounds: int, iters: int) -> None:
    """The whole forward of each of `variants` (names of VARIANTS), timed in `rounds` interleaved rounds (every
    variant once a round, V3 set around each call): this GPU's drift between and within calls (6-8 %) lands on every
    variant alike. Medians over the rounds, each against the first variant named."""
    from kimi.ops import kda_triton as kt
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"])

    def timed(v):
        with v3_options(VARIANTS[v]), torch.no_grad():
            return measure(lambda: kt.kda_chunk_fwd_triton(*args, scale=scale), iters)[0]
    rounds_table("forward", variants, rounds, timed)


def rounds_table(what: str, variants: list, rounds: int, timed, extra: dict | None = None) -> None:
    """`timed(variant)` (ms) for every variant once a round, `rounds` rounds, printed as medians with their spread
    and ratio to the first variant's; `extra`: a last column ({"title": name, variant: text, ...})."""
    times = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            times[v].append(timed(v))
    med = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
    first = variants[0]
    print(f"\n{what}, {rounds} interleaved rounds, median ms (spread) and against {first}"
          f"{', ' + extra['title'] if extra else ''}:", flush=True)
    print(f"| variant | ms | min-max | ratio |{' ' + extra['title'] + ' |' if extra else ''}\n"
          f"|---|---|---|---|{'---|' if extra else ''}", flush=True)
    for v in variants:
        print(f"| {v} | {med[v]:.3f} | {min(times[v]):.3f}-{max(times[v]):.3f} | {med[v] / med[first]:.3f} |"
              f"{' ' + extra[v] + ' |' if extra else ''}", flush=True)


ROUND_12 = {"BF16_OPERANDS": False, "STATE_TERMS": {"block_k": 64, "num_warps": 8}}
"""Round 12's backward defaults over today's (docs/performance.md, KDA round 13)."""

BWD_VARIANTS = {"defaults": {},
                # the reverse state pass (the op's: the own kernel, from the forward's scratch): its chain's dots as
                # two dots of bf16 parts rather than "auto"'s choice, or dS_{n+1} stored in fp32 rather than bf16
                "reverse-x2": {"REVERSE": {"dots": "x2"}}, "reverse-dS-fp32": {"REVERSE": {"dstates": "fp32"}},
                # the pairwise sums of _bwd_dqkg_kernel: anchors side by side in the columns (default) or batched
                "pairwise-batched": {"PAIRWISE": "batched"},
                # the terms through the state: in their own launch (default: 32 key channels, 4 warps) by 64 key
                # channels at 8 warps (round 12's), or inside _bwd_dqkg_kernel
                "state-terms-bk64-8w": {"STATE_TERMS": {"block_k": 64, "num_warps": 8}},
                "state-terms-in-dqkg": {"STATE_TERMS": {"split": False}},
                "state-terms-bv32": {"STATE_TERMS": {"block_v": 32}},
                "state-terms-2-stages": {"STATE_TERMS": {"num_stages": 2}},
                # the reverse pass's columns: "auto" takes the narrowest block whose programs fit one wave (one x2n
                # program an SM); or 16, 32 columns (x2n), 32 on TF32 dots, 8 warps
                "reverse-bv16": {"REVERSE": {"block_v": 16}}, "reverse-bv32": {"REVERSE": {"block_v": 32}},
                "reverse-bv32-tf32": {"REVERSE": {"block_v": 32, "dots": None}},
                "reverse-bv32-8w": {"REVERSE": {"block_v": 32, "num_warps": 8}},
                # dO Uᵀ, dO S_nᵀ, U dS_{n+1}ᵀ on TF32 rather than bf16 operands (their stored dtype)
                "tf32-operands": {"BF16_OPERANDS": False},
                # round 12's defaults (at 32 heads also with reverse-bv16)
                "round-12": ROUND_12, "round-12-bv16": {**ROUND_12, "REVERSE": {"block_v": 16}}}
"""Options of kda_bwd_triton (module attributes; a dict value updates that attribute's dict) for
`--bwd-variants`."""


@contextlib.contextmanager
def bwd_options(options: dict):
    """kda_bwd_triton's attributes with `options` over them for the block, as they were afterwards."""
    from kimi.ops import kda_bwd_triton as kb
    saved = {n: getattr(kb, n) for n in options}
    try:
        for n, value in options.items():
            setattr(kb, n, {**saved[n], **value} if isinstance(saved[n], dict) else value)
        yield
    finally:
        for n, value in saved.items():
            setattr(kb, n, value)


def bwd_interleaved_rows(x: dict, scale: float, variants: list, rounds: int, iters: int) -> None:
    """The op's forward+backward (kda="triton") under each of `variants` (names of BWD_VARIANTS) in `rounds`
    interleaved rounds; medians, each against the first variant named, and the gradients' largest difference from
    the first variant's (the options change launches, not the math)."""
    core = IMPLEMENTATIONS["kda"]["triton"]
    do = torch.randn_like(x["v"])
    names = ("q", "k", "v", "g", "beta", "h0")

    def step():
        leaves = [x[n].detach().requires_grad_() for n in names]
        core(*leaves[:5], leaves[5], None, scale=scale)[0].backward(do)
        return [t.grad for t in leaves]
    def timed(v):
        with bwd_options(BWD_VARIANTS[v]):
            return measure(step, iters)[0]
    grads = {}
    for v in variants:
        with bwd_options(BWD_VARIANTS[v]):
            grads[v] = step()
    diff = {v: f"{max(rel(a, b) for a, b in zip(grads[v], grads[variants[0]])):.1e}" for v in variants}
    rounds_table("forward+backward", variants, rounds, timed,
                 extra={"title": f"largest gradient difference from {variants[0]}'s", **diff})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["8192x96"],
                    help="TxH, D = 128 (the issue's: 8192x96 32768x32 65536x8)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--decode-sweep", action="store_true", help="also sweep the decode kernels' launch configs")
    ap.add_argument("--no-fla-chunk", action="store_true",
                    help="skip fla's chunk_kda rows (its autotuning takes minutes a shape)")
    ap.add_argument("--fla-safe-only", action="store_true",
                    help="of fla's chunk_kda, only the safe-gate configuration (the faster one: half the autotuning)")
    ap.add_argument("--chunk-triton", action="store_true", help='also kda="chunk_triton" under torch.compile')
    ap.add_argument("--only-variants", action="store_true", help="only the rows of the forward's variants")
    ap.add_argument("--variants", nargs="*", default=None, help=f"of {list(VARIANTS)} (default: all)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="also time the named --variants' forwards in this many interleaved rounds (medians)")
    ap.add_argument("--v3", nargs="*", default=[], metavar="KEY=VALUE",
                    help="kda_triton.V3 options over the defaults for every row of ours (Python literals: "
                         "out=kernel block_k6=16)")
    ap.add_argument("--bwd-variants", nargs="*", default=None, metavar="NAME",
                    help=f"also time the op's forward+backward under these of {list(BWD_VARIANTS)} (kda_bwd_triton "
                         "options) in --rounds interleaved rounds (default 3)")
    a = ap.parse_args()
    try:
        from kimi.ops import kda_triton as kt
        kt.V3.update(parse_v3(a.v3))
    except ValueError as e:
        ap.error(f"--v3 {e}")
    unknown_bwd = [v for v in a.bwd_variants or () if v not in BWD_VARIANTS]
    if unknown_bwd:
        ap.error(f"--bwd-variants {unknown_bwd}: not among {list(BWD_VARIANTS)}")
    unknown = [v for v in a.variants or () if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants {unknown}: not among {list(VARIANTS)}")
    if a.rounds and not a.variants and not a.bwd_variants:
        ap.error("--rounds times the named --variants or --bwd-variants: name at least one")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}"
          f"{', V3 ' + ' '.join(a.v3) if a.v3 else ''}", flush=True)
    chunk_kda, fused_recurrent_kda = fla_module()
    if a.no_fla_chunk:
        chunk_kda = None
    for shape in a.shapes:
        T, H = (int(s) for s in shape.split("x"))
        chunk_rows(T, H, 128, a.iters, chunk_kda, a.chunk_triton, a.only_variants, a.variants, a.fla_safe_only)
        if a.rounds:
            interleaved_rows(inputs(T, H, 128, torch.device("cuda")), 128 ** -0.5, a.variants, a.rounds, a.iters)
        if a.bwd_variants:
            bwd_interleaved_rows(inputs(T, H, 128, torch.device("cuda")), 128 ** -0.5, a.bwd_variants,
                                 a.rounds or 3, a.iters)
        torch.cuda.empty_cache()
    if not a.no_decode:
        decode_rows(64, 96, 128, a.iters, fused_recurrent_kda, a.decode_sweep)


if __name__ == "__main__":
    main()
