"""LoRA as pure functions over the parameter tree (Hu et al. 2021; no dropout, no DoRA).

An adapter on a weight W [out, in] is a pair A [r, in], B [out, r] with the effective weight

    W' = W + (alpha / r) · B @ A

Adapters live in their own flat dict keyed by the weight's dotted path
(`"model.layers.3.self_attn.kv_b_proj.weight" -> {"A": ..., "B": ...}`). `apply` returns a new tree with the
effective weights in place, so every consumer of a weight sees the adapted one: in particular `kv_b_proj`
enters both the expanded and the absorbed MLA form through the same effective weight. Stacked
routed experts [E, m, Z] get one adapter per expert (A [E, r, Z], B [E, m, r]).

B starts at zero, so a fresh adapter leaves the model unchanged. The indexer is never a target (it is frozen,
docs/numerics.md#indexer-scores); `e_score_correction_bias` is not a weight and is never a target either.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .params import Tree, tree_items, tree_map

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "q_a_proj", "q_b_proj",
                     "kv_a_proj_with_mqa", "kv_b_proj")
"""The default targets: every projection of KDA and gated MLA that reads or writes the residual stream
(the small KDA gate projections f_a/f_b/b_proj can be added by name)."""
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
"""Dense MLP (layer 0) and shared experts."""
EXPERT_TARGETS = ("experts",)
"""Routed experts: w1, w2, w3 of every expert."""


class LoRAError(ValueError):
    pass


def target_paths(params: Tree, targets: tuple[str, ...]) -> list[str]:
    """Dotted paths of the weights named by `targets` (module names such as 'kv_b_proj', or 'experts').

    Matching is on the module name right above the weight (`...self_attn.kv_b_proj.weight`), or on
    `experts.w1|w2|w3`. Indexer weights never match."""
    if not targets:
        raise LoRAError("LoRA needs at least one target module")
    found, names = [], set()
    for path, leaf in tree_items(params):
        parts = path.split(".")
        if ".indexer." in path or leaf.dim() < 2:
            continue
        if parts[-1] == "weight" and len(parts) >= 2 and parts[-2] in targets:
            found.append(path)
            names.add(parts[-2])
        elif parts[-2:-1] == ["experts"] and "experts" in targets:
            found.append(path)
            names.add("experts")
    if unknown := sorted(set(targets) - names):
        raise LoRAError(f"LoRA targets {unknown} match no weight in this model (the indexer is never a target)")
    return found


def init_adapters(params: Tree, targets: tuple[str, ...], rank: int, *, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> dict[str, dict[str, nn.Parameter]]:
    """Fresh adapters for every target weight: A ~ U(±1/sqrt(in)) (nn.Linear's default), B = 0.
    Returned on the weights' device, in `dtype` (fp32: the adapters are the trained master weights)."""
    if rank <= 0:
        raise LoRAError(f"LoRA rank must be positive, got {rank}")
    flat = dict(tree_items(params))
    gen = torch.Generator().manual_seed(seed)
    adapters = {}
    for path in target_paths(params, targets):
        W = flat[path]
        *lead, out, inp = W.shape
        bound = 1.0 / math.sqrt(inp)
        A = torch.empty(*lead, rank, inp).uniform_(-bound, bound, generator=gen)
        B = torch.zeros(*lead, out, rank)
        adapters[path] = {"A": nn.Parameter(A.to(W.device, dtype)), "B": nn.Parameter(B.to(W.device, dtype))}
    return adapters


def delta(adapter: dict[str, Tensor], scale: float) -> Tensor:
    """scale · B @ A: [out, in] (or [E, out, in] for stacked experts)."""
    return scale * torch.matmul(adapter["B"], adapter["A"])


def apply(params: Tree, adapters: dict[str, dict[str, Tensor]], scale: float) -> Tree:
    """A new tree whose target weights are W + scale · B @ A (in W's dtype); other leaves are the same objects.
    Differentiable in the adapters; the base weights are used as they are (frozen by the caller)."""
    def leaf(path, W):
        if path not in adapters:
            return W
        return W + delta(adapters[path], scale).to(W.dtype)
    return tree_map(leaf, params)


@torch.no_grad()
def merge(params: Tree, adapters: dict[str, dict[str, Tensor]], scale: float) -> Tree:
    """The adapted tree with plain merged weights (for export): W + scale · B @ A, computed in fp32 and
    rounded once to W's dtype."""
    def leaf(path, W):
        if path not in adapters:
            return W.detach()
        return (W.float() + delta({k: v.float() for k, v in adapters[path].items()}, scale)).to(W.dtype)
    return tree_map(leaf, params)


def scale_of(rank: int, alpha: float) -> float:
    """alpha / r, the usual LoRA scaling."""
    return alpha / rank
