"""kimi/loss.py: the vocabulary-blocked head cross-entropy against float64 cross-entropy over the whole logits."""

import pytest
import torch

from kimi.loss import IGNORE, token_loss_sum

from helpers import rel_err


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_blockwise_head_loss_equals_full_cross_entropy(dtype):
    """The vocabulary-blocked loss (blocks of 7 over 30 words: a ragged last block of 2; labels at both edges of
    every block, ignored rows) gives the loss and gradients of cross-entropy over the whole logits in float64,
    with the logits kept or recomputed; recomputing, it keeps no [N, V]-sized tensor for the backward, keeping,
    only the compute-dtype logits blocks; and it rejects labels outside the vocabulary."""
    N, D, V = 15, 8, 30
    h = torch.randn(N, D, dtype=torch.float64)
    w = torch.randn(V, D, dtype=torch.float64)
    labels = torch.tensor([0, 6, 7, 13, 14, 20, 21, 27, 28, 29, IGNORE, 3, IGNORE, 17, 29])
    h64, w64 = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(h64 @ w64.T, labels, ignore_index=IGNORE, reduction="sum")
    (want * 0.5).backward()
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    for block_logits in (7 * N, N * V, 1):             # blocks of 7, one block, blocks of one word
        for keep_logits in (0, N * V):
            hd, wd = h.to(dtype, copy=True).requires_grad_(), w.to(dtype, copy=True).requires_grad_()
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                got = token_loss_sum(hd[None], wd, labels[None], block_logits=block_logits,
                                     keep_logits=keep_logits)
            (got * 0.5).backward()
            assert got.dtype == torch.promote_types(dtype, torch.float32) and rel_err(got, want) < max(tol, 1e-6)
            assert rel_err(hd.grad, h64.grad) < tol and rel_err(wd.grad, w64.grad) < tol
            assert hd.grad.dtype == wd.grad.dtype == dtype
            assert all(t.numel() <= max(N * D, V * D) for t in saved[:4])   # h, w, labels, log-sum-exp
            kept = saved[4:]                                                  # the logits blocks, when kept
            assert sum(t.numel() for t in kept) == (N * V if keep_logits else 0)
            assert all(t.dtype == dtype and t.shape[0] == N for t in kept)
    for bad in (V, -1):
        with pytest.raises(ValueError, match=f"label {bad} at position 4 .* outside the vocabulary"):
            token_loss_sum(h[None], w, torch.where(torch.arange(N) == 4, bad, labels)[None])
