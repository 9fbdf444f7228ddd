"""Triton kernel of the routed experts' matmuls for a few tokens (decode), beside its reference.

Rows arrive sorted by expert (`offs` the cumulative row counts, as for `F.grouped_mm`). The grid runs over row
slots x blocks of BLOCK_M outputs, not over experts: the program at the first row of an expert's group streams
that block of the expert's weight once per 16 rows of the group (once at decode sizes) and writes all of them; the
programs at the other rows do nothing. So the launch scales with the rows (16 at batch 1), not with the experts
(896 in the release, most unchosen): decode is weight-bandwidth bound, and each chosen expert is read once.
Registered as `kimi::moe_gemv` in `experts.py`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import interpreted, tl, triton, triton_available

def moe_gemv_reference(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """y[r] = w[e] @ x[r] for the rows r of expert e (rows offs[e-1]:offs[e]). x [N, K], w [E, M, K], offs [E]
    int32 cumulative -> y [N, M] in x's dtype (fp32 accumulation)."""
    y = x.new_zeros(x.shape[0], w.shape[1])
    bounds = [0, *offs.tolist()]
    for e in range(w.shape[0]):
        a, b = bounds[e], bounds[e + 1]
        if b > a:
            y[a:b] = (x[a:b].float() @ w[e].float().t()).to(x.dtype)
    return y


if triton is not None:
    @triton.jit
    def _moe_gemv_kernel(x_ptr, w_ptr, offs_ptr, eid_ptr, y_ptr, M, K, stride_xn, stride_we, stride_wm,
                         stride_wk, stride_yn, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr, UPCAST: tl.constexpr):
        i = tl.program_id(0)                    # a row slot; only the first row of each expert's group works
        mt = tl.program_id(1)
        e = tl.load(eid_ptr + i)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        end = tl.where(i == start, tl.load(offs_ptr + e), start)
        m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        w_base = w_ptr + e.to(tl.int64) * stride_we + m[:, None] * stride_wm
        for r0 in range(start, end, ROWS):      # no iteration unless this slot starts its group
            r = r0 + tl.arange(0, ROWS)
            acc = tl.zeros((ROWS, BLOCK_M), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                w = tl.load(w_base + k[None, :] * stride_wk, mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
                xv = tl.load(x_ptr + r[:, None] * stride_xn + k[None, :], mask=(r[:, None] < end) & (k[None, :] < K),
                             other=0.0)
                if UPCAST:   # the interpreter's 16-bit dot is wrong (triton 3.9); fp32 is exact there
                    acc += tl.dot(xv.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
                elif IEEE:
                    acc += tl.dot(xv, tl.trans(w), input_precision="ieee")
                else:
                    acc += tl.dot(xv, tl.trans(w))
            tl.store(y_ptr + r[:, None] * stride_yn + m[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=(r[:, None] < end) & (m[None, :] < M))


if triton is not None:
    # Block shapes for the GPU, tuned on the first call per (M, K) (decode warm-up, outside any CUDA-graph capture;
    # every config writes y only, so the tuning reruns are harmless).
    _moe_gemv_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=nw, num_stages=ns)
                 for bm, bk, nw, ns in [(32, 128, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4), (64, 128, 8, 4),
                                        (64, 256, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3)]],
        key=["M", "K"])(_moe_gemv_kernel)


def moe_gemv_triton(x: Tensor, w: Tensor, offs: Tensor, *, block_m: int | None = None,
                    block_k: int | None = None) -> Tensor:
    """The Triton kernel of `moe_gemv_reference` (same contract; w may be any strided view). Block shapes are
    autotuned on a GPU unless given (the interpreter uses 64 x 128 by default)."""
    if not triton_available(x.device):
        raise RuntimeError("moe_gemv_triton needs Triton and a CUDA tensor (or TRITON_INTERPRET=1); "
                           "Backend(moe='grouped') runs anywhere")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        raise ValueError(f"moe_gemv_triton: x and w must share a float32/bfloat16/float16 dtype, got {x.dtype}, "
                         f"{w.dtype}")
    x = x.contiguous()
    N, K = x.shape
    M = w.shape[1]
    y = x.new_empty(N, M)
    if N == 0:
        return y
    # the expert of each sorted row: the number of group ends at or before it (static shapes, no host sync)
    eid = torch.searchsorted(offs, torch.arange(N, device=x.device, dtype=offs.dtype), right=True, out_int32=True)
    args = (x, w, offs, eid, y, M, K, x.stride(0), w.stride(0), w.stride(1), w.stride(2), y.stride(0))
    flags = dict(ROWS=16, IEEE=x.dtype == torch.float32, UPCAST=interpreted() and x.dtype != torch.float32)
    if block_m is None and block_k is None and not interpreted():
        _moe_gemv_tuned[lambda meta: (N, triton.cdiv(M, meta["BLOCK_M"]))](*args, **flags)
    else:
        block_m, block_k = block_m or 64, block_k or 128
        _moe_gemv_kernel[(N, triton.cdiv(M, block_m))](*args, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4,
                                                       num_stages=4, **flags)
    return y


