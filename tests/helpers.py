"""Shared test helpers."""

import dataclasses

import torch

import kimi


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ computed in float64."""
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def tiny(**changes) -> kimi.ModelConfig:
    return dataclasses.replace(kimi.preset("tiny"), **changes)


def without_indexer(cfg: kimi.ModelConfig) -> kimi.ModelConfig:
    return dataclasses.replace(cfg, index_n_heads=None, index_head_dim=None, index_topk=None)


def drop_indexer(params):
    """The same tree without the indexer subtrees (a K3-style tree)."""
    layers = []
    for layer in params["model"]["layers"]:
        attn = {k: v for k, v in layer["self_attn"].items() if k != "indexer"}
        layers.append({**layer, "self_attn": attn})
    return {**params, "model": {**params["model"], "layers": layers}}
