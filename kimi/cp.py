"""Context parallelism: the tokens of each row split over the ranks of a process group, with the logits and
gradients of one process (docs/context_parallel.md).

Layout. A row of T tokens is cut into equal chunks; rank r of N holds

    contiguous:  chunk r of N                      tokens [r·T/N, (r+1)·T/N)
    zigzag:      chunks r and 2N−1−r of 2N         an early and a late chunk: causal work balanced over ranks

concatenated in that order in its local tensors [B, T/N, ...]. Only the two token mixers read other tokens; the
embedding, norms, attention residuals, MoE, head and loss are per token and run on the local tokens unchanged.

- Gated MLA: local queries, every key. The latent [c ; k_pe] and the indexer's keys are all-gathered in global
  order; the local queries' candidate ranges hold global key positions (`KeyRanges` with causal=False, as a decode
  cache's: the queries are not the keys), so the indexer and the attention ops run unchanged.
- KDA: a short conv needs the W−1 raw inputs before each chunk (the halo: the last W−1 rows of every chunk,
  all-gathered). A chunk maps the state it starts from to M·S + Z (the recurrence is affine in the state): one
  pass of the chunk's tokens from a zero state, with the value columns widened by K zero columns started from the
  identity, gives [Z | M] at once (`chunk_transition`). The (Z, M) of all chunks are all-gathered and chained in
  global order in fp32 (`merge_states`): each chunk's true entering state, from which it runs the KDA core again.
  A document start inside a chunk zeroes its M (the core's reset discards the state), cutting the chain there.

Every collective is `torch.distributed`'s differentiable all-gather, whose backward reduce-scatters (sums) the
gradients back to the rank that owns the tokens; the merge is plain autograd (each rank chains all chunks). A rank's
parameter gradients are its share; their sum over the group is the one-process gradient (train.py shards the
weights over all processes with FSDP2, whose gradient average times the process count the training step folds into
its loss scale is that sum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops
from .common import compute_dtype
from .ranges import KeyRanges

LAYOUTS = ("contiguous", "zigzag")


class CPError(ValueError):
    """Input that context parallelism cannot run (a length the layout cannot split, a cache, a bad layout)."""


@dataclass(frozen=True, eq=False)
class ContextParallel:
    """Which ranks share each row and how its tokens are laid out over them. `group` None only for one rank
    (tests: zigzag on one rank still splits each row into two chunks)."""
    size: int
    rank: int
    layout: str = "zigzag"
    group: object = None      # a torch.distributed ProcessGroup

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise CPError(f"context parallel layout must be one of {LAYOUTS}, got {self.layout!r}")
        if not 0 <= self.rank < self.size:
            raise CPError(f"context parallel rank {self.rank} is outside [0, {self.size})")
        if self.size > 1 and self.group is None:
            raise CPError(f"context parallelism over {self.size} ranks needs their process group")

    @classmethod
    def of(cls, group=None, layout: str = "zigzag") -> "ContextParallel":
        """Over a process group (default: the whole world)."""
        group = group or dist.group.WORLD
        return cls(size=dist.get_world_size(group), rank=dist.get_rank(group), layout=layout, group=group)

    @classmethod
    def of_mesh(cls, mesh, dim: str = "cp", layout: str = "zigzag") -> "ContextParallel":
        """Over one dimension of a `DeviceMesh` (e.g. ("dp", "cp")): the ranks along `dim` share a row."""
        return cls.of(mesh.get_group(dim), layout)

    @property
    def n_chunks(self) -> int:
        """Chunks a row is cut into."""
        return self.size * (2 if self.layout == "zigzag" else 1)

    @property
    def chunks(self) -> tuple[int, ...]:
        """The global chunk indices this rank holds, in local order."""
        if self.layout == "zigzag":
            return self.rank, 2 * self.size - 1 - self.rank
        return (self.rank,)

    def check_length(self, T: int, halo: int = 0) -> int:
        """The chunk length of rows of T tokens: T must be a positive multiple of `n_chunks`, and a chunk at least
        `halo` tokens long (a KDA short conv of width W reads W−1 tokens before each chunk)."""
        if T <= 0 or T % self.n_chunks:
            raise CPError(f"a row of {T} tokens cannot be split over {self.size} ranks in the {self.layout} layout: "
                          f"the length must be a multiple of {self.n_chunks}")
        c = T // self.n_chunks
        if c < halo:
            raise CPError(f"rows of {T} tokens over {self.size} ranks ({self.layout}) give chunks of {c} tokens; the "
                          f"KDA short convs need at least {halo} (the W−1 tokens before each chunk)")
        return c

    def positions(self, T: int, device=None) -> Tensor:
        """The global positions [T / size] this rank holds of a row of T tokens, in local order."""
        c = self.check_length(T)
        return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in self.chunks])

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's part of a whole row tensor x (its tokens along `dim`)."""
        return x.index_select(dim, self.positions(x.shape[dim], x.device))

    def gather(self, x: Tensor, dim: int = 1) -> Tensor:
        """The whole rows in global order from every rank's part x (its tokens along `dim`; any equal-sized
        pieces per chunk, e.g. one entry per chunk). Differentiable: the backward sums the gradient over the ranks
        and hands each its part."""
        if self.size > 1:
            from torch.distributed import _functional_collectives as funcol
            x = funcol.all_gather_single(x.movedim(dim, 0).contiguous(), 0, self.group)
            x = funcol.wait_tensor(x).movedim(0, dim)
        return self.in_order(x, dim)

    def in_order(self, x: Tensor, dim: int = 1) -> Tensor:
        """The ranks' parts concatenated in rank order along `dim` -> the whole rows in global order."""
        if self.layout == "contiguous":
            return x
        n = self.size         # rank r's part is chunks r, 2N−1−r
        order = [2 * j for j in range(n)] + [2 * (2 * n - 1 - j) + 1 for j in range(n, 2 * n)]
        piece = x.shape[dim] // (2 * n)
        idx = torch.tensor(order, device=x.device)[:, None] * piece + torch.arange(piece, device=x.device)
        return x.index_select(dim, idx.flatten())

    def batch(self, ranges: KeyRanges, reset: Tensor) -> "Shard":
        """This rank's view of one batch, from the document structure of the whole rows: their ranges and document
        starts [B, T] (`kimi.ranges.document_ranges`, `kimi.model.document_resets` of the gathered ids)."""
        pos = self.positions(reset.shape[1], reset.device)
        local = KeyRanges(lo=ranges.lo[:, pos], hi=ranges.hi[:, pos], span=ranges.span, causal=False)
        return Shard(self, reset.shape[1], local, reset[:, pos], reset)


@dataclass(frozen=True, eq=False)
class Shard:
    """One batch on one rank (`ContextParallel.batch`): the layers' `cp=` argument."""
    cp: ContextParallel
    T: int               # tokens of a whole row
    ranges: KeyRanges    # the local queries' candidates, global key positions
    reset: Tensor        # [B, T/size] bool: local document starts
    reset_all: Tensor    # [B, T] bool: the whole rows' document starts

    def gather(self, x: Tensor) -> Tensor:
        """[B, T/size, ...] local tokens -> [B, T, ...] the whole rows (differentiable)."""
        return self.cp.gather(x, 1)

    def chunked(self, x: Tensor) -> Tensor:
        """[B, T/size, ...] -> [B·n, c, ...]: the local chunks as rows (n local chunks of c tokens)."""
        n = len(self.cp.chunks)
        return x.reshape(x.shape[0] * n, x.shape[1] // n, *x.shape[2:])

    def unchunked(self, x: Tensor) -> Tensor:
        """The inverse of `chunked`."""
        n = len(self.cp.chunks)
        return x.reshape(x.shape[0] // n, x.shape[1] * n, *x.shape[2:])

    def with_halo(self, x: Tensor, width: int) -> tuple[Tensor, Tensor]:
        """Each local chunk of x [B, T/size, C] with the `width` rows before it in the whole row (zeros before the
        row's start): ([B·n, width + c, C], their document starts [B·n, width + c]). The halos come from the
        chunks' owners (every chunk's last `width` rows all-gathered, differentiably)."""
        c = self.cp.check_length(self.T, width)
        chunks = self.chunked(x)
        if width == 0:
            return chunks, self.chunked(self.reset)
        B, n = x.shape[0], len(self.cp.chunks)
        tails = self.cp.gather(chunks[:, c - width:].reshape(B, n, width, -1), 1)      # [B, n_chunks, width, C]
        tails = torch.cat([tails.new_zeros(B, 1, *tails.shape[2:]), tails], 1)          # chunk j's halo at j
        ids = torch.tensor(self.cp.chunks, device=x.device)
        halo = tails.index_select(1, ids).flatten(0, 1)                                  # [B·n, width, C]
        pos = (ids[:, None] * c - width + torch.arange(width + c, device=x.device)).clamp(min=0)
        return torch.cat([halo, chunks], 1), self.reset_all[:, pos].flatten(0, 1)


# ---------------------------------------------------------------------------------------------- KDA

def chunk_transition(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, reset: Tensor | None, *, scale: float,
                     backend, gate_lower_bound: float | None = None) -> tuple[Tensor, Tensor]:
    """What a run of tokens does to the KDA state: for every start state S its final state is M·S + Z. Inputs as
    `kimi.ops.kda_core`'s. Returns (Z [B, H, K, V]: the final state from a zero start, M [B, H, K, K]) in the
    core's state dtype. The state's value columns evolve independently, each by the same linear map plus its
    value's input, so one core pass with K extra zero value columns that start from the identity gives [Z | M].
    A reset inside the run zeroes M."""
    B, _, H, K = q.shape
    V = v.shape[-1]
    dt = compute_dtype(q.dtype)
    v_aug = torch.cat([v, v.new_zeros(*v.shape[:-1], K)], -1)
    eye = torch.eye(K, dtype=dt, device=q.device).expand(B, H, K, K)
    s0 = torch.cat([eye.new_zeros(B, H, K, V), eye], -1)
    _, S = ops.kda_core(q, k, v_aug, g, beta, s0, reset, scale=scale, backend=backend,
                        gate_lower_bound=gate_lower_bound)
    return S[..., :V], S[..., V:]


def merge_states(Z: Tensor, M: Tensor) -> Tensor:
    """The state entering each chunk [B, n, H, K, V] from the chunks' transitions in order, Z [B, n, H, K, V] and
    M [B, n, H, K, K]: S_0 = 0, S_{j+1} = M_j S_j + Z_j, in fp32 (fp64 for fp64)."""
    dt = compute_dtype(Z.dtype)
    S = Z.new_zeros(Z.shape[0], *Z.shape[2:], dtype=dt)
    out = []
    for j in range(Z.shape[1]):
        out.append(S)
        S = M[:, j].to(dt) @ S + Z[:, j].to(dt)
    return torch.stack(out, 1)


def kda_core_cp(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, shard: Shard, *, scale: float, backend,
                gate_lower_bound: float | None = None) -> Tensor:
    """`kimi.ops.kda_core` over the whole rows, for this rank's tokens (shapes as its, [B, T/size, ...]; document
    starts from `shard`). Each local chunk's transition, all-gathered, merged in global order, then the chunk from
    its entering state. Returns o [B, T/size, H, V]."""
    B, H, K, V = q.shape[0], q.shape[2], q.shape[3], v.shape[-1]
    n = len(shard.cp.chunks)
    qc, kc, vc, gc, bc = (shard.chunked(t) for t in (q, k, v, g, beta))
    rc = shard.chunked(shard.reset)
    kw = dict(scale=scale, backend=backend, gate_lower_bound=gate_lower_bound)
    Z, M = chunk_transition(qc, kc, vc, gc, bc, rc, **kw)
    ZM = shard.cp.gather(torch.cat([Z, M], -1).view(B, n, H, K, V + K), 1)        # [B, n_chunks, H, K, V + K]
    S = merge_states(ZM[..., :V], ZM[..., V:])
    S = S.index_select(1, torch.tensor(shard.cp.chunks, device=q.device)).flatten(0, 1)
    o, _ = ops.kda_core(qc, kc, vc, gc, bc, S, rc, **kw)
    return shard.unchunked(o)
