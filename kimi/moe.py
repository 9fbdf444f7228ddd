"""FFN: SiTU-GLU, the dense MLP, and the Stable LatentMoE (MODEL.md §6).

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
from .common import compute_dtype, linear, rms_norm, upcast


def situ_glu(gate: Tensor, up: Tensor, beta: float, beta_lin: float | None) -> Tensor:
    """SiTU-GLU (MODEL.md §6.1) in fp32, returned in gate's dtype. Saturates at beta for large gate inputs
    and soft-clamps up to ±beta_lin."""
    g, u = upcast(gate), upcast(up)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if beta_lin is not None:
        u = beta_lin * torch.tanh(u / beta_lin)
    return (a * u).to(gate.dtype)


def mlp(p: dict, x: Tensor, cfg) -> Tensor:
    """Dense MLP / shared experts: down_proj(SiTU(gate_proj(x), up_proj(x)))."""
    a = situ_glu(linear(x, p["gate_proj"]), linear(x, p["up_proj"]), cfg.activation_situ_beta,
                 cfg.activation_situ_linear_beta)
    return linear(a, p["down_proj"])


def route(p: dict, x: Tensor, cfg) -> tuple[Tensor, Tensor]:
    """Router (MODEL.md §6.3). x [N, D] -> (expert ids [N, k] int64, weights [N, k] fp32).
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


def experts_dense(z: Tensor, idx: Tensor, weight: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, *, beta: float,
                  beta_lin: float | None) -> Tensor:
    """Reference: every expert on every token, combined with a [N, E] weight matrix that is 0 where an expert was
    not chosen (adding exact zeros leaves the sum unchanged). Any dtype; cost E/k times the routed work.
    z [N, Z], idx [N, k], weight [N, k] fp32, w1/w3 [E, m, Z], w2 [E, Z, m] -> [N, Z] in z's dtype."""
    ct = compute_dtype(z.dtype)
    combine = torch.zeros(z.shape[0], w1.shape[0], dtype=ct, device=z.device).scatter(1, idx, weight.to(ct))
    h = torch.einsum("nz,emz->enm", z, w1)
    u = torch.einsum("nz,emz->enm", z, w3)
    y = torch.einsum("enm,ezm->enz", situ_glu(h, u, beta, beta_lin), w2)        # [E, N, Z], activation dtype
    return torch.einsum("enz,ne->nz", y.to(ct), combine).to(z.dtype)


def experts_grouped(z: Tensor, idx: Tensor, weight: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, *, beta: float,
                    beta_lin: float | None, mm=None) -> Tensor:
    """Tokens sorted by expert, each group through its expert with one grouped matmul (static shapes: no host
    sync, no data-dependent sizes). float32/bfloat16 only; expert dims must be multiples of 16 bytes.
    `mm(x, w, offs)` is the grouped matmul (default `F.grouped_mm`; the model passes the `kimi::grouped_mm` op)."""
    if z.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"Backend(moe='grouped') runs float32/bfloat16, got {z.dtype}; "
                         "use Backend(moe='dense') for float64")
    E, m, Z = w1.shape
    if (m * z.element_size()) % 16 or (Z * z.element_size()) % 16:
        raise ValueError(f"Backend(moe='grouped'): grouped_mm needs moe_intermediate_size ({m}) and "
                         f"routed_expert_hidden_size ({Z}) to be multiples of {16 // z.element_size()} in {z.dtype}; "
                         "use Backend(moe='dense')")
    mm = mm or (lambda x, w, offs: F.grouped_mm(x, w, offs=offs))
    N, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=z.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    xs = z[order // k]                                                           # [N·k, Z] grouped by expert
    a = situ_glu(mm(xs, w1.transpose(1, 2), offs), mm(xs, w3.transpose(1, 2), offs), beta, beta_lin)
    ys = mm(a, w2.transpose(1, 2), offs)                                         # [N·k, Z]
    y = torch.empty_like(ys).index_copy(0, order, ys).view(N, k, Z)
    ct = compute_dtype(z.dtype)
    return (y.to(ct) * weight.to(ct)[..., None]).sum(1).to(z.dtype)



def latent_moe(p: dict, x: Tensor, cfg, backend) -> Tensor:
    """Stable LatentMoE (MODEL.md §6.4). x [B, T, D] (post_attention_layernorm output) -> [B, T, D]."""
    B, T, D = x.shape
    xf = x.reshape(B * T, D)
    idx, w = route(p["gate"], xf, cfg)
    z = linear(xf, p["routed_expert_down_proj"])                                 # [N, Z]
    r = ops.moe_experts(z, idx, w, p["experts"], cfg=cfg, backend=backend)
    if cfg.latent_moe_use_norm:
        r = rms_norm(r, p["routed_expert_norm"], cfg.rms_norm_eps)
    out = linear(r, p["routed_expert_up_proj"]) + mlp(p["shared_experts"], xf, cfg)
    return out.view(B, T, D)
