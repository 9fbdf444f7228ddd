"""CPU stand-ins for cuDNN Frontend's DSA wrappers and FlashMLA's sparse forward, written from their documented
contracts (shapes, masks, tie rules, LSE conventions), so that the adapter `kimi/ops/cudnn_dsa.py` is tested
without the packages; each asserts the input contract the real kernel states. The H200 tests of
tests/test_cudnn_backend.py run the real ones."""

from __future__ import annotations

import contextlib

import torch

from kimi.ops import cudnn_dsa, lightning_index
from kimi.ops.sparse_attention import sparse_mla_gather, sparse_mla_gather_bwd


class FakeDSA:
    calls: dict[str, int] = {}

    @classmethod
    def _count(cls, name):
        cls.calls[name] = cls.calls.get(name, 0) + 1

    @classmethod
    def indexer_forward_wrapper(cls, q, k, w, ratio=4, sm_scale=1.0, cu_seqlens_q=None, cu_seqlens_k=None,
                                max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None, **unused):
        """THD, one segment: scores [T_q, S] in fp32 of bf16 q [T_q, n, 128], k [S, 1, 128]; key j visible to query
        i when j < clamp(offset + i + 1, 0, S), -inf otherwise."""
        cls._count("indexer_forward_wrapper")
        assert ratio == 1 and q.dim() == 3 and k.dim() == 3 and k.shape[1] == 1 and w.shape == q.shape[:2]
        assert q.dtype == k.dtype == torch.bfloat16 and cu_seqlens_q.tolist() == [0, q.shape[0]]
        assert cu_seqlens_k.tolist() == [0, k.shape[0]] and max_seqlen_q == q.shape[0] and max_seqlen_k == k.shape[0]
        s = sm_scale * lightning_index.scores(q[None].float(), k[None, :, 0].float(), w[None].float())[0]
        Tq, S = s.shape
        limit = (int(q_causal_offsets[0]) + torch.arange(Tq) + 1).clamp(0, S)
        return {"scores": s.masked_fill(torch.arange(S)[None] >= limit[:, None], float("-inf"))}

    @classmethod
    def indexer_top_k_wrapper(cls, input_values, seq_lens, top_k, next_n=1, return_val=True, deterministic=False,
                              **unused):
        """Row i: the top_k largest of its first seq_lens[i] columns, ties to the smaller column; with
        `deterministic` in ascending column order; -1 past a short row's length."""
        cls._count("indexer_top_k_wrapper")
        assert 0 < top_k <= 2048 and next_n == 1 and deterministic and not return_val
        assert input_values.is_contiguous() and seq_lens.dtype == torch.int32 and bool((seq_lens >= 1).all())
        n, cols = input_values.shape
        inside = torch.arange(cols)[None] < seq_lens[:, None]
        order = torch.sort(input_values.float(), dim=-1, descending=True, stable=True).indices
        outside = (~torch.gather(inside, -1, order)).int()        # the row's columns first, in score order
        order = torch.gather(order, -1, torch.sort(outside, dim=-1, stable=True).indices)
        pick = order[:, :top_k]
        if pick.shape[1] < top_k:
            pick = torch.nn.functional.pad(pick, (0, top_k - pick.shape[1]), value=cols)
        pick = torch.where(torch.arange(top_k)[None] < seq_lens[:, None], pick, cols)
        pick = pick.sort(-1).values
        return {"indices": torch.where(pick == cols, -1, pick).to(torch.int32)}

    @classmethod
    def sparse_attention_backward_wrapper(cls, q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None,
                                          topk_length=None, **unused):
        """dq, dkv of the absorbed sparse attention (kv the 2-D latent, values its first out.shape[-1] columns);
        the first topk_length[i] indices of row i valid, the rest ignored; natural-log LSE; no sink."""
        cls._count("sparse_attention_backward_wrapper")
        assert q.dim() == 3 and kv.dim() == 2 and out.shape == dout.shape and lse.dtype == torch.float32
        assert bool(torch.isneginf(attn_sink).all()) and topk_length is not None and bool((topk_length >= 1).all())
        prefix = torch.arange(topk_idxs.shape[1])[None] < topk_length[:, None]
        assert bool((topk_idxs[prefix] >= 0).all()), "a -1 inside the valid prefix"
        idx = torch.where(prefix, topk_idxs, -1)
        dq, dkv = sparse_mla_gather_bwd(q[None], kv[None], idx[None], out[None], lse[None], dout[None], None,
                                        scale=softmax_scale, d_v=out.shape[-1])
        return {"dq": dq[0], "dkv": dkv[0], "d_sink": torch.zeros(q.shape[1])}


def fake_flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """FlashMLA's contract: q [s_q, 64 or 128, d], kv [s_kv, 1, d], indices [s_q, 1, topk] with topk % 128 == 0
    (-1 invalid); (out, max_logits, lse) with lse natural-log and +inf on a row without keys."""
    assert q.shape[1] in (64, 128) and kv.dim() == 3 and kv.shape[1] == 1 and indices.shape[1] == 1
    assert indices.shape[-1] % 128 == 0
    o, lse = sparse_mla_gather(q[None], kv[None, :, 0], indices[None, :, 0], scale=sm_scale, d_v=d_v)
    return o[0], torch.zeros_like(lse[0]), torch.where(torch.isneginf(lse[0]), float("inf"), lse[0])


@contextlib.contextmanager
def fake_cudnn(monkeypatch, *, flash=True, widths_checked=True):
    """Route kimi/ops/cudnn_dsa.py to the stand-ins, with the GPU check passed (`require` remembers success);
    `widths_checked=False` lifts the bf16 / 576-wide restriction of cuDNN's backward so tiny models run."""
    monkeypatch.setattr(cudnn_dsa, "_load_dsa", lambda: (FakeDSA, ""))
    monkeypatch.setattr(cudnn_dsa, "_load_flash_mla",
                        lambda: (fake_flash_mla_sparse_fwd, "") if flash else (None, "ModuleNotFoundError: flash_mla"))
    monkeypatch.setattr(cudnn_dsa, "_READY", {"flashmla", "triton", "gather"} if flash else {"triton", "gather"})
    if not widths_checked:
        monkeypatch.setattr(cudnn_dsa, "_check_widths", lambda *a: None)
    FakeDSA.calls = {}
    yield FakeDSA
