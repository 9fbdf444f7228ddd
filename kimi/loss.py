"""The training loss: summed fp32 cross-entropy of the head's logits over label tokens, one vocabulary block at a
time, so the [N, V] logits never exist in fp32 (docs/numerics.md#loss)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .common import host_checks
from .model import compile_options

IGNORE = -100
"""Label of a position that is not trained on (padding, prompt tokens, the last token of a document)."""


def _block_stats(z: Tensor, labels: Tensor, v0: int) -> tuple[Tensor, Tensor]:
    """One vocabulary block of logits z [N, W] (words v0 ..): each row's log-sum-exp and its label's logit (0 when
    the label is not in the block; IGNORE = -100 never is), in fp32 (float64 for float64 z)."""
    zf = z.to(torch.promote_types(z.dtype, torch.float32))
    inside = (labels >= v0) & (labels < v0 + z.shape[1])
    col = (labels - v0).clamp(0, z.shape[1] - 1)
    return torch.logsumexp(zf, -1), torch.where(inside, zf.gather(1, col[:, None])[:, 0], 0.0)


def _block_grad(z: Tensor, lse: Tensor, labels: Tensor, v0: int, row_scale: Tensor) -> Tensor:
    """The loss's gradient at one block of logits z [N, W], in z's dtype: (softmax − onehot(label)) · row_scale
    [N, 1] (0 on IGNORE rows), the softmax in fp32 from the whole row's log-sum-exp lse [N]."""
    zf = z.to(lse.dtype)
    onehot = labels[:, None] == v0 + torch.arange(z.shape[1], device=z.device)
    return (((zf - lse[:, None]).exp() - onehot.to(zf.dtype)) * row_scale).to(z.dtype)


@functools.cache
def _loss_kernels(fused: bool):
    """(_block_stats, _block_grad), each one generated kernel per block on a GPU (`fused`): eagerly each is several
    passes over an fp32 copy of the block. Inference graphs (no autograd inside `_HeadCrossEntropy`); block width
    and offset are dynamic, so one graph serves every block."""
    if not fused:
        return _block_stats, _block_grad
    opts = compile_options(fullgraph=True, dynamic=True)
    return torch.compile(_block_stats, **opts), torch.compile(_block_grad, **opts)


class _HeadCrossEntropy(torch.autograd.Function):
    """Σ over label rows of cross-entropy(h Wᵀ, label) in fp32 (float64 for float64 h), one vocabulary block at a
    time, without an fp32 [N, V] tensor.

    The whole logits in fp32 would be several GB at the step's memory peak (every activation alive). The forward
    keeps each row's log-sum-exp and, when `keep`, the compute-dtype logits blocks (half the fp32 size in bf16);
    otherwise the backward recomputes each block (one more head matmul). Per block the softmax statistics and the
    logits' gradient are one fused kernel each on a GPU (`_loss_kernels`). Each block of dW is one GEMM over all
    rows; dh adds the blocks' products in fp32. Logits are rounded to the compute dtype before the fp32 softmax, as
    `F.cross_entropy(F.linear(h, W).float(), ...)` would."""

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, labels: Tensor, block: int, keep: bool) -> Tensor:
        stats, _ = _loss_kernels(h.is_cuda)
        lse, target, kept = [], 0.0, []
        for v0 in range(0, w.shape[0], block):
            z = h @ w[v0:v0 + block].T
            l, t = stats(z, labels, v0)
            lse.append(l)
            target = target + t
            if keep:
                kept.append(z)
        lse = torch.logsumexp(torch.stack(lse), 0)
        ctx.save_for_backward(h, w, labels, lse, *kept)
        ctx.block = block
        return torch.where(labels != IGNORE, lse - target, 0.0).sum()

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, w, labels, lse, *kept = ctx.saved_tensors
        _, block_grad = _loss_kernels(h.is_cuda)
        row_scale = torch.where(labels != IGNORE, grad.to(lse.dtype), 0.0)[:, None]
        dh = torch.zeros(h.shape, dtype=lse.dtype, device=h.device) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(w) if ctx.needs_input_grad[1] else None
        for i, v0 in enumerate(range(0, w.shape[0], ctx.block)):
            wb = w[v0:v0 + ctx.block]
            dz = block_grad(kept[i] if kept else h @ wb.T, lse, labels, v0, row_scale)
            if dw is not None:   # straight into dw's rows: no block-sized temporary and copy
                torch.mm(dz.T, h, out=dw[v0:v0 + ctx.block])
            if dh is not None:
                dh += dz @ wb
        return None if dh is None else dh.to(h.dtype), dw, None, None, None


def token_loss_sum(h: Tensor, head: Tensor, labels: Tensor, *, block_logits: int = 1 << 26,
                   keep_logits: int = 1 << 30) -> Tensor:
    """Summed fp32 cross-entropy over label tokens (labels == IGNORE skipped) of the logits h [B, T, D] · headᵀ
    [V, D], computed by vocabulary blocks of at most `block_logits` logits (at least one word a block;
    `_HeadCrossEntropy`). The compute-dtype logits are kept for the backward when there are at most `keep_logits`
    of them (2 GiB in bf16), else recomputed there. Labels outside [0, V) other than IGNORE are an error."""
    h, labels = h.flatten(0, 1), labels.flatten()
    V = head.shape[0]
    if host_checks():
        bad = (labels != IGNORE) & ((labels < 0) | (labels >= V))
        if bool(bad.any()):
            raise ValueError(f"label {int(labels[bad][0])} at position {int(bad.nonzero()[0])} of the micro-batch "
                             f"is outside the vocabulary [0, {V}) (and is not IGNORE={IGNORE})")
    block = max(1, min(V, block_logits // max(1, h.shape[0])))
    backward = torch.is_grad_enabled() and (h.requires_grad or head.requires_grad)   # evaluation keeps nothing
    return _HeadCrossEntropy.apply(h, head, labels, block, backward and h.shape[0] * V <= keep_logits)
