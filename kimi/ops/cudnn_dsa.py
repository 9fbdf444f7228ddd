"""cuDNN Frontend's DSA kernels (and FlashMLA's sparse forward, where it is built) behind the project's op
contracts: `Backend(attn="cudnn")` (docs/numerics.md#sparse-attention-contract, docs/architecture.md#backends).

- Indexer (`indexer_topk_cudnn`, the contract of `kimi::indexer_topk`): cuDNN's dense fp32 scores, one batch row
  and at most `SCORE_BUFFER_BYTES` of scores at a time (query blocks), the candidate ranges applied to them, then
  cuDNN's radix top-k in its deterministic mode (ascending positions, the smaller position wins a tie, as the
  contract ranks them). What lies outside [lo_t, hi_t) never survives: it scores -inf and its picks are dropped.
- Sparse attention backward (`sparse_mla_bwd_cudnn`, the contract of `kimi::sparse_mla_gather_bwd`): cuDNN's SM90
  kernel over the rows that hold a key (it needs at least one), the selection compacted to a valid prefix, no
  attention sink (-inf), 96 heads passed as they are (its SM90 kernel tiles heads by 64 and masks the rest).
  Natural-log LSE on both sides (the forward's, whichever kernel wrote it); no LSE gradient (the op of
  sparse_attention.py adds one through the torch backward).
- Forward under it (`Backend.sparse_fwd`): FlashMLA's `flash_mla_sparse_fwd` (heads padded to 128, slots to a
  multiple of 128, as it requires), the project's Triton forward, or `gather`.

Nothing here runs without the optional packages (`pip install 'kimi[cudnn]'`) and an SM90+ GPU: `require` says
which is missing, once, when the backend is chosen.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..ranges import range_mask

SCORE_BUFFER_BYTES = 4 << 30
"""At most this many bytes of cuDNN's fp32 [queries, keys] indexer scores at a time: long rows run in query blocks."""
TOPK_BUFFER_BYTES = 1 << 30
"""Scores a call of cuDNN's top-k reads at a time (its scratch is a few times this), in rows of `TOPK_ROWS`."""
TOPK_ROWS = 512
MAX_TOPK = 2048
"""cuDNN's top-k takes 0 < k <= 2048."""
FLASH_MLA_HEADS = (64, 128)
FLASH_MLA_TOPK_ALIGN = 128


class CudnnUnavailable(RuntimeError):
    """attn='cudnn' cannot run here: a package or the GPU is missing (the message names which)."""


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


@functools.lru_cache(maxsize=None)
def _load_dsa():
    try:
        from cudnn import DSA
        for name in ("indexer_forward_wrapper", "indexer_top_k_wrapper", "sparse_attention_backward_wrapper"):
            getattr(DSA, name)
    except Exception as e:     # not installed, or its CUTLASS DSL runtime missing ("No CTK flavor installed")
        return None, _why(e)
    return DSA, ""


@functools.lru_cache(maxsize=None)
def _load_flash_mla():
    try:
        from flash_mla import flash_mla_sparse_fwd
    except Exception as e:
        return None, _why(e)
    return flash_mla_sparse_fwd, ""


def dsa_module():
    """cuDNN Frontend's `DSA` namespace; `CudnnUnavailable` if it does not import."""
    dsa, why = _load_dsa()
    if dsa is None:
        raise CudnnUnavailable(f"attn='cudnn' needs cuDNN Frontend's DSA kernels with the CUTLASS DSL (pip install "
                               f"'kimi[cudnn]'; docs/architecture.md#cudnn): {why}")
    return dsa


def flash_mla_available() -> bool:
    return _load_flash_mla()[0] is not None


_READY: set[str] = set()
"""The `sparse_fwd` values `require` has passed in this process (later calls, traced ones too, only look here)."""


def require(sparse_fwd: str) -> None:
    """Raise `CudnnUnavailable` unless attn='cudnn' with forward `sparse_fwd` can run in this process: cuDNN's DSA
    kernels import, a CUDA GPU of compute capability 9.0 or later is present, and FlashMLA imports if asked for."""
    if sparse_fwd in _READY:
        return
    if not torch.cuda.is_available():
        raise CudnnUnavailable("attn='cudnn' needs a CUDA GPU of compute capability 9.0 or later (Hopper); none here")
    cap = torch.cuda.get_device_capability()
    if cap < (9, 0):
        raise CudnnUnavailable(f"attn='cudnn' needs compute capability 9.0 or later (Hopper); this GPU is "
                               f"{cap[0]}.{cap[1]}: use attn='triton' or 'gather'")
    dsa_module()
    if sparse_fwd == "flashmla" and not flash_mla_available():
        raise CudnnUnavailable(f"sparse_fwd='flashmla' needs FlashMLA built from its repository (not on the "
                               f"package index; README#cudnn): {_load_flash_mla()[1]}; or use sparse_fwd='triton'")
    _READY.add(sparse_fwd)


def default_forward() -> str:
    """The forward `sparse_fwd='auto'` runs under attn='cudnn': FlashMLA where it imports, else the Triton kernels."""
    return "flashmla" if flash_mla_available() else "triton"


def _valid_first(idx: Tensor, keep: Tensor) -> Tensor:
    """The kept entries of each row first, ascending, then -1 (idx int32 [..., k])."""
    big = torch.iinfo(torch.int32).max
    out = torch.where(keep, idx, big).sort(-1).values
    return torch.where(out == big, -1, out).to(torch.int32)


# ---------------------------------------------------------------------------------------------- indexer

def indexer_topk_cudnn(q: Tensor, k: Tensor, w: Tensor, lo: Tensor, hi: Tensor, *, topk: int,
                       causal: bool = False) -> Tensor:
    """`kimi::indexer_topk`'s contract on cuDNN: q [B, T, n, 128], k [B, S, 128], w [B, T, n] (scales folded in),
    lo, hi [B, T] -> int32 [B, T, topk], per query min(topk, #candidates) positions of [lo_t, hi_t) ascending,
    then -1. Scores in bf16 inputs and fp32 sums (cuDNN's), at most `SCORE_BUFFER_BYTES` of them at once;
    `causal` (hi_t <= t + 1) lets cuDNN mask the keys past each query itself."""
    if not 0 <= topk <= MAX_TOPK:
        raise ValueError(f"attn='cudnn': index_topk={topk} must be in 0..{MAX_TOPK} (cuDNN's top-k)")
    if q.shape[-1] != 128 or q.shape[2] not in (16, 32, 64):
        raise ValueError(f"attn='cudnn': the indexer needs 16, 32 or 64 heads of 128 (cuDNN's SM90 kernel), got "
                         f"{q.shape[2]} x {q.shape[-1]}")
    dsa = dsa_module()
    B, T, n, d = q.shape
    S = k.shape[1]
    out = torch.full((B, T, topk), -1, dtype=torch.int32, device=q.device)
    if T == 0 or S == 0 or topk == 0:
        return out
    qb, kb, wb = q.to(torch.bfloat16), k.to(torch.bfloat16), w.to(torch.float32)
    rows = max(1, min(T, SCORE_BUFFER_BYTES // (4 * S)))
    step = max(TOPK_ROWS, TOPK_BUFFER_BYTES // (4 * S) // TOPK_ROWS * TOPK_ROWS)
    i32 = dict(dtype=torch.int32, device=q.device)
    for b in range(B):
        for t0 in range(0, T, rows):
            t1 = min(T, t0 + rows)
            lo_b, hi_b = lo[b, t0:t1].clamp(0, S), hi[b, t0:t1].clamp(0, S)
            # packed (THD) form, one segment: query t0 + i sees the keys below offset + i + 1 (every key without
            # `causal`); the ranges mask the rest below
            scores = dsa.indexer_forward_wrapper(
                qb[b, t0:t1], kb[b, :, None], wb[b, t0:t1], ratio=1, sm_scale=1.0,
                cu_seqlens_q=torch.tensor([0, t1 - t0], **i32), cu_seqlens_k=torch.tensor([0, S], **i32),
                max_seqlen_q=t1 - t0, max_seqlen_k=S, q_causal_offsets=torch.tensor([t0 if causal else S], **i32),
            )["scores"]
            scores.masked_fill_(~range_mask(lo_b[None], hi_b[None], S)[0], float("-inf"))
            for r0 in range(0, t1 - t0, step):
                r1 = min(t1 - t0, r0 + step)
                idx = dsa.indexer_top_k_wrapper(scores[r0:r1].contiguous(), hi_b[r0:r1].clamp_min(1).to(torch.int32),
                                                topk, return_val=False, deterministic=True)["indices"]
                keep = (idx >= lo_b[r0:r1, None]) & (idx < hi_b[r0:r1, None])     # -inf picks below lo, -1 pads
                out[b, t0 + r0:t0 + r1] = _valid_first(idx, keep)
    return out


# ---------------------------------------------------------------------------------------------- attention

def _check_widths(q: Tensor, latent: Tensor, d_v: int) -> None:
    if q.dtype not in (torch.bfloat16, torch.float16) or latent.dtype != q.dtype:
        raise ValueError(f"attn='cudnn': cuDNN's sparse backward takes bf16 or fp16 q and latent, got {q.dtype}, "
                         f"{latent.dtype}")
    if (q.shape[-1], d_v) not in ((576, 512), (512, 512)):
        raise ValueError(f"attn='cudnn': cuDNN's sparse backward takes latents of 576 (values 512) or 512, got "
                         f"{q.shape[-1]} (values {d_v})")


def sparse_mla_bwd_cudnn(q: Tensor, latent: Tensor, indices: Tensor, o: Tensor, lse: Tensor, do: Tensor, *,
                         scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    """`kimi::sparse_mla_gather_bwd`'s contract without an LSE gradient (cuDNN takes none) on cuDNN's SM90 sparse
    backward: (dq in q's dtype, dlatent in the latent's)."""
    _check_widths(q, latent, d_v)
    dsa = dsa_module()
    B, T, H, _ = q.shape
    dq = torch.zeros_like(q)
    dlat = torch.zeros(latent.shape, dtype=torch.float32, device=q.device)
    sink = torch.full((H,), float("-inf"), dtype=torch.float32, device=q.device)
    S = latent.shape[1]
    for b in range(B):
        idx = _valid_first(indices[b], (indices[b] >= 0) & (indices[b] < S))     # a valid prefix, as cuDNN reads it
        length = (idx >= 0).sum(-1, dtype=torch.int32)
        rows = (length > 0).nonzero().squeeze(1)          # cuDNN needs a key a row; rows without one get zeros
        if rows.numel() == 0:
            continue
        r = dsa.sparse_attention_backward_wrapper(
            q[b, rows].contiguous(), latent[b].contiguous(), o[b, rows].to(q.dtype).contiguous(),
            do[b, rows].to(q.dtype).contiguous(), lse[b, rows].float().contiguous(), sink, idx[rows].contiguous(),
            softmax_scale=scale, topk_length=length[rows])
        dq[b, rows] = r["dq"].to(q.dtype)
        dlat[b] += r["dkv"].float()
    return dq, dlat.to(latent.dtype)


def sparse_mla_fwd_flashmla(q: Tensor, latent: Tensor, indices: Tensor, *, scale: float,
                            d_v: int) -> tuple[Tensor, Tensor]:
    """`kimi::sparse_mla_gather`'s forward on FlashMLA's `flash_mla_sparse_fwd`: heads padded with zeros to 64 or
    128, slots to a multiple of 128 with -1, per batch row; its natural-log LSE, +inf on a row without keys,
    becomes the contract's -inf (o is 0 there on both)."""
    fwd, why = _load_flash_mla()
    if fwd is None:
        raise CudnnUnavailable(f"sparse_fwd='flashmla': FlashMLA does not import: {why}")
    _check_widths(q, latent, d_v)
    B, T, H, D = q.shape
    heads = next((h for h in FLASH_MLA_HEADS if h >= H), None)
    if heads is None:
        raise ValueError(f"sparse_fwd='flashmla': FlashMLA runs at most {FLASH_MLA_HEADS[-1]} heads, got {H}")
    k = indices.shape[-1]
    pad_k = -k % FLASH_MLA_TOPK_ALIGN
    o = q.new_empty(B, T, H, d_v)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    for b in range(B):
        qp = torch.nn.functional.pad(q[b], (0, 0, 0, heads - H))
        idx = torch.nn.functional.pad(indices[b], (0, pad_k), value=-1)[:, None]
        out, _, l = fwd(qp.contiguous(), latent[b][:, None].contiguous(), idx.contiguous(), scale, d_v=d_v)
        o[b] = out[:, :H]
        lse[b] = torch.where(torch.isposinf(l[:, :H]), float("-inf"), l[:, :H].float())
    return o, lse
