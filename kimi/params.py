"""The parameter tree: one spec tree from which shapes, dtypes, init, checkpoint names and counts all derive.

Tree paths are the checkpoint names without the `language_model.` prefix:
`params["model"]["layers"][3]["self_attn"]["kv_b_proj"]["weight"]` is `model.layers.3.self_attn.kv_b_proj.weight`.
Two documented layout differences from the files (docs/checkpoints.md#stacked-experts, #a-log), both handled in
`checkpoint.py`:
- routed experts are stacked per layer: `block_sparse_moe.experts.w1` is [E, m, Z] (w3 likewise, w2 [E, Z, m]);
  the files hold `experts.{e}.w1.weight` (or its MXFP4 pair) per expert;
- `A_log` holds the `num_heads` entries used; the files pad it to a multiple of 128.

Leaves are `nn.Parameter` (CUDA graphs treat parameters as static inputs). The indexer and the router's
`e_score_correction_bias` have `requires_grad=False`: the indexer is frozen, the bias is a buffer that is never
trained (docs/numerics.md#init).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .config import DTYPES, ModelConfig

Tree = Any  # nested dicts and lists with tensor (or Spec) leaves


@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    init: str = "normal"
    """normal (N(0, initializer_range)), ones, zeros, a_log (log U(1,16)), conv (U(±1/sqrt(W))),
    lm_head (truncated normal, std D^-1/2, cut at 3 std), embed (normal with the pad row zeroed)."""
    fp32: bool = False
    """Kept in fp32 whatever the model dtype (docs/numerics.md#precision): A_log, dt_bias, conv weights, o_norm,
    e_score_correction_bias."""
    trainable: bool = True


def _linear(out: int, inp: int, **kw) -> dict:
    return {"weight": Spec((out, inp), **kw)}


def _norm(n: int) -> dict:
    return {"weight": Spec((n,), "ones")}


def _kda_specs(cfg: ModelConfig) -> dict:
    la, D = cfg.linear_attn_config, cfg.hidden_size
    H, K, W = la.num_heads, la.head_dim, la.short_conv_kernel_size
    P = H * K
    p = {
        "q_proj": _linear(P, D), "k_proj": _linear(P, D), "v_proj": _linear(P, D),
        "q_conv1d": {"weight": Spec((P, 1, W), "conv", fp32=True)},
        "k_conv1d": {"weight": Spec((P, 1, W), "conv", fp32=True)},
        "v_conv1d": {"weight": Spec((P, 1, W), "conv", fp32=True)},
        "f_a_proj": _linear(K, D), "f_b_proj": _linear(P, K),
        "b_proj": _linear(H, D),
        "A_log": Spec((H,), "a_log", fp32=True),
        "dt_bias": Spec((P,), "zeros", fp32=True),
        "o_norm": {"weight": Spec((K,), "ones", fp32=True)},
        "o_proj": _linear(D, P),
    }
    if la.use_full_rank_gate:
        p["g_proj"] = _linear(P, D)
    else:
        p["g_a_proj"], p["g_b_proj"] = _linear(K, D), _linear(P, K)
    return p


def _mla_specs(cfg: ModelConfig) -> dict:
    D, H = cfg.hidden_size, cfg.num_attention_heads
    p: dict = {}
    if cfg.q_lora_rank is None:
        p["q_proj"] = _linear(H * cfg.qk_head_dim, D)
    else:
        p["q_a_proj"] = _linear(cfg.q_lora_rank, D)
        p["q_a_layernorm"] = _norm(cfg.q_lora_rank)
        p["q_b_proj"] = _linear(H * cfg.qk_head_dim, cfg.q_lora_rank)
    p["kv_a_proj_with_mqa"] = _linear(cfg.kv_lora_rank + cfg.qk_rope_head_dim, D)
    p["kv_a_layernorm"] = _norm(cfg.kv_lora_rank)
    p["kv_b_proj"] = _linear(H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    if cfg.mla_use_output_gate:
        p["g_proj"] = _linear(H * cfg.v_head_dim, D)
    p["o_proj"] = _linear(D, H * cfg.v_head_dim)
    if cfg.has_indexer:
        n, d = cfg.index_n_heads, cfg.index_head_dim
        frozen = dict(trainable=False)
        p["indexer"] = {
            "wq_b": _linear(n * d, cfg.q_lora_rank, **frozen),
            "wk": _linear(d, D, **frozen),
            "k_norm": {"weight": Spec((d,), "ones", trainable=False), "bias": Spec((d,), "zeros", trainable=False)},
            "weights_proj": _linear(n, D, **frozen),
        }
    return p


def _mlp_specs(D: int, inter: int) -> dict:
    return {"gate_proj": _linear(inter, D), "up_proj": _linear(inter, D), "down_proj": _linear(D, inter)}


def _moe_specs(cfg: ModelConfig) -> dict:
    D, E, m, Z = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    p = {
        "gate": {"weight": Spec((E, D)), "e_score_correction_bias": Spec((E,), "zeros", fp32=True, trainable=False)},
        "routed_expert_down_proj": _linear(Z, D),
        "routed_expert_up_proj": _linear(D, Z),
        "experts": {"w1": Spec((E, m, Z)), "w3": Spec((E, m, Z)), "w2": Spec((E, Z, m))},
        "shared_experts": _mlp_specs(D, m * cfg.num_shared_experts),
    }
    if cfg.latent_moe_use_norm:
        p["routed_expert_norm"] = _norm(Z)
    return p


def param_specs(cfg: ModelConfig) -> Tree:
    """The spec tree: the one place parameter shapes are written down."""
    D = cfg.hidden_size
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        layer = {"input_layernorm": _norm(D), "post_attention_layernorm": _norm(D),
                 "self_attn": _kda_specs(cfg) if kind == "kda" else _mla_specs(cfg)}
        if cfg.attn_res_block_size is not None:
            layer |= {"self_attention_res_norm": _norm(D), "self_attention_res_proj": _linear(1, D),
                      "mlp_res_norm": _norm(D), "mlp_res_proj": _linear(1, D)}
        if cfg.is_moe_layer(i):
            layer["block_sparse_moe"] = _moe_specs(cfg)
        else:
            layer["mlp"] = _mlp_specs(D, cfg.intermediate_size)
        layers.append(layer)
    model = {"embed_tokens": {"weight": Spec((cfg.vocab_size, D), "embed")}, "layers": layers, "norm": _norm(D)}
    if cfg.attn_res_block_size is not None:
        model |= {"output_attn_res_norm": _norm(D), "output_attn_res_proj": _linear(1, D)}
    tree = {"model": model}
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = {"weight": Spec((cfg.vocab_size, D), "lm_head")}
    return tree


# ---------------------------------------------------------------------------------------------- tree helpers

def tree_items(tree: Tree, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, leaf) pairs in a fixed order; list indices become path components."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from tree_items(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from tree_items(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def tree_map(fn: Callable[[str, Any], Any], tree: Tree, prefix: str = "") -> Tree:
    """Apply fn(path, leaf) to every leaf; the structure is kept."""
    if isinstance(tree, dict):
        return {k: tree_map(fn, v, f"{prefix}{k}.") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [tree_map(fn, v, f"{prefix}{i}.") for i, v in enumerate(tree)]
    return fn(prefix[:-1], tree)


def unflatten(flat: dict[str, Any]) -> Tree:
    """The inverse of `tree_items`: {"a.b.0.c": x} -> {"a": {"b": [{"c": x}]}} (integer components become list
    positions)."""
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


def to_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {DTYPES}")
    return getattr(torch, name)


def leaf_dtype(spec: Spec, dtype: torch.dtype) -> torch.dtype:
    """fp32-kept tensors follow float64 models (for float64 references) and stay fp32 otherwise."""
    return torch.promote_types(dtype, torch.float32) if spec.fp32 else dtype


def param_count(cfg: ModelConfig, *, active: bool = False, embedding: bool = True) -> int:
    """Parameters in the tree. `active`: routed experts counted k of E per layer (per-token active count)."""
    total = 0
    for path, spec in tree_items(param_specs(cfg)):
        n = math.prod(spec.shape)
        if active and ".experts." in path:
            n = n // cfg.num_experts * cfg.num_experts_per_token
        if not embedding and path == "model.embed_tokens.weight":
            continue
        total += n
    return total


# ---------------------------------------------------------------------------------------------- init

def _init_leaf(spec: Spec, cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """Draw one leaf in float32 on the generator's device (the CPU by default, so a seed gives the same weights on
    every device and dtype)."""
    shape, std = spec.shape, cfg.initializer_range
    empty = lambda: torch.empty(shape, device=gen.device)
    if spec.init == "ones":
        return torch.ones(shape, device=gen.device)
    if spec.init == "zeros":
        return torch.zeros(shape, device=gen.device)
    if spec.init == "a_log":
        return empty().uniform_(1.0, 16.0, generator=gen).log_()
    if spec.init == "conv":  # nn.Conv1d's default (kaiming-uniform, a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        bound = 1.0 / math.sqrt(math.prod(shape[1:]))
        return empty().uniform_(-bound, bound, generator=gen)
    if spec.init == "lm_head":
        s = shape[-1] ** -0.5
        return nn.init.trunc_normal_(empty(), std=s, a=-3 * s, b=3 * s, generator=gen)
    w = empty().normal_(0.0, std, generator=gen)
    if spec.init == "embed" and cfg.pad_token_id is not None and 0 <= cfg.pad_token_id < shape[0]:
        w[cfg.pad_token_id] = 0
    return w


def init_params(cfg: ModelConfig, seed: int = 0, dtype: str | None = None, device: str | torch.device = "cpu", *,
                draw_on_device: bool = False) -> Tree:
    """A fresh parameter tree with the checkpoint's shapes and dtypes (the reference implementation's init,
    docs/numerics.md#init).

    Args:
        cfg: the model.
        seed: weights are a function of (cfg, seed) only, the same on every device and in every dtype.
        dtype: compute/storage dtype name (default `cfg.dtype`); fp32-kept tensors stay fp32.
        device: 'meta' gives a shape-only tree without drawing numbers (for the full-size presets).
        draw_on_device: draw with a generator on `device` instead of the CPU: much faster for large models on a
            GPU, but the weights then differ from the CPU draw of the same seed (for benchmarks).
    Returns: nested dicts/lists of `nn.Parameter`.
    """
    dt = to_dtype(dtype or cfg.dtype)
    device = torch.device(device)
    gen = torch.Generator(device if draw_on_device and device.type != "meta" else "cpu").manual_seed(seed)

    def make(path: str, spec: Spec) -> nn.Parameter:
        ldt = leaf_dtype(spec, dt)
        if device.type == "meta":
            t = torch.empty(spec.shape, dtype=ldt, device="meta")
        else:
            t = _init_leaf(spec, cfg, gen).to(device=device, dtype=ldt)
        return nn.Parameter(t, requires_grad=spec.trainable)

    return tree_map(make, param_specs(cfg))
