import dataclasses
import json

import pytest
from hypothesis import given, strategies as st

import kimi
from kimi.config import KDAConfig, _k3_layer_lists

# The reference implementation's "tiny-27M" test config: 27,142,320 parameters, 21,833,904 active.
TINY_27M = json.loads("""{"model_type": "kimi_linear", "vocab_size": 8192, "hidden_size": 512, "num_hidden_layers": 4,
 "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 128, "kv_lora_rank": 64,
 "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
 "mla_use_nope": true, "mla_use_output_gate": true,
 "intermediate_size": 1536, "first_k_dense_replace": 1, "moe_layer_freq": 1,
 "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2,
 "moe_intermediate_size": 384, "routed_expert_hidden_size": 256, "latent_moe_use_norm": true,
 "moe_router_activation_func": "sigmoid", "moe_renormalize": true, "routed_scaling_factor": 1.0,
 "use_grouped_topk": true, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
 "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
 "rms_norm_eps": 1e-5, "attn_res_block_size": 2, "tie_word_embeddings": false,
 "num_nextn_predict_layers": 0,
 "linear_attn_config": {"num_heads": 8, "head_dim": 64, "short_conv_kernel_size": 4,
   "kda_layers": [1, 2, 3], "full_attn_layers": [4], "use_full_rank_gate": true, "gate_lower_bound": -5.0}}""")


def test_release_parameter_counts():
    """The release's published counts: 2,779,484,476,000 total, 104.19 B active without the input embedding; the K3.1 Pro
    indexer adds 13,959,424 per gated-MLA layer (335,026,176)."""
    k3, pro = kimi.preset("k3"), kimi.preset("k3_1_pro")
    assert kimi.param_count(k3) == 2_779_484_476_000
    assert kimi.param_count(k3, active=True) == 105_364_017_760
    assert kimi.param_count(k3, active=True, embedding=False) == 104_189_612_640
    assert kimi.param_count(pro) - kimi.param_count(k3) == 335_026_176 == 24 * 13_959_424


def test_tiny_27m_counts_and_structure():
    cfg = kimi.ModelConfig.from_hf(TINY_27M)
    assert kimi.param_count(cfg) == 27_142_320
    assert kimi.param_count(cfg, active=True) == 21_833_904
    assert cfg.layer_types == ("kda", "kda", "kda", "mla")
    assert cfg.num_attn_res_blocks == 2 and not cfg.has_indexer


def test_release_layer_pattern():
    cfg = kimi.preset("k3_1_pro")
    mla = [i for i, t in enumerate(cfg.layer_types) if t == "mla"]
    assert mla == [*range(3, 92, 4), 92] and len(mla) == 24
    assert cfg.num_attn_res_blocks == 8
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5)


def test_wrapped_and_text_only_configs_agree(tmp_path):
    text = kimi.preset("tiny").to_hf()
    wrapped = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
               "vision_config": {"vt_hidden_size": 1024}, "media_placeholder_token_id": 163605}
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    assert kimi.ModelConfig.from_hf(tmp_path) == kimi.ModelConfig.from_hf(text) == kimi.preset("tiny")
    assert kimi.ModelConfig.from_hf({**text, "some_future_key": 3}) == kimi.preset("tiny")


@pytest.mark.parametrize("key", ["hidden_size", "kv_lora_rank", "attn_res_block_size", "num_experts"])
def test_missing_required_key_is_named(key):
    text = kimi.preset("tiny").to_hf()
    del text[key]
    with pytest.raises(ValueError, match=key):
        kimi.ModelConfig.from_hf(text)


def test_bad_values_are_named():
    text = kimi.preset("tiny").to_hf()
    with pytest.raises(ValueError, match="hidden_size"):
        kimi.ModelConfig.from_hf({**text, "hidden_size": "128"})
    with pytest.raises(ValueError, match="index_topk"):
        kimi.ModelConfig.from_hf({**text, "index_topk": None})
    with pytest.raises(ValueError, match="situ"):
        kimi.ModelConfig.from_hf({**text, "hidden_act": "silu"})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        kimi.ModelConfig.from_hf({**text, "num_key_value_heads": 2})
    with pytest.raises(FileNotFoundError):
        kimi.ModelConfig.from_hf("/nonexistent/checkpoint")


@given(L=st.integers(1, 40), data=st.data())
def test_layer_lists_must_partition(L, data):
    kda, full = _k3_layer_lists(L)
    ok = KDAConfig(num_heads=2, head_dim=8, kda_layers=kda, full_attn_layers=full)
    cfg = dataclasses.replace(kimi.preset("tiny"), num_hidden_layers=L, first_k_dense_replace=min(1, L),
                              linear_attn_config=ok)
    assert sum(t == "mla" for t in cfg.layer_types) == len(full)
    layer = data.draw(st.integers(1, L))
    broken = [
        dataclasses.replace(ok, kda_layers=tuple(x for x in kda if x != layer),
                            full_attn_layers=tuple(x for x in full if x != layer)),   # a layer in neither
        dataclasses.replace(ok, kda_layers=tuple(sorted(set(kda) | {layer})),
                            full_attn_layers=tuple(sorted(set(full) | {layer}))),      # a layer in both
        dataclasses.replace(ok, full_attn_layers=(*full, L + 1)),                       # out of range
    ]
    for la in broken:
        with pytest.raises(ValueError, match="partition"):
            dataclasses.replace(cfg, linear_attn_config=la)


def test_missing_linear_attn_config_uses_k3_pattern():
    text = kimi.preset("tiny").to_hf()
    del text["linear_attn_config"]
    cfg = kimi.ModelConfig.from_hf(text)
    assert cfg.linear_attn_config.full_attn_layers == (4, 8) and cfg.linear_attn_config.num_heads == 96


def test_backend_choices_are_checked():
    assert kimi.Backend() == kimi.Backend(attn="auto", mla_form="auto", kda="auto", moe="auto")
    with pytest.raises(ValueError, match="Backend.attn"):
        kimi.Backend(attn="flash")
    with pytest.raises(ValueError, match="Backend.kda"):
        kimi.Backend(kda="fused")
    assert hash(kimi.Backend()) == hash(kimi.Backend())
