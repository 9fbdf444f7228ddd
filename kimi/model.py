"""The model: embedding -> 93 decoder layers joined by Attention Residuals -> output mix, norm, head.

Attention Residuals (docs/numerics.md#attention-residuals). Layers are grouped in blocks of
`attn_res_block_size`. The state between layers is the current block's partial sum P (also the layer input h) and
the list R of closed entries: R[0] is the embedding, R[n] the summed sublayer outputs of block n-1. A sublayer does
not read P directly but a per-token softmax mix of R and P:

    Mix(P, R) = Σ_i α_i V_i,   V = [R..., P],   α = softmax_i( <RMSNorm_noweight(V_i), w_norm ⊙ w_proj> )

in fp32, cast back. Layer l: a_in = Mix(P, R) (just P at layer 0); at a block start P joins R and a new partial
sum starts; P += attn(input_layernorm(a_in)); m_in = Mix(P, R); P += ffn(post_attention_layernorm(m_in)).
After the last layer the output mix over R and P feeds the final norm and the head.
With `attn_res_block_size = None` the layers use the plain pre-norm residual.

Documents: `document_ids` [B, T] marks packed documents; a new document starts wherever the id changes, and
negative ids mark padding. Attention is document-causal and the KDA state and short conv restart at every
document start.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
from torch import Tensor

from . import kda, mla, moe
from .cache import CacheError, Step, check_cache, step_positions
from .cp import ContextParallel, CPError, Shard
from .common import compute_dtype, host_checks, rms_norm
from .config import Backend, ModelConfig
from .ranges import KeyRanges, document_ranges


DEFAULT_BACKEND = Backend()


def attn_res_mix(P: Tensor, R: list[Tensor] | Tensor, p_norm: dict, p_proj: dict, eps: float) -> Tensor:
    """Mix(P, R): P [B, T, D] and entries R (a list of [B, T, D], or one stacked [n, B, T, D]
    tensor) -> [B, T, D] in P's dtype. The norm weight enters only the pseudo-query; the mixed values are the raw
    entries."""
    V = torch.cat([R, P[None]]) if isinstance(R, Tensor) else torch.stack([*R, P])   # [n+1, B, T, D]
    ct = compute_dtype(V.dtype)
    Vf = V.to(ct)
    keys = Vf * torch.rsqrt(Vf.pow(2).mean(-1, keepdim=True) + eps)
    query = p_norm["weight"].to(ct) * p_proj["weight"][0].to(ct)             # [D]
    alpha = torch.softmax((keys * query).sum(-1), dim=0)                    # [n+1, B, T]; no 1/sqrt(D)
    return (alpha[..., None] * Vf).sum(0).to(P.dtype)


def document_resets(document_ids: Tensor) -> Tensor:
    """[B, T] bool, True where a document starts after position 0 (wherever the id changes): the KDA state and
    conv restart there."""
    reset = torch.zeros_like(document_ids, dtype=torch.bool)
    reset[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return reset


def layer_plan(cfg: ModelConfig, i: int) -> tuple[str, bool, bool]:
    """What layer i is: (attention kind 'kda' | 'mla', MoE FFN (else dense MLP), opens an attention-residual
    block). Layers with the same plan run the same code on same-shaped parameters."""
    block = cfg.attn_res_block_size
    return cfg.layer_types[i], cfg.is_moe_layer(i), block is not None and i % block == 0


def layer_step(p: dict, h: Tensor, R: list[Tensor] | Tensor, plan: tuple[str, bool, bool], cfg: ModelConfig,
               backend: Backend, *, ranges: KeyRanges, reset: Tensor | None, cache: dict | None = None,
               step: Step | None = None, cp: Shard | None = None) -> tuple[Tensor, list[Tensor] | Tensor]:
    """Decoder layer with plan `layer_plan(cfg, i)`. h [B, T, D] is the layer input (the current block's partial
    sum), R the closed attention-residual entries; returns (h', R'). The plan, not the index, selects the code, so
    one compiled graph serves every layer with the same plan (`compile_layers`). R is a list, or (in
    `compile_layers`) one stacked [n, B, T, D] tensor; it is returned in the same form. cache: this layer's cache
    dict (kimi/cache.py), step: where the new tokens sit. ranges: the gated-MLA queries' candidate keys
    (kimi/ranges.py). cp: this rank's part of the batch under context parallelism (kimi/cp.py)."""
    kind, is_moe, opens_block = plan
    eps = cfg.rms_norm_eps

    def attn(a_in):
        a = rms_norm(a_in, p["input_layernorm"], eps)
        if kind == "kda":
            return kda.kda_layer(p["self_attn"], a, cfg, backend, reset=reset, cache=cache, step=step, cp=cp)
        return mla.gated_mla(p["self_attn"], a, cfg, backend, ranges=ranges, cache=cache, step=step, cp=cp)

    def ffn(m_in):
        m = rms_norm(m_in, p["post_attention_layernorm"], eps)
        if is_moe:
            return moe.latent_moe(p["block_sparse_moe"], m, cfg, backend)
        return moe.mlp(p["mlp"], m, cfg)

    if cfg.attn_res_block_size is None:
        h = h + attn(h)
        return h + ffn(h), R
    P = h
    a_in = attn_res_mix(P, R, p["self_attention_res_norm"], p["self_attention_res_proj"], eps) if len(R) else P
    if opens_block:                            # close the block: its sum becomes a frozen entry
        R, P = (torch.cat([R, P[None]]) if isinstance(R, Tensor) else [*R, P]), None
    a_out = attn(a_in)
    P = a_out if P is None else P + a_out
    m_in = attn_res_mix(P, R, p["mlp_res_norm"], p["mlp_res_proj"], eps)
    return P + ffn(m_in), R


def forward(params: dict, input_ids: Tensor, config: ModelConfig, backend: Backend | None = None, *,
            document_ids: Tensor | None = None, max_document_len: int | None = None, cache: dict | None = None,
            head: bool = True, layer: Callable | None = None,
            cp: ContextParallel | None = None) -> Tensor | tuple[Tensor, dict]:
    """Logits [B, T, V] (in the parameters' dtype) for input_ids [B, T] (int).

    Args:
        params: the tree from `init_params` / `load_checkpoint`.
        backend: implementations to run (default `Backend()`).
        document_ids: [B, T] int; packed documents are runs of equal ids, negative ids are padding.
            Default: one document per row. Not accepted with a cache.
        max_document_len: a bound on the documents' lengths the caller knows on the host (the data pipeline
            does). At most `config.index_topk` tells the gated-MLA layers that the indexer would select every
            candidate: they skip it and attend densely over the documents (exactly the same result, and no
            T×T mask on the 'gather' path); with an indexer only that comparison matters. Without one it bounds
            the key window of each query block. Not checked against document_ids (that would read the device):
            a wrong bound gives wrong attention.
        cache: a decode cache from `kimi.init_cache` (kimi/cache.py). The T tokens are then the next T of every
            row: they are written at slots [pos, pos + T) and attend to everything cached before them. The
            first call is the prefill (it may be split over several calls), T = 1 calls are decode steps.
            The buffers are updated in place and pos advances by T; returns (logits, cache). Inference only:
            runs under no_grad.
        head: False returns the final norm's output [B, T, D] instead of the logits (no cache), for a loss that
            applies the head itself (`kimi.loss.token_loss_sum` never holds the [B, T, V] logits).
        layer: runs one decoder layer, `layer(p, h, R, plan, cfg, backend, ranges=, reset=, cache=, step=) -> (h, R)`
            with the signature of `layer_step` (the default). `p` is `params["model"]["layers"][i]` as given, never
            looked into here: a wrapper may put its own objects there (the FSDP units of `kimi.fsdp` do). Under
            context parallelism it is also given `cp=` (a `kimi.cp.Shard`).
        cp: context parallelism (`kimi.cp.ContextParallel`): input_ids and document_ids are this rank's tokens of
            each row in the context's layout (`cp.shard` of the whole rows; every rank the same shape), and so are
            the logits. Every rank of the group must make the same call. `max_document_len` bounds the whole rows'
            documents. Not with a cache (docs/context_parallel.md).
    """
    layer = layer or layer_step
    if cache is not None:
        if cp is not None:
            raise CPError("context parallelism runs whole sequences without a cache; decode without cp=")
        with torch.no_grad():
            return _forward(params, input_ids, config, backend, document_ids=document_ids,
                            max_document_len=max_document_len, cache=cache, layer=layer)
    return _forward(params, input_ids, config, backend, document_ids=document_ids,
                    max_document_len=max_document_len, cache=None, head=head, layer=layer, cp=cp)


def recomputed(layer: Callable = layer_step) -> Callable:
    """`layer` (a `forward(layer=)` callable) with activation checkpointing: its activations are freed after the
    forward and recomputed from the layer's inputs in the backward (`torch.utils.checkpoint`, non-reentrant), so a
    training step holds one layer's activations at a time instead of every layer's
    (docs/performance.md#activation-checkpointing). Selective: the outputs of the ops in `RECOMPUTE_KEEPS` (the
    indexer's selection, the router's top-k) are saved, not recomputed, so the recomputed layer attends to the same
    keys and routes to the same experts as the forward did, whatever the rounding of a recompiled recompute. Works
    eagerly, inside `torch.compile` (the region becomes a checkpoint node the partitioner recomputes) and inside
    FSDP2 units."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in RECOMPUTE_KEEPS else CheckpointPolicy.PREFER_RECOMPUTE

    context = functools.partial(create_selective_checkpoint_contexts, policy)

    def run(p, h, R, plan, cfg, backend, **kwargs):
        return checkpoint(layer, p, h, R, plan, cfg, backend, use_reentrant=False, context_fn=context, **kwargs)
    return run


RECOMPUTE_KEEPS = frozenset({torch.ops.kimi.indexer_topk.default, torch.ops.kimi.indexer_topk_triton.default,
                             torch.ops.kimi.indexer_topk_cudnn.default, torch.ops.aten.topk.default})
"""Ops whose outputs `recomputed` saves: selections (a hard top-k recomputed from slightly different rounding could
pick other keys or experts than the forward did)."""


def compile_layers(*, layer: Callable = layer_step, **compile_kwargs) -> Callable[..., Tensor | tuple[Tensor, dict]]:
    """`forward` with its decoder layers run through one `torch.compile`d `layer_step` (regional compilation).

    Layers with the same `layer_plan` share one compiled graph, so compile time grows with the number of distinct
    layer kinds, not with depth. The closed attention-residual entries travel as one stacked [n, B, T, D] tensor
    whose count is marked dynamic from 2 on (0 and 1 are always specialized), so each plan has at most three graphs:
    the release's 93 layers compile 7 graphs, not one graph 93 layers long (docs/compile.md#regional; why not
    `torch.compiler.nested_compile_region`: docs/compile.md#nested-regions). Embedding, the output mix and the head
    run eagerly; the layer loop is Python.
    `layer`: what is compiled (`layer_step`, or `recomputed()` for activation checkpointing); `compile_kwargs` go
    to `torch.compile` (e.g. `dynamic=True`, `backend=...`). Same signature as `forward`.
    Raises Dynamo's per-function recompile limit so that every distinct layer gets its graph."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit,
                                                           1024)
    compiled = torch.compile(layer, **compile_options(**compile_kwargs))

    def layer(p, h, R, *args, **kwargs):
        if R.shape[0] >= 2:
            torch._dynamo.mark_dynamic(R, 0)
        return compiled(p, h, R, *args, **kwargs)

    def regional_forward(params: dict, input_ids: Tensor, config: ModelConfig, backend: Backend | None = None, *,
                         document_ids: Tensor | None = None, max_document_len: int | None = None,
                         cache: dict | None = None, head: bool = True, cp: ContextParallel | None = None):
        if cache is not None and cp is not None:
            raise CPError("context parallelism runs whole sequences without a cache; decode without cp=")
        with torch.no_grad() if cache is not None else contextlib.nullcontext():
            return _forward(params, input_ids, config, backend, document_ids=document_ids,
                            max_document_len=max_document_len, cache=cache, layer=layer, stacked=True,
                            head=head or cache is not None, cp=cp)

    regional_forward.__doc__ = "`kimi.forward` (without `layer=`) with its decoder layers compiled per plan."
    return regional_forward


def head_weight(params: dict, config: ModelConfig) -> Tensor:
    """The output head's weight [V, D]: `lm_head`, or the embedding when the config ties them."""
    return params["model"]["embed_tokens"]["weight"] if config.tie_word_embeddings else params["lm_head"]["weight"]


def compile_options(**compile_kwargs) -> dict:
    """`torch.compile` keyword arguments with the Inductor workarounds this model needs on the installed torch
    (`compile_layers` applies them; pass `torch.compile(fn, **kimi.compile_options(fullgraph=True))` elsewhere).

    Before torch 2.13 Inductor's mix-order reduction miscompiles an RMSNorm backward over a dynamic row count, so it
    is switched off there (docs/compile.md#inductor-workarounds); `mode=` is folded into the same options
    (torch.compile takes one or the other)."""
    if (compile_kwargs.get("backend", "inductor") != "inductor" or _torch_version() >= (2, 13)
            or not hasattr(torch._inductor.config.triton, "mix_order_reduction")):
        return compile_kwargs
    kwargs = dict(compile_kwargs)
    options = dict(kwargs.pop("options", None) or {})
    mode = kwargs.pop("mode", None)
    if mode not in (None, "default"):
        options = {**torch._inductor.list_mode_options(mode), **options}
    options.setdefault("triton.mix_order_reduction", False)
    return {**kwargs, "options": options}


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _forward(params, input_ids, config, backend, *, document_ids, cache, max_document_len=None, layer=layer_step,
             stacked=False, head=True, cp=None):
    backend = backend or DEFAULT_BACKEND
    cfg = config
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an int32/int64 tensor [B, T], got {input_ids.dtype} "
                         f"{list(input_ids.shape)}")
    if max_document_len is not None:
        if not isinstance(max_document_len, int) or isinstance(max_document_len, bool) or max_document_len <= 0:
            raise ValueError(f"max_document_len must be a positive integer, got {max_document_len!r}")
        if cache is not None:
            raise CacheError("max_document_len bounds packed documents, which a cache does not take")
        row = input_ids.shape[1] * (1 if cp is None else cp.size)
        if document_ids is None and max_document_len < row:
            raise ValueError(f"max_document_len={max_document_len}, but without document_ids each row is one "
                             f"document of {row} tokens")
    step = None
    if cache is not None:
        if document_ids is not None:
            raise CacheError("document_ids (packed documents) cannot be combined with a cache; for prompts of "
                             "unequal length left-pad them and pass the row starts to init_cache/reset_cache")
        check_cache(cache, cfg, input_ids, params["model"]["embed_tokens"]["weight"].dtype)
        step = step_positions(cache, input_ids.shape[1], cfg)
    if document_ids is None:
        document_ids = torch.zeros_like(input_ids)
    elif document_ids.shape != input_ids.shape or document_ids.dtype.is_floating_point:
        raise ValueError(f"document_ids must be an integer tensor shaped like input_ids {list(input_ids.shape)}, "
                         f"got {document_ids.dtype} {list(document_ids.shape)}")
    if host_checks() and input_ids.numel() and (
            int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}), got "
                         f"[{int(input_ids.min())}, {int(input_ids.max())}]")
    if cache is None:
        span = max_document_len
        if cfg.has_indexer and span is not None:
            # With an indexer only "every document fits in index_topk" matters: other bounds map to T, one graph.
            span = cfg.index_topk if span <= cfg.index_topk else None
        if cp is None:
            ranges = document_ranges(document_ids, span)
            reset = document_resets(document_ids)
        else:   # the whole rows' documents, then this rank's view of them
            cp.check_length(input_ids.shape[1] * cp.size)
            whole = cp.gather(document_ids)
            shard = cp.batch(document_ranges(whole, span), document_resets(whole))
            ranges, reset = shard.ranges, shard.reset
    else:
        ranges, reset = step.ranges, None
    extra = {} if cp is None else {"cp": shard}
    m = params["model"]
    h = torch.nn.functional.embedding(input_ids, m["embed_tokens"]["weight"])
    R: list[Tensor] | Tensor = h.new_empty(0, *h.shape) if stacked else []
    for i, p in enumerate(m["layers"]):
        h, R = layer(p, h, R, layer_plan(cfg, i), cfg, backend, ranges=ranges, reset=reset,
                     cache=None if cache is None else cache["layers"][i], step=step, **extra)
    if cfg.attn_res_block_size is not None:
        h = attn_res_mix(h, R, m["output_attn_res_norm"], m["output_attn_res_proj"], cfg.rms_norm_eps)
    h = rms_norm(h, m["norm"], cfg.rms_norm_eps)
    if not head:
        return h
    logits = torch.nn.functional.linear(h, head_weight(params, cfg))
    if cache is None:
        return logits
    cache["pos"].add_(input_ids.shape[1])
    return logits, cache
