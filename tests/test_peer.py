"""Parity with another implementation: a tiny K3 checkpoint written by NVIDIA NeMo AutoModel 0.7.0's `kimi_k3`
(HF layout, wrapped config, 3 shards, MXFP4 experts, A_log padded to 128) with its float32 logits, plain and
packed. How it was made: tests/data/automodel_k3_tiny/README.md."""

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kimi
from helpers import rel_err

FIXTURE = Path(__file__).parent / "data" / "automodel_k3_tiny"
BACKENDS = [kimi.Backend(), kimi.Backend(attn="eager", kda="recurrent", moe="dense"),
            kimi.Backend(attn="eager", mla_form="absorbed", kda="chunk", moe="grouped")]


@pytest.fixture(scope="module")
def peer():
    cfg, params = kimi.load_checkpoint(FIXTURE, dtype="float32")
    return cfg, params, load_file(FIXTURE / "inputs.safetensors")


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_automodel(peer, backend):
    cfg, params, ref = peer
    assert rel_err(kimi.forward(params, ref["input_ids"], cfg, backend), ref["logits"]) < 1e-5
    packed = kimi.forward(params, ref["packed_input_ids"], cfg, backend, document_ids=ref["packed_document_ids"])
    assert rel_err(packed, ref["packed_logits"]) < 1e-5


def test_adding_an_indexer_with_topk_at_least_length_keeps_logits(peer):
    cfg, params, ref = peer
    T = ref["input_ids"].shape[1]
    n, d = 2, 16
    pro = dataclasses.replace(cfg, index_n_heads=n, index_head_dim=d, index_topk=T)
    layers = []
    for i, layer in enumerate(params["model"]["layers"]):
        if cfg.layer_types[i] == "mla":
            indexer = {"wq_b": {"weight": torch.randn(n * d, cfg.q_lora_rank)},
                       "wk": {"weight": torch.randn(d, cfg.hidden_size)},
                       "k_norm": {"weight": torch.randn(d), "bias": torch.randn(d)},
                       "weights_proj": {"weight": torch.randn(n, cfg.hidden_size)}}
            layer = {**layer, "self_attn": {**layer["self_attn"], "indexer": indexer}}
        layers.append(layer)
    with_indexer = {**params, "model": {**params["model"], "layers": layers}}
    backend = kimi.Backend(attn="eager", moe="dense")
    dense = kimi.forward(params, ref["input_ids"], cfg, backend)
    assert torch.equal(kimi.forward(with_indexer, ref["input_ids"], pro, backend), dense)
    sparse = kimi.forward(with_indexer, ref["input_ids"], dataclasses.replace(pro, index_topk=6), backend)
    assert rel_err(sparse, dense) > 1e-4                         # a smaller budget really selects
