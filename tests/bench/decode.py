"""Decode speed against the memory-bandwidth floor.

    PYTHONPATH=. python tests/bench/decode.py                                # H200: K3.1 Pro widths, 4 layers
    PYTHONPATH=. python tests/bench/decode.py --device cpu --preset tiny --layers 0 --experts 0 --context 64

Model: a preset at its real per-layer widths with fewer layers (K3's pattern: 3 KDA + 1 gated MLA per 4) and fewer
routed experts (top-k kept), random weights. The cache is filled to `--context` tokens with random values (a decode
step costs the same whatever the values), then one token per row is decoded per step.

The floor is the time to read, once, every byte a decode step must touch, at the measured device-copy bandwidth:
- weights: everything except the embedding table (B rows of it) and the routed experts, plus the routed experts the
  batch selects (measured from the router on the step's hidden states is not possible from outside, so the expected
  number under uniform routing: E (1 - (1 - k/E)^B) per MoE layer);
- KDA: the fp32 recurrent state, read and written, and the conv tails;
- gated MLA: every cached indexer key (the indexer scores all of them) and the min(context, index_topk) selected
  576-wide latents per row.
Ratio = floor / measured step; 1.0 would be perfect.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kimi  # noqa: E402
from kimi.config import scaled  # noqa: E402
from kimi.generation import make_steps  # noqa: E402
from kimi.params import param_specs, tree_items  # noqa: E402


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    n = int(gib * 2**30) // 4
    x = torch.empty(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * 4 * 10 / (time.perf_counter() - t)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def floor_bytes(cfg: kimi.ModelConfig, params: dict, B: int, context: int) -> dict[str, float]:
    expert_bytes = other = 0
    for path, leaf in tree_items(params):
        n = leaf.numel() * leaf.element_size()
        if path == "model.embed_tokens.weight":
            other += B * leaf.shape[1] * leaf.element_size()
        elif ".experts." in path:
            expert_bytes += n
        else:
            other += n
    E, k = cfg.num_experts, cfg.num_experts_per_token
    touched = E * (1 - (1 - k / E) ** B) if E else 0
    experts = expert_bytes / E * touched if E else 0
    la = cfg.linear_attn_config
    kinds = cfg.layer_types
    n_kda, n_mla = kinds.count("kda"), kinds.count("mla")
    act = params["model"]["embed_tokens"]["weight"].element_size()
    kda = n_kda * B * (2 * la.num_heads * la.head_dim ** 2 * 4
                       + 3 * (la.short_conv_kernel_size - 1) * la.num_heads * la.head_dim * act)
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    selected = min(context, cfg.index_topk) if cfg.has_indexer else context
    mla = n_mla * B * (selected * latent + (context * cfg.index_head_dim if cfg.has_indexer else 0)) * act
    return {"weights": other + experts, "kda_state": kda, "mla_cache": mla}


def fill_cache(cache: dict, context: int):
    g = torch.Generator(cache["pos"].device).manual_seed(0)
    for layer in cache["layers"]:
        for name, t in layer.items():
            if name == "state":
                t.normal_(0, 0.05, generator=g)
            else:
                t.normal_(0, 1.0, generator=g)
    cache["pos"].fill_(context)


def decode_setup(cfg, params, B, context, max_len, device, attn: str = "auto", kda: str = "auto"):
    """A cache of max_len slots filled to `context`, the backend (`attn`, `kda` as `kimi.Backend`'s), one eager
    decode step and its input ids."""
    cache = kimi.init_cache(cfg, B, max_len, dtype=params["model"]["embed_tokens"]["weight"].dtype, device=device)
    fill_cache(cache, context)
    backend = kimi.Backend(attn=attn, mla_form="absorbed", kda=kda)

    def step(params, ids, cache):
        logits, _ = kimi.forward(params, ids, cfg, backend, cache=cache)
        return logits[:, -1]

    return cache, backend, step, torch.randint(0, min(cfg.vocab_size, 256), (B, 1), device=device)


def bench(cfg, params, B, context, steps, compile: bool, device, mode: str = "graph", attn: str = "auto",
          kda: str = "auto") -> float:
    cache, backend, step, ids = decode_setup(cfg, params, B, context, context + steps + 8, device, attn, kda)
    if not compile:
        fn = step
    elif mode == "graph":      # what generate.py runs: regional compile, the whole step as one CUDA graph
        fn = make_steps(cfg, backend, True)[1]
    else:                      # one fullgraph of the whole step under cudagraph trees
        fn = torch.compile(step, fullgraph=True, mode="reduce-overhead")
        kimi.mark_static(cache)
    t = time.perf_counter()
    with torch.no_grad():
        for _ in range(3):
            fn(params, ids, cache)
        sync(device)
        warm = time.perf_counter() - t
        cache["pos"].fill_(context)
        t = time.perf_counter()
        for _ in range(steps):
            fn(params, ids, cache)
        sync(device)
    per_step = (time.perf_counter() - t) / steps
    note = ", compile included," if compile else ""
    print(f"  B={B}: {per_step * 1e3:.2f} ms/step (3 warm-up steps{note} {warm:.1f} s)", flush=True)
    return per_step


def profile(cfg, params, B, context, device, steps: int = 5, top: int = 30):
    """Per-kernel GPU time of one compiled decode step (no CUDA graphs, so each kernel is its own launch; the
    kernels are the ones the graph replays). Prints kernels per step, their summed time, and the top kernels."""
    from kernel_profile import profile_kernels
    cache, _, step, ids = decode_setup(cfg, params, B, context, context + steps + 16, device)
    fn = torch.compile(step, fullgraph=True)

    def run():
        for _ in range(steps):
            fn(params, ids, cache)
        sync(device)

    with torch.no_grad():
        for _ in range(3):
            fn(params, ids, cache)
        sync(device)
        profile_kernels(run, steps, f"profile B={B}", top)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="k3_1_pro")
    ap.add_argument("--layers", type=int, default=4, help="0: keep the preset's")
    ap.add_argument("--experts", type=int, default=64, help="routed experts kept (0: the preset's)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=4096, help="cached tokens per row before the timed steps")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--attn", default="auto", choices=["auto", "eager", "gather", "triton"],
                    help="kimi.Backend.attn of the step (auto: the dense absorbed path up to 8,192 slots, then "
                         "gather)")
    ap.add_argument("--kda", default="auto", choices=["auto", "chunk", "chunk_triton", "triton"],
                    help="kimi.Backend.kda (triton: the fused decode kernel, convs + norms + step in one launch)")
    ap.add_argument("--mode", default="graph", choices=["graph", "whole"],
                    help="graph: generate.py's decode (regional compile + one captured CUDA graph); whole: one "
                         "torch.compile fullgraph of the step with mode='reduce-overhead'")
    ap.add_argument("--profile", action="store_true", help="also print per-kernel GPU time of a compiled step")
    a = ap.parse_args()
    device = torch.device(a.device)
    cfg = scaled(kimi.preset(a.preset), num_layers=a.layers or None, num_experts=a.experts or None)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    t = time.perf_counter()
    params = kimi.init_params(cfg, seed=0, dtype=dtype, device=device, draw_on_device=True)
    print(f"{a.preset} widths, {cfg.num_hidden_layers} layers {cfg.layer_types}, {cfg.num_experts} experts top "
          f"{cfg.num_experts_per_token}: {kimi.param_count(cfg) / 1e9:.2f}B params ({dtype}), built in "
          f"{time.perf_counter() - t:.0f} s", flush=True)
    bw = copy_bandwidth(device)
    print(f"measured copy bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    compile = not a.no_compile and device.type == "cuda"
    rows = []
    for B in a.batch:
        step = bench(cfg, params, B, a.context, a.steps, compile, device, a.mode, a.attn, a.kda)
        parts = floor_bytes(cfg, params, B, a.context)
        total = sum(parts.values())
        floor = total / bw
        rows.append((B, step, floor, parts, total))
    print()
    how = f"compiled ({a.mode}, CUDA graphs)" if compile else "eager"
    print(f"context {a.context} tokens, attn {a.attn}, kda {a.kda}, {how}, bandwidth "
          f"{bw / 1e12:.2f} TB/s")
    print("| batch | ms / step | tokens/s | floor ms | floor / step | weights GB | KDA state GB | MLA cache GB |")
    print("|---|---|---|---|---|---|---|---|")
    for B, step, floor, parts, total in rows:
        print(f"| {B} | {step * 1e3:.2f} | {B / step:.0f} | {floor * 1e3:.2f} | {floor / step:.0%} | "
              f"{parts['weights'] / 1e9:.2f} | {parts['kda_state'] / 1e9:.3f} | {parts['mla_cache'] / 1e9:.3f} |")
    if a.profile:
        for B in a.batch:
            profile(cfg, params, B, a.context, device)


if __name__ == "__main__":
    main()
