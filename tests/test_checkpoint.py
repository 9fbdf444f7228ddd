"""kimi/checkpoint.py: MXFP4, the checkpoint layout (docs/checkpoints.md), error reports, atomic saves."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import kimi.checkpoint as ck
from kimi.checkpoint import CheckpointError, load_checkpoint, mxfp4_decode, mxfp4_encode, save_checkpoint
from kimi.config import ModelConfig, preset
from kimi.params import init_params, param_specs, tree_items

LUT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
MAG = LUT[:8]
CFG = preset("tiny")
P = "language_model."


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern, so that -0.0 != 0.0 and dtypes must agree."""
    return t.detach().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_tree(a, b):
    a, b = dict(tree_items(a)), dict(tree_items(b))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(bits(a[k]), bits(b[k])), k


def ref_decode(packed, scale):
    """Element by element from the nibble rule, in Python floats."""
    rows = []
    for r in range(packed.shape[0]):
        row = []
        for j, b in enumerate(packed[r].tolist()):
            for code in (b & 0x0F, b >> 4):  # element 2j is the low nibble
                row.append(math.ldexp(LUT[code], int(scale[r, len(row) // 32]) - 127))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


# ============================================================================================== MXFP4 decode

def test_decode_arange_vector():
    packed = torch.arange(32, dtype=torch.uint8).reshape(2, 16)
    scale = torch.full((2, 1), 127, dtype=torch.uint8)
    # byte j of row 0 is j: low nibble j, high nibble 0; row 1 holds 16+j: low nibble j, high nibble 1 (0.5)
    row0 = [v for j in range(16) for v in (LUT[j], 0.0)]
    row1 = [v for j in range(16) for v in (LUT[j], 0.5)]
    expected = torch.tensor([row0, row1], dtype=torch.bfloat16)
    got = mxfp4_decode(packed, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 32)
    assert torch.equal(bits(got), bits(expected))
    assert got[0, 16].item() == 0.0 and math.copysign(1, got[0, 16].item()) == -1  # code 8 is -0
    assert got[0, :6].tolist() == [0.0, 0.0, 0.5, 0.0, 1.0, 0.0]


def test_decode_zeros():
    got = mxfp4_decode(torch.zeros(1, 16, dtype=torch.uint8), torch.full((1, 1), 127, dtype=torch.uint8))
    assert got.shape == (1, 32) and got.dtype == torch.bfloat16
    assert torch.equal(bits(got), torch.zeros(1, 32, dtype=torch.int16))


@pytest.mark.parametrize("s", [0, 1, 100, 120, 126, 127, 128, 130, 200, 252])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_decode_scales_are_exact_powers_of_two(s, dtype):
    g = torch.Generator().manual_seed(s)
    packed = torch.randint(0, 256, (3, 64), dtype=torch.uint8, generator=g)
    scale = torch.full((3, 4), s, dtype=torch.uint8)
    scale[1, 2] = 127  # groups scale independently
    got = mxfp4_decode(packed, scale, dtype)
    assert got.dtype == dtype
    assert torch.equal(bits(got), bits(ref_decode(packed, scale).to(dtype)))
    # and the float64 reference itself is exact: value / 2^(s-127) is an E2M1 value
    unit = ref_decode(packed, torch.full((3, 4), 127, dtype=torch.uint8))
    assert torch.equal(got.double()[0] / 2.0 ** (s - 127), unit[0])


def test_decode_scale_255_no_special_case():
    packed = torch.tensor([[0x21] * 16], dtype=torch.uint8)  # codes 1 (0.5), 2 (1.0)
    got = mxfp4_decode(packed, torch.tensor([[255]], dtype=torch.uint8), torch.float64)
    assert got[0, :2].tolist() == [2.0**127, 2.0**128]


def test_decode_sign_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes | (codes << 4)).reshape(1, 16)  # both nibbles of byte j hold code j
    got = mxfp4_decode(packed, torch.tensor([[128]], dtype=torch.uint8), torch.float32)
    assert got[0, 0::2].tolist() == got[0, 1::2].tolist() == [2 * v for v in LUT]
    assert torch.equal(torch.signbit(got[0, 0::2]), codes >= 8)  # code 8 is -0.0, not +0.0


def test_decode_into_strided_destination():
    dest = torch.full((3, 2, 64), 7.0, dtype=torch.bfloat16)
    view = dest[:, 1, ::2]  # [3, 32], non-contiguous
    ptr = view.data_ptr()
    packed = torch.randint(0, 256, (3, 16), dtype=torch.uint8)
    scale = torch.randint(100, 140, (3, 1), dtype=torch.uint8)
    out = mxfp4_decode(packed, scale, out=view)
    assert out.data_ptr() == ptr
    assert torch.equal(bits(dest[:, 1, ::2]), bits(mxfp4_decode(packed, scale)))
    assert (dest[:, 0] == 7).all() and (dest[:, 1, 1::2] == 7).all()


def test_mxfp4_errors():
    u8 = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_decode(u8.to(torch.int32), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_decode(u8, torch.zeros(2, 1, dtype=torch.float32))
    with pytest.raises(ValueError, match="do not match"):
        mxfp4_decode(u8, torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not match"):
        mxfp4_decode(u8, torch.zeros(3, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="divisible by 32"):
        mxfp4_encode(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="floating"):
        mxfp4_encode(torch.zeros(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="inf or NaN"):
        mxfp4_encode(torch.tensor([[math.inf] + [0.0] * 31]))


# ============================================================================================== MXFP4 encode

def test_encode_rounding_rule():
    """Nearest E2M1 value, ties to the even code; the scale is the smallest that does not clip."""
    k = -3
    row = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -5, 0.3, 4.9, 5.1, -0.0, 0.0, 2.4] + [0.0] * 16
    want = [7, 0, 2, 2, 4, 4, 6, 6, 8, 14, 1, 6, 7, 8, 0, 4] + [0] * 16
    packed, scale = mxfp4_encode(torch.tensor([row], dtype=torch.float64) * 2.0**k)
    assert scale.tolist() == [[127 + k]]
    codes = torch.stack((packed & 15, packed >> 4), -1).flatten(-2)
    assert codes[0].tolist() == want
    # smallest scale: max 6.0001 needs the next scale up; max 3 fits 6 at one scale down
    assert mxfp4_encode(torch.tensor([[6.0001] + [0.0] * 31]))[1].item() == 128
    assert mxfp4_encode(torch.tensor([[3.0] + [0.0] * 31]))[1].item() == 126
    assert mxfp4_encode(torch.zeros(1, 64))[1].tolist() == [[127, 127]]  # all-zero groups: scale 1


# SHIFT[v]: how many doublings keep a group whose largest magnitude is v within 6 (the canonical scale is s - SHIFT)
SHIFT = {0.5: 3, 1.0: 2, 1.5: 2, 2.0: 1, 3.0: 1, 4.0: 0, 6.0: 0}


def canonical(codes: torch.Tensor, scale: torch.Tensor):
    """What encode(decode(codes, scale)) must return. Decoding is many-to-one only through equivalent scales:
    a group whose largest magnitude is v < 4 equals the same group with every magnitude doubled j times and the
    scale lowered by j; encode picks the smallest scale (j = min(SHIFT[v], s)); an all-zero group gets 127 with
    its codes (and signs: -0 is code 8) kept."""
    codes, scale = codes.clone(), scale.clone()
    for r in range(codes.shape[0]):
        for g in range(scale.shape[1]):
            c = codes[r, 32 * g: 32 * g + 32]
            vmax = max(MAG[int(x) & 7] for x in c)
            if vmax == 0:
                scale[r, g] = 127
                continue
            j = min(SHIFT[vmax], int(scale[r, g]))
            scale[r, g] -= j
            for i, x in enumerate(c.tolist()):
                c[i] = (x & 8) | MAG.index(MAG[x & 7] * 2**j)
    return codes, scale


def pack(codes):
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 4), groups=st.integers(1, 3),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]), sparse=st.booleans())
def test_encode_inverts_decode(seed, rows, groups, dtype, sparse):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, 32 * groups), dtype=torch.uint8, generator=g)
    if sparse:  # small magnitudes only and some all-zero groups, so the equivalent-scale cases come up
        codes = codes & torch.randint(0, 2, codes.shape, dtype=torch.uint8, generator=g).mul(8).add(3)
        codes[0, :32] &= 8
    # float64 represents every scale; in float32/bfloat16, 6·2^(s-127) overflows above s = 252
    scale = torch.randint(0, 256 if dtype == torch.float64 else 253, (rows, groups), dtype=torch.uint8, generator=g)
    w = mxfp4_decode(pack(codes), scale, dtype)
    p2, s2 = mxfp4_encode(w)
    want_codes, want_scale = canonical(codes, scale)
    assert torch.equal(s2, want_scale)
    assert torch.equal(p2, pack(want_codes))
    assert torch.equal(bits(mxfp4_decode(p2, s2, dtype)), bits(w))  # representable tensors come back bit-exactly


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 3), groups=st.integers(1, 3),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
def test_decode_encode_is_nearest(seed, rows, groups, dtype):
    g = torch.Generator().manual_seed(seed)
    mag = 2.0 ** torch.randint(-30, 30, (rows, groups, 1), generator=g)
    w = (torch.randn(rows, groups, 32, generator=g, dtype=torch.float64) * mag)
    w[0, 0, torch.randint(0, 32, (8,), generator=g)] = 0.0
    if rows > 1:
        w[1, 0] = 0.0  # an all-zero group
    w = w.flatten(-2).to(dtype)
    packed, scale = mxfp4_encode(w)
    x = w.double().unflatten(-1, (-1, 32))
    amax = x.abs().amax(-1)
    s = scale.double() - 127
    # smallest non-clipping scale (127 for all-zero groups)
    smallest = (amax <= 6 * 2**s) & ((scale == 0) | (amax > 6 * 2 ** (s - 1)))
    assert torch.where(amax == 0, scale == 127, smallest).all()
    dec = mxfp4_decode(packed, scale, torch.float64).unflatten(-1, (-1, 32))
    grid = torch.tensor(LUT, dtype=torch.float64) * (2**s)[..., None, None]  # [r, G, 1, 16]
    dist = (grid - x[..., None]).abs()
    best = dist.amin(-1)
    assert torch.equal((dec - x).abs(), best)  # each element is a nearest grid value
    assert torch.equal(torch.signbit(dec), torch.signbit(x))
    codes = torch.stack((packed & 15, packed >> 4), -1).flatten(-2).unflatten(-1, (-1, 32)).long()
    tie = ((dist == best[..., None]) & (grid.abs() != dec.abs()[..., None])).any(-1)
    assert ((codes[tie] & 7) % 2 == 0).all()  # ties went to the even code


# ============================================================================================== round trip

@pytest.mark.parametrize("dtype,wrap", [("bfloat16", True), ("float32", True), ("float64", True), ("float32", False)])
def test_round_trip_bit_exact(tmp_path, dtype, wrap):
    params = init_params(CFG, seed=1, dtype=dtype)
    path = tmp_path / "ck"
    save_checkpoint(path, CFG, params, max_shard_bytes=300_000, wrap=wrap)
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) >= 3
    n = len(shards)
    assert [s.name for s in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    cfg2, params2 = load_checkpoint(path)
    assert cfg2 == dataclasses.replace(CFG, dtype=dtype)  # config.json records the tree's dtype
    assert_same_tree(params, params2)

    index = json.loads((path / "model.safetensors.index.json").read_text())
    pre = P if wrap else ""
    names = set(index["weight_map"])
    assert all(n.startswith(P) for n in names) == wrap
    sizes = 0
    for shard in shards:
        for n, t in load_file(shard).items():
            assert index["weight_map"][n] == shard.name
            sizes += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == sizes
    assert f"{pre}model.layers.1.block_sparse_moe.experts.7.w2.weight" in names
    assert not any(n.endswith(("experts.w1", "experts.w2", "experts.w3")) for n in names)
    a_name = f"{pre}model.layers.0.self_attn.A_log"
    a_log = load_file(path / index["weight_map"][a_name])[a_name]
    H = CFG.linear_attn_config.num_heads
    assert a_log.shape == (128,) and (a_log[H:] == 0).all()
    assert torch.equal(bits(a_log[:H]), bits(params["model"]["layers"][0]["self_attn"]["A_log"]))
    config = json.loads((path / "config.json").read_text())
    if wrap:
        assert config["model_type"] == "kimi_k3" and config["architectures"] == ["KimiK3ForConditionalGeneration"]
        assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (256, 258, 511)
        assert config["text_config"]["model_type"] == "kimi_linear"
    else:
        assert config["model_type"] == "kimi_linear" and "text_config" not in config


def test_mxfp4_experts_round_trip(tmp_path):
    params = init_params(CFG, seed=2, dtype="bfloat16")
    g = torch.Generator().manual_seed(0)
    for path, leaf in tree_items(params):
        if ".experts." in path:  # representable values: decode of random codes and scales
            E, rows, cols = leaf.shape
            codes = torch.randint(0, 16, (E, rows, cols), dtype=torch.uint8, generator=g)
            scale = torch.randint(110, 130, (E, rows, cols // 32), dtype=torch.uint8, generator=g)
            leaf.data.copy_(mxfp4_decode(pack(codes), scale))
    save_checkpoint(tmp_path / "ck", CFG, params, experts="mxfp4", max_shard_bytes=100_000)
    _, params2 = load_checkpoint(tmp_path / "ck")
    assert_same_tree(params, params2)
    tensors = read_all(tmp_path / "ck")
    e = f"{P}model.layers.3.block_sparse_moe.experts.5"
    m, Z = CFG.moe_intermediate_size, CFG.routed_expert_hidden_size
    packed = tensors[f"{e}.w1.weight_packed"]
    assert packed.shape == (m, Z // 2) and packed.dtype == torch.uint8
    assert tensors[f"{e}.w2.weight_scale"].shape == (Z, m // 32) and f"{e}.w1.weight" not in tensors
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    q = config["text_config"]["quantization_config"]
    assert q["format"] == "mxfp4-pack-quantized" and q["config_groups"]["group_0"]["weights"]["group_size"] == 32


def test_mixed_plain_and_mxfp4_experts_single_file(tmp_path):
    params = init_params(CFG, seed=3, dtype="float32")
    save_checkpoint(tmp_path / "ck", CFG, params)
    e = f"{P}model.layers.2.block_sparse_moe.experts.4.w3"

    def to_mxfp4(t):
        t[f"{e}.weight_packed"], t[f"{e}.weight_scale"] = mxfp4_encode(t.pop(f"{e}.weight"))

    rewrite(tmp_path / "ck", to_mxfp4)
    _, params2 = load_checkpoint(tmp_path / "ck")
    w = params["model"]["layers"][2]["block_sparse_moe"]["experts"]["w3"]
    w2 = params2["model"]["layers"][2]["block_sparse_moe"]["experts"]["w3"]
    assert torch.equal(w2[4], mxfp4_decode(*mxfp4_encode(w[4]), torch.float32))
    assert torch.equal(w2[3], w[3]) and not torch.equal(w2[4], w[4])


def test_unpadded_a_log_and_vision_tensors_load(tmp_path):
    params = init_params(CFG, seed=4, dtype="bfloat16")
    save_checkpoint(tmp_path / "ck", CFG, params)
    H = CFG.linear_attn_config.num_heads

    def edit(t):
        t[f"{P}model.layers.1.self_attn.A_log"] = t[f"{P}model.layers.1.self_attn.A_log"][:H].clone()
        t["vision_tower.patch_embed.weight"] = torch.ones(3, 3)
        t["mm_projector.proj.weight"] = torch.ones(2)

    rewrite(tmp_path / "ck", edit)
    _, params2 = load_checkpoint(tmp_path / "ck")
    assert_same_tree(params, params2)


def test_dtype_device_trainable_contract(tmp_path):
    params = init_params(CFG, seed=5, dtype="float32")
    save_checkpoint(tmp_path / "ck", CFG, params)
    cfg, loaded = load_checkpoint(tmp_path / "ck", dtype="bfloat16", device="cpu")
    specs = dict(tree_items(param_specs(cfg)))
    orig = dict(tree_items(params))
    kept = {"A_log", "dt_bias", "q_conv1d.weight", "o_norm.weight", "e_score_correction_bias"}
    seen = set()
    for path, leaf in tree_items(loaded):
        spec = specs[path]
        assert isinstance(leaf, torch.nn.Parameter) and leaf.device.type == "cpu"
        assert leaf.requires_grad == spec.trainable
        if ".indexer." in path or path.endswith("e_score_correction_bias"):
            assert not leaf.requires_grad, path
        assert leaf.dtype == (torch.float32 if spec.fp32 else torch.bfloat16), path
        assert torch.equal(leaf, orig[path].to(leaf.dtype)), path
        seen |= {k for k in kept if path.endswith(k)}
    assert seen == kept


# ============================================================================================== errors

def read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


def rewrite(folder: Path, edit):
    """Apply edit(tensors dict) and write the result back as one model.safetensors file (no index)."""
    tensors = read_all(folder)
    edit(tensors)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    (folder / "model.safetensors.index.json").unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "ck"
    save_checkpoint(path, CFG, init_params(CFG, seed=6, dtype="bfloat16"), max_shard_bytes=400_000)
    return path


@pytest.fixture
def ck_copy(saved, tmp_path):
    import shutil

    return Path(shutil.copytree(saved, tmp_path / "ck"))


def load_error(path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert isinstance(e.value, ValueError)
    return str(e.value)


def test_missing_tensor(ck_copy):
    rewrite(ck_copy, lambda t: t.pop(f"{P}model.norm.weight"))
    msg = load_error(ck_copy)
    assert "missing (1)" in msg and f"{P}model.norm.weight" in msg


def test_unexpected_tensor(ck_copy):
    rewrite(ck_copy, lambda t: t.update({f"{P}model.layers.0.extra.weight": torch.zeros(2)}))
    msg = load_error(ck_copy)
    assert "unexpected (1)" in msg and f"{P}model.layers.0.extra.weight" in msg


def test_transposed_kv_b_proj(ck_copy):
    name = f"{P}model.layers.3.self_attn.kv_b_proj.weight"
    rewrite(ck_copy, lambda t: t.update({name: t[name].T.contiguous()}))
    msg = load_error(ck_copy)
    H, d = CFG.num_attention_heads, CFG.qk_nope_head_dim + CFG.v_head_dim
    assert name in msg and f"[{CFG.kv_lora_rank}, {H * d}]" in msg and "transposed" in msg


def test_bad_a_log_and_wrong_dtype_and_half_mxfp4_pair(ck_copy):
    a = f"{P}model.layers.0.self_attn.A_log"
    e = f"{P}model.layers.1.block_sparse_moe.experts.0.w1"

    def edit(t):
        t[a] = torch.zeros(100)
        t[f"{P}model.norm.weight"] = t[f"{P}model.norm.weight"].to(torch.int32)
        t[f"{e}.weight_packed"] = mxfp4_encode(t.pop(f"{e}.weight"))[0]

    rewrite(ck_copy, edit)
    msg = load_error(ck_copy)
    assert f"{a}: [100]" in msg and "multiple of 128" in msg
    assert f"{P}model.norm.weight: I32" in msg
    assert f"{e}.weight_scale" in msg and "missing (1)" in msg


def test_missing_shard_and_bad_index_entry(ck_copy):
    index = json.loads((ck_copy / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][f"{P}lm_head.weight"]
    (ck_copy / shard).unlink()
    norm_shard = index["weight_map"][f"{P}model.norm.weight"]
    index["weight_map"][f"{P}model.norm.weight"] = next(f for f in sorted(set(index["weight_map"].values()))
                                                       if f not in (shard, norm_shard))
    (ck_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = load_error(ck_copy)
    assert shard in msg and "not in the folder" in msg
    assert f"{P}model.norm.weight" in msg and "does not hold it" in msg


def test_missing_config_key(ck_copy):
    config = json.loads((ck_copy / "config.json").read_text())
    del config["text_config"]["hidden_size"]
    (ck_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_size"):
        load_checkpoint(ck_copy)


def test_one_error_lists_everything_and_caps(ck_copy):
    def edit(t):
        t["model.norm.weight"] = t.pop(f"{P}model.norm.weight")  # lost its prefix
        t.pop(f"{P}model.layers.2.block_sparse_moe.experts.3.w2.weight")
        for i in range(25):
            t[f"{P}junk.{i}"] = torch.zeros(1)
        t[f"{P}lm_head.weight"] = t[f"{P}lm_head.weight"][:, :8].contiguous()

    rewrite(ck_copy, edit)
    msg = load_error(ck_copy)
    assert "missing (2)" in msg and "unexpected (26)" in msg and "mis-shaped (1)" in msg
    assert "lack the 'language_model.' prefix" in msg
    assert f"{P}model.norm.weight" in msg and "experts.3.w2.weight (or .weight_packed + .weight_scale)" in msg
    assert f"{P}lm_head.weight: [512, 8]" in msg
    assert "... and 6 more" in msg and msg.count(f"{P}junk.") == 20


def test_k3_checkpoint_with_indexer_config(tmp_path):
    k3 = dataclasses.replace(CFG, index_n_heads=None, index_head_dim=None, index_topk=None)
    save_checkpoint(tmp_path / "ck", k3, init_params(k3, dtype="bfloat16"))
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    config["text_config"] |= dict(index_n_heads=4, index_head_dim=32, index_topk=16)
    (tmp_path / "ck" / "config.json").write_text(json.dumps(config))
    msg = load_error(tmp_path / "ck")
    for leaf in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
        assert f"{P}model.layers.3.self_attn.indexer.{leaf}" in msg
    assert "K3 checkpoint" in msg


def test_errors_read_no_data_and_success_reads_each_tensor_once(ck_copy, monkeypatch):
    reads = []

    class Counting:
        def __init__(self, *a, **k):
            self.f = safe_open(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def get_tensor(self, name):
            reads.append(name)
            return self.inner.get_tensor(name)

        def __getattr__(self, k):
            return getattr(self.inner, k)

    monkeypatch.setattr(ck, "safe_open", Counting)
    load_checkpoint(ck_copy)
    index = json.loads((ck_copy / "model.safetensors.index.json").read_text())
    assert sorted(reads) == sorted(index["weight_map"])
    reads.clear()
    rewrite(ck_copy, lambda t: t.pop(f"{P}model.norm.weight"))
    load_error(ck_copy)
    assert reads == []


# ============================================================================================== atomic save

def test_atomic_save_failure_keeps_previous(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    old = init_params(CFG, seed=7, dtype="bfloat16")
    save_checkpoint(path, CFG, old, max_shard_bytes=300_000)
    calls = []

    def failing_save_file(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        return save_file(*a, **k)

    monkeypatch.setattr(ck, "save_file", failing_save_file)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(path, CFG, init_params(CFG, seed=8, dtype="bfloat16"), max_shard_bytes=300_000)
    assert len(calls) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary folder left behind
    assert_same_tree(old, load_checkpoint(path)[1])

    monkeypatch.setattr(ck, "save_file", save_file)
    new = init_params(CFG, seed=8, dtype="float32")
    save_checkpoint(path, CFG, new)  # a successful save replaces the folder as a whole
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    assert len(list(path.glob("*.safetensors"))) == 1
    assert_same_tree(new, load_checkpoint(path)[1])


def test_save_refuses_non_checkpoint_folder_and_bad_trees(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    params = init_params(CFG, dtype="bfloat16")
    with pytest.raises(FileExistsError):
        save_checkpoint(tmp_path / "notes", CFG, params)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="experts"):
        save_checkpoint(tmp_path / "x", CFG, params, experts="fp8")
    del params["model"]["norm"]
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        save_checkpoint(tmp_path / "x", CFG, params)
    assert not (tmp_path / "x").exists()


def test_saved_files_get_the_usual_permissions(tmp_path):
    """Every file of a saved checkpoint is readable as any new file is here (0666 less the umask); safetensors
    alone would write its shards 0600."""
    import os
    import stat
    cfg = preset("tiny")
    save_checkpoint(tmp_path / "ckpt", cfg, init_params(cfg, seed=0))
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "ckpt").iterdir()}
    assert modes and all(m == 0o666 & ~mask for m in modes.values()), modes


def test_a_truncated_shard_is_reported_as_the_cause_alone(tmp_path):
    """A shard cut short (a copy interrupted): the report names the file and stops there, without listing its
    tensors as missing or hinting at a config mismatch."""
    cfg = preset("tiny")
    save_checkpoint(tmp_path / "ckpt", cfg, init_params(cfg, seed=0), max_shard_bytes=2**20)
    shard = sorted((tmp_path / "ckpt").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "ckpt")
    text = str(e.value)
    assert f"{shard.name}: cannot read the safetensors header" in text
    assert "missing" not in text and "hint" not in text, text
