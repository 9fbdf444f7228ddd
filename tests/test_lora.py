"""kimi/lora.py: which leaves the adapter targets name, and the adapters' shapes. (Training with adapters and
merging them: tests/test_train.py.)"""

import pytest

import kimi
from kimi import lora

from helpers import small_cfg


def test_lora_targets():
    cfg = small_cfg()
    params = kimi.init_params(cfg, seed=0)
    paths = lora.target_paths(params, lora.ATTENTION_TARGETS + lora.EXPERT_TARGETS)
    assert "model.layers.1.self_attn.kv_b_proj.weight" in paths
    assert "model.layers.1.block_sparse_moe.experts.w2" in paths
    assert not [p for p in paths if "indexer" in p]
    ad = lora.init_adapters(params, ("experts",), 3)
    assert ad["model.layers.1.block_sparse_moe.experts.w1"]["A"].shape == (cfg.num_experts, 3, 64)
    with pytest.raises(lora.LoRAError, match="wq_b"):
        lora.target_paths(params, ("wq_b",))
