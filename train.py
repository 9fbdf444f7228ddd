"""Train or fine-tune a Kimi K3.1 Pro model (full or LoRA) on text or chat data, on a CPU or on GPUs.

    python train.py                                   # tiny preset, fresh weights, the project's own text, CPU
    python train.py --model path/to/ckpt --data.paths chat.jsonl --lora.rank 16
    torchrun --nproc-per-node 8 train.py k3_1_pro_sft --model path/to/ckpt --data.paths train.jsonl
    python train.py --help                            # every option; `python train.py PRESET --help` for a preset

The recipe, top to bottom: build the model (a checkpoint folder or a preset with fresh weights), tokenize the data
into rows (`kimi.data`: packed with `document_ids`, or one document per padded row), then for each optimizer step
draw a global batch and run `kimi.training.train_step` (forward/backward over micro-batches, clip, AdamW), and every
so often evaluate, log, plot (`kimi.plot`) and write an atomic training checkpoint (`kimi.train_state`: params or
adapters, optimizer, step, data position, RNG). At the end the model is exported in the Hugging Face layout
(`kimi.save_checkpoint`, LoRA merged), loadable by generate.py.

Numerics (docs/numerics.md#precision, docs/numerics.md#loss): on CPU everything is fp32. On a GPU the master weights
and AdamW state are fp32 and the forward runs in bf16 (the tree is cast inside the loss function; the fp32 leaves
stay fp32); the loss is fp32 cross-entropy summed over label tokens and divided by the label tokens of the whole
global batch, so gradient accumulation and data parallelism give the same gradient as one big batch.

Several GPUs (`torchrun`): PyTorch FSDP2 with one unit per decoder layer (`kimi.fsdp`, docs/architecture.md#fsdp),
each compiled on its own. With one process the layers go through `kimi.compile_layers` (or, `--compile-scope model`,
the whole model up to the head is one `torch.compile(fullgraph=True)` graph). The loss
(`kimi.loss.token_loss_sum`, the head applied by vocabulary blocks) always runs eagerly. `--cp N`: context
parallelism, each row's tokens split over the N processes, which hold the whole model (`kimi.cp`,
docs/context_parallel.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import random
import shutil
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import tyro
from torch import Tensor

import kimi
from kimi import lora
from kimi.config import ModelConfig
from kimi.cp import ContextParallel
from kimi.data import (DataError, Rows, Sampler, default_corpus, fit_documents, make_rows, read_documents,
                       split_documents)
from kimi.fsdp import build_fsdp, gather, sharded_trainable_named
from kimi.loss import IGNORE
from kimi.params import leaf_dtype, param_specs, to_dtype, tree_items, tree_map
from kimi import runs
from kimi.plot import plot_metrics
from kimi.tokenizer import load_tokenizer
from kimi.train_state import load_training_state, save_training_state
from kimi.training import (adamw, fp32_paths, lora_flop_params, lr_at, make_loss, model_flops_per_token, peak_flops,
                           recompute_wanted, train_step, trainable_named)


# ============================================================================================== configuration

@dataclass(frozen=True, kw_only=True)
class DataConfig:
    paths: tuple[str, ...] = ()
    """Text files (each file one document) and .jsonl files (one document per line: {"text": ...} for
    pretraining-style loss on every token, {"messages": [...]} for chat SFT with loss on assistant tokens only).
    Empty: the project's own text (the kimi package's source and README), a small demo corpus."""
    seq_len: int = 128
    """Tokens per row (the model sees seq_len inputs and predicts seq_len labels)."""
    pack: bool = True
    """Pack several documents per row (document-causal attention, KDA state resets at document starts); False:
    one document per row, padded (negative document id)."""
    long_documents: Literal["error", "split"] = "error"
    """A document longer than seq_len: 'error' stops with its location, 'split' cuts it into seq_len pieces."""
    eval_fraction: float = 0.05
    """Share of documents held out for evaluation (at least one when > 0)."""


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    rank: int = 0
    """0: full fine-tuning. > 0: train rank-r adapters only; the base model is frozen."""
    alpha: float = 16.0
    """Adapter scale is alpha / rank."""
    targets: tuple[str, ...] = lora.ATTENTION_TARGETS
    """Module names to adapt (kimi/lora.py). Add gate_proj/up_proj/down_proj for MLPs, 'experts' for experts."""


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    every: int = 10
    """Print a progress line (loss, tokens/s, MFU, memory, ETA) every this many steps, and at the first and last.
    Every step is written to `out`/metrics.jsonl."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard events to `out`/tensorboard (needs `pip install 'kimi[tensorboard]'`;
    view with `tensorboard --logdir out`)."""
    plot_log_scale: bool = False
    """loss.png with a logarithmic loss axis (a long run's late progress stays visible)."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str = "tiny"
    """A checkpoint folder (HF layout) or a preset name (fresh weights): tiny, medium, k3, k3_1_pro."""
    out: str = "out/tiny"
    """Output folder: training checkpoints ckpt-NNNNNN/, metrics.jsonl, loss.png, the export in model/."""
    data: DataConfig = DataConfig()
    """The training text: files, row length, packing."""
    lora: LoRAConfig = LoRAConfig()
    """Low-rank adapters instead of full fine-tuning (rank 0: off)."""

    steps: int = 100
    """Optimizer steps."""
    batch_size: int = 8
    """Rows per optimizer step, over all processes (the global batch)."""
    micro_batch_size: int = 8
    """Rows per forward/backward on each process; batch_size / (micro_batch_size · processes) is the
    gradient-accumulation count."""

    lr: float = 3e-3
    """Peak learning rate of AdamW, reached after the warm-up."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """After linear warmup: cosine decay, or warmup-stable-decay (constant, then linear decay)."""
    warmup_steps: int = 10
    """Steps of linear warm-up from 0 to lr."""
    decay_fraction: float = 0.2
    """WSD only: share of steps in the final linear decay."""
    weight_decay: float = 0.1
    """Applied to matrices only (not norms, A_log, dt_bias, conv weights)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moment decay rates (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: off)."""

    seed: int = 0
    """Weights (preset), adapters, data split and order."""
    device: str = "auto"
    """auto (cuda if present), cpu, cuda."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype: auto is bfloat16 on GPU and float32 on CPU. Master weights and AdamW state are fp32."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the model: auto is on with a GPU, off on CPU (CPU Inductor code generation takes minutes)."""
    compile_scope: Literal["layers", "model"] = "layers"
    """layers: `kimi.compile_layers`, one graph per distinct layer (compile time independent of depth); model: the
    model up to the head as one fullgraph (more fusion, compile time grows with depth). Several processes always
    compile per FSDP unit."""
    activation_checkpointing: Literal["auto", "none", "layers"] = "auto"
    """layers: recompute each decoder layer in the backward instead of keeping its activations
    (`kimi.model.recomputed`; the indexer's selection and the router's choices are kept, not recomputed): about a
    third more compute, the activation memory of one layer instead of all. auto: layers on a GPU when a
    micro-batch's activations, gradients and optimizer state would not fit the free memory
    (`kimi.training.recompute_wanted`), else none."""
    attn: Literal["auto", "eager", "sdpa", "gather", "triton", "cudnn"] = "auto"
    """Gated MLA's attention (`kimi.Backend.attn`); auto: from key ranges, nothing of size T×T: on a GPU in bf16
    'triton' (the Triton indexer and sparse attention) at every length, elsewhere 'gather' past 32,768 tokens and
    SDPA with a dense mask below; 'gather' (dense attention, no indexer) when every document fits in index_topk.
    'cudnn': cuDNN Frontend's indexer and sparse backward (Hopper, `pip install '.[cudnn]'`), the forward
    --sparse-fwd."""
    sparse_fwd: Literal["auto", "flashmla", "triton", "gather"] = "auto"
    """With --attn cudnn, the sparse attention forward (`kimi.Backend.sparse_fwd`); auto: FlashMLA where it imports,
    else the Triton kernels."""
    kda: Literal["auto", "recurrent", "chunk", "chunk_opaque", "chunk_triton", "triton"] = "auto"
    """The KDA core (`kimi.Backend.kda`); auto: 'triton' (the chunked forward and backward as Triton kernels) on a
    GPU with Triton for bf16/fp16 activations and K3's bounded gate, 'chunk_triton' there otherwise (the
    chunk-to-chunk state pass one kernel each way instead of a scan of small matmuls), 'chunk_opaque' when compiling
    on the CPU (a fraction of the compile time), 'chunk' otherwise."""
    moe: Literal["auto", "dense", "grouped", "gemv"] = "auto"
    """Routed experts (`kimi.Backend.moe`); auto: 'grouped' for float32/bfloat16 micro-batches."""
    mla_form: Literal["auto", "expanded", "absorbed"] = "auto"
    """`kimi.Backend.mla_form`; auto: 'absorbed' for attn 'gather', else 'expanded' (training has no cache)."""
    tf32: bool = True
    """GPU: fp32 matmuls run on TF32 tensor cores (`torch.set_float32_matmul_precision("high")`): the KDA chunk
    algebra and its Triton state pass (fp32 for bf16 activations; inputs rounded to 10 mantissa bits, sums in fp32)
    and the indexer's scores (its q·k products from bf16 values are exact in TF32; the head-weighted sum over ReLU'd
    fp32 products is rounded, so near-ties in the frozen top-k may flip). --no-tf32 keeps them full fp32."""

    log: LogConfig = LogConfig()
    """Progress lines, metrics and the loss plot."""
    eval_every: int = 50
    """Evaluate every this many steps and at the end (0: only at the end)."""
    eval_rows: int = 64
    """Evaluate on at most this many held-out rows."""
    ckpt_every: int = 100
    """Write a training checkpoint every this many steps and at the end (0: only at the end)."""
    keep_checkpoints: int = 2
    """Keep this run's newest this many checkpoints, by step (0: all)."""
    resume: bool = False
    """Continue from the newest checkpoint in `out` (exactly: params, optimizer, step, data position, RNG). The
    settings must be the run's own except those in `RESUME_MAY_CHANGE` (e.g. a larger --steps)."""
    overwrite: bool = False
    """Start a new run in an `out` that holds one, deleting that run's checkpoints, metrics, plot and export.
    Without it (or --resume) such a folder is refused."""
    stop_after: int | None = None
    """Stop (with a checkpoint) after this many steps of this run, e.g. to fit a time limit; --resume continues."""
    max_bad_steps: int = 5
    """Stop after this many consecutive steps with a non-finite loss or gradient (each is skipped)."""
    export: bool = True
    """Write the final model in the HF layout to `out`/model (LoRA merged)."""
    cp: int = 1
    """Context parallelism: each row's tokens are split over this many processes (`kimi.cp`); with more processes
    (torchrun), each group of --cp consecutive ranks shares its rows and the groups are data parallel; the weights
    are sharded over all processes (FSDP2). --data.seq-len must split into --cp chunks (zigzag: 2 x --cp) of at
    least the short conv's width minus one tokens."""
    cp_layout: Literal["zigzag", "contiguous"] = "zigzag"
    """With --cp: which tokens a process holds. zigzag: chunks r and 2N-1-r of 2N (balances the causal attention
    and indexer work); contiguous: chunk r of N."""


RESUME_MAY_CHANGE = frozenset({"steps", "stop_after", "log.every", "log.tensorboard", "log.plot_log_scale",
                               "eval_every", "eval_rows", "ckpt_every", "keep_checkpoints", "resume", "overwrite",
                               "export", "max_bad_steps", "out", "activation_checkpointing", "cp", "cp_layout"})
"""Settings a --resume may change: when and what is logged, evaluated, saved and exported, how long the run goes
(a longer --steps also stretches the learning-rate schedule from the resumed step on) and whether activations are
recomputed (memory, not the math: eagerly the recompute is bit-identical) and how a row's tokens are spread over
processes (--cp: the same math up to rounding). Every other change would make the resumed run differ from the run
it continues, and is refused."""


PRESETS: dict[str, tuple[str, TrainConfig]] = {
    "tiny": ("the tiny model, fresh weights, the project's own text, a few minutes on a CPU (the default)",
             TrainConfig(data=DataConfig(long_documents="split"))),
    "k3_1_pro_sft": ("full SFT with the recipe's optimizer (docs/architecture.md#training: AdamW lr 1e-5, betas "
                     "0.9/0.95, no weight decay, clip 1.0, seed 1234, 100 steps); give --model and --data.paths",
                     TrainConfig(model="k3_1_pro", out="out/sft", steps=100, batch_size=256, micro_batch_size=1,
                                 lr=1e-5, min_lr_ratio=1.0, warmup_steps=0, weight_decay=0.0, seed=1234,
                                 data=DataConfig(seq_len=2048, pack=False), eval_every=100, ckpt_every=50)),
    "lora": ("LoRA rank 16 on the attention projections; give --model and --data.paths",
             TrainConfig(out="out/lora", lr=2e-4, weight_decay=0.0, lora=LoRAConfig(rank=16, alpha=32.0),
                         steps=500, eval_every=100, ckpt_every=100)),
}


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient (each was skipped)."""


# ============================================================================================== data, model

def build_data(cfg: TrainConfig, tok, model_cfg: ModelConfig) -> tuple[Rows, Rows]:
    """(train rows, eval rows) from the configured files."""
    d = cfg.data
    if tok.vocab_size > model_cfg.vocab_size:
        raise DataError(f"the tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                        f"{model_cfg.vocab_size}")
    docs = fit_documents(read_documents(list(d.paths) or default_corpus(), tok), d.seq_len, d.long_documents)
    train_docs, eval_docs = split_documents(docs, d.eval_fraction, cfg.seed)
    pad = tok.pad_id if tok.pad_id is not None else 0
    return make_rows(train_docs, d.seq_len, d.pack, pad), make_rows(eval_docs, d.seq_len, d.pack, pad)


def setup_distributed(device_arg: str) -> tuple[int, int, torch.device]:
    """(rank, world, device). Under torchrun: NCCL on GPUs, gloo on CPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device_arg == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is usable here (a CPU-only torch build, or no GPU visible); "
                         "use --device cpu or auto")
    if device_arg not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {device_arg!r}")
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    if world == 1:
        return 0, 1, torch.device("cuda" if use_cuda else device_arg if device_arg != "auto" else "cpu")
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        return rank, world, torch.device("cuda", local)
    dist.init_process_group("gloo")
    return rank, world, torch.device("cpu")


def setup_context_parallel(cfg: TrainConfig, world: int, device: torch.device) -> ContextParallel | None:
    """--cp N: a ("dp", "cp") device mesh over the processes (world / N data-parallel groups of N consecutive
    ranks) and the context over its "cp" dimension (None for --cp 1)."""
    if cfg.cp == 1:
        return None
    if world % cfg.cp:
        raise ValueError(f"--cp {cfg.cp} needs a multiple of {cfg.cp} processes (torchrun --nproc-per-node), got "
                         f"{world}")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (world // cfg.cp, cfg.cp), mesh_dim_names=("dp", "cp"))
    return ContextParallel.of_mesh(mesh, "cp", cfg.cp_layout)


def build_model(cfg: TrainConfig, device: torch.device, compute: torch.dtype):
    """(model config, params, adapters, checkpoint folder or None). Full fine-tuning: fp32 master weights. LoRA:
    the base in the compute dtype, frozen; fp32 adapters. The indexer is frozen either way."""
    if Path(cfg.model).is_dir():
        model_cfg, params = kimi.load_checkpoint(cfg.model, dtype="float32" if not cfg.lora.rank else compute,
                                                 device=device)
        source = cfg.model
    elif cfg.model in kimi.PRESETS:
        model_cfg = kimi.preset(cfg.model)
        params = kimi.init_params(model_cfg, seed=cfg.seed, dtype="float32" if not cfg.lora.rank else
                                  str(compute).removeprefix("torch."), device=device)
        source = None
    elif Path(cfg.model).is_file():
        raise ValueError(f"--model {cfg.model!r} is a file; pass the checkpoint folder that holds config.json and "
                         f"the safetensors ({Path(cfg.model).parent})")
    else:
        raise ValueError(f"--model {cfg.model!r} is neither a checkpoint folder nor a preset "
                         f"({sorted(kimi.PRESETS)})")
    specs = dict(tree_items(param_specs(model_cfg)))
    for path, p in tree_items(params):
        p.requires_grad_(specs[path].trainable and not cfg.lora.rank)
    adapters = {}
    if cfg.lora.rank:
        adapters = lora.init_adapters(params, cfg.lora.targets, cfg.lora.rank, seed=cfg.seed)
    return model_cfg, params, adapters, source


def train(cfg: TrainConfig) -> dict:
    """Run the configured job; returns a summary (first/last loss, eval loss, tokens/s, wall time)."""
    _check(cfg)
    t_run = time.perf_counter()
    run_config = dataclasses.asdict(cfg)
    changes = runs.check(Path(cfg.out), run_config, resume=cfg.resume, overwrite=cfg.overwrite,
                         allowed=RESUME_MAY_CHANGE)     # before anything is loaded: a refused folder costs nothing
    rank, world, device = setup_distributed(cfg.device)
    cp = setup_context_parallel(cfg, world, device)
    dp = world // cfg.cp                   # data-parallel processes (each group of --cp shares its rows)
    is_main = rank == 0
    log = print if is_main else (lambda *a, **k: None)
    compute = to_dtype(("bfloat16" if device.type == "cuda" else "float32") if cfg.dtype == "auto" else cfg.dtype)
    use_compile = cfg.compile == "on" or (cfg.compile == "auto" and device.type == "cuda")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    out = Path(cfg.out)

    # ------------------------------------------------------------------------------------------ model and data
    model_cfg, params, adapters, source = build_model(cfg, device, compute)
    if cp is not None:      # the rows must split into chunks that hold the short convs' reach
        cp.check_length(cfg.data.seq_len, model_cfg.linear_attn_config.short_conv_kernel_size - 1)
    tok = load_tokenizer(source, model_cfg)
    train_rows, eval_rows = build_data(cfg, tok, model_cfg)
    accum = cfg.batch_size // (cfg.micro_batch_size * dp)
    if accum * cfg.micro_batch_size * dp != cfg.batch_size:
        raise ValueError(f"batch_size={cfg.batch_size} is not a multiple of micro_batch_size="
                         f"{cfg.micro_batch_size} x {dp} data-parallel processes")
    if is_main:
        for w in degenerate_settings(cfg, len(train_rows)):
            print(f"warning: {w}", file=sys.stderr)
    backend = kimi.Backend(attn=cfg.attn, kda=cfg.kda, moe=cfg.moe, mla_form=cfg.mla_form, sparse_fwd=cfg.sparse_fwd)
    if is_main and backend.attn == "cudnn":     # the forward under cuDNN's backward, said once ("auto" resolved)
        print(f"attn=cudnn: sparse forward {kimi.ops.resolve(backend, device=device, dtype=compute).sparse_fwd}")
    scale = lora.scale_of(cfg.lora.rank, cfg.lora.alpha) if cfg.lora.rank else 1.0
    longest = max(train_rows.longest_document(), eval_rows.longest_document())
    step_kw = dict(cfg=model_cfg, backend=backend, dtype=compute, fp32_paths=fp32_paths(model_cfg), lora_scale=scale,
                   max_document_len=longest or None)
    named = trainable_named(params, adapters)
    n_params = sum(p.numel() for p in named.values())
    tokens = cfg.micro_batch_size * cfg.data.seq_len // cfg.cp
    recompute = cfg.activation_checkpointing == "layers" or (
        cfg.activation_checkpointing == "auto" and world == 1 and
        recompute_wanted(model_cfg, tokens, device, trainable=n_params))
    adapter_flops = lora_flop_params(model_cfg, adapters) if adapters else None    # before FSDP frees the tree
    root = None
    if world > 1:
        # the FSDP root's call is the micro-batch loss (under --cp: its tokens' share of the rows); the optimizer
        # steps its sharded leaves
        root = build_fsdp(params, adapters, **step_kw, compile_units=use_compile, recompute=recompute, cp=cp)
        named = sharded_trainable_named(root)
        micro_loss = root
        params = adapters = None          # the units hold the shards; the whole unsharded model is freed with this
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if cfg.activation_checkpointing == "auto":    # decided on the sharded model, the same on every process
            want = torch.tensor([recompute_wanted(model_cfg, tokens, device, trainable=-(-n_params // world))],
                                dtype=torch.int32, device=device)
            dist.all_reduce(want, op=dist.ReduceOp.MAX)
            recompute = root.ctx["recompute"] = bool(want.item())   # read by the layer units when they run
    else:
        micro_loss = functools.partial(make_loss(cfg.compile_scope if use_compile else None, recompute=recompute),
                                       params, adapters, **step_kw)
    opt = adamw(named, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                fused=device.type == "cuda")
    lr_of = functools.partial(lr_at, lr=cfg.lr, steps=cfg.steps, warmup_steps=cfg.warmup_steps,
                              min_lr_ratio=cfg.min_lr_ratio, schedule=cfg.schedule, decay_fraction=cfg.decay_fraction)
    sampler = Sampler(len(train_rows), cfg.seed)

    step, bad = 0, 0
    if is_main:
        runs.claim(out, run_config, resume=cfg.resume, overwrite=cfg.overwrite)
    if world > 1:
        dist.barrier()
    if cfg.resume:
        ckpt = runs.latest_complete(out)
        step, bad = load_training_state(ckpt, named, opt, sampler)
        log(f"resumed from {ckpt} at step {step}" + (f" (changed: {'; '.join(changes)})" if changes else ""))
    metrics = runs.Metrics(out, t0=t_run, tensorboard=cfg.log.tensorboard, resumed_at=step if cfg.resume else None,
                           enabled=is_main)
    record = metrics.record

    flops_tok = model_flops_per_token(model_cfg, cfg.data.seq_len, adapters=adapter_flops)
    peak = peak_flops(device)
    log(f"model {cfg.model}: {kimi.param_count(model_cfg):,} parameters, training {n_params:,}"
        f"{f' (LoRA rank {cfg.lora.rank})' if cfg.lora.rank else ''} | {len(train_rows)} train rows, "
        f"{len(eval_rows)} eval rows of {cfg.data.seq_len} tokens, longest document {longest:,} | "
        f"{world} process(es) on {device}"
        f"{f' (context parallel over {cfg.cp}, {cfg.cp_layout})' if cp is not None else ''}, "
        f"{str(compute).removeprefix('torch.')} compute, compile {'on' if use_compile else 'off'}, "
        f"activation checkpointing {'layers' if recompute else 'none'}, grad accumulation {accum}")

    def evaluate() -> float | None:
        if len(eval_rows) == 0:
            return None
        # Every process evaluates the same rows (FSDP's collectives need the same calls everywhere).
        rows = eval_rows.select(slice(0, cfg.eval_rows))
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for i in range(0, max(len(rows), 1), cfg.micro_batch_size):
                b = rows.select(slice(i, i + cfg.micro_batch_size))
                if len(b):
                    s = micro_loss(*_on(b, device))
                    if cp is not None:      # each process has its tokens' share of the loss
                        dist.all_reduce(s, group=cp.group)
                    total += torch.tensor([s.item(), (b.labels != IGNORE).sum().item()], dtype=torch.float64)
        return (total[0] / total[1]).item()

    def checkpoint() -> None:
        saved = save_training_state(out, step, named, opt, sampler, bad_steps=bad, config=run_config,
                                    keep=cfg.keep_checkpoints, rank=rank)
        log(f"saved checkpoint {saved}")

    # ------------------------------------------------------------------------------------------ the loop
    first_loss = last_loss = eval_loss = None
    t_start, tokens_run, steps_run, t_first = time.perf_counter(), 0, 0, None
    t_log, tokens_log = t_start, 0
    mb = cfg.micro_batch_size
    with runs.StopSignals(log) as stop:   # SIGINT/SIGTERM: finish the step, save, stop
        while step < cfg.steps:
            if stop_requested(stop, world, device):
                checkpoint()
                name = signal.Signals(stop.signum).name
                raise runs.Interrupted(stop.signum, f"{name} at step {step}: checkpoint saved in {out}; continue "
                                                    "with --resume")
            batch = train_rows.select(sampler.take(cfg.batch_size))
            mine = batch.select(slice(rank // cfg.cp * accum * mb, (rank // cfg.cp + 1) * accum * mb))
            for g in opt.param_groups:
                g["lr"] = lr_of(step)
            micro = (_on(mine.select(slice(k * mb, (k + 1) * mb)), device) for k in range(accum))
            labels = int((batch.labels != IGNORE).sum())
            result = train_step(micro_loss, micro, opt, named.values(), label_tokens=labels, grad_clip=cfg.grad_clip,
                                world=world)
            loss, gnorm = result.loss, result.grad_norm
            step += 1
            steps_run += 1
            if steps_run == 1:
                t_first = time.perf_counter()    # the step's loss is a host float: the step has finished
            if not result.finite:
                bad += 1
                warnings.warn(f"step {step}: non-finite loss {loss} or gradient norm {gnorm}; step skipped "
                              f"({bad} in a row, stopping at {cfg.max_bad_steps})", stacklevel=1)
                if bad >= cfg.max_bad_steps:
                    raise TrainingDiverged(f"{bad} consecutive steps with a non-finite loss or gradient; stopping at "
                                           f"step {step} (last checkpoint in {out})")
                continue
            bad = 0
            tokens = int((batch.document_ids >= 0).sum())
            tokens_run += tokens
            tokens_log += tokens
            first_loss = loss if first_loss is None else first_loss
            last_loss = loss
            m = {"step": step, "loss": loss, "lr": opt.param_groups[0]["lr"], "grad_norm": gnorm}
            if step % cfg.log.every == 0 or step == cfg.steps or step == 1:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                now = time.perf_counter()
                tps = tokens_log / max(now - t_log, 1e-9)
                m["tokens_per_s"] = tps
                if peak:
                    m["mfu"] = tps * flops_tok / (peak * world)
                m["peak_memory_gib"], m["host_memory_gib"] = peak_memory_gib(device), host_memory_gib()
                # The ETA leaves out this run's first step (compilation, warm-up): it is the pace since then.
                eta = "…" if steps_run == 1 else _fmt_time((now - t_first) / (steps_run - 1) * (cfg.steps - step))
                mfu = f" | MFU {m['mfu']:.1%}" if "mfu" in m else ""
                log(f"step {step:>6}/{cfg.steps} | loss {loss:.4f} | lr {m['lr']:.2e} | grad norm {gnorm:.3f} | "
                    f"{tps:,.0f} tok/s{mfu} | {m['peak_memory_gib']:.1f} GiB"
                    + (f" GPU, {m['host_memory_gib']:.1f} GiB host" if device.type == "cuda" else "")
                    + f" | ETA {eta}")
                t_log, tokens_log = now, 0
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                eval_loss = evaluate()
                if eval_loss is not None:
                    m["eval_loss"] = eval_loss
                    log(f"step {step:>6} | eval loss {eval_loss:.4f}")
            record(m)
            stopping = cfg.stop_after is not None and steps_run >= cfg.stop_after
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == cfg.steps or stopping:
                checkpoint()
            if stopping:
                log(f"stopping after {steps_run} steps as asked; continue with --resume")
                break

    # ------------------------------------------------------------------------------------------ eval, export, plot
    wall = time.perf_counter() - t_start
    summary = {"first_loss": first_loss, "last_loss": last_loss, "steps": step, "wall_s": wall,
               "tokens_per_s": tokens_run / max(wall, 1e-9)}
    if step >= cfg.steps:
        eval_loss = evaluate()
        summary["eval_loss"] = eval_loss
        if eval_loss is not None:
            record({"step": step, "eval_loss": eval_loss})
            log(f"final eval loss {eval_loss:.4f}")
        if cfg.export:
            export(out / "model", model_cfg, params, adapters, scale, root, source, is_main)
            log(f"exported the model to {out / 'model'}")
    metrics.close()
    if is_main and metrics.path.exists():
        plot_metrics(metrics.path, out / "loss.png", log_scale=cfg.log.plot_log_scale)
        log(f"{tokens_run:,} tokens in {_fmt_time(wall)} ({summary['tokens_per_s']:,.0f} tok/s); metrics in "
            f"{metrics.path}, curve in {out / 'loss.png'}"
            + (f", TensorBoard events in {out / runs.TENSORBOARD_DIR}" if cfg.log.tensorboard else ""))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def stop_requested(stop: runs.StopSignals, world: int, device: torch.device) -> bool:
    """Whether a signal asked to stop, on any process (they all stop at the same step, or a collective would hang)."""
    if world == 1:
        return stop.signum is not None
    flag = torch.tensor([0 if stop.signum is None else stop.signum], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    stop.signum = int(flag) or None
    return stop.signum is not None


def _on(rows: Rows, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """A micro-batch's (input_ids, labels, document_ids) on the device."""
    return rows.input_ids.to(device), rows.labels.to(device), rows.document_ids.to(device)


def export(folder: Path, model_cfg: ModelConfig, params, adapters, scale: float, root, source, is_main: bool) -> None:
    """The model in the HF layout in the checkpoint's dtype (LoRA merged), plus the source's tokenizer files."""
    if root is not None:   # gather the sharded leaves (every process takes part)
        params, adapters = gather(root)
    if not is_main:
        return
    tree = lora.merge(params, adapters, scale) if adapters else tree_map(lambda _, p: p.detach(), params)
    dt = to_dtype(model_cfg.dtype)
    specs = dict(tree_items(param_specs(model_cfg)))
    tree = tree_map(lambda path, p: p.to("cpu", leaf_dtype(specs[path], dt)), tree)
    kimi.save_checkpoint(folder, model_cfg, tree)
    if source is not None:
        for name in ("tiktoken.model", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(source) / name).is_file():
                shutil.copy2(Path(source) / name, folder / name)


def peak_memory_gib(device: torch.device) -> float:
    """The process's peak memory so far on `device`: allocated on the GPU, resident on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return host_memory_gib()


def host_memory_gib() -> float:
    """The process's peak resident host memory (ru_maxrss, KiB on Linux)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _fmt_time(s: float) -> str:
    return str(datetime.timedelta(seconds=round(s)))


def _check(cfg: TrainConfig) -> None:
    problems = []
    for name in ("steps", "batch_size", "micro_batch_size", "max_bad_steps"):
        if getattr(cfg, name) <= 0:
            problems.append(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.log.every <= 0:
        problems.append(f"log.every must be positive, got {cfg.log.every}")
    if cfg.log.tensorboard and runs.tensorboard_missing():
        problems.append(runs.tensorboard_missing())
    if cfg.data.seq_len <= 0:
        problems.append(f"data.seq_len must be positive, got {cfg.data.seq_len}")
    if not 0 <= cfg.data.eval_fraction < 1:
        problems.append(f"data.eval_fraction must be in [0, 1), got {cfg.data.eval_fraction}")
    if cfg.lora.rank < 0:
        problems.append(f"lora.rank must be >= 0, got {cfg.lora.rank}")
    if cfg.cp <= 0:
        problems.append(f"cp must be positive, got {cfg.cp}")
    if cfg.warmup_steps < 0:
        problems.append(f"warmup_steps must be >= 0, got {cfg.warmup_steps}")
    if not cfg.lr > 0:
        problems.append(f"lr must be positive, got {cfg.lr}")
    if problems:
        raise ValueError("train config: " + "; ".join(problems))


def degenerate_settings(cfg: TrainConfig, train_rows: int) -> list[str]:
    """Settings that run but are almost certainly not what was meant, each as one sentence."""
    found = []
    if cfg.warmup_steps >= cfg.steps:
        found.append(f"the warm-up ({cfg.warmup_steps} steps) is not shorter than the run ({cfg.steps} steps): the "
                     "learning rate never reaches --lr")
    if cfg.batch_size > train_rows:
        found.append(f"a step takes {cfg.batch_size} rows but the training data has {train_rows}: rows repeat "
                     "within a step")
    if cfg.data.seq_len < 8:
        found.append(f"--data.seq-len {cfg.data.seq_len}: rows this short give the model almost no context")
    return found


def main(argv: list[str] | None = None) -> dict:
    """`python train.py [PRESET] [--options]`; the preset (default tiny) supplies the defaults."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in PRESETS else "tiny"
    presets = "\n".join(f"  {k}: {d}" for k, (d, _) in PRESETS.items())
    cfg = tyro.cli(TrainConfig, default=PRESETS[name][1], args=argv, prog="train.py [PRESET]",
                   description=f"Train or fine-tune Kimi K3.1 Pro (preset '{name}').\n\nPresets (first "
                               f"argument, default tiny):\n{presets}")
    return train(cfg)


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:   # DataError, CheckpointError, TokenizerError, LoRAError, bad config values
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
    except runs.Interrupted as e:
        print(f"stopped: {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        print("aborted (a second Ctrl-C): nothing saved since the last checkpoint", file=sys.stderr)
        sys.exit(130)
