"""The training step's pieces: the compute-dtype casts of the fp32 master weights, the objective (model up to the
head, then the blockwise loss), one optimizer step over micro-batches, the learning-rate schedule, AdamW's
parameter groups and the FLOP count for MFU (docs/architecture.md#training)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from . import lora, model
from .config import Backend, ModelConfig
from .cp import ContextParallel
from .loss import token_loss_sum
from .model import compile_layers, compile_options, head_weight, layer_step, recomputed
from .params import param_count, param_specs, tree_items, tree_map

# ---------------------------------------------------------------------------------------------- precision casts


def fp32_paths(cfg: ModelConfig) -> frozenset[str]:
    """The leaves kept in fp32 whatever the compute dtype (docs/numerics.md#precision)."""
    return frozenset(p for p, s in tree_items(param_specs(cfg)) if s.fp32)


def cast_tree(tree, dtype: torch.dtype, fp32_paths: frozenset[str], prefix: str = ""):
    """The tree in the compute dtype, except the fp32 leaves (A_log, dt_bias, convs, o_norm...; `fp32_paths`)."""
    def leaf(path, p):
        return p if (prefix + path) in fp32_paths or p.dtype == dtype else p.to(dtype)
    return tree_map(leaf, tree)


def compiled_cast(**compile_kwargs):
    """`cast_tree` for fp32 master weights, with their gradients written straight into the fp32 `.grad`s
    (`_MasterCast`) by generated kernels: the layer-wise compiled step's casts, which otherwise run eagerly.

    Eagerly the backward of each cast is a bf16 -> fp32 copy, for which CUDA has no vectorized kernel (PyTorch's
    generic dtype-converting copy), and with gradient accumulation AccumulateGrad then adds that fp32 copy to
    `.grad` in one more pass. Here each gradient is upcast into a new `.grad`, or added to the existing one, in one
    generated kernel as soon as it exists. Leaves that are not trainable leaves (frozen weights, LoRA-merged
    weights) get a plain cast. `compile_kwargs` go to `torch.compile` (e.g. a test's `backend="aot_eager"`)."""
    opts = compile_options(**{"fullgraph": True, "dynamic": True, **compile_kwargs})
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
                # size from the first example's size, and a tiny first example gives a slow kernel.
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
    graph (and still writes p.grad), so only the training step (`train_step`) uses this."""

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


# ---------------------------------------------------------------------------------------------- the objective

def hidden_states(params, adapters, input_ids: Tensor, document_ids: Tensor, *, cfg: ModelConfig,
                  backend: Backend, dtype: torch.dtype, fp32_paths: frozenset[str], lora_scale: float,
                  max_document_len: int | None = None, forward: Callable = model.forward,
                  cast: Callable = cast_tree, cp: ContextParallel | None = None) -> tuple[Tensor, Tensor]:
    """The model up to the head: the final norm's output [B, T, D] and the head's weight [V, D], both in the compute
    dtype (adapters merged). `max_document_len`: the data's longest document, as `kimi.forward` takes it.
    `forward`: `kimi.forward` or a compiled variant (`kimi.compile_layers(...)`); `cast`: `cast_tree` or
    `compiled_cast()`. `cp`: context parallelism, as `kimi.forward` takes it (the inputs are this rank's tokens)."""
    tree = lora.apply(params, adapters, lora_scale) if adapters else params
    tree = cast(tree, dtype, fp32_paths)
    h = forward(tree, input_ids, cfg, backend, document_ids=document_ids, max_document_len=max_document_len,
                head=False, **({} if cp is None else {"cp": cp}))
    return h, head_weight(tree, cfg)


def loss_sum(params, adapters, input_ids: Tensor, labels: Tensor, document_ids: Tensor, *, hidden=hidden_states,
             keep_logits: int = 1 << 30, cp: ContextParallel | None = None, **kw) -> Tensor:
    """The training objective: summed label-token loss of one micro-batch (input_ids, labels, document_ids
    [B, T]). `hidden`: `hidden_states` or a compiled variant; `keep_logits` as `token_loss_sum`'s; other keywords
    as `hidden_states`'. The loss itself runs eagerly: inside a compiled graph AOTAutograd would merge
    `_HeadCrossEntropy`'s block matmuls (and recomputed ones) with the rest of the graph.

    `cp`: context parallelism (kimi/cp.py). The micro-batch holds whole rows, each rank runs its tokens of them
    (`cp.shard`; the labels are already the next tokens, so a chunk's last label is the next chunk's first token)
    and returns the loss of those: the sum over the group's ranks is the rows' loss."""
    if cp is not None:
        input_ids, labels, document_ids = (cp.shard(t) for t in (input_ids, labels, document_ids))
        kw["cp"] = cp
    h, head = hidden(params, adapters, input_ids, document_ids, **kw)
    return token_loss_sum(h, head, labels, keep_logits=keep_logits)


def make_loss(compile_scope: str | None = None, *, recompute: bool = False, master_cast: bool = True):
    """`loss_sum` as train.py runs it in one process. `compile_scope`: None runs eagerly; "layers" compiles per
    distinct layer (embedding and output mix eager, the weight casts `compiled_cast`'s, or `cast_tree`'s without
    `master_cast`); "model" compiles everything up to the head as one fullgraph. The loss stays eager either way.
    `recompute`: activation checkpointing, every decoder layer recomputed in the backward (`kimi.model.recomputed`)."""
    layer = recomputed() if recompute else layer_step
    forward = functools.partial(model.forward, layer=layer) if recompute else model.forward
    if compile_scope is None:
        hidden = functools.partial(hidden_states, forward=forward)
    elif compile_scope == "model":
        hidden = torch.compile(functools.partial(hidden_states, forward=forward), **compile_options(fullgraph=True))
    elif compile_scope == "layers":
        hidden = functools.partial(hidden_states, forward=compile_layers(layer=layer, fullgraph=True),
                                   cast=compiled_cast() if master_cast else cast_tree)
    else:
        raise ValueError(f"compile_scope must be None, 'layers' or 'model', got {compile_scope!r}")
    return functools.partial(loss_sum, hidden=hidden)


ACTIVATION_BYTES = 220
"""Bytes of activations per token, per decoder layer, per unit of `hidden_size` that a bf16 training step keeps
without recomputation: the memory recomputing every layer freed on the H200 at the release's widths with every
token routed to 8 experts (docs/performance.md#activation-checkpointing: 23.5 GiB for 1 × 4096 tokens and 4
layers; recomputation still keeps one layer's activations and every layer's input, so the true figure is somewhat
higher, and higher again with the release's 16 experts a token). `recompute_wanted`'s estimate, with a margin."""


def recompute_wanted(cfg: ModelConfig, tokens: int, device: torch.device, *, trainable: int) -> bool:
    """Whether train.py's `--activation-checkpointing auto` recomputes: on a CUDA device, when a micro-batch of
    `tokens` would not fit the memory free now (the model loaded, the optimizer state not yet allocated) with
    ~10 % to spare: its activations (`ACTIVATION_BYTES` per token, layer and unit of width) plus 12 bytes for each
    of this process's `trainable` parameters (the fp32 gradient and AdamW's two moments). Never on the CPU (its
    memory is the host's, and CPU runs are small)."""
    if device.type != "cuda":
        return False
    need = ACTIVATION_BYTES * tokens * cfg.num_hidden_layers * cfg.hidden_size + 12 * trainable
    return need > 0.9 * torch.cuda.mem_get_info(device)[0]


# ---------------------------------------------------------------------------------------------- the step

@dataclass(frozen=True)
class StepResult:
    loss: float
    """Mean loss per label token of the global batch."""
    grad_norm: float
    """Global gradient norm, before clipping."""

    @property
    def finite(self) -> bool:
        """Whether the optimizer stepped (a non-finite loss or gradient skips the step)."""
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def train_step(micro_loss: Callable[[Tensor, Tensor, Tensor], Tensor],
               micro_batches: Iterable[tuple[Tensor, Tensor, Tensor]], opt: torch.optim.Optimizer,
               params: Iterable[Tensor], *, label_tokens: int, grad_clip: float, world: int = 1) -> StepResult:
    """One optimizer step over this process's micro-batches (input_ids, labels, document_ids, each [B, T]).

    `micro_loss(input_ids, labels, document_ids)` returns a micro-batch's summed label-token loss; each is
    backpropagated scaled by 1 / `label_tokens`, the label tokens of the whole global batch (every process), so the
    gradient is the global batch's mean whatever the accumulation count (docs/numerics.md#loss). With `world`
    processes FSDP averages the gradients (of rows and, under context parallelism, of each row's shares), and the
    factor `world` turns that average into the sum. Then the gradient norm of `params` (the trained leaves), the step
    clipped to `grad_clip` (`clipped_step`) when the loss and the norm are finite, and the gradients are dropped."""
    total = None
    for input_ids, labels, document_ids in micro_batches:
        s = micro_loss(input_ids, labels, document_ids)
        (s * (world / max(label_tokens, 1))).backward()
        total = s.detach().double() if total is None else total + s.detach().double()
    if total is None:
        raise ValueError("train_step needs at least one micro-batch")
    if world > 1:
        dist.all_reduce(total)
    loss = (total / max(label_tokens, 1)).item()
    grads = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in grads], foreach=True)
    result = StepResult(loss, float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    if result.finite:
        clipped_step(opt, grads, norm, grad_clip)
    opt.zero_grad(set_to_none=True)
    return result


def clipped_step(opt: torch.optim.Optimizer, params: list[Tensor], norm: Tensor, max_norm: float) -> None:
    """One optimizer step with the gradients clipped to a global norm of `max_norm` (0: no clipping), given their
    norm (`torch.nn.utils.get_total_norm`), as `clip_grad_norm_` then `step` would. A fused AdamW on plain tensors
    takes the clipping as its `grad_scale`, the divisor its kernel applies to every gradient (the hook AMP's
    GradScaler uses to unscale), so the gradients are not rewritten in a pass of their own first; otherwise (CPU,
    FSDP's DTensors) they are scaled in place, bit for bit as `clip_grad_norm_` does."""
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


# ---------------------------------------------------------------------------------------------- optimizer

def lr_at(step: int, *, lr: float, steps: int, warmup_steps: int, min_lr_ratio: float, schedule: str = "cosine",
          decay_fraction: float = 0.2) -> float:
    """Learning rate of optimizer step `step` (0-based) of `steps`: linear warmup, then cosine decay or
    warmup-stable-decay (WSD: constant, then a linear decay over the last `decay_fraction` of the steps) down to
    lr · min_lr_ratio."""
    lo = lr * min_lr_ratio
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "cosine":
        progress = (step - warmup_steps) / max(1, steps - warmup_steps - 1)
        return lo + (lr - lo) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    decay = max(1, round(decay_fraction * steps))
    start = steps - decay
    if step < start:
        return lr
    return lr + (lo - lr) * min(1.0, (step - start + 1) / decay)


def adamw(named: dict[str, Tensor], *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
          fused: bool) -> torch.optim.AdamW:
    """AdamW over the trained leaves by name, with weight decay on matrices only (norm gains, A_log, dt_bias and
    the short convs' weights are not decayed)."""
    def decays(name, p):
        return p.dim() >= 2 and "conv1d" not in name
    return torch.optim.AdamW([{"params": [p for n, p in named.items() if decays(n, p)], "weight_decay": weight_decay},
                              {"params": [p for n, p in named.items() if not decays(n, p)], "weight_decay": 0.0}],
                             lr=lr, betas=betas, eps=eps, fused=fused)


def trainable_named(params, adapters: dict) -> dict[str, Tensor]:
    """The trained leaves by name, in a fixed order: the adapters ('path:A', 'path:B') when there are any, else the
    leaves of the tree that require a gradient (by path). The checkpoint's and the optimizer state's keys."""
    if adapters:
        return {f"{path}:{k}": v for path, ab in adapters.items() for k, v in ab.items()}
    return {p: v for p, v in tree_items(params) if v.requires_grad}


# ---------------------------------------------------------------------------------------------- FLOPs

def model_flops_per_token(cfg: ModelConfig, seq_len: int, *, adapters: float | None = None) -> float:
    """Training FLOPs per token (forward + backward), the usual 6·N estimate plus sequence terms:

    - 6 · N_active: every active matmul weight (experts counted k of E, the head counted, the embedding lookup
      and the indexer not), 2 FLOPs per multiply-add, forward + 2× backward. Under LoRA (`adapters`: the
      adapter parameters a token passes through, `lora_flop_params`) the frozen base counts 4 · N_active (forward
      and input gradient, no weight gradient) and the adapters 6 each: the model's work, whatever the
      implementation does (kimi.lora merges the adapters into the weights, so it also forms their weight
      gradients);
    - gated MLA attention: 6 · H · (d_qk + d_v) · keys, keys = mean over a row of min(t, index_topk) causal keys
      (all t without an indexer), expanded form;
    - KDA: 6 · H · (3 · d_k · d_v + C · (d_k + d_v)) per token, the state update / readout and the
      intra-chunk (C = 64) attention of the chunked form, roughly;
    - the frozen indexer, forward only: 2 · N_indexer + 2 · n · d · (t/2 keys on average).
    Dense rows of length seq_len are assumed (packing keeps this roughly right)."""
    n_active = param_count(cfg, active=True, embedding=False)
    n_idx = sum(math.prod(s.shape) for p, s in tree_items(param_specs(cfg)) if ".indexer." in p)
    flops = 6.0 * (n_active - n_idx) if adapters is None else 4.0 * (n_active - n_idx) + 6.0 * adapters
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


def lora_flop_params(cfg: ModelConfig, adapters: dict) -> float:
    """The adapter parameters a token passes through: all of them, but those of the routed experts counted k of E
    (a token visits num_experts_per_token of the stacked experts)."""
    routed = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 1.0
    return sum(sum(t.numel() for t in ab.values()) * (routed if ".experts." in path else 1.0)
               for path, ab in adapters.items())


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU (for MFU), None when unknown or on CPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in (("H200", 989e12), ("H100", 989e12), ("B200", 2250e12), ("A100", 312e12)):
        if key in name:
            return value
    return None
