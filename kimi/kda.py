"""Kimi Delta Attention (KDA): the linear-attention mixer of the KDA layers (docs/architecture.md#kda-layer).

    q, k, v = SiLU(short_conv(proj(x)))          causal depthwise convs, restarted at document starts
    g       = gate(f_b(f_a(x)))                  per-channel log-decay ≤ 0
    beta    = sigmoid(b_proj(x))                 write strength
    o       = delta_rule(l2norm(q), l2norm(k), v, g, beta)      the KDA core, `kimi.ops.kda_core`
    y       = o_proj(RMSNorm(o) · weight · sigmoid(g_proj(x)))

Packed documents: `reset [B, T]` (True where a document starts) restarts the convs and the recurrence. The core's
forms (recurrent definition, chunked, Triton) live in `kimi/ops/delta_rule.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cp as context_parallel
from . import ops
from .common import compute_dtype, linear


# ---------------------------------------------------------------------------------------------- gate, conv, norms

def kda_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None) -> Tensor:
    """Log-decay g [B, T, H, K] from the raw gate f [B, T, H, K], in compute_dtype(f.dtype) (docs/numerics.md#kda-gate).

    Bounded (K3, lb < 0):  g = lb · sigmoid(e^{A_log[h]} · (f + dt_bias)) ∈ [lb, 0]
    Unbounded (None):      g = −e^{A_log[h]} · softplus(f + dt_bias)     ≤ 0
    A_log [H] and dt_bias [H*K] are fp32 checkpoint tensors; e^{A_log} sits inside the sigmoid.
    """
    H, K = f.shape[-2:]
    dt = compute_dtype(f.dtype)
    z = f.to(dt) + dt_bias.to(dt).view(H, K)
    a = A_log.to(dt).exp().view(H, 1)
    if lower_bound is None:
        return -a * F.softplus(z)
    return lower_bound * torch.sigmoid(a * z)


def short_conv(x: Tensor, weight: Tensor, reset: Tensor | None = None) -> Tensor:
    """Depthwise causal conv + SiLU (docs/numerics.md#short-conv): x [B, T, C], weight [C, 1, W] -> [B, T, C] in
    x.dtype.

    y[t, c] = silu(Σ_j w[c, 0, j] · x[t − (W−1) + j, c]), x = 0 before t = 0 and before the latest reset ≤ t.
    reset [B, T] bool: True where a document starts.
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    dt = compute_dtype(x.dtype)
    xp = F.pad(x.to(dt), (0, 0, W - 1, 0))  # zeros before t = 0
    w = weight.to(dt).view(C, W)
    if reset is not None:
        # Tap t−s belongs to token t's document iff no reset lies in (t−s, t]; the document index (a running
        # count of resets) is non-decreasing, so that is "same document index". Padded slots get −1: never equal.
        doc = reset.to(torch.int32).cumsum(1)
        docp = F.pad(doc, (W - 1, 0), value=-1)
    y = xp.new_zeros(B, T, C)
    for j in range(W):  # W static taps; no loop over T
        tap = xp[:, j:j + T]
        if reset is not None:
            tap = torch.where((docp[:, j:j + T] == doc)[..., None], tap, 0.0)
        y = y + tap * w[:, j]
    return F.silu(y).to(x.dtype)


L2NORM_EPS = 1e-6


def l2norm(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """x / sqrt(Σ x² + eps) over the last dim (eps inside the sqrt); fp32 math, x.dtype out."""
    xf = x.to(compute_dtype(x.dtype))
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def gated_rms_norm(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """(o / sqrt(mean(o²) + eps)) · weight · sigmoid(gate) over the last dim. o, gate [B, T, H, V],
    weight [V] shared by all heads. fp32 math, o.dtype out. The activation is sigmoid, not SiLU."""
    dt = compute_dtype(o.dtype)
    of = o.to(dt)
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(dt) * torch.sigmoid(gate.to(dt))).to(o.dtype)


# ---------------------------------------------------------------------------------------------- the layer

def short_conv_cached(x: Tensor, weight: Tensor, tail: Tensor, reset: Tensor) -> Tensor:
    """`short_conv` continuing from a cache. x [B, T, C] new raw inputs, tail [B, W-1, C] the
    previous W-1 raw inputs (updated in place to the last W-1 of tail + x), reset [B, W-1+T] bool over that
    window (True at the row's first real token: taps before it read 0)."""
    W = weight.shape[-1]
    window = torch.cat([tail, x], dim=1)
    y = short_conv(window, weight, reset)[:, W - 1:]
    tail.copy_(window[:, window.shape[1] - (W - 1):])
    return y


def kda_layer(p: dict, x: Tensor, cfg, backend, *, reset: Tensor | None = None, cache: dict | None = None,
              step=None, cp: context_parallel.Shard | None = None) -> Tensor:
    """One KDA mixer. x [B, T, D] is the layer's normalized input; -> [B, T, D] in x.dtype. p is the layer's
    `self_attn` subtree (checkpoint names, kimi/params.py). reset [B, T] bool marks document starts: the convs and
    the recurrence restart there.

    With `cache` (this layer's dict from kimi/cache.py) and `step` (`cache.Step`), the convs and the recurrence
    continue from the cached tails and state, restart at each row's start slot, and write the cache in place.

    With `cp` (context parallelism, kimi/cp.py) x holds this rank's tokens: the convs read their halos and the
    recurrence starts each local chunk from the state the ranks before it leave (`kimi.cp.kda_core_cp`)."""
    la = cfg.linear_attn_config
    H, K = la.num_heads, la.head_dim
    T = x.shape[1]
    dt = compute_dtype(x.dtype)
    heads = lambda t: t.unflatten(-1, (H, -1))
    f = heads(linear(linear(x, p["f_a_proj"]), p["f_b_proj"]))
    g = kda_gate(f, p["A_log"], p["dt_bias"], la.gate_lower_bound)
    beta = torch.sigmoid(linear(x, p["b_proj"]).to(dt))               # fp32 before the sigmoid
    if cache is not None and T == 1 and ops.kda_decode_fused(backend, device=x.device, dtype=x.dtype,
                                                             gate_lower_bound=la.gate_lower_bound):
        # decode on kda='triton': convs, norms and the step in one launch, the cache updated in place
        raw = [linear(x, p[f"{name}_proj"])[:, 0] for name in ("q", "k", "v")]
        weights = [p[f"{name}_conv1d"]["weight"] for name in ("q", "k", "v")]
        tails = [cache[f"conv_{name}"] for name in ("q", "k", "v")]
        o = torch.ops.kimi.kda_decode_step(*raw, *weights, *tails, step.conv_reset, g[:, 0], beta[:, 0],
                                           cache["state"], scale=K ** -0.5, eps=L2NORM_EPS)[:, None]
        return _output(p, x, o, cfg, heads)
    # All projections read the layer input x, not the conv outputs.
    if cp is not None:
        return _output(p, x, _kda_cp(p, x, g, beta, cfg, backend, cp, heads), cfg, heads)
    if cache is None:
        conv = lambda name: short_conv(linear(x, p[f"{name}_proj"]), p[f"{name}_conv1d"]["weight"], reset)
    else:
        conv = lambda name: short_conv_cached(linear(x, p[f"{name}_proj"]), p[f"{name}_conv1d"]["weight"],
                                              cache[f"conv_{name}"], step.conv_reset)
    q, k, v = (heads(conv(name)) for name in ("q", "k", "v"))
    q, k = l2norm(q), l2norm(k)
    bound = dict(gate_lower_bound=la.gate_lower_bound)
    if cache is None:
        o, _ = ops.kda_core(q, k, v, g, beta, None, reset, scale=K ** -0.5, backend=backend, **bound)
    elif T == 1:   # decode: one step of the recurrence
        keep = (~step.reset[:, 0]).to(cache["state"].dtype)[:, None, None, None]
        o, S = ops.kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], cache["state"] * keep, scale=K ** -0.5)
        o = o[:, None].to(v.dtype)
        cache["state"].copy_(S)
    else:          # (chunked) prefill: the chunked or recurrent core from the cached state
        o, S = ops.kda_core(q, k, v, g, beta, cache["state"], step.reset, scale=K ** -0.5, backend=backend, **bound)
        cache["state"].copy_(S)
    return _output(p, x, o, cfg, heads)


def _kda_cp(p: dict, x: Tensor, g: Tensor, beta: Tensor, cfg, backend, cp, heads) -> Tensor:
    """The convs and the core of a KDA layer under context parallelism: o [B, T/size, H, V]."""
    la = cfg.linear_attn_config
    W = la.short_conv_kernel_size

    def conv(name):
        window, reset = cp.with_halo(linear(x, p[f"{name}_proj"]), W - 1)
        return cp.unchunked(short_conv(window, p[f"{name}_conv1d"]["weight"], reset)[:, W - 1:])
    q, k, v = (heads(conv(name)) for name in ("q", "k", "v"))
    return context_parallel.kda_core_cp(l2norm(q), l2norm(k), v, g, beta, cp, scale=la.head_dim ** -0.5,
                                        backend=backend, gate_lower_bound=la.gate_lower_bound)


def _output(p: dict, x: Tensor, o: Tensor, cfg, heads) -> Tensor:
    """The gated output norm and o_proj of a KDA layer: o [B, T, H, V] -> [B, T, D]."""
    la = cfg.linear_attn_config
    if la.use_full_rank_gate:
        gate = linear(x, p["g_proj"])
    else:
        gate = linear(linear(x, p["g_a_proj"]), p["g_b_proj"])
    o = gated_rms_norm(o, heads(gate), p["o_norm"]["weight"], cfg.rms_norm_eps)
    return linear(o.flatten(-2), p["o_proj"])
