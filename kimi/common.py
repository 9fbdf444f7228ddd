"""Small shared pieces: the compute-dtype rule, linear, RMSNorm, LayerNorm, SiTU-GLU.

"fp32" means "at least fp32" here: `upcast` keeps float64 inputs in float64, so the whole model can run as a
float64 reference (docs/numerics.md#precision).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def host_checks() -> bool:
    """Whether checks that read a device value on the host may run: not while torch.compile traces (the value is
    symbolic) and not while a CUDA graph is captured (a host sync would break the capture). The caller of a
    compiled or captured step validates its inputs instead."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 tensors, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def upcast(x: Tensor) -> Tensor:
    return x.to(compute_dtype(x.dtype))


def linear(x: Tensor, p: dict) -> Tensor:
    """x @ W.T for a checkpoint linear {"weight": [out, in]} (no linear in the text model has a bias)."""
    return F.linear(x, p["weight"])


def rms_norm(x: Tensor, p: dict, eps: float) -> Tensor:
    """Kimi's RMSNorm (docs/numerics.md#norms): normalize in fp32, cast back to x's dtype, then multiply by the weight.
    The weight multiplies after the cast, so a bf16 weight on bf16 x gives a bf16 product."""
    xf = upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return p["weight"] * y.to(x.dtype)


def layer_norm(x: Tensor, p: dict, eps: float) -> Tensor:
    """LayerNorm with weight and bias computed in fp32 and cast back (the indexer's k_norm)."""
    xf = upcast(x)
    y = F.layer_norm(xf, xf.shape[-1:], upcast(p["weight"]), upcast(p["bias"]), eps)
    return y.to(x.dtype)


def situ_glu(gate: Tensor, up: Tensor, beta: float, beta_lin: float | None) -> Tensor:
    """SiTU-GLU (docs/numerics.md#situ-glu) in fp32, returned in gate's dtype. Saturates at beta for large gate inputs
    and soft-clamps up to ±beta_lin."""
    g, u = upcast(gate), upcast(up)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if beta_lin is not None:
        u = beta_lin * torch.tanh(u / beta_lin)
    return (a * u).to(gate.dtype)
