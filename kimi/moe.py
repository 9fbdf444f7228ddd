"""FFN: the dense MLP and the Stable LatentMoE (docs/architecture.md#latent-moe).

SiTU-GLU (fp32):  a = β·tanh(g/β)·sigmoid(g),  u' = β_lin·tanh(u/β_lin),  out = a·u'   (β = 4, β_lin = 25)
Router (fp32):    s = sigmoid(x Wᵀ); choose top-k of s + bias (bias for choice only); weights = s at the chosen
                  experts, renormalized, times routed_scaling_factor.
LatentMoE:        z = down(x) [T, Z];  y_e = W2_e SiTU(W1_e z, W3_e z) per chosen expert (rounded to the
                  activation dtype);  r = cast(Σ_j fp32(y_ej)·w_j)  (weights after the down projection, one
                  rounding of the sum);  out = up(RMSNorm(r)) + shared_experts(x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops
from .common import compute_dtype, linear, rms_norm, situ_glu


def mlp(p: dict, x: Tensor, cfg) -> Tensor:
    """Dense MLP / shared experts: down_proj(SiTU(gate_proj(x), up_proj(x)))."""
    a = situ_glu(linear(x, p["gate_proj"]), linear(x, p["up_proj"]), cfg.activation_situ_beta,
                 cfg.activation_situ_linear_beta)
    return linear(a, p["down_proj"])


def route(p: dict, x: Tensor, cfg) -> tuple[Tensor, Tensor]:
    """Router (docs/numerics.md#router). x [N, D] -> (expert ids [N, k] int64, weights [N, k] fp32).
    Scores and weights are in fp32 (fp64 for an fp64 model)."""
    ct = compute_dtype(x.dtype)
    logits = F.linear(x.to(ct), p["weight"].to(ct))                              # [N, E]
    s = torch.sigmoid(logits) if cfg.moe_router_activation_func == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = s + p["e_score_correction_bias"].to(ct)                           # bias only decides the choice
    G = cfg.num_expert_group
    if G > 1 and G > cfg.topk_group:
        N, E = choice.shape
        grouped = choice.view(N, G, E // G)
        group_score = grouped.topk(min(2, E // G), dim=-1).values.sum(-1)      # [N, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, E)
    idx = choice.topk(cfg.num_experts_per_token, dim=-1).indices
    w = s.gather(1, idx)
    if cfg.num_experts_per_token > 1 and cfg.moe_renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * cfg.routed_scaling_factor


def latent_moe(p: dict, x: Tensor, cfg, backend) -> Tensor:
    """Stable LatentMoE. x [B, T, D] (post_attention_layernorm output) -> [B, T, D]."""
    B, T, D = x.shape
    xf = x.reshape(B * T, D)
    idx, w = route(p["gate"], xf, cfg)
    z = linear(xf, p["routed_expert_down_proj"])                                 # [N, Z]
    r = ops.moe_experts(z, idx, w, p["experts"], beta=cfg.activation_situ_beta,
                        beta_lin=cfg.activation_situ_linear_beta, backend=backend)
    if cfg.latent_moe_use_norm:
        r = rms_norm(r, p["routed_expert_norm"], cfg.rms_norm_eps)
    out = linear(r, p["routed_expert_up_proj"]) + mlp(p["shared_experts"], xf, cfg)
    return out.view(B, T, D)
