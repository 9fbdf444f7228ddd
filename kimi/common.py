"""Small shared pieces: the compute-dtype rule, linear, RMSNorm, LayerNorm.

"fp32" in the specs means "at least fp32": `upcast` keeps float64 inputs in float64, so the whole model can run
as a float64 reference (MODEL.md §2 numerics otherwise unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def compile_region(fn):
    """Where a layer function would be marked `torch.compiler.nested_compile_region` (compiled once, stamped
    out for every layer; COMPILE.md B.5). Not applied: on torch 2.11 with CUDA, Inductor plus nested regions gave
    wrong gradients for the reused KDA/MLA layers (relative error ~0.9 against eager; forward correct; aot_eager
    with regions and Inductor without regions both exact; tests/bench/gpu_grad_check.py reproduces it).
    Correct gradients are worth the longer compile."""
    return fn


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
    """Kimi's RMSNorm (MODEL.md §2): normalize in fp32, cast back to x's dtype, then multiply by the weight.
    The weight multiplies after the cast, so a bf16 weight on bf16 x gives a bf16 product."""
    xf = upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return p["weight"] * y.to(x.dtype)


def layer_norm(x: Tensor, p: dict, eps: float) -> Tensor:
    """LayerNorm with weight and bias computed in fp32 and cast back (the indexer's k_norm, DSA.md §3.1)."""
    xf = upcast(x)
    y = F.layer_norm(xf, xf.shape[-1:], upcast(p["weight"]), upcast(p["bias"]), eps)
    return y.to(x.dtype)
