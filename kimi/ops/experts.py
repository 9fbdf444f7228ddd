"""The routed experts of the LatentMoE: y = Σ_j w_j · W2_e SiTU(W1_e z, W3_e z) over each token's chosen experts e
(docs/numerics.md#latent-moe-combine), and the grouped matmuls they run on.

Three registered implementations with one signature `(z, idx, weight, w1, w2, w3, *, beta, beta_lin) -> [N, Z]`:

- `moe_experts_dense`: every expert on every token, weighted by a [N, E] matrix that is 0 where an expert was not
  chosen (exact zeros leave the sum unchanged). Any dtype; E/k times the routed work. The reference.
- `moe_experts_grouped`: tokens sorted by expert, each projection one `kimi::grouped_mm` (torch's grouped GEMM).
- `moe_experts_gemv`: the same with `kimi::moe_gemv`, a Triton kernel that reads each chosen expert's weights
  once for a few rows (decoding; `experts_triton.py`).

Both sorted forms have static shapes: no host sync and no data-dependent sizes.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common import compute_dtype, situ_glu
from . import experts_triton
from .registry import traceable

# ---------------------------------------------------------------------------------------------- opaque: grouped_mm


@torch.library.custom_op("kimi::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Row-grouped matmul: rows offs[e-1]:offs[e] of x [N, Kd] times w[e] [Kd, M] -> [N, M]. Wraps torch's grouped
    GEMM, whose compile-time meta function accepts only bfloat16 although the CPU kernel runs float32 too; this op's
    fake kernel serves every dtype."""
    return F.grouped_mm(x, w, offs=offs).contiguous()


@grouped_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("kimi::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(x: Tensor, dy: Tensor, offs: Tensor) -> Tensor:
    """Per-group xᵀ·dy: [E, Kd, M] from x [N, Kd], dy [N, M] split by offs (grouped_mm's weight gradient)."""
    return F.grouped_mm(x.t(), dy, offs=offs).contiguous()


@grouped_mm_wgrad.register_fake
def _(x, dy, offs):
    return x.new_empty(offs.shape[0], x.shape[1], dy.shape[1])


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _wgrad_backward(ctx, gw):  # gw [E, Kd, M]: d/dx = dy·gwᵀ, d/ddy = x·gw, per group
    x, dy, offs = ctx.saved_tensors
    gw = gw.contiguous()
    return grouped_mm(dy, gw.transpose(1, 2), offs), grouped_mm(x, gw, offs), None


def _grouped_mm_backward(ctx, dy):   # only the gradients asked for (frozen experts under LoRA: no [E, ...] dw)
    x, w, offs = ctx.saved_tensors
    dy = dy.contiguous()
    dx = grouped_mm(dy, w.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_wgrad(x, dy, offs) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_mm_wgrad.register_autograd(_wgrad_backward, setup_context=_save_inputs)
grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_save_inputs)


# ---------------------------------------------------------------------------------------------- opaque: moe_gemv

@torch.library.custom_op("kimi::moe_gemv", mutates_args=())
def moe_gemv(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Rows offs[e-1]:offs[e] of x [N, K] times w[e]ᵀ (w [E, M, K], any strides) -> [N, M]: `grouped_mm(x,
    w.transpose(1, 2), offs)` for a few rows, as the Triton kernel (a CUDA tensor, or TRITON_INTERPRET=1)."""
    return experts_triton.moe_gemv_triton(x, w, offs)


@moe_gemv.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[1])


def _moe_gemv_backward(ctx, dy):   # y = x wᵀ per group: dx = dy w, dw = dyᵀ x (each only when asked for)
    x, w, offs = ctx.saved_tensors
    dy = dy.contiguous()
    dx = grouped_mm(dy, w.contiguous(), offs) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_wgrad(dy, x, offs) if ctx.needs_input_grad[1] else None
    return dx, dw, None


moe_gemv.register_autograd(_moe_gemv_backward, setup_context=_save_inputs)


# ---------------------------------------------------------------------------------------------- the experts

def moe_experts_dense(z: Tensor, idx: Tensor, weight: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, *, beta: float,
                      beta_lin: float | None) -> Tensor:
    """The reference. z [N, Z], idx [N, k] int64, weight [N, k] fp32, w1/w3 [E, m, Z], w2 [E, Z, m] -> [N, Z] in
    z's dtype."""
    ct = compute_dtype(z.dtype)
    combine = torch.zeros(z.shape[0], w1.shape[0], dtype=ct, device=z.device).scatter(1, idx, weight.to(ct))
    h = torch.einsum("nz,emz->enm", z, w1)
    u = torch.einsum("nz,emz->enm", z, w3)
    y = torch.einsum("enm,ezm->enz", situ_glu(h, u, beta, beta_lin), w2)        # [E, N, Z], activation dtype
    return torch.einsum("enz,ne->nz", y.to(ct), combine).to(z.dtype)


def _sorted_by_expert(z: Tensor, idx: Tensor, weight: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, *, beta: float,
                      beta_lin: float | None, mm: Callable, name: str) -> Tensor:
    """Tokens sorted by expert, each projection one `mm(x [rows, Kd], w [E, Kd, M], offs)` over the groups."""
    if z.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"Backend(moe={name!r}) runs float32/bfloat16, got {z.dtype}; "
                         "use Backend(moe='dense') for float64")
    E, m, Z = w1.shape
    if (m * z.element_size()) % 16 or (Z * z.element_size()) % 16:
        raise ValueError(f"Backend(moe={name!r}): grouped matmuls need moe_intermediate_size ({m}) and "
                         f"routed_expert_hidden_size ({Z}) to be multiples of {16 // z.element_size()} in "
                         f"{z.dtype}; use Backend(moe='dense')")
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


def moe_experts_grouped(z: Tensor, idx: Tensor, weight: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, *,
                        beta: float, beta_lin: float | None) -> Tensor:
    """`moe_experts_dense` by grouped matmuls (float32/bfloat16; expert dims multiples of 16 bytes)."""
    return _sorted_by_expert(z, idx, weight, w1, w2, w3, beta=beta, beta_lin=beta_lin, mm=grouped_mm,
                             name="grouped")


def moe_experts_gemv(z: Tensor, idx: Tensor, weight: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, *, beta: float,
                     beta_lin: float | None) -> Tensor:
    """`moe_experts_grouped` with `kimi::moe_gemv` for the matmuls: one pass over each chosen expert's weights."""
    return _sorted_by_expert(z, idx, weight, w1, w2, w3, beta=beta, beta_lin=beta_lin, name="gemv",
                             mm=lambda x, w_t, offs: moe_gemv(x, w_t.transpose(1, 2), offs))


_SCHEMA = ("(Tensor z, Tensor idx, Tensor weight, Tensor w1, Tensor w2, Tensor w3, *, float beta, float? beta_lin) "
           "-> Tensor")
for _fn in (moe_experts_dense, moe_experts_grouped, moe_experts_gemv):
    traceable(_fn.__name__ + _SCHEMA, _fn)
