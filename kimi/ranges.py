"""Which keys each query may attend to, as ranges: query t's candidates are the key positions [lo_t, hi_t)
(docs/architecture.md#key-ranges).

    no cache:  lo_t = start of t's document,  hi_t = t + 1        (document-causal; packed documents are runs)
    cache:     lo_t = start[b],               hi_t = slot_t + 1   (the row's first real slot to the query itself)
    padding:   lo_t = hi_t                                        (no candidates: attention gives exactly 0)

Built once per forward and shared by every gated-MLA layer: two [B, T] int64 tensors instead of a [B, T, S] mask,
so the sparse path never holds anything of size T×S. `span` is a host-side bound on hi − lo that the data path
knows without reading a device value: when every query has at most `index_topk` candidates the indexer would
select all of them, so its scores and top-k are skipped and attention runs dense over the ranges.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class KeyRanges(NamedTuple):
    lo: Tensor      # [B, T] int64: first candidate key position
    hi: Tensor      # [B, T] int64: one past the last (lo = hi: none)
    span: int       # bound on hi - lo (host int): the longest document, or the cache's slot count
    causal: bool    # no cache: the T queries are the T keys, so query t's keys lie in [t - span + 1, t]

    def positions(self) -> Tensor:
        """Each query's position within its document (or since its row's start) [B, T]: hi − 1 − lo, 0 on
        padding. The indexer's RoPE position."""
        return (self.hi - 1 - self.lo).clamp(min=0)

    def mask(self, S: int) -> Tensor:
        """The candidates as a dense mask [B, T, S] bool, for the dense-mask reference backends."""
        return range_mask(self.lo, self.hi, S)


def range_mask(lo: Tensor, hi: Tensor, S: int) -> Tensor:
    """Candidate keys as a mask [..., S] from ranges [lo, hi) of any shape (lo = hi: none)."""
    s = torch.arange(S, device=lo.device)
    return (s >= lo[..., None]) & (s < hi[..., None])


def document_ranges(document_ids: Tensor, span: int | None = None) -> KeyRanges:
    """Document-causal ranges from document ids [B, T] (a new document wherever the id changes, negative ids
    are padding). `span`: a known bound on the document length (default T)."""
    B, T = document_ids.shape
    t = torch.arange(T, device=document_ids.device).expand(B, T)
    new = torch.ones_like(document_ids, dtype=torch.bool)
    new[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start = torch.where(new, t, torch.zeros_like(t)).cummax(dim=1).values
    real = document_ids >= 0
    return KeyRanges(lo=torch.where(real, start, t), hi=torch.where(real, t + 1, t),
                     span=T if span is None else min(span, T), causal=True)


def cache_ranges(slots: Tensor, start: Tensor, max_len: int) -> KeyRanges:
    """Ranges of queries at cache slots [T] in rows whose real tokens begin at start [B]."""
    real = slots[None, :] >= start[:, None]                                      # [B, T]
    at = slots[None, :].expand_as(real)
    return KeyRanges(lo=torch.where(real, start[:, None], at), hi=torch.where(real, at + 1, at), span=max_len,
                     causal=False)
