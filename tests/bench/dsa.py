"""One gated-MLA layer (DSA) at long context: time and peak memory of each attention path, and generation's prefill.

    PYTHONPATH=. python tests/bench/dsa.py                               # H200: K3.1 Pro widths, 8K to 128K
    PYTHONPATH=. python tests/bench/dsa.py --preset tiny --device cpu --tokens 256 512 --prefill 0

Layer: the gated-MLA layer of the preset at its real widths (K3.1 Pro: hidden 7168, 96 heads with q/k 192 and v 128,
kv rank 512, indexer 64 x 128 choosing 2,048 keys), B = 1, bf16, random weights, one document of T tokens, eager
(each op as PyTorch runs it; the later kernels add rows; `--compile`: the layer through `torch.compile(fullgraph=True)`
as train.py runs it, the first call of each row untimed). Rows per T:

- `gather`: `Backend(attn="gather")`, ranges instead of masks: blocked indexer top-k, attention over the gathered
  latents in the absorbed form;
- `triton`: `Backend(attn="triton")`, the same path with the Triton indexer (streaming top-k) and the Triton
  sparse attention forward and backward;
- `cudnn`: `Backend(attn="cudnn")` where cuDNN Frontend is installed: its indexer scores and top-k, its SM90
  sparse backward, the forward `sparse_fwd="auto"` resolves to (FlashMLA if built, else the Triton kernels);
- `gather, documents of 2,048`: the same layer on packed documents of index_topk tokens with the bound passed
  (`max_document_len`): no indexer, dense document-causal attention over a key window per query block;
- `sdpa (dense mask)`: the expanded form through SDPA with a [T, T] mask, the path `attn="auto"` took for every
  length before (and still takes without a cache up to 32,768 keys on a CPU or in fp32);
- `dense causal flash attention`: `F.scaled_dot_product_attention(is_causal=True)` on the expanded per-head q, k, v
  alone (no projections, no indexer): what dense attention costs with a fused kernel.

At the first T (8K by default) the gather and sdpa layers' outputs and input gradients are compared (the same
selection: the indexer op is shared). "peak" is the most memory allocated during the call, on top of the weights
and the input. fwd+bwd differentiates every weight but the frozen indexer's, and the input.

`--profile`: after each T's rows, the CUDA kernels of each selected path's forward+backward, per step, largest first
(where the layer's time goes).

Prefill (`--prefill`, default 131072 and 32768 tokens): `kimi.generation.generate` as generate.py runs it (its
default backend or those `--prefill-backends` names, chunks of 8,192 tokens into the cache, compiled per distinct
layer on CUDA as generate.py does, after an untimed compiling call; `--no-prefill-compile`: eager) on the preset
scaled to 4 layers and 8 experts, one prompt, 4 new tokens: prefill seconds, tokens/s, the first, middle and last
chunk's seconds (how the time grows with the cache behind a chunk), peak memory; with `--profile` then the CUDA
kernels of the same call (the prefill and its 4 decode steps), per chunk.

    PYTHONPATH=. python tests/bench/dsa.py --tokens --prefill 8192 131072 --prefill-backends default kda=chunk_opaque
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kimi  # noqa: E402
from kimi.config import scaled  # noqa: E402
from kimi.generation import DEFAULT_BACKEND, generate, make_steps  # noqa: E402
from kimi.mla import gated_mla  # noqa: E402
from kimi.ranges import document_ranges  # noqa: E402
from kernel_profile import profile_kernels  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device, iters: int) -> tuple[float, float]:
    """(median ms of `iters` calls after one warm-up, peak GiB allocated above what was allocated before)."""
    fn()
    sync(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(iters):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if device.type == "cuda" else float("nan")
    return sorted(times)[len(times) // 2] * 1e3, peak


def attempt(fn, device, iters):
    try:
        return measure(fn, device, iters)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def mla_layer(cfg, device):
    """The first gated-MLA layer's `self_attn` subtree of the preset scaled to 4 layers, bf16, on the device."""
    small = scaled(cfg, num_layers=4, num_experts=max(cfg.num_experts_per_token, 1)) if cfg.num_experts else cfg
    i = small.layer_types.index("mla")
    params = kimi.init_params(small, dtype="bfloat16", device=device, draw_on_device=device.type == "cuda")
    return params["model"]["layers"][i]["self_attn"]


def layer_rows(a, cfg, device):
    p = mla_layer(cfg, device)
    layer = gated_mla
    if a.compile:   # as train.py runs a layer: one graph (fullgraph), the kernels as custom ops
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        layer = torch.compile(gated_mla, **kimi.compile_options(fullgraph=True, dynamic=False))
    H, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    k = cfg.index_topk
    try:
        cudnn = kimi.Backend(attn="cudnn")
        print(f"cudnn: forward {kimi.ops.resolve(cudnn, device=device, dtype=torch.bfloat16).sparse_fwd}", flush=True)
    except kimi.ops.cudnn_dsa.CudnnUnavailable as e:
        cudnn = None
        print(f"(no cudnn rows: {e})", flush=True)
    print("| T | path | fwd ms | fwd peak GiB | fwd+bwd ms | fwd+bwd peak GiB |\n|---|---|---|---|---|---|",
          flush=True)
    for n, T in enumerate(a.tokens):
        x = torch.randn(1, T, cfg.hidden_size, device=device, dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        one_doc = torch.zeros(1, T, dtype=torch.long, device=device)
        short_doc = (torch.arange(T, device=device) // k)[None]
        iters = 3 if T <= 32768 else 2

        def run(backend, doc, span, grad):
            ranges = document_ranges(doc, span)
            if not grad:
                with torch.no_grad():
                    return layer(p, x, cfg, backend, ranges=ranges)
            xg = x.detach().requires_grad_()
            y = layer(p, xg, cfg, backend, ranges=ranges)
            y.backward(dy)
            return y, xg.grad

        paths = [("triton", kimi.Backend(attn="triton"), one_doc, None),
                 ("gather", kimi.Backend(attn="gather"), one_doc, None),
                 (f"gather, documents of {k:,}", kimi.Backend(attn="gather"), short_doc, k)]
        if cudnn is not None:
            paths.insert(1, ("cudnn", cudnn, one_doc, None))
        if T <= a.max_sdpa:
            paths.append(("sdpa (dense mask)", kimi.Backend(attn="sdpa", mla_form="expanded"), one_doc, None))
        paths = [r for r in paths if not a.paths or r[0].split(",")[0].split(" ")[0] in a.paths]
        for name, backend, doc, span in paths:
            fwd = attempt(lambda: run(backend, doc, span, False), device, iters)
            bwd = attempt(lambda: run(backend, doc, span, True), device, iters)
            for leaf in (v for _, v in kimi.params.tree_items(p)):
                leaf.grad = None
            print(f"| {T:,} | {name} | {_cell(fwd)} | {_cell(bwd)} |", flush=True)
        for name, backend, doc, span in paths if a.profile and device.type == "cuda" else ():
            def steps(backend=backend, doc=doc, span=span):
                for _ in range(2):
                    run(backend, doc, span, True)
                sync(device)
            profile_kernels(steps, 2, f"{name} layer forward+backward, T = {T:,}", top=25)
            for leaf in (v for _, v in kimi.params.tree_items(p)):
                leaf.grad = None
            print("\n| T | path | fwd ms | fwd peak GiB | fwd+bwd ms | fwd+bwd peak GiB |\n|---|---|---|---|---|---|",
                  flush=True)
        q = torch.randn(1, H, T, dn + dr, device=device, dtype=torch.bfloat16, requires_grad=True)
        kk = torch.randn(1, H, T, dn + dr, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, H, T, dv, device=device, dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(1, H, T, dv, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            fwd = attempt(lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True), device, iters)
        bwd = attempt(lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True).backward(do), device, iters)
        print(f"| {T:,} | dense causal flash attention (attention alone) | {_cell(fwd)} | {_cell(bwd)} |", flush=True)
        del q, kk, v, do
        if n == 0 and T <= a.max_sdpa and not a.paths:
            y_g, dx_g = run(kimi.Backend(attn="gather"), one_doc, None, True)
            y_s, dx_s = run(kimi.Backend(attn="sdpa", mla_form="expanded"), one_doc, None, True)
            print(f"\nT = {T:,}: gather vs sdpa (bf16, same selection): output rel. error {_rel(y_g, y_s):.2e}, input "
                  f"gradient {_rel(dx_g, dx_s):.2e}\n", flush=True)
        del x, dy


def prefill_rows(a, cfg, device):
    small = scaled(cfg, num_layers=4, num_experts=8) if cfg.num_experts else cfg
    params = kimi.init_params(small, dtype="bfloat16", device=device, draw_on_device=device.type == "cuda")
    for leaf in (v for _, v in kimi.params.tree_items(params)):
        leaf.requires_grad_(False)
    compiled = a.prefill_compile if a.prefill_compile is not None else device.type == "cuda"
    print("| prompt tokens | backend | prefill s | tokens/s | first / middle / last chunk s | peak GiB |\n"
          "|---|---|---|---|---|---|", flush=True)
    for spec in a.prefill_backends:
        try:
            backend = DEFAULT_BACKEND if spec == "default" else dataclasses.replace(
                DEFAULT_BACKEND, **dict(kv.split("=", 1) for kv in spec.split(",")))
        except (TypeError, ValueError) as e:
            sys.exit(f"--prefill-backends {spec!r}: expected 'default' or field=value pairs of kimi.Backend joined "
                     f"by commas ({e})")
        steps = make_steps(small, backend, compile=compiled)     # one set per backend: compiled once
        for T in a.prefill:
            prompt = torch.randint(0, small.vocab_size, (T,)).tolist()
            chunks = []
            try:
                if compiled:     # the first call compiles (and a new cache length recompiles once): untimed
                    t0 = time.perf_counter()
                    generate(params, small, [prompt], max_new_tokens=4, prefill_chunk=a.prefill_chunk,
                             backend=backend, steps=steps)
                    print(f"  ({T:,} tokens, {_backend(backend)}: the first, compiling call took "
                          f"{time.perf_counter() - t0:.1f} s)", flush=True)
                if device.type == "cuda":            # the peak of the timed call alone
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                r = generate(params, small, [prompt], max_new_tokens=4, prefill_chunk=a.prefill_chunk,
                             backend=backend, steps=steps, on_prefill=lambda done, total, s: chunks.append(s))
                peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
                each = [b - a_ for a_, b in zip([0.0] + chunks, chunks)]      # the cumulative times, per chunk
                split = " / ".join(f"{each[i]:.2f}" for i in (0, len(each) // 2, -1)) if each else ""
                print(f"| {T:,} | {_backend(backend)}, {'compiled' if compiled else 'eager'}, chunks of "
                      f"{a.prefill_chunk:,} | {r.prefill_s:.2f} | "
                      f"{T / r.prefill_s:,.0f} | {split} | {peak:.1f} |", flush=True)
            except torch.OutOfMemoryError as e:
                print(f"| {T:,} | {_backend(backend)} | out of memory ({str(e).splitlines()[0][:80]}) | | | |",
                      flush=True)
                continue
            if a.profile and device.type == "cuda":   # after the timed run: the kernels are compiled
                n = -(-T // a.prefill_chunk)
                # the timed call's max_new_tokens: the same cache length, so a compiled prefill does not recompile
                profile_kernels(lambda: (generate(params, small, [prompt], max_new_tokens=4,
                                                  prefill_chunk=a.prefill_chunk, backend=backend, steps=steps),
                                         torch.cuda.synchronize()), n,
                                f"profile, prefill of {T:,} tokens ({_backend(backend)}), per chunk", top=40,
                                ops=25)


def _backend(b):
    return ", ".join(f"{k}={getattr(b, k)}" for k in ("attn", "mla_form", "kda", "moe"))


def _cell(r):
    return "out of memory | " if r is None else f"{r[0]:,.1f} | {r[1]:.1f}"


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="k3_1_pro")
    ap.add_argument("--tokens", type=int, nargs="*", default=[8192, 32768, 65536, 131072])
    ap.add_argument("--max-sdpa", type=int, default=32768, help="longest T for the dense-mask row (64K: OOM)")
    ap.add_argument("--paths", nargs="*", default=[], choices=["triton", "cudnn", "gather", "sdpa"],
                    help="layer rows to run (default: all); 'gather' includes its short-document row")
    ap.add_argument("--compile", action="store_true",
                    help="the layer rows through torch.compile(fullgraph=True), as train.py runs a layer (the first "
                         "call of each row compiles: untimed)")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel profile of each path's forward+backward, and of each prefill row (per chunk)")
    ap.add_argument("--prefill", type=int, nargs="*", default=[131072, 32768])
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--prefill-backends", nargs="*", default=["default"],
                    help="generate's backend for the prefill rows: 'default' or Backend fields, e.g. "
                         "'kda=triton,attn=triton'")
    ap.add_argument("--prefill-compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compile the prefill per distinct layer, as generate.py does (default: on CUDA); the "
                         "first, compiling call of each row is untimed")
    a = ap.parse_args()
    device = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = True     # as train.py (--tf32): fp32 matmuls of bf16 values on TF32
    cfg = kimi.preset(a.preset)
    print(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"preset {a.preset}", flush=True)
    if a.tokens:
        layer_rows(a, cfg, device)
    if a.prefill:
        print()
        prefill_rows(a, cfg, device)


if __name__ == "__main__":
    main()
