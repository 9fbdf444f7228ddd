"""Train or fine-tune a Kimi K3.1 Pro model (full or LoRA) on text or chat data, on a CPU or on GPUs.

    python train.py                                   # tiny preset, fresh weights, the project's own text, CPU
    python train.py --model path/to/ckpt --data.paths chat.jsonl --lora.rank 16
    torchrun --nproc-per-node 8 train.py k3_1_pro_sft --model path/to/ckpt --data.paths train.jsonl
    python train.py --help                            # every option; `python train.py PRESET --help` for a preset

The loop, top to bottom: build the model (a checkpoint folder or a preset with fresh weights), tokenize the data
into rows (packed with `document_ids`, or one document per padded row), then for each optimizer step draw a
global batch, run forward/backward over micro-batches, clip, step AdamW, and every so often evaluate, log and
write an atomic training checkpoint (params or adapters, optimizer, step, data position, RNG). At the end the
model is exported in the Hugging Face layout (`kimi.save_checkpoint`, LoRA merged), loadable by generate.py.

Numerics: on CPU everything is fp32. On a GPU the master weights and AdamW state are fp32 and the forward runs
in bf16 (the tree is cast inside the loss function; MODEL.md §7.2's fp32 leaves stay fp32), the loss is fp32
cross-entropy summed over label tokens and divided by the label tokens of the whole global batch (MODEL.md §9),
so gradient accumulation and data parallelism give the same gradient as one big batch.

Several GPUs (`torchrun`): PyTorch FSDP2. Each decoder layer's leaves are owned by a thin `nn.Module` unit
(`_Unit`) that `fully_shard` wraps; the root unit owns the embedding, final norm and head and calls the layer
units in the same order as `kimi.forward`. Why units and not DTensor leaves in the functional forward: FSDP2's
hooks all-gather one layer just before it runs and free it after, with prefetching, on stock PyTorch; the
DTensor route would gather the whole tree up front in eager mode and relies on compiler passes (nightly-only in
torchtitan) to get per-layer memory (COMPILE.md B.8). Each unit is compiled on its own (FSDP2's hooks cannot be
traced); with one process the layers go through `kimi.compile_layers` (or, `--compile-scope model`, the whole
model up to the head is one `torch.compile(fullgraph=True)` graph). The loss (`_HeadCrossEntropy`, the head applied
by vocabulary blocks) always runs eagerly.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import random
import shutil
import struct
import sys
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from torch import Tensor, nn

import kimi
from kimi import kernels, lora
from kimi.config import ModelConfig
from kimi.model import attn_res_mix, decoder_layer, document_runs, head_weight
from kimi.common import host_checks, rms_norm
from kimi.params import leaf_dtype, param_specs, to_dtype, tree_items, tree_map
from kimi.tokenizer import load_tokenizer

IGNORE = -100
"""Label of a position that is not trained on (padding, prompt tokens, the last token of a document)."""


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
class TrainConfig:
    model: str = "tiny"
    """A checkpoint folder (HF layout) or a preset name (fresh weights): tiny, medium, k3, k3_1_pro."""
    out: str = "out/tiny"
    """Output folder: training checkpoints ckpt-NNNNNN/, metrics.jsonl, loss.png, the export in model/."""
    data: DataConfig = DataConfig()
    lora: LoRAConfig = LoRAConfig()

    steps: int = 100
    """Optimizer steps."""
    batch_size: int = 8
    """Rows per optimizer step, over all processes (the global batch)."""
    micro_batch_size: int = 8
    """Rows per forward/backward on each process; batch_size / (micro_batch_size · processes) is the
    gradient-accumulation count."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """After linear warmup: cosine decay, or warmup-stable-decay (constant, then linear decay)."""
    warmup_steps: int = 10
    decay_fraction: float = 0.2
    """WSD only: share of steps in the final linear decay."""
    weight_decay: float = 0.1
    """Applied to matrices only (not norms, A_log, dt_bias, conv weights)."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
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
    attn: Literal["eager", "sdpa"] = "sdpa"
    kda: Literal["auto", "recurrent", "chunk", "chunk_opaque", "chunk_triton"] = "auto"
    """auto: 'chunk_triton' on a GPU (the chunk algebra fused by Inductor, the chunk-to-chunk state pass one Triton
    kernel each way: a K3.1-width step on the H200 took 474.5 ms against 530.1 ms with 'chunk', whose state pass is
    a scan of small matmuls), 'chunk_opaque' when compiling on the CPU (a fraction of the compile time), 'chunk'
    uncompiled on the CPU. See `kimi.Backend.kda`."""
    moe: Literal["dense", "grouped"] = "grouped"
    mla_form: Literal["expanded", "absorbed"] = "expanded"
    tf32: bool = True
    """GPU: fp32 matmuls run on TF32 tensor cores (`torch.set_float32_matmul_precision("high")`): the KDA chunk
    algebra and its Triton state pass (fp32 for bf16 activations; inputs rounded to 10 mantissa bits, sums in fp32)
    and the indexer's scores (its q·k products from bf16 values are exact in TF32; the head-weighted sum over ReLU'd
    fp32 products is rounded, so near-ties in the frozen top-k may flip). --no-tf32 keeps them full fp32."""

    log_every: int = 10
    eval_every: int = 50
    """Evaluate every this many steps and at the end (0: only at the end)."""
    eval_rows: int = 64
    """Evaluate on at most this many held-out rows."""
    ckpt_every: int = 100
    """Write a training checkpoint every this many steps and at the end (0: only at the end)."""
    keep_checkpoints: int = 2
    resume: bool = False
    """Continue from the newest checkpoint in `out` (exactly: params, optimizer, step, data position, RNG)."""
    stop_after: int | None = None
    """Stop (with a checkpoint) after this many steps of this run, e.g. to fit a time limit; --resume continues."""
    max_bad_steps: int = 5
    """Stop after this many consecutive steps with a non-finite loss or gradient (each is skipped)."""
    export: bool = True
    """Write the final model in the HF layout to `out`/model (LoRA merged)."""


PRESETS: dict[str, tuple[str, TrainConfig]] = {
    "tiny": ("the tiny model, fresh weights, the project's own text, a few minutes on a CPU (the default)",
             TrainConfig(data=DataConfig(long_documents="split"))),
    "k3_1_pro_sft": ("full SFT with the recipe's optimizer (MODEL.md §9: AdamW lr 1e-5, betas 0.9/0.95, no "
                     "weight decay, clip 1.0, seed 1234, 100 steps); give --model and --data.paths",
                     TrainConfig(model="k3_1_pro", out="out/sft", steps=100, batch_size=256, micro_batch_size=1,
                                 lr=1e-5, min_lr_ratio=1.0, warmup_steps=0, weight_decay=0.0, seed=1234,
                                 data=DataConfig(seq_len=2048, pack=False), eval_every=100, ckpt_every=50)),
    "lora": ("LoRA rank 16 on the attention projections; give --model and --data.paths",
             TrainConfig(out="out/lora", lr=2e-4, weight_decay=0.0, lora=LoRAConfig(rank=16, alpha=32.0),
                         steps=500, eval_every=100, ckpt_every=100)),
}


class DataError(ValueError):
    """Bad training data: says which file (and line) and what is wrong."""


class TrainingDiverged(RuntimeError):
    pass


# ============================================================================================== data

@dataclass
class Document:
    inputs: list[int]
    labels: list[int]
    """labels[j] is the token after inputs[j], or IGNORE where no loss is taken."""
    where: str


def default_corpus() -> list[Path]:
    """The project's own text: the kimi package's source files and the README (about 150 kB)."""
    root = Path(kimi.__file__).parent
    files = sorted(root.glob("*.py"))
    readme = root.parent / "README.md"
    return files + ([readme] if readme.is_file() else [])


def _text_document(text: str, tok, where: str) -> Document:
    if not text.strip():
        raise DataError(f"{where}: empty text")
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(text) + [tok.eos_id]
    return Document(ids[:-1], ids[1:], where)


def _chat_document(messages, tok, where: str) -> Document:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    try:
        ids, assistant = tok.encode_chat(messages)
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{where}: {e}") from None
    if not any(assistant[1:]):
        raise DataError(f"{where}: no assistant tokens to train on")
    labels = [t if a else IGNORE for t, a in zip(ids[1:], assistant[1:])]
    return Document(ids[:-1], labels, where)


def read_documents(paths: list[str | Path], tok) -> list[Document]:
    """Tokenize every file into documents (text files: one each; .jsonl: one per line)."""
    docs = []
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"data file {path} does not exist")
        if path.suffix != ".jsonl":
            try:
                docs.append(_text_document(path.read_text(encoding="utf-8"), tok, str(path)))
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 text ({e})") from None
            continue
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                where = f"{path}:{n}"
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
                if isinstance(obj, dict) and "messages" in obj:
                    docs.append(_chat_document(obj["messages"], tok, where))
                elif isinstance(obj, dict) and "text" in obj:
                    if not isinstance(obj["text"], str):
                        raise DataError(f"{where}: 'text' must be a string")
                    docs.append(_text_document(obj["text"], tok, where))
                else:
                    raise DataError(f"{where}: expected an object with 'text' or 'messages'")
    if not docs:
        raise DataError(f"no documents in {[str(p) for p in paths]}")
    return docs


def fit_documents(docs: list[Document], seq_len: int, long_documents: str) -> list[Document]:
    """Documents of at most seq_len inputs: an error for a longer one, or it is cut into pieces."""
    out = []
    for d in docs:
        if len(d.inputs) <= seq_len:
            out.append(d)
        elif long_documents == "error":
            raise DataError(f"{d.where}: document has {len(d.inputs) + 1} tokens, more than seq_len + 1 = "
                            f"{seq_len + 1}; raise --data.seq-len or pass --data.long-documents split")
        else:
            out += [Document(d.inputs[i:i + seq_len], d.labels[i:i + seq_len], f"{d.where}[{i}:]")
                    for i in range(0, len(d.inputs), seq_len)]
    return out


@dataclass
class Rows:
    """Training rows: input_ids, labels, document_ids, each [N, T] int64 (document id < 0 is padding)."""
    input_ids: Tensor
    labels: Tensor
    document_ids: Tensor

    def __len__(self):
        return self.input_ids.shape[0]

    def select(self, idx) -> "Rows":
        return Rows(self.input_ids[idx], self.labels[idx], self.document_ids[idx])


def make_rows(docs: list[Document], seq_len: int, pack: bool, pad_id: int) -> Rows:
    """Packed: documents fill rows in order (a document that does not fit starts the next row); not packed:
    one document per row. The rest of a row is padding (pad_id, IGNORE, document id -1)."""
    rows: list[list[Document]] = []
    used = seq_len
    for d in docs:
        if not pack or used + len(d.inputs) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(d)
        used += len(d.inputs)
    N = len(rows)
    ids = torch.full((N, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((N, seq_len), IGNORE, dtype=torch.long)
    doc_ids = torch.full((N, seq_len), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        t = 0
        for k, d in enumerate(row):
            n = len(d.inputs)
            ids[r, t:t + n] = torch.tensor(d.inputs)
            labels[r, t:t + n] = torch.tensor(d.labels)
            doc_ids[r, t:t + n] = k
            t += n
    return Rows(ids, labels, doc_ids)


def build_data(cfg: TrainConfig, tok, model_cfg: ModelConfig) -> tuple[Rows, Rows]:
    """(train rows, eval rows) from the configured files."""
    d = cfg.data
    if tok.vocab_size > model_cfg.vocab_size:
        raise DataError(f"the tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                        f"{model_cfg.vocab_size}")
    docs = fit_documents(read_documents(list(d.paths) or default_corpus(), tok), d.seq_len, d.long_documents)
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    n_eval = 0 if d.eval_fraction <= 0 or len(docs) < 2 else max(1, round(d.eval_fraction * len(docs)))
    held = set(order[:n_eval])
    train = [x for i, x in enumerate(docs) if i not in held]
    evals = [x for i, x in enumerate(docs) if i in held]
    pad = tok.pad_id if tok.pad_id is not None else 0
    return make_rows(train, d.seq_len, d.pack, pad), make_rows(evals, d.seq_len, d.pack, pad)


class Sampler:
    """Endless shuffled passes over the rows; the position (epoch, offset) is all its state."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.offset = n, seed, 0, 0

    def _perm(self) -> list[int]:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def take(self, k: int) -> list[int]:
        out, perm = [], self._perm()
        while len(out) < k:
            if self.offset == self.n:
                self.epoch, self.offset = self.epoch + 1, 0
                perm = self._perm()
            m = min(k - len(out), self.n - self.offset)
            out += perm[self.offset:self.offset + m]
            self.offset += m
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}


# ============================================================================================== model and loss

def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine or WSD down to
    lr · min_lr_ratio."""
    lo = cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps - 1)
        return lo + (cfg.lr - lo) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    decay = max(1, round(cfg.decay_fraction * cfg.steps))
    start = cfg.steps - decay
    if step < start:
        return cfg.lr
    return cfg.lr + (lo - cfg.lr) * min(1.0, (step - start + 1) / decay)


def cast_tree(tree, dtype: torch.dtype, fp32_paths: frozenset[str], prefix: str = ""):
    """The tree in the compute dtype, except MODEL.md §7.2's fp32 leaves (A_log, dt_bias, convs, o_norm...)."""
    def leaf(path, p):
        return p if (prefix + path) in fp32_paths or p.dtype == dtype else p.to(dtype)
    return tree_map(leaf, tree)


def auto_kda(device: torch.device, use_compile: bool) -> str:
    """`--kda auto`: 'chunk_triton' on a GPU with Triton ('chunk' without), 'chunk_opaque' when compiling on the
    CPU, 'chunk' otherwise (TrainConfig.kda says why)."""
    if device.type == "cuda":
        return "chunk_triton" if kernels.available(device) else "chunk"
    return "chunk_opaque" if use_compile else "chunk"


def compiled_cast(**compile_kwargs):
    """`cast_tree` for fp32 master weights, with their gradients written straight into the fp32 `.grad`s
    (`_MasterCast`) by generated kernels: the layer-wise compiled step's casts, which otherwise run eagerly.

    Eagerly the backward of each cast is a bf16 -> fp32 copy, for which CUDA has no vectorized kernel (PyTorch's
    generic dtype-converting copy: on the H200 a K3.1-width micro-batch spent 23.6 ms in it, 134 calls of which 99
    are these casts, against 9.6 ms for the vectorized fp32 -> bf16 casts of the forward), and with gradient
    accumulation AccumulateGrad then adds that fp32 copy to `.grad` in one more pass (measured: 4 micro-batches
    took 51 ms more than 4 x (one micro-batch step − the 70 ms optimizer)). Here each gradient is upcast into a new
    `.grad`, or added to the existing one, in one generated kernel as soon as it exists (on the H200: 10.9 ms a
    micro-batch for all 92 weights). Leaves that are not trainable leaves (frozen weights, LoRA-merged weights) get
    a plain cast. `compile_kwargs` go to `torch.compile` (e.g. a test's `backend="aot_eager"`)."""
    opts = kimi.compile_options(**{"fullgraph": True, "dynamic": True, **compile_kwargs})
    upcast, accumulate = torch.compile(_upcast, **opts), torch.compile(_accumulate, **opts)
    warm = set()

    def cast(tree, dtype: torch.dtype, fp32_paths: frozenset[str], prefix: str = ""):
        def leaf(path, p):
            if (prefix + path) in fp32_paths or p.dtype == dtype:
                return p
            if not (p.is_leaf and p.requires_grad):
                return p.to(dtype)
            if (p.device, p.dtype, dtype) not in warm:
                # Compile both kernels here, on this thread (the backward runs them on autograd's device thread),
                # in the backward's grad mode, on a weight-sized example: Inductor picks a dynamic kernel's block
                # size from the first example's size (compiled on 2 elements, the upcast took 1.8 s a step).
                with torch.no_grad():
                    x = torch.zeros(1 << 24, dtype=dtype, device=p.device)
                    accumulate(upcast(x, p.dtype), x)
                warm.add((p.device, p.dtype, dtype))
            return _MasterCast.apply(p, dtype, (upcast, accumulate))
        return tree_map(leaf, tree)
    return cast


def _upcast(g: Tensor, dtype: torch.dtype) -> Tensor:
    return g.to(dtype)


def _accumulate(acc: Tensor, g: Tensor) -> None:
    acc.add_(g.to(acc.dtype))


class _MasterCast(torch.autograd.Function):
    """A trainable leaf p in the compute dtype; backward puts the gradient into p.grad itself, in p's dtype: a new
    tensor when p.grad is None (`kernels` = (upcast, accumulate)), else added in place, as AccumulateGrad would,
    and passes nothing on (p is a leaf). A cast that gets no gradient leaves p.grad as it is (None stays None, as
    eagerly). `.backward()` accumulates as usual; `torch.autograd.grad(loss, p)` raises that p was not used in the
    graph (and still writes p.grad), so only train.py's step uses this."""

    @staticmethod
    def forward(ctx, p: Tensor, dtype: torch.dtype, kernels) -> Tensor:
        ctx.p, ctx.kernels = p, kernels
        ctx.set_materialize_grads(False)
        return p.to(dtype)

    @staticmethod
    def backward(ctx, g: Tensor | None):
        if g is None:
            return None, None, None
        p, (upcast, accumulate) = ctx.p, ctx.kernels
        flat = g.reshape(-1)   # flat: Dynamo keeps sizes symbolic (one graph for all shapes)
        if p.grad is None:
            p.grad = upcast(flat, p.dtype).view(p.shape)
        else:
            accumulate(p.grad.view(-1), flat)
        return None, None, None


def _block_stats(z: Tensor, labels: Tensor, v0: int) -> tuple[Tensor, Tensor]:
    """One vocabulary block of logits z [N, W] (words v0 ..): each row's log-sum-exp and its label's logit (0 when
    the label is not in the block; IGNORE = -100 never is), in fp32 (float64 for float64 z)."""
    zf = z.to(torch.promote_types(z.dtype, torch.float32))
    inside = (labels >= v0) & (labels < v0 + z.shape[1])
    col = (labels - v0).clamp(0, z.shape[1] - 1)
    return torch.logsumexp(zf, -1), torch.where(inside, zf.gather(1, col[:, None])[:, 0], 0.0)


def _block_grad(z: Tensor, lse: Tensor, labels: Tensor, v0: int, row_scale: Tensor) -> Tensor:
    """The loss's gradient at one block of logits z [N, W], in z's dtype: (softmax − onehot(label)) · row_scale
    [N, 1] (0 on IGNORE rows), the softmax in fp32 from the whole row's log-sum-exp lse [N]."""
    zf = z.to(lse.dtype)
    onehot = labels[:, None] == v0 + torch.arange(z.shape[1], device=z.device)
    return (((zf - lse[:, None]).exp() - onehot.to(zf.dtype)) * row_scale).to(z.dtype)


@functools.cache
def _loss_kernels(fused: bool):
    """(_block_stats, _block_grad), each one generated kernel per block on a GPU (`fused`): eagerly they are ~10
    passes over fp32 copies of the block. Inference graphs (no autograd inside `_HeadCrossEntropy`); block width
    and offset are dynamic, so one graph serves every block."""
    if not fused:
        return _block_stats, _block_grad
    opts = kimi.compile_options(fullgraph=True, dynamic=True)
    return torch.compile(_block_stats, **opts), torch.compile(_block_grad, **opts)


class _HeadCrossEntropy(torch.autograd.Function):
    """Σ over label rows of cross-entropy(h Wᵀ, label) in fp32 (float64 for float64 h), one vocabulary block at a
    time, without an fp32 [N, V] tensor.

    At 4096 tokens and the release's 163840 words the logits are 1.3 GB in bf16 and 2.7 GB as fp32; the one-shot
    loss also kept the fp32 log-softmax for its backward, all when the step's memory peaks (every activation
    alive). Here the forward keeps each row's log-sum-exp and, when `keep`, the compute-dtype logits blocks (the
    bf16 logits, half the fp32 size); otherwise the backward recomputes each block (one more head matmul: 9.6
    TFLOP, ~14 ms on the H200 at 4096 tokens). Per block the softmax statistics and the logits' gradient are one
    fused kernel each on a GPU (`_loss_kernels`). Each block of dW is one GEMM over all rows; dh adds the blocks'
    products in fp32. Logits are rounded to the compute dtype before the fp32 softmax, as
    `F.cross_entropy(F.linear(h, W).float(), ...)` would."""

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, labels: Tensor, block: int, keep: bool) -> Tensor:
        stats, _ = _loss_kernels(h.is_cuda)
        lse, target, kept = [], 0.0, []
        for v0 in range(0, w.shape[0], block):
            z = h @ w[v0:v0 + block].T
            l, t = stats(z, labels, v0)
            lse.append(l)
            target = target + t
            if keep:
                kept.append(z)
        lse = torch.logsumexp(torch.stack(lse), 0)
        ctx.save_for_backward(h, w, labels, lse, *kept)
        ctx.block = block
        return torch.where(labels != IGNORE, lse - target, 0.0).sum()

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, w, labels, lse, *kept = ctx.saved_tensors
        _, block_grad = _loss_kernels(h.is_cuda)
        row_scale = torch.where(labels != IGNORE, grad.to(lse.dtype), 0.0)[:, None]
        dh = torch.zeros(h.shape, dtype=lse.dtype, device=h.device) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(w) if ctx.needs_input_grad[1] else None
        for i, v0 in enumerate(range(0, w.shape[0], ctx.block)):
            wb = w[v0:v0 + ctx.block]
            dz = block_grad(kept[i] if kept else h @ wb.T, lse, labels, v0, row_scale)
            if dw is not None:   # straight into dw's rows: no block-sized temporary and copy
                torch.mm(dz.T, h, out=dw[v0:v0 + ctx.block])
            if dh is not None:
                dh += dz @ wb
        return None if dh is None else dh.to(h.dtype), dw, None, None, None


def token_loss_sum(h: Tensor, head: Tensor, labels: Tensor, *, block_logits: int = 1 << 26,
                   keep_logits: int = 1 << 30) -> Tensor:
    """Summed fp32 cross-entropy over label tokens (labels == IGNORE skipped) of the logits h [B, T, D] · headᵀ
    [V, D], computed by vocabulary blocks of at most `block_logits` logits (at least one word a block;
    `_HeadCrossEntropy`). The compute-dtype logits are kept for the backward when there are at most `keep_logits`
    of them (2 GiB in bf16; 4096 tokens of the release's vocabulary are 0.67G), else recomputed there. Labels
    outside [0, V) other than IGNORE are an error."""
    h, labels = h.flatten(0, 1), labels.flatten()
    V = head.shape[0]
    if host_checks():
        bad = (labels != IGNORE) & ((labels < 0) | (labels >= V))
        if bool(bad.any()):
            raise ValueError(f"label {int(labels[bad][0])} at position {int(bad.nonzero()[0])} of the micro-batch "
                             f"is outside the vocabulary [0, {V}) (and is not IGNORE={IGNORE})")
    block = max(1, min(V, block_logits // max(1, h.shape[0])))
    backward = torch.is_grad_enabled() and (h.requires_grad or head.requires_grad)   # evaluation keeps nothing
    return _HeadCrossEntropy.apply(h, head, labels, block, backward and h.shape[0] * V <= keep_logits)


def hidden_states(params, adapters, input_ids: Tensor, document_ids: Tensor, *, cfg: ModelConfig,
                  backend: kimi.Backend, dtype: torch.dtype, fp32_paths: frozenset[str], lora_scale: float,
                  forward=kimi.forward, cast=cast_tree) -> tuple[Tensor, Tensor]:
    """The model up to the head: the final norm's output [B, T, D] and the head's weight, both in the compute
    dtype (adapters merged). `forward`: `kimi.forward` or a compiled variant (`kimi.compile_layers(...)`);
    `cast`: `cast_tree` or `compiled_cast()`."""
    tree = lora.apply(params, adapters, lora_scale) if adapters else params
    tree = cast(tree, dtype, fp32_paths)
    return forward(tree, input_ids, cfg, backend, document_ids=document_ids, head=False), head_weight(tree, cfg)


def loss_sum(params, adapters, input_ids: Tensor, labels: Tensor, document_ids: Tensor, *, hidden=hidden_states,
             keep_logits: int = 1 << 30, **kw) -> Tensor:
    """The single-process training objective: summed label-token loss of one micro-batch. `hidden`:
    `hidden_states` or a compiled variant; `keep_logits` as `token_loss_sum`'s; other keywords as
    `hidden_states`'. The loss itself runs eagerly: inside a compiled graph AOTAutograd would merge
    `_HeadCrossEntropy`'s block matmuls (and recomputed ones) with the rest of the graph."""
    h, head = hidden(params, adapters, input_ids, document_ids, **kw)
    return token_loss_sum(h, head, labels, keep_logits=keep_logits)


def compiled_loss(scope: str, *, master_cast: bool = True):
    """`loss_sum` with the model compiled: per distinct layer (`scope="layers"`; embedding and output mix eager, the
    weight casts `compiled_cast`'s, or `cast_tree`'s without `master_cast`) or everything up to the head as one
    fullgraph ("model"); the loss stays eager either way."""
    if scope == "model":
        hidden = torch.compile(hidden_states, **kimi.compile_options(fullgraph=True))
    else:
        hidden = functools.partial(hidden_states, forward=kimi.compile_layers(fullgraph=True),
                                   cast=compiled_cast() if master_cast else cast_tree)
    return functools.partial(loss_sum, hidden=hidden)


def clipped_step(opt: torch.optim.Optimizer, params: list[Tensor], norm: Tensor, max_norm: float) -> None:
    """One optimizer step with the gradients clipped to a global norm of `max_norm` (0: no clipping), given their
    norm (`torch.nn.utils.get_total_norm`), as `clip_grad_norm_` then `step` would. A fused AdamW on plain tensors
    takes the clipping as its `grad_scale`, the divisor its kernel applies to every gradient (the hook AMP's
    GradScaler uses to unscale), so the gradients are not rewritten in a pass of their own first (in the H200
    profile of a K3.1-width step, AdamW's and clipping's multi-tensor kernels went from 70.2 to 67.7 ms); otherwise
    (CPU, FSDP's DTensors) they are scaled in place, bit for bit as `clip_grad_norm_` does."""
    if max_norm > 0 and opt.defaults.get("fused") and not hasattr(norm, "full_tensor"):
        opt.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0).float()   # 1 / clip_grad_norm_'s coefficient
        opt.found_inf = torch.zeros((), device=norm.device)                  # non-finite steps never get here
        try:
            opt.step()
        finally:
            del opt.grad_scale, opt.found_inf
        return
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    opt.step()


def unflatten(flat: dict[str, Tensor]) -> dict:
    """{"a.b.0.c": x} -> {"a": {"b": [{"c": x}]}} (integer components become list positions)."""
    root: dict = {}
    for path, v in flat.items():
        node, parts = root, path.split(".")
        for k in parts[:-1]:
            node = node.setdefault(k, {})
        node[parts[-1]] = v

    def lists(n):
        if not isinstance(n, dict):
            return n
        if n and all(k.isdigit() for k in n):
            return [lists(n[str(i)]) for i in range(len(n))]
        return {k: lists(v) for k, v in n.items()}
    return lists(root)


class _Unit(nn.Module):
    """An FSDP2 unit: owns some leaves of the tree (and their adapters) and calls a pure function with the
    subtree rebuilt at call time (COMPILE.md B.8). Parameter names are the dotted paths with '/' for '.'."""

    def __init__(self, leaves: dict[str, nn.Parameter], adapters: dict, prefix: str, ctx: dict):
        super().__init__()
        self.prefix, self.ctx = prefix, ctx
        for path, p in leaves.items():
            self.register_parameter(path.replace(".", "/"), p)
        for path, ab in adapters.items():
            for k, p in ab.items():
                self.register_parameter(f"lora:{path.replace('.', '/')}:{k}", p)

    def subtree(self):
        """The owned subtree (paths relative to `prefix`), adapters applied, in the compute dtype."""
        base, adapters = {}, {}
        for name, p in self.named_parameters(recurse=False):
            if name.startswith("lora:"):
                _, path, k = name.split(":")
                adapters.setdefault(path.replace("/", ".")[len(self.prefix):], {})[k] = p
            else:
                base[name.replace("/", ".")[len(self.prefix):]] = p
        tree = unflatten(base)
        c = self.ctx
        if adapters:
            tree = lora.apply(tree, adapters, c["lora_scale"])
        return cast_tree(tree, c["dtype"], c["fp32_paths"], self.prefix)


class _Layer(_Unit):
    def forward(self, h, R, seg, reset):
        c = self.ctx
        return decoder_layer(self.subtree(), h, list(R), c["index"][self.prefix], c["cfg"], c["backend"],
                             seg=seg, reset=reset)


class _Root(_Unit):
    """Everything outside the layers; calls the layer units in the order of `kimi.forward` (model.py)."""

    def __init__(self, leaves, adapters, layers: list[_Layer], ctx):
        super().__init__(leaves, adapters, "", ctx)
        self.layers = nn.ModuleList(layers)

    def forward(self, input_ids, document_ids, labels):
        """The summed label-token loss (the head's weight is gathered only inside this call)."""
        cfg = self.ctx["cfg"]
        tree = self.subtree()
        m = tree["model"]
        seg, reset = document_runs(document_ids)
        h = F.embedding(input_ids, m["embed_tokens"]["weight"])
        R: list[Tensor] = []
        for layer in self.layers:
            h, R = layer(h, R, seg, reset)
        if cfg.attn_res_block_size is not None:
            h = attn_res_mix(h, R, m["output_attn_res_norm"], m["output_attn_res_proj"], cfg.rms_norm_eps)
        h = rms_norm(h, m["norm"], cfg.rms_norm_eps)
        return token_loss_sum(h, head_weight(tree, cfg), labels)


def build_fsdp(params, adapters, ctx: dict, compile_units: bool) -> _Root:
    """Shard the tree over all processes: one FSDP2 unit per decoder layer, the root unit for the rest."""
    from torch.distributed.fsdp import fully_shard

    # A layer returns the attention-residual entries R, some of which are views; nothing here updates a unit's
    # output in place (the case that warning is about), so it is noise on every call.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

    flat = dict(tree_items(params))
    layers = []
    ctx["index"] = {}
    for i in range(len(params["model"]["layers"])):
        pre = f"model.layers.{i}."
        ctx["index"][pre] = i
        unit = _Layer({p: v for p, v in flat.items() if p.startswith(pre)},
                      {p: v for p, v in adapters.items() if p.startswith(pre)}, pre, ctx)
        if compile_units:
            unit.compile(**kimi.compile_options(fullgraph=True))
        fully_shard(unit)
        layers.append(unit)
    root = _Root({p: v for p, v in flat.items() if not p.startswith("model.layers.")},
                 {p: v for p, v in adapters.items() if not p.startswith("model.layers.")}, layers, ctx)
    fully_shard(root)
    return root


def trainable_named(params, adapters, root: _Root | None) -> dict[str, nn.Parameter]:
    """The trained leaves by name (path, or 'path:A' / 'path:B' for adapters), in a fixed order. After FSDP the
    module's (sharded) parameters replace the tree's."""
    if root is not None:
        out = {}
        for name, p in root.named_parameters():
            name = name.split(".")[-1]
            if p.requires_grad:
                out[name[5:].replace("/", ".") if name.startswith("lora:") else name.replace("/", ".")] = p
        return dict(sorted(out.items()))
    if adapters:
        return {f"{path}:{k}": v for path, ab in adapters.items() for k, v in ab.items()}
    return {p: v for p, v in tree_items(params) if v.requires_grad}


# ============================================================================================== FLOPs

def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the usual 6·N estimate plus sequence terms:

    - 6 · N_active: every active matmul weight (experts counted k of E, the head counted, the embedding lookup
      and the indexer not), 2 FLOPs per multiply-add, forward + 2× backward;
    - gated MLA attention: 6 · H · (d_qk + d_v) · keys, keys = mean over a row of min(t, index_topk) causal keys
      (all t without an indexer), expanded form;
    - KDA: 6 · H · (3 · d_k · d_v + C · (d_k + d_v)) per token, the state update / readout and the
      intra-chunk (C = 64) attention of the chunked form, roughly;
    - the frozen indexer, forward only: 2 · N_indexer + 2 · n · d · (t/2 keys on average).
    Dense rows of length seq_len are assumed (packing keeps this roughly right)."""
    n_active = kimi.param_count(cfg, active=True, embedding=False)
    n_idx = sum(math.prod(s.shape) for p, s in tree_items(param_specs(cfg)) if ".indexer." in p)
    flops = 6.0 * (n_active - n_idx)
    T = seq_len
    mean_t = (T + 1) / 2
    for kind in cfg.layer_types:
        if kind == "mla":
            keys = mean_t if not cfg.has_indexer else sum(min(t, cfg.index_topk) for t in range(1, T + 1)) / T
            flops += 6 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * keys
            if cfg.has_indexer:
                flops += 2 * cfg.index_n_heads * cfg.index_head_dim * mean_t
        else:
            la = cfg.linear_attn_config
            flops += 6 * la.num_heads * (3 * la.head_dim * la.head_dim + 64 * 2 * la.head_dim)
    return flops + 2.0 * n_idx


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU (for MFU), None when unknown or on CPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in (("H200", 989e12), ("H100", 989e12), ("B200", 2250e12), ("A100", 312e12)):
        if key in name:
            return value
    return None


# ============================================================================================== checkpoints

def _full(t: Tensor) -> Tensor:
    """A full CPU copy (DTensors are gathered: a collective, every process must call it)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True)


def _like(full: Tensor, param: Tensor) -> Tensor:
    """`full` placed like `param` (sharded the same way if param is a DTensor)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(full.to(param.to_local().device), param.device_mesh, param.placements)
    return full.to(param.device)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training_state(folder: Path, step: int, named: dict[str, Tensor], opt: torch.optim.Optimizer,
                        sampler: Sampler, cfg: TrainConfig, bad_steps: int, rank: int) -> None:
    """Atomically write out/ckpt-{step}/state.pt: trained leaves, AdamW state by name, step, data position, RNG.
    Every process takes part (DTensor gathers); process 0 writes."""
    ids = {id(p): n for n, p in named.items()}
    opt_state = {}
    for group in opt.param_groups:
        for p in group["params"]:
            opt_state[ids[id(p)]] = {k: _full(v) if isinstance(v, Tensor) and v.dim() else v
                                     for k, v in opt.state.get(p, {}).items()}
    state = {"step": step, "params": {n: _full(p) for n, p in named.items()}, "optimizer": opt_state,
             "data": sampler.state(), "rng": rng_state(), "bad_steps": bad_steps,
             "config": dataclasses.asdict(cfg)}
    if rank != 0:
        return
    final = folder / f"ckpt-{step:06d}"
    tmp = folder / f".tmp-ckpt-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    old = sorted(folder.glob("ckpt-*"))[:-cfg.keep_checkpoints] if cfg.keep_checkpoints > 0 else []
    for p in old:
        shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(folder: Path) -> Path | None:
    found = sorted(p for p in folder.glob("ckpt-*") if (p / "state.pt").is_file())
    return found[-1] if found else None


def load_training_state(path: Path, named: dict[str, nn.Parameter], opt: torch.optim.Optimizer,
                        sampler: Sampler) -> tuple[int, int]:
    """Restore what `save_training_state` wrote; returns (step, bad_steps)."""
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    if set(state["params"]) != set(named):
        missing, extra = sorted(set(named) - set(state["params"])), sorted(set(state["params"]) - set(named))
        raise ValueError(f"{path}: checkpoint does not match this run's trained parameters "
                         f"(missing {missing[:5]}, unexpected {extra[:5]}); same --model and --lora?")
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(_like(state["params"][n].to(p.dtype), p))
    for group in opt.param_groups:
        for p in group["params"]:
            name = next(n for n, q in named.items() if q is p)
            saved = state["optimizer"][name]
            if saved:
                opt.state[p] = {k: _like(v, p) if isinstance(v, Tensor) and v.dim() else
                                (v.clone() if isinstance(v, Tensor) else v) for k, v in saved.items()}
                if isinstance(opt.state[p].get("step"), Tensor) and opt.defaults.get("fused"):
                    opt.state[p]["step"] = opt.state[p]["step"].to(p.device)
    sampler.epoch, sampler.offset = state["data"]["epoch"], state["data"]["offset"]
    set_rng_state(state["rng"])
    return state["step"], state["bad_steps"]


# ============================================================================================== observability

def write_png(path: Path, series: list[tuple[list[float], list[float], tuple[int, int, int]]],
              width: int = 640, height: int = 360) -> None:
    """A minimal line plot as a PNG (no plotting dependency): each series (xs, ys, rgb) drawn in one box with
    shared axes, y from its min to max. Numbers are in metrics.jsonl; this is the picture."""
    img = bytearray(b"\xff" * (width * height * 3))
    pad = 20
    xs_all = [x for s in series for x in s[0]]
    ys_all = [y for s in series for y in s[1] if math.isfinite(y)]
    if not xs_all or not ys_all:
        return
    x0, x1 = min(xs_all), max(xs_all) or 1
    y0, y1 = min(ys_all), max(ys_all)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1

    def put(px, py, rgb):
        if 0 <= px < width and 0 <= py < height:
            i = (py * width + px) * 3
            img[i:i + 3] = bytes(rgb)

    for px in range(pad, width - pad):          # axes box
        put(px, height - pad, (0, 0, 0))
        put(px, pad, (200, 200, 200))
    for py in range(pad, height - pad):
        put(pad, py, (0, 0, 0))
        put(width - pad, py, (200, 200, 200))

    def to_px(x, y):
        return (pad + round((x - x0) / (x1 - x0) * (width - 2 * pad)),
                height - pad - round((y - y0) / (y1 - y0) * (height - 2 * pad)))

    for xs, ys, rgb in series:
        pts = [to_px(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
        for (ax, ay), (bx, by) in zip(pts, pts[1:] or pts):
            n = max(abs(bx - ax), abs(by - ay), 1)
            for k in range(n + 1):
                put(ax + round((bx - ax) * k / n), ay + round((by - ay) * k / n), rgb)
        for px, py in pts if len(pts) < 50 else []:
            for dx in (-1, 0, 1):
                for dy in (-1, 0, 1):
                    put(px + dx, py + dy, rgb)
    raw = b"".join(b"\x00" + bytes(img[r * width * 3:(r + 1) * width * 3]) for r in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    path.write_bytes(png)


def plot_metrics(metrics_path: Path, png_path: Path) -> None:
    train, evals = ([], []), ([], [])
    for line in metrics_path.read_text().splitlines():
        m = json.loads(line)
        if "loss" in m:
            train[0].append(m["step"]), train[1].append(m["loss"])
        if "eval_loss" in m:
            evals[0].append(m["step"]), evals[1].append(m["eval_loss"])
    write_png(png_path, [(*train, (31, 119, 180)), (*evals, (214, 39, 40))])


def _fmt_time(s: float) -> str:
    return str(datetime.timedelta(seconds=round(s)))


# ============================================================================================== the run

def setup_distributed(device_arg: str) -> tuple[int, int, torch.device]:
    """(rank, world, device). Under torchrun: NCCL on GPUs, gloo on CPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
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
    rank, world, device = setup_distributed(cfg.device)
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

    model_cfg, params, adapters, source = build_model(cfg, device, compute)
    tok = load_tokenizer(source, model_cfg)
    train_rows, eval_rows = build_data(cfg, tok, model_cfg)
    accum = cfg.batch_size // (cfg.micro_batch_size * world)
    if accum * cfg.micro_batch_size * world != cfg.batch_size:
        raise ValueError(f"batch_size={cfg.batch_size} is not a multiple of micro_batch_size="
                         f"{cfg.micro_batch_size} x {world} processes")
    kda = auto_kda(device, use_compile) if cfg.kda == "auto" else cfg.kda
    backend = kimi.Backend(attn=cfg.attn, kda=kda, moe=cfg.moe, mla_form=cfg.mla_form)
    fp32_paths = frozenset(p for p, s in tree_items(param_specs(model_cfg)) if s.fp32)
    scale = lora.scale_of(cfg.lora.rank, cfg.lora.alpha) if cfg.lora.rank else 1.0

    root = None
    if world > 1:
        ctx = dict(cfg=model_cfg, backend=backend, dtype=compute, fp32_paths=fp32_paths, lora_scale=scale)
        root = build_fsdp(params, adapters, ctx, use_compile)

        def micro_loss(ids, labels, doc):
            return root(ids, doc, labels)
    else:
        fn = compiled_loss(cfg.compile_scope) if use_compile else loss_sum

        def micro_loss(ids, labels, doc):
            return fn(params, adapters, ids, labels, doc, cfg=model_cfg, backend=backend, dtype=compute,
                      fp32_paths=fp32_paths, lora_scale=scale)

    named = trainable_named(params, adapters, root)
    decay = [p for n, p in named.items() if p.dim() >= 2 and "conv1d" not in n]
    no_decay = [p for n, p in named.items() if not (p.dim() >= 2 and "conv1d" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas,
                            eps=cfg.eps, fused=device.type == "cuda")
    sampler = Sampler(len(train_rows), cfg.seed)

    step, bad = 0, 0
    metrics_path = out / "metrics.jsonl"
    if cfg.resume:
        ckpt = latest_checkpoint(out)
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {out}")
        step, bad = load_training_state(ckpt, named, opt, sampler)
        log(f"resumed from {ckpt} at step {step}")
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        kept = [ln for ln in metrics_path.read_text().splitlines() if json.loads(ln)["step"] <= step] \
            if cfg.resume and metrics_path.exists() else []
        metrics_path.write_text("".join(ln + "\n" for ln in kept))

    n_params = sum(p.numel() for p in named.values()) if root is None else \
        sum(p.numel() for _, p in tree_items(params) if p.requires_grad) + sum(
            v.numel() for ab in adapters.values() for v in ab.values())
    flops_tok = model_flops_per_token(model_cfg, cfg.data.seq_len)
    peak = peak_flops(device)
    log(f"model {cfg.model}: {kimi.param_count(model_cfg):,} parameters, training {n_params:,}"
        f"{f' (LoRA rank {cfg.lora.rank})' if cfg.lora.rank else ''} | {len(train_rows)} train rows, "
        f"{len(eval_rows)} eval rows of {cfg.data.seq_len} tokens | {world} process(es) on {device}, "
        f"{str(compute).removeprefix('torch.')} compute, compile {'on' if use_compile else 'off'}, "
        f"grad accumulation {accum}")

    def record(m: dict) -> None:
        if is_main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(m) + "\n")

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
                    s = micro_loss(b.input_ids.to(device), b.labels.to(device), b.document_ids.to(device))
                    total += torch.tensor([s.item(), (b.labels != IGNORE).sum().item()], dtype=torch.float64)
        return (total[0] / total[1]).item()

    def checkpoint() -> None:
        save_training_state(out, step, named, opt, sampler, cfg, bad, rank)
        if world > 1:
            dist.barrier()

    first_loss = last_loss = eval_loss = None
    t_start, tokens_run, steps_run = time.perf_counter(), 0, 0
    t_log, tokens_log = t_start, 0
    while step < cfg.steps:
        idx = sampler.take(cfg.batch_size)
        batch = train_rows.select(idx)
        label_tokens = int((batch.labels != IGNORE).sum())
        mine = batch.select(slice(rank * accum * cfg.micro_batch_size, (rank + 1) * accum * cfg.micro_batch_size))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss_total = torch.zeros((), dtype=torch.float64, device=device)
        for k in range(accum):
            mb = mine.select(slice(k * cfg.micro_batch_size, (k + 1) * cfg.micro_batch_size))
            s = micro_loss(mb.input_ids.to(device), mb.labels.to(device), mb.document_ids.to(device))
            # FSDP averages gradients over processes; the world factor makes that the global-batch mean.
            (s * (world / max(label_tokens, 1))).backward()
            loss_total += s.detach().double()
        if world > 1:
            dist.all_reduce(loss_total)
        loss = (loss_total / max(label_tokens, 1)).item()
        grads = [p for p in named.values() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in grads], foreach=True)
        gnorm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        step += 1
        steps_run += 1
        if not (math.isfinite(loss) and math.isfinite(gnorm)):
            bad += 1
            opt.zero_grad(set_to_none=True)
            warnings.warn(f"step {step}: non-finite loss {loss} or gradient norm {gnorm}; step skipped "
                          f"({bad} in a row, stopping at {cfg.max_bad_steps})", stacklevel=1)
            if bad >= cfg.max_bad_steps:
                raise TrainingDiverged(f"{bad} consecutive steps with a non-finite loss or gradient; stopping at "
                                       f"step {step} (last checkpoint in {out})")
            continue
        bad = 0
        clipped_step(opt, grads, norm, cfg.grad_clip)
        opt.zero_grad(set_to_none=True)
        tokens = int((batch.document_ids >= 0).sum())
        tokens_run += tokens
        tokens_log += tokens
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss
        m = {"step": step, "loss": loss, "lr": opt.param_groups[0]["lr"], "grad_norm": gnorm}
        if step % cfg.log_every == 0 or step == cfg.steps or step == 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            tps = tokens_log / max(now - t_log, 1e-9)
            m["tokens_per_s"] = tps
            if peak:
                m["mfu"] = tps * flops_tok / (peak * world)
            eta = (now - t_start) / steps_run * (cfg.steps - step)
            mfu = f" | MFU {m['mfu']:.1%}" if "mfu" in m else ""
            log(f"step {step:>6}/{cfg.steps} | loss {loss:.4f} | lr {m['lr']:.2e} | grad norm {gnorm:.3f} | "
                f"{tps:,.0f} tok/s{mfu} | "
                f"ETA {_fmt_time(eta)}")
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
    if is_main and metrics_path.exists():
        plot_metrics(metrics_path, out / "loss.png")
        log(f"{tokens_run:,} tokens in {_fmt_time(wall)} ({summary['tokens_per_s']:,.0f} tok/s); metrics in "
            f"{metrics_path}, curve in {out / 'loss.png'}")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def export(folder: Path, model_cfg: ModelConfig, params, adapters, scale: float, root: _Root | None, source,
           is_main: bool) -> None:
    """The model in the HF layout in the checkpoint's dtype (LoRA merged), plus the source's tokenizer files."""
    if root is not None:   # gather the sharded leaves (every process), rebuild the tree
        full = {}
        for name, p in root.named_parameters():
            full[name.split(".")[-1]] = _full(p)
        params = unflatten({n.replace("/", "."): v for n, v in full.items() if not n.startswith("lora:")})
        adapters = {}
        for n, v in full.items():
            if n.startswith("lora:"):
                _, path, k = n.split(":")
                adapters.setdefault(path.replace("/", "."), {})[k] = v
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


def _check(cfg: TrainConfig) -> None:
    problems = []
    for name in ("steps", "batch_size", "micro_batch_size", "log_every", "max_bad_steps"):
        if getattr(cfg, name) <= 0:
            problems.append(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.data.seq_len <= 0:
        problems.append(f"data.seq_len must be positive, got {cfg.data.seq_len}")
    if not 0 <= cfg.data.eval_fraction < 1:
        problems.append(f"data.eval_fraction must be in [0, 1), got {cfg.data.eval_fraction}")
    if cfg.lora.rank < 0:
        problems.append(f"lora.rank must be >= 0, got {cfg.lora.rank}")
    if cfg.warmup_steps < 0 or cfg.lr <= 0:
        problems.append("warmup_steps must be >= 0 and lr positive")
    if problems:
        raise ValueError("train config: " + "; ".join(problems))


def main(argv: list[str] | None = None) -> dict:
    """`python train.py [PRESET] [--options]`; the preset (default tiny) supplies the defaults."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in PRESETS else "tiny"
    presets = "\n".join(f"  {k}: {d}" for k, (d, _) in PRESETS.items())
    cfg = tyro.cli(TrainConfig, default=PRESETS[name][1], args=argv, prog=f"train.py [PRESET]",
                   description=f"Train or fine-tune Kimi K3.1 Pro (preset '{name}').\n\nPresets (first "
                               f"argument, default tiny):\n{presets}")
    return train(cfg)


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:   # DataError, CheckpointError, TokenizerError, LoRAError, bad config values
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
