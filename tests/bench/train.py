"""Training-step throughput: tokens/s, MFU and peak memory of train.py's step (`kimi.training.train_step` over the
compiled layers, fp32 master weights with `kimi.training.compiled_cast`'s gradient upcasts, bf16 compute, TF32 fp32
matmuls, the blockwise loss, fused AdamW, clipping) on one device, random weights.

    python tests/bench/train.py                                  # one H200: K3.1 Pro widths, 4 layers, 8 experts
    python tests/bench/train.py --device cpu --preset tiny --batch 2 --seq 64 --steps 2
    torchrun --nproc-per-node 2 tests/bench/train.py --seq 131072 --cp 2 --recompute   # context parallel, 2 GPUs

Under torchrun the weights are sharded over the processes (FSDP2, train.py's several-GPU path) and `--cp N` splits
each row over groups of N processes (`kimi.cp`, docs/context_parallel.md); tokens/s count the whole world's tokens,
MFU divides by the world's peak, and peak memory is the most any one process allocated.

The scaled preset (default `k3_1_pro`) keeps every per-layer width of the release (hidden 7168, 96 KDA heads x 128,
96 MLA heads 128/64/128 with q/kv ranks 1536/512, expert width 3072 in latent 3584, 2 shared experts, top-16
routing, indexer 64 x 128 top-2048, vocabulary 163840) and its layer pattern (a dense first layer, KDA, gated MLA
every 4th and last), with fewer layers and fewer routed experts so that weights, gradients and AdamW state (16
bytes a parameter) plus the bf16 weight copies and activations fit one GPU: 4 layers and 8 experts (top-8) are
6.0B parameters, ~96 GB of training state (16 experts, top-16: 6.8B, ~109 GB). With top-k equal to the expert
count every expert GEMM sees all B·T rows (its width is the release's; how many rows an expert gets in the release
depends on the batch and expert parallelism).

Model FLOPs per token: `kimi.training.model_flops_per_token` (6 x active matmul parameters, plus the attention,
KDA-state and indexer terms, documented there; under `--lora-rank` the frozen base counts 4 a parameter and the
adapters 6). `--topk` routes each token to fewer experts (sparse routing, as the release's 16 of 896; the router's own
balance on the random tokens is printed after the timing, per MoE layer);
`--lora-rank` freezes the base in bf16 with fp32 adapters (`--lora-targets`), so many more experts fit.
MFU = tokens/s x FLOPs per token / peak (`kimi.training.peak_flops`, dense bf16). Timing: `--warmup` steps
(compilation), then the median of `--steps` steps, synchronized.
A step is `--accum` forward+backward passes of B x T tokens (one table row per count given), then clipping and
one AdamW update: the optimizer's fixed cost (it reads and writes 28 bytes a parameter; the embedding and head are
2.35B of the 6.0B parameters at 4 layers) is spread over accum x B x T tokens, as in training with a global batch
larger than one micro-batch. The accumulated fp32 gradients (4 bytes a parameter) stay resident through the
following micro-batches: a count that runs out of memory with the loss keeping its bf16 logits is retried with
them recomputed (the `logits` column says which).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the package of this checkout
import kimi  # noqa: E402
from kimi.config import scaled  # noqa: E402
from kimi import lora  # noqa: E402
from kimi.training import (adamw, fp32_paths, lora_flop_params, make_loss, model_flops_per_token,  # noqa: E402
                           peak_flops, train_step, trainable_named)


def bench(a) -> list[dict]:
    """One row per accumulation count in `a.accum`, all after one compilation."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(a.device)
    if world > 1:      # torchrun: FSDP2 over the processes, context parallelism inside groups of --cp
        import torch.distributed as dist
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if world % a.cp:
        sys.exit(f"--cp {a.cp} needs a multiple of {a.cp} processes, got {world}")
    if a.lora_rank < 0 or (a.lora_rank and world > 1):
        sys.exit(f"--lora-rank must be >= 0 and runs in one process (got {a.lora_rank} with {world} processes)")
    cfg = scaled(kimi.preset(a.preset), num_layers=a.layers, num_experts=a.experts)
    if a.topk is not None:
        if not 1 <= a.topk <= cfg.num_experts:
            sys.exit(f"--topk must lie in [1, {cfg.num_experts}] (the routed experts), got {a.topk}")
        cfg = dataclasses.replace(cfg, num_experts_per_token=a.topk)
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    use_compile = a.compile if a.compile is not None else device.type == "cuda"
    torch.manual_seed(0)
    # fp32 master weights drawn on the device (fast for billions of parameters; the values only need to be sane);
    # under LoRA the base in the compute dtype, frozen, with fp32 adapters (train.py's build_model)
    params = kimi.init_params(cfg, seed=0, dtype=str(compute).removeprefix("torch.") if a.lora_rank else "float32",
                              device=device, draw_on_device=True)
    adapters = {}
    if a.lora_rank:
        for _, p in kimi.params.tree_items(params):
            p.requires_grad_(False)
        try:
            adapters = lora.init_adapters(params, tuple(a.lora_targets), a.lora_rank)
        except lora.LoRAError as e:
            sys.exit(f"--lora-targets: {e}")
    backend = kimi.Backend(attn=a.attn, kda=a.kda, moe=a.moe, mla_form=a.mla_form, sparse_fwd=a.sparse_fwd)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if a.tf32 else "highest")
    fn = make_loss(a.compile_scope if use_compile else None, recompute=a.recompute, master_cast=a.cast == "compiled")
    V, B, T = cfg.vocab_size, a.batch, a.seq
    ids = torch.randint(0, V, (B, T), device=device)
    labels = torch.roll(ids, -1, dims=1)
    doc_len = a.doc_len or T
    doc = (torch.arange(T, device=device) // doc_len).expand(B, T).contiguous()     # packed documents of doc_len
    step_kw = dict(cfg=cfg, backend=backend, dtype=compute, fp32_paths=fp32_paths(cfg),
                   lora_scale=lora.scale_of(a.lora_rank, 2.0 * a.lora_rank) if a.lora_rank else 1.0,
                   max_document_len=doc_len if a.tell_lengths else None)
    root = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from kimi.cp import ContextParallel
        from kimi.fsdp import build_fsdp, sharded_trainable_named
        cp = None
        if a.cp > 1:
            mesh = init_device_mesh(device.type, (world // a.cp, a.cp), mesh_dim_names=("dp", "cp"))
            cp = ContextParallel.of_mesh(mesh, "cp", a.cp_layout)
        root = build_fsdp(params, {}, **step_kw, compile_units=use_compile, recompute=a.recompute, cp=cp)
        params = None
        named = sharded_trainable_named(root)
    else:
        named = trainable_named(params, adapters)
    opt = adamw(named, lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=device.type == "cuda")
    rows_world = world // a.cp             # data-parallel groups, each with its own rows of B x T

    def step(accum: int, keep_logits: int = 1 << 30):
        """train.py's optimizer step over `accum` micro-batches: the same one each time (only the timing matters)."""
        def micro_loss(*batch):
            if root is not None:
                return root(*batch)
            return fn(params, adapters, *batch, **step_kw, keep_logits=keep_logits)
        return train_step(micro_loss, [(ids, labels, doc)] * accum, opt, named.values(),
                          label_tokens=accum * B * T * rows_world, grad_clip=1.0, world=world)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    for i in range(a.warmup):   # the loss is a sanity check: ~ln(V) at the start on random tokens, finite
        result = step(1)
        sync()
        mem = ""
        if device.type == "cuda":
            mem = (f", {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated after it, peak "
                   f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
            torch.cuda.reset_peak_memory_stats(device)
        print(f"  warm-up step {i + 1}/{a.warmup} done at {time.perf_counter() - t0:.0f} s, loss {result.loss:.4f} "
              f"(ln V = {math.log(V):.4f}), grad norm {result.grad_norm:.4g}{mem}", flush=True)
    warm_s = time.perf_counter() - t0
    flops = model_flops_per_token(cfg, T, adapters=lora_flop_params(cfg, adapters) if adapters else None)
    peak = peak_flops(device)
    rows = []

    def timed(accum: int, keep_logits: int) -> dict:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(a.steps):
            sync()
            t = time.perf_counter()
            if not step(accum, keep_logits).finite:   # skipped, so not a whole step: say so
                print(f"  {accum} micro-batches: a non-finite loss or gradient, the optimizer step was skipped",
                      flush=True)
            sync()
            times.append(time.perf_counter() - t)
        step_s = statistics.median(times)
        tps = accum * B * T * rows_world / step_s
        peak_gb = math.nan
        if device.type == "cuda":
            peak_gb = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30, device=device)
            if world > 1:
                torch.distributed.all_reduce(peak_gb, op=torch.distributed.ReduceOp.MAX)
            peak_gb = float(peak_gb)
        return dict(
            model=f"{a.preset} L{cfg.num_hidden_layers} E{cfg.num_experts} k{cfg.num_experts_per_token} "
                  f"attn={a.attn}{'/' + a.sparse_fwd if a.attn == 'cudnn' else ''} kda={a.kda} moe={a.moe} "
                  f"cast={a.cast} tf32={'on' if a.tf32 else 'off'}"
                  + (" recompute" if a.recompute else "")
                  + (f" LoRA r{a.lora_rank} on {'+'.join(a.lora_targets)}" if a.lora_rank else "")
                  + (f" {world} processes" + (f" cp {a.cp} {a.cp_layout}" if a.cp > 1 else "") if world > 1 else "")
                  + (f" docs of {doc_len}{'' if a.tell_lengths else ' (length not passed)'}" if a.doc_len else ""),
            params=kimi.param_count(cfg), active=kimi.param_count(cfg, active=True),
            shape=f"{accum}x{B}x{T}" if accum > 1 else f"{B}x{T}",
            logits="kept" if B * T * V <= keep_logits else "recomputed",
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            compiled=use_compile, warm_s=warm_s, step_ms=step_s * 1e3, tps=tps, tflops=tps * flops / 1e12,
            flops_per_token=flops, mfu=tps * flops / (peak * world) if peak else math.nan, peak_gb=peak_gb)

    for accum in a.accum:
        # The accumulated fp32 gradients stay resident through the next micro-batches: where that no longer fits,
        # the row is tried again with the loss recomputing its logits. (The retry is outside the `except`: its
        # traceback holds the failed step's tensors.)
        row = None
        for keep_logits in (1 << 30, 0):
            try:
                row = timed(accum, keep_logits)
            except torch.OutOfMemoryError:
                pass
            if row is not None:
                break
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            kept = B * T * V <= keep_logits
            print(f"  {accum} micro-batches: out of memory with the logits {'kept' if kept else 'recomputed'}",
                  flush=True)
            if not kept:
                break
        if row is not None:
            rows.append(row)
            print("  " + _row(row), flush=True)
    if world == 1 and cfg.num_experts and cfg.num_experts_per_token < cfg.num_experts:
        print("  " + routing_balance(params, cfg, backend, ids, doc), flush=True)
    if a.profile and device.type == "cuda":
        from kernel_profile import profile_kernels
        profile_kernels(lambda: (step(1), sync()), 1, "profile, one training step (one micro-batch)", top=70,
                        ops=30)
    return rows


def routing_balance(params: dict, cfg, backend, ids, doc) -> str:
    """How evenly the router spreads these tokens over the experts: one eager forward without the head and without
    gradients (the adapters left out: LoRA's B starts at zero), recording every MoE layer's expert choices. Returns
    a line with each layer's busiest expert's tokens over the mean and the experts that got none."""
    from kimi import moe
    counts = []
    route = moe.route

    def recording(p, x, c):
        idx, w = route(p, x, c)
        counts.append(torch.bincount(idx.flatten(), minlength=c.num_experts).float())
        return idx, w
    moe.route = recording
    try:
        with torch.no_grad():
            kimi.forward(params, ids, cfg, backend, document_ids=doc, head=False)
    except torch.OutOfMemoryError:
        return "routing balance: out of memory for its extra forward"
    finally:
        moe.route = route
    peak = ", ".join(f"{float(c.max() / c.mean()):.2f}" for c in counts)
    idle = ", ".join(str(int((c == 0).sum())) for c in counts)
    return (f"routing of these random tokens, per MoE layer: the busiest expert's tokens over the mean {peak}; "
            f"experts without a token {idle} (of {cfg.num_experts}, top {cfg.num_experts_per_token})")


_HEADER = ("| model | params | active | device | [accum x] B x T | logits | compiled | step ms | tokens/s | TFLOP/s | "
           "MFU | peak GB |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def _row(r: dict) -> str:
    return (f"| {r['model']} | {_n(r['params'])} | {_n(r['active'])} | {r['device']} | {r['shape']} | {r['logits']} | "
            f"{'yes' if r['compiled'] else 'no'} | {r['step_ms']:.1f} | {r['tps']:,.0f} | {r['tflops']:.1f} | "
            f"{r['mfu']:.1%} | {r['peak_gb']:.1f} |")


def _n(x: float) -> str:
    return f"{x / 1e9:.2f}B" if x >= 1e9 else f"{x / 1e6:.1f}M"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="k3_1_pro")
    ap.add_argument("--layers", type=int, default=None, help="default: 4 for the release presets, preset's own else")
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default: 8 for the release presets)")
    ap.add_argument("--topk", type=int, default=None,
                    help="experts routed a token, 1 to --experts (default: the preset's, at most --experts); the "
                         "long-context issue's sparse routing is at most a quarter of the experts")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="LoRA adapters of this rank (0: full fine-tuning): the base frozen in bf16, fp32 adapters; "
                         "MFU counts the frozen weights 4 FLOPs a parameter, not 6")
    ap.add_argument("--lora-targets", nargs="+", default=list(lora.ATTENTION_TARGETS),
                    help="modules to adapt (kimi/lora.py; 'experts' for the routed experts)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--doc-len", type=int, default=None,
                    help="pack documents of this many tokens into each row (default: one document per row)")
    ap.add_argument("--tell-lengths", action=argparse.BooleanOptionalAction, default=True,
                    help="pass the document length to the model as max_document_len (train.py does)")
    ap.add_argument("--attn", default="auto", choices=["auto", "eager", "sdpa", "gather", "triton", "cudnn"],
                    help="train.py's --attn (auto: triton on a GPU in bf16, else sdpa in the expanded form up to 32K "
                         "keys; triton: the Triton indexer and sparse MLA; cudnn: cuDNN Frontend's indexer and "
                         "sparse backward)")
    ap.add_argument("--sparse-fwd", default="auto", choices=["auto", "flashmla", "triton", "gather"],
                    help="train.py's --sparse-fwd: the sparse forward under --attn cudnn")
    ap.add_argument("--kda", default="auto", choices=["auto", "chunk", "chunk_opaque", "chunk_triton", "triton"],
                    help="train.py's --kda (auto: triton on a GPU for bf16 and the bounded gate, else "
                         "chunk_triton there; on a CPU chunk_opaque compiled, chunk eager); chunk: traced by "
                         "Inductor, the state pass a scan; chunk_opaque: the KDA chunk core as one opaque op (fast "
                         "compile); chunk_triton: chunk with the state pass in Triton; triton: the chunked forward "
                         "and backward as Triton kernels")
    ap.add_argument("--moe", default="auto", choices=["auto", "dense", "grouped", "gemv"],
                    help="train.py's --moe (auto: grouped for float32/bfloat16 micro-batches)")
    ap.add_argument("--accum", type=int, nargs="+", default=[1],
                    help="micro-batches (of --batch x --seq) per optimizer step, as train.py's gradient accumulation; "
                         "several counts give one row each after one compilation")
    ap.add_argument("--mla-form", default="auto", choices=["auto", "expanded", "absorbed"],
                    help="train.py's --mla-form (auto: expanded without a cache)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="default: on for CUDA, off for CPU")
    ap.add_argument("--compile-scope", default="layers", choices=["layers", "model"],
                    help="layers: kimi.compile_layers (one graph per distinct layer); model: one fullgraph")
    ap.add_argument("--cast", default="compiled", choices=["compiled", "eager"],
                    help="compile scope 'layers': the weight casts as compiled calls (kimi.training.compiled_cast, "
                         "train.py's way) or eager")
    ap.add_argument("--recompute", action="store_true",
                    help="activation checkpointing: every decoder layer recomputed in the backward (train.py's "
                         "--activation-checkpointing layers)")
    ap.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                    help="fp32 matmuls on TF32 tensor cores (train.py's --tf32)")
    ap.add_argument("--cp", type=int, default=1,
                    help="under torchrun: context parallelism over groups of this many processes (train.py's --cp)")
    ap.add_argument("--cp-layout", default="zigzag", choices=["zigzag", "contiguous"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="then print the per-kernel GPU time of one step (CUDA)")
    a = ap.parse_args()
    if int(os.environ.get("RANK", "0")):      # under torchrun the first process prints the tables
        sys.stdout = open(os.devnull, "w")
    if min(a.accum) < 1:
        ap.error(f"--accum counts must be at least 1, got {a.accum}")
    if a.preset in ("k3", "k3_1_pro"):
        a.layers = a.layers or 4
        a.experts = a.experts or 8
    rows = bench(a)
    if not rows:
        sys.exit("no configuration fitted in memory")
    print(f"\nFLOPs per token {rows[0]['flops_per_token'] / 1e9:.3g} G; warm-up (compile) {rows[0]['warm_s']:.0f} s")
    print(_HEADER)
    for r in rows:
        print(_row(r))


if __name__ == "__main__":
    main()
