"""Gated MLA's attention over the selected keys: the dense-mask references and the range-based 'gather' path
(docs/numerics.md#sparse-attention, #sparse-attention-contract).

    o = softmax(σ q kᵀ over Sel(t)) v,   σ = (d_nope + d_rope)^-1/2

Sel(t) is every visible key, or the indexer's selection intersected with them (so a selection can never reach a
future or foreign key). Three registered implementations with one signature
`(q, c, k_pe, kv_b, visible, topk_idx, *, scale) -> o [B, T, H, d_v]`:

- `sparse_mla_eager`: expanded form (per-head K/V through kv_b_proj), fp32 softmax; the reference.
- `sparse_mla_sdpa`: the expanded form through `F.scaled_dot_product_attention` with the boolean mask.
- `sparse_mla_absorbed`: W_UK folded into q and W_UV applied after attention over the shared 576-wide latent
  [c ; k_pe], the form sparse kernels and decoding run (docs/numerics.md#absorbed-form).

All build a [B, T, S] keep-mask: fine for tests and moderate lengths. Rows with no visible key (padding queries)
give exactly 0 and zero gradient, never NaN.

Below them, nothing of size T×S: `sparse_mla_gather` (+ `_bwd`), the contract of the sparse kernels (the absorbed
form over gathered latents, queries in blocks, with the LSE), and `sparse_mla_gathered`, the layer's path
`Backend(attn="gather")` built on it from per-query key ranges (`kimi/ranges.py`), with `dense_mla_ranges` for
the calls where every candidate is attended. `sparse_mla_triton` (+ `_bwd`) is the same contract as Triton kernels
(kimi/ops/sparse_mla_triton.py), and `sparse_mla_triton_ranges` the layer's path `Backend(attn="triton")` on it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common import compute_dtype
from ..ranges import KeyRanges, range_mask
from . import cudnn_dsa
from . import sparse_mla_triton as kernels
from .registry import traceable, triton_available


def select_visible(visible: Tensor, topk_idx: Tensor | None) -> Tensor:
    """visible [B, T, S] bool intersected with the selected key positions topk_idx [B, T, k] (-1 = none)."""
    if topk_idx is None:
        return visible
    S = visible.shape[-1]
    # Scatter valid positions into S+1 columns with -1 sent to the spare last column: duplicates of the
    # sentinel never overwrite a real selection.
    cols = torch.where(topk_idx >= 0, topk_idx, S).long()
    sel = torch.zeros(*topk_idx.shape[:2], S + 1, dtype=torch.bool, device=visible.device)
    sel = sel.scatter(-1, cols, True)[..., :S]
    return sel & visible


def _attend_eager(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float) -> Tensor:
    """q [B, H, T, E], k [B, H, S, E], v [B, H, S, F], keep [B, T, S] -> [B, H, T, F].
    Scores in the activation dtype, softmax in fp32."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = s.to(compute_dtype(s.dtype))
    has_key = keep.any(-1)[:, None, :, None]                                    # [B, 1, T, 1]
    # An all-masked row is replaced by zeros before the softmax (finite gradients), its probabilities zeroed after.
    s = s.masked_fill(~keep[:, None], float("-inf")).masked_fill(~has_key, 0.0)
    p = torch.softmax(s, dim=-1) * has_key
    return torch.matmul(p.to(v.dtype), v)


def _attend_sdpa(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float) -> Tensor:
    has_key = keep.any(-1)                                                      # [B, T]
    # Rows with no key attend to everything and are zeroed after: SDPA kernels return NaN for fully masked rows.
    mask = (keep | ~has_key[..., None])[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o * has_key[:, None, :, None].to(o.dtype)


def _attend_shared(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float) -> Tensor:
    """Attention with one K/V shared by all heads: q [B, H, T, E], k [B, S, E], v [B, S, F], keep [B, T, S] ->
    [B, H, T, F]. The queries of all heads are one batched matmul against the shared keys, so no per-head copy of K
    or V is made (SDPA's math path and broadcasting matmuls would expand K to every head)."""
    B, H, T, E = q.shape
    s = torch.bmm(q.transpose(1, 2).reshape(B, T * H, E), k.transpose(1, 2)) * scale
    s = s.unflatten(1, (T, H)).to(compute_dtype(s.dtype))
    has_key = keep.any(-1)[:, :, None, None]                                   # [B, T, 1, 1]
    s = s.masked_fill(~keep[:, :, None], float("-inf")).masked_fill(~has_key, 0.0)
    p = torch.softmax(s, dim=-1) * has_key
    o = torch.bmm(p.to(v.dtype).flatten(1, 2), v)
    return o.unflatten(1, (T, H)).transpose(1, 2)


def _expand_kv(c: Tensor, k_pe: Tensor, kv_b: Tensor, H: int, dn: int) -> tuple[Tensor, Tensor]:
    """Per-head keys [B, H, S, d_n + d_r] and values [B, H, S, d_v] from the latent through kv_b_proj."""
    W = kv_b.unflatten(0, (H, -1))                             # [H, d_n + d_v, R]
    k_nope, v = torch.einsum("bsr,hdr->bhsd", c, W).split([dn, W.shape[1] - dn], dim=-1)
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, H, -1, -1)], dim=-1)      # k_pe shared by all heads
    return k, v


def _expanded(q: Tensor, c: Tensor, k_pe: Tensor, kv_b: Tensor, keep: Tensor, scale: float, attend) -> Tensor:
    k, v = _expand_kv(c, k_pe, kv_b, q.shape[2], q.shape[-1] - k_pe.shape[-1])
    return attend(q.transpose(1, 2), k, v, keep, scale).transpose(1, 2)       # [B, T, H, d_v]


def sparse_mla_eager(q: Tensor, c: Tensor, k_pe: Tensor, kv_b: Tensor, visible: Tensor, topk_idx: Tensor | None, *,
                     scale: float) -> Tensor:
    """The expanded form, fp32 softmax over the keep-mask: the reference.

    q [B, T, H, d_n + d_r] (nope part first), c [B, S, R] normalized latent, k_pe [B, S, d_r] shared key slice,
    kv_b the kv_b_proj weight [H·(d_n + d_v), R] (a LoRA effective weight works the same), visible [B, T, S] bool,
    topk_idx int32 [B, T, k] (-1 padded) or None (every visible key). Returns o [B, T, H, d_v] in q's dtype."""
    return _expanded(q, c, k_pe, kv_b, select_visible(visible, topk_idx), scale, _attend_eager)


def sparse_mla_sdpa(q: Tensor, c: Tensor, k_pe: Tensor, kv_b: Tensor, visible: Tensor, topk_idx: Tensor | None, *,
                    scale: float) -> Tensor:
    """`sparse_mla_eager` through `F.scaled_dot_product_attention` with the same boolean mask."""
    return _expanded(q, c, k_pe, kv_b, select_visible(visible, topk_idx), scale, _attend_sdpa)


def absorb_query(q: Tensor, kv_b: Tensor, d_r: int) -> Tensor:
    """The absorbed query [B, T, H, R + d_r] = [W_UKᵀ q_nope ; q_rope] (docs/numerics.md#absorbed-form)."""
    H = q.shape[2]
    dn = q.shape[-1] - d_r
    W_uk = kv_b.unflatten(0, (H, -1))[:, :dn]
    if torch.compiler.is_compiling():   # Inductor plans the matmul's output into the concatenation itself
        q_nope, q_pe = q.split([dn, d_r], dim=-1)
        return torch.cat([torch.einsum("bthd,hdr->bthr", q_nope, W_uk), q_pe], dim=-1)
    return _AbsorbQuery.apply(q, W_uk)


def _heads(t: Tensor) -> Tensor:
    """[B, T, H, n] as the head-major [H, B·T, n] view a batched matmul over heads takes (no copy when t is
    contiguous)."""
    B, T, H, n = t.shape
    return t.reshape(B * T, H, n).transpose(0, 1)


class _AbsorbQuery(torch.autograd.Function):
    """`absorb_query` in eager mode: the head-batched matmul writes W_UKᵀ q_nope straight into the first R columns
    of the [B, T, H, R + d_r] result and q_rope is copied beside it, where a concatenation would copy the matmul's
    head-major output once more (and the backward of q's split would concatenate its gradient again); the
    backward writes dq the same way. The same products as the einsum: one bmm per direction."""

    @staticmethod
    def forward(ctx, q: Tensor, W_uk: Tensor) -> Tensor:
        dn, R = W_uk.shape[1:]
        out = q.new_empty(*q.shape[:3], R + q.shape[-1] - dn)
        torch.bmm(_heads(q)[..., :dn], W_uk, out=_heads(out)[..., :R])
        out[..., R:] = q[..., dn:]
        ctx.save_for_backward(q, W_uk)
        return out

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None]:
        q, W_uk = ctx.saved_tensors
        dn, R = W_uk.shape[1:]
        g = g.contiguous()
        g_lat = _heads(g)[..., :R]
        dq = dW = None
        if ctx.needs_input_grad[0]:
            dq = torch.empty_like(q, memory_format=torch.contiguous_format)
            torch.bmm(g_lat, W_uk.transpose(1, 2), out=_heads(dq)[..., :dn])
            dq[..., dn:] = g[..., R:]
        if ctx.needs_input_grad[1]:
            dW = torch.bmm(_heads(q.contiguous())[..., :dn].transpose(1, 2), g_lat)
        return dq, dW


def unabsorb_output(o_lat: Tensor, kv_b: Tensor, d_n: int) -> Tensor:
    """o [B, T, H, d_v] = W_UV o_lat from the attention output over the latent o_lat [B, T, H, R]."""
    W_uv = kv_b.unflatten(0, (o_lat.shape[2], -1))[:, d_n:]
    return torch.einsum("bthr,hdr->bthd", o_lat, W_uv)


def sparse_mla_absorbed(q: Tensor, c: Tensor, k_pe: Tensor, kv_b: Tensor, visible: Tensor,
                        topk_idx: Tensor | None, *, scale: float) -> Tensor:
    """`sparse_mla_eager` in the absorbed form: attention over the shared latent [c ; k_pe], same σ."""
    return _absorbed(q, torch.cat([c, k_pe], dim=-1), kv_b, select_visible(visible, topk_idx), scale)


def _absorbed(q: Tensor, latent: Tensor, kv_b: Tensor, keep: Tensor, scale: float) -> Tensor:
    """The absorbed form over latent [B, S, R + d_r] ([c ; k_pe], R = kv_b's input width) masked by keep
    [B, T, S] -> o [B, T, H, d_v]."""
    R = kv_b.shape[1]
    d_r = latent.shape[-1] - R
    Q = absorb_query(q, kv_b, d_r).transpose(1, 2)                             # [B, H, T, R + d_r]
    o_lat = _attend_shared(Q, latent, latent[..., :R], keep, scale)            # [B, H, T, R]
    return unabsorb_output(o_lat.transpose(1, 2), kv_b, q.shape[-1] - d_r)


_SCHEMA = "(Tensor q, Tensor c, Tensor k_pe, Tensor kv_b, Tensor visible, Tensor? topk_idx, *, float scale) -> Tensor"
for _fn in (sparse_mla_eager, sparse_mla_sdpa, sparse_mla_absorbed):
    traceable(_fn.__name__ + _SCHEMA, _fn)


# ---------------------------------------------------------------------------------------------- gathering reference
# The contract the sparse kernels implement (docs/numerics.md#sparse-attention-contract): attention of every head
# over the latents its query selected, in the absorbed form, with the natural-log LSE over the selected keys.
# Queries run in blocks, so memory is O(block · k · D) beyond the inputs and outputs, never O(T · S).

def _gather_block(latent: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """The selected latents [B, Tb, k, D] (zeros at -1) and the validity mask [B, Tb, k] of a query block."""
    B, Tb, k = idx.shape
    valid = idx >= 0
    rows = torch.where(valid, idx, 0).long().reshape(B, Tb * k)
    kv = latent.gather(1, rows[..., None].expand(-1, -1, latent.shape[-1])).view(B, Tb, k, -1)
    return kv, valid


def _block_scores(q: Tensor, kv: Tensor, valid: Tensor, scale: float) -> Tensor:
    """σ q·kv [B, Tb, H, k] in the compute dtype, -inf at unselected slots (q [B, Tb, H, D], kv [B, Tb, k, D])."""
    s = torch.einsum("bthd,btkd->bthk", q, kv) * scale
    return s.masked_fill(~valid[:, :, None], float("-inf"))


def _probs(s: Tensor, lse: Tensor, valid: Tensor) -> Tensor:
    """e^{s − lse} at the selected slots, exact zeros elsewhere and on rows without keys (lse = -inf)."""
    return torch.where(valid[:, :, None], (s - lse.nan_to_num(neginf=0.0)[..., None]).exp(), 0.0)


def _block_forward(q: Tensor, kv: Tensor, valid: Tensor, scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    """q [B, Tb, H, D], kv [B, Tb, k, D] -> o [B, Tb, H, d_v] in q's dtype, lse [B, Tb, H] in the compute dtype."""
    ct = compute_dtype(q.dtype)
    s = _block_scores(q.to(ct), kv.to(ct), valid, scale)
    lse = torch.logsumexp(s, dim=-1)                                              # -inf on rows without keys
    o = torch.einsum("bthk,btkv->bthv", _probs(s, lse, valid), kv[..., :d_v].to(ct))
    return o.to(q.dtype), lse


GATHER_ELEMENTS = 1 << 28
"""Without an explicit `block` the gathering attention takes as many queries a block as keep its gathered latents
[B, block, k, D] at most this many elements (1 GiB in fp32)."""


def _gather_rows(latent: Tensor, indices: Tensor, block: int | None) -> int:
    B, _, k = indices.shape
    return block or max(1, min(1024, GATHER_ELEMENTS // max(1, B * k * latent.shape[-1])))


@torch.library.custom_op("kimi::sparse_mla_gather", mutates_args=())
def sparse_mla_gather(q: Tensor, latent: Tensor, indices: Tensor, *, scale: float, d_v: int,
                      block: int | None = None) -> tuple[Tensor, Tensor]:
    """Attention over the selected latents: q [B, T, H, D] (W_UK absorbed, D = kv_lora_rank + d_r), latent
    [B, S, D] (values: its first `d_v` columns), indices int32 [B, T, k] (positions in S, -1 padded) ->
    (o [B, T, H, d_v] in q's dtype, lse [B, T, H] fp32, or fp64 for fp64 q). A row without keys gives o = 0 and
    lse = -inf. The caller's selection must already respect visibility (the indexer only picks candidates).
    `block`: queries a block (default: by `GATHER_ELEMENTS`)."""
    block = _gather_rows(latent, indices, block)
    o, lse = [], []
    for t in range(0, q.shape[1], block):
        kv, valid = _gather_block(latent, indices[:, t:t + block])
        ob, lb = _block_forward(q[:, t:t + block], kv, valid, scale, d_v)
        o.append(ob)
        lse.append(lb)
    if not o:
        return q.new_empty(*q.shape[:3], d_v), q.new_empty(q.shape[:3], dtype=compute_dtype(q.dtype))
    return torch.cat(o, 1).contiguous(), torch.cat(lse, 1).contiguous()


@sparse_mla_gather.register_fake
def _(q, latent, indices, *, scale, d_v, block=None):
    return q.new_empty(*q.shape[:3], d_v), q.new_empty(q.shape[:3], dtype=compute_dtype(q.dtype))


@torch.library.custom_op("kimi::sparse_mla_gather_bwd", mutates_args=())
def sparse_mla_gather_bwd(q: Tensor, latent: Tensor, indices: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                          dlse: Tensor | None, *, scale: float, d_v: int,
                          block: int | None = None) -> tuple[Tensor, Tensor]:
    """(dq, dlatent) of `sparse_mla_gather` from its inputs, outputs and the output gradients, block by block:
    the probabilities are recomputed from the LSE (p = e^{s − lse}), ds = p ⊙ (do·vᵀ − Σ_v do ⊙ o + dlse), and
    each block's key and value gradients are scattered back onto the latent rows they were gathered from."""
    ct = compute_dtype(q.dtype)
    block = _gather_rows(latent, indices, block)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)    # written block by block, rounded once each
    dlat = torch.zeros(latent.shape, dtype=ct, device=latent.device)
    B, D = q.shape[0], latent.shape[-1]
    for t in range(0, q.shape[1], block):
        qb, dob = q[:, t:t + block].to(ct), do[:, t:t + block].to(ct)
        idx = indices[:, t:t + block]
        kv, valid = _gather_block(latent, idx)
        kv = kv.to(ct)
        p = _probs(_block_scores(qb, kv, valid, scale), lse[:, t:t + block], valid)
        delta = (dob * o[:, t:t + block].to(ct)).sum(-1, keepdim=True)             # [B, Tb, H, 1]
        if dlse is not None:
            delta = delta - dlse[:, t:t + block, :, None].to(ct)
        dp = torch.einsum("bthv,btkv->bthk", dob, kv[..., :d_v])
        ds = p * (dp - delta) * scale
        dq[:, t:t + block] = torch.einsum("bthk,btkd->bthd", ds, kv)
        dkv = torch.einsum("bthk,bthd->btkd", ds, qb)
        dkv[..., :d_v] += torch.einsum("bthk,bthv->btkv", p, dob)
        rows = torch.where(valid, idx, 0).long().reshape(B, -1)
        dkv = torch.where(valid[..., None], dkv, 0.0).reshape(B, -1, D)
        dlat.scatter_add_(1, rows[..., None].expand(-1, -1, D), dkv)
    return dq, dlat.to(latent.dtype)


@sparse_mla_gather_bwd.register_fake
def _(q, latent, indices, o, lse, do, dlse, *, scale, d_v, block=None):
    return q.new_empty(q.shape), latent.new_empty(latent.shape)


def _attention_autograd(op, backward_op) -> None:
    """Register the backward of an op of `sparse_mla_gather`'s contract: (dq, dlatent) from `backward_op` on the
    saved inputs and outputs (no gradient for the indices)."""
    def setup(ctx, inputs, keyword_only_inputs, output):
        q, latent, indices = inputs
        o, lse = output
        ctx.save_for_backward(q, latent, indices, o, lse)
        ctx.kw = dict(keyword_only_inputs)
        ctx.set_materialize_grads(False)    # an unused LSE's gradient stays None, not a zero tensor to read

    def backward(ctx, do, dlse):
        q, latent, indices, o, lse = ctx.saved_tensors
        do = torch.zeros_like(o) if do is None else do.contiguous()
        dq, dlat = backward_op(q, latent, indices, o, lse, do, dlse, **ctx.kw)
        return dq, dlat, None
    op.register_autograd(backward, setup_context=setup)


_attention_autograd(sparse_mla_gather, sparse_mla_gather_bwd)


# ---------------------------------------------------------------------------------------------- range-based layer path

def sparse_mla_gathered(q: Tensor, latent: Tensor, kv_b: Tensor, lo: Tensor, hi: Tensor, topk_idx: Tensor | None, *,
                        scale: float, span: int, causal: bool, block: int = 1024) -> Tensor:
    """Gated MLA's attention from the candidate ranges [lo, hi) [B, T] (`KeyRanges`' fields), with nothing of size
    T×S: `Backend(attn="gather")`, the op `kimi::sparse_mla_gathered`. It reads the latent [c ; k_pe] as one
    tensor (with a cache, the cache itself: nothing is copied).

    With a selection topk_idx [B, T, k] (-1 padded): the absorbed form through `kimi::sparse_mla_gather`, on the
    selection intersected with the ranges (as the dense-mask references do, a selection can never reach a future
    or foreign key). Without one every candidate is attended: `dense_mla_ranges`.
    q [B, T, H, d_n + d_r], latent [B, S, R + d_r], kv_b the kv_b_proj weight [H·(d_n + d_v), R] (a LoRA
    effective weight enters both W_UK and W_UV) -> o [B, T, H, d_v] in q's dtype."""
    if topk_idx is None:
        return dense_mla_ranges(q, latent, kv_b, KeyRanges(lo, hi, span, causal), scale=scale, block=block)
    return _selected(q, latent, kv_b, lo, hi, topk_idx, scale, torch.ops.kimi.sparse_mla_gather)


def _selected(q: Tensor, latent: Tensor, kv_b: Tensor, lo: Tensor, hi: Tensor, topk_idx: Tensor, scale: float,
              attend) -> Tensor:
    """The absorbed form over a selection intersected with the ranges, `attend` an op of
    `sparse_mla_gather`'s contract."""
    R = kv_b.shape[1]
    d_r = latent.shape[-1] - R
    inside = (topk_idx >= lo[..., None]) & (topk_idx < hi[..., None])
    topk_idx = torch.where(inside, topk_idx, -1)
    o_lat, _ = attend(absorb_query(q, kv_b, d_r), latent, topk_idx, scale=scale, d_v=R)
    return unabsorb_output(o_lat, kv_b, q.shape[-1] - d_r)


def dense_mla_ranges(q: Tensor, latent: Tensor, kv_b: Tensor, ranges: KeyRanges, *, scale: float,
                     block: int = 1024) -> Tensor:
    """Attention over every candidate in [lo_t, hi_t), `block` queries at a time (shapes as
    `sparse_mla_gathered`'s).

    Without a cache (`ranges.causal`) the expanded form through SDPA: a query block [t0, t1) needs only the keys
    [t0 − span + 1, t1), so with documents of at most `span` tokens each block's mask is [block, block + span]:
    short documents run as dense document-causal attention with no T×T mask. With a cache the absorbed form over
    the cached latents, as many queries a block as keep the scores [B, H, rows, S] within `GATHER_ELEMENTS`."""
    B, T, H, _ = q.shape
    S, R = latent.shape[1], kv_b.shape[1]
    out = []
    if ranges.causal:
        k, v = _expand_kv(latent[..., :R], latent[..., R:], kv_b, H, q.shape[-1] - (latent.shape[-1] - R))
        qh = q.transpose(1, 2)
        for t0, t1 in _blocks(T, block):
            w0 = 0 if t0 == 0 else max(0, t0 - ranges.span + 1)
            keep = range_mask(ranges.lo[:, t0:t1] - w0, ranges.hi[:, t0:t1] - w0, t1 - w0)
            out.append(_attend_sdpa(qh[:, :, t0:t1], k[:, :, w0:t1], v[:, :, w0:t1], keep, scale))
        return torch.cat(out, dim=2).transpose(1, 2)
    for t0, t1 in _blocks(T, max(1, min(block, GATHER_ELEMENTS // max(1, B * H * S)))):
        keep = range_mask(ranges.lo[:, t0:t1], ranges.hi[:, t0:t1], S)
        out.append(_absorbed(q[:, t0:t1], latent, kv_b, keep, scale))
    return torch.cat(out, dim=1)


def _blocks(T, block: int) -> list[tuple[int, int]]:
    """Query blocks [t0, t1) covering [0, T); a single one when T <= block, so that a symbolic length (a compile
    with dynamic shapes) is not specialized."""
    if T <= block:
        return [(0, T)]
    return [(t0, min(t0 + block, T)) for t0 in range(0, T, block)]


traceable("sparse_mla_gathered(Tensor q, Tensor latent, Tensor kv_b, Tensor lo, Tensor hi, Tensor? topk_idx, *, "
          "float scale, SymInt span, bool causal, int block=1024) -> Tensor", sparse_mla_gathered)


# ---------------------------------------------------------------------------------------------- Triton kernels

@torch.library.custom_op("kimi::sparse_mla_triton", mutates_args=())
def sparse_mla_triton(q: Tensor, latent: Tensor, indices: Tensor, *, scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    """`sparse_mla_gather`'s contract as Triton kernels (`kernels.sparse_mla_fwd_triton`: 96 heads in tiles of 32,
    the decode path split over the selected keys); bf16, fp16 or fp32 q and latent."""
    if not triton_available(q.device):
        raise RuntimeError("sparse_mla_triton needs Triton and a CUDA device (or TRITON_INTERPRET=1)")
    return kernels.sparse_mla_fwd_triton(q, latent, indices, scale=scale, d_v=d_v)


@sparse_mla_triton.register_fake
def _(q, latent, indices, *, scale, d_v):
    return q.new_empty(*q.shape[:3], d_v), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("kimi::sparse_mla_triton_bwd", mutates_args=())
def sparse_mla_triton_bwd(q: Tensor, latent: Tensor, indices: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                          dlse: Tensor | None, *, scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    """(dq, dlatent) of `sparse_mla_triton` (`kernels.sparse_mla_bwd_triton`: dlatent accumulated in fp32 by
    atomics, or, under `torch.use_deterministic_algorithms(True)`, summed in a fixed order: bitwise reproducible,
    at twice dlatent's memory traffic)."""
    return kernels.sparse_mla_bwd_triton(q, latent, indices, o, lse, do, dlse, scale=scale, d_v=d_v,
                                         deterministic=torch.are_deterministic_algorithms_enabled())


@sparse_mla_triton_bwd.register_fake
def _(q, latent, indices, o, lse, do, dlse, *, scale, d_v):
    return q.new_empty(q.shape), latent.new_empty(latent.shape)


_attention_autograd(sparse_mla_triton, sparse_mla_triton_bwd)


def sparse_mla_triton_ranges(q: Tensor, latent: Tensor, kv_b: Tensor, lo: Tensor, hi: Tensor,
                             topk_idx: Tensor | None, *, scale: float, span: int, causal: bool,
                             block: int = 1024) -> Tensor:
    """`sparse_mla_gathered` with the attention over the selection in the Triton kernels: `Backend(attn="triton")`,
    the op `kimi::sparse_mla_triton_ranges` (same signature). Without a selection (every candidate attended) it is
    `dense_mla_ranges`, as on the 'gather' path."""
    if topk_idx is None:
        return dense_mla_ranges(q, latent, kv_b, KeyRanges(lo, hi, span, causal), scale=scale, block=block)
    return _selected(q, latent, kv_b, lo, hi, topk_idx, scale, torch.ops.kimi.sparse_mla_triton)


traceable("sparse_mla_triton_ranges(Tensor q, Tensor latent, Tensor kv_b, Tensor lo, Tensor hi, Tensor? topk_idx, *, "
          "float scale, SymInt span, bool causal, int block=1024) -> Tensor", sparse_mla_triton_ranges)


# ---------------------------------------------------------------------------------------------- cuDNN (+ FlashMLA)

SPARSE_FORWARDS = ("flashmla", "triton", "gather")
"""The forwards `Backend(attn="cudnn")` runs under cuDNN's backward (`Backend.sparse_fwd`)."""


@torch.library.custom_op("kimi::sparse_mla_cudnn", mutates_args=())
def sparse_mla_cudnn(q: Tensor, latent: Tensor, indices: Tensor, *, scale: float, d_v: int,
                     forward: str) -> tuple[Tensor, Tensor]:
    """`sparse_mla_gather`'s contract with `forward` (FlashMLA's sparse forward, the Triton kernels or the torch
    gather) and cuDNN's SM90 backward (kimi/ops/cudnn_dsa.py). All three write the natural-log LSE the backward
    reads."""
    if forward == "flashmla":
        return cudnn_dsa.sparse_mla_fwd_flashmla(q, latent, indices, scale=scale, d_v=d_v)
    if forward == "triton":
        return kernels.sparse_mla_fwd_triton(q, latent, indices, scale=scale, d_v=d_v)
    if forward == "gather":
        return sparse_mla_gather(q, latent, indices, scale=scale, d_v=d_v)
    raise ValueError(f"sparse_mla_cudnn: forward={forward!r}, expected one of {SPARSE_FORWARDS}")


@sparse_mla_cudnn.register_fake
def _(q, latent, indices, *, scale, d_v, forward):
    return q.new_empty(*q.shape[:3], d_v), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("kimi::sparse_mla_cudnn_bwd", mutates_args=())
def sparse_mla_cudnn_bwd(q: Tensor, latent: Tensor, indices: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                         dlse: Tensor | None, *, scale: float, d_v: int, forward: str) -> tuple[Tensor, Tensor]:
    """(dq, dlatent) of `sparse_mla_cudnn` on cuDNN's SM90 sparse backward, whichever forward ran. cuDNN takes no
    LSE gradient; the backward is linear in (do, dlse), so a nonzero dlse adds the torch gather's backward of
    (0, dlse), at the price of one device read to tell. The layer never differentiates through the LSE, so its
    backward gets None there (no zeros materialized, nothing to read)."""
    dq, dlat = cudnn_dsa.sparse_mla_bwd_cudnn(q, latent, indices, o, lse, do, scale=scale, d_v=d_v)
    if dlse is not None and bool(dlse.ne(0).any()):
        eq, el = sparse_mla_gather_bwd(q, latent, indices, o, lse, torch.zeros_like(do), dlse, scale=scale, d_v=d_v)
        dq, dlat = dq + eq, (dlat.float() + el.float()).to(latent.dtype)
    return dq, dlat


@sparse_mla_cudnn_bwd.register_fake
def _(q, latent, indices, o, lse, do, dlse, *, scale, d_v, forward):
    return q.new_empty(q.shape), latent.new_empty(latent.shape)


_attention_autograd(sparse_mla_cudnn, sparse_mla_cudnn_bwd)


def sparse_mla_cudnn_ranges(q: Tensor, latent: Tensor, kv_b: Tensor, lo: Tensor, hi: Tensor,
                            topk_idx: Tensor | None, *, scale: float, span: int, causal: bool, block: int = 1024,
                            forward: str = "triton") -> Tensor:
    """`sparse_mla_gathered` with the attention over the selection on `sparse_mla_cudnn`: `Backend(attn="cudnn")`,
    the op `kimi::sparse_mla_cudnn_ranges` (the gathering path's signature plus `forward`). Without a selection
    `dense_mla_ranges`, as on the other range-based paths."""
    if topk_idx is None:
        return dense_mla_ranges(q, latent, kv_b, KeyRanges(lo, hi, span, causal), scale=scale, block=block)
    attend = functools.partial(torch.ops.kimi.sparse_mla_cudnn, forward=forward)
    return _selected(q, latent, kv_b, lo, hi, topk_idx, scale, attend)


traceable("sparse_mla_cudnn_ranges(Tensor q, Tensor latent, Tensor kv_b, Tensor lo, Tensor hi, Tensor? topk_idx, *, "
          "float scale, SymInt span, bool causal, int block=1024, str forward='triton') -> Tensor",
          sparse_mla_cudnn_ranges)
