"""Build a tiny Kimi K3 reference checkpoint + logits with NVIDIA NeMo AutoModel's kimi_k3 model.

Usage (from /work/peer):
    TRITON_INTERPRET=1 venv/bin/python make_fixture.py --kda triton   # FLA Triton kernels, interpreted on CPU
    venv/bin/python make_fixture.py --kda naive                         # FLA naive_recurrent_kda monkeypatch

Writes /work/peer/fixture/ (or --out).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import TEXT_CONFIG, build_model  # noqa: E402

SEED = 1234
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


# ----------------------------------------------------------------------------- MXFP4 (docs/checkpoints.md#mxfp4)
def random_mxfp4(out_f: int, in_f: int, gen: torch.Generator, scale_lo: int = 121, scale_hi: int = 124):
    """Random E2M1 codes [out,in] (0..15) and E8M0 scales [out,in/32] in [scale_lo, scale_hi]."""
    assert in_f % 32 == 0
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.int64)
    scales = torch.randint(scale_lo, scale_hi + 1, (out_f, in_f // 32), generator=gen, dtype=torch.int64)
    return codes, scales


def decode_codes(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Own decoder (independent of AutoModel): value = LUT[code] * 2^(s-127), fp32."""
    vals = E2M1[codes]
    exp = (scales - 127).repeat_interleave(32, dim=1).to(torch.float32)
    return vals * torch.pow(2.0, exp)


def pack_mxfp4(codes: torch.Tensor, scales: torch.Tensor):
    """Byte j of a row: element 2j in the LOW nibble, element 2j+1 in the HIGH nibble."""
    lo = codes[:, 0::2]
    hi = codes[:, 1::2]
    packed = (lo | (hi << 4)).to(torch.uint8)
    return packed.contiguous(), scales.to(torch.uint8).contiguous()


# ----------------------------------------------------------------------------- init
@torch.no_grad()
def init_nontrivial(model, gen: torch.Generator):
    """Random non-trivial values for every native (non-expert) tensor."""
    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    def rand(shape):
        return torch.rand(shape, generator=gen, dtype=torch.float32)

    sd = model.state_dict(keep_vars=True)
    kinds = {}
    for name, t in sd.items():
        shape = t.shape
        if "experts.gate_and_up_projs" in name or "experts.down_projs" in name:
            continue  # set later from MXFP4 codes
        if name.endswith("A_log"):
            v = torch.log(1.0 + 15.0 * rand(shape))  # log(U(1,16))
            kind = "A_log=log(U(1,16))"
        elif name.endswith("dt_bias"):
            v = 0.5 * randn(shape)
            kind = "0.5*randn"
        elif name.endswith("e_score_correction_bias"):
            v = 0.1 * randn(shape)
            kind = "0.1*randn"
        elif "conv1d" in name:
            v = rand(shape) - 0.5
            kind = "U(-0.5,0.5)"
        elif "norm" in name and name.endswith("weight") and t.dim() == 1:
            v = 1.0 + 0.1 * randn(shape)
            kind = "1+0.1*randn"
        elif name.endswith("embed_tokens.weight"):
            v = randn(shape)
            kind = "randn"
        elif name.endswith("res_proj.weight"):
            v = 0.2 * randn(shape)
            kind = "0.2*randn"
        elif name.endswith("q_a_proj.weight"):
            # small latent (rms ~0.02) so the q_a_layernorm eps (1e-6 in AM) visibly affects logits
            v = 0.003 * randn(shape)
            kind = "q_a_proj 0.003*randn"
        elif name.endswith("kv_a_proj_with_mqa.weight"):
            # compressed-KV rows small (kv_a_layernorm eps visible); k_pe rows normal
            v = 0.1 * randn(shape)
            v[: model.config.kv_lora_rank] *= 0.03
            kind = "kv_a_proj: c rows 0.003*randn, k_pe rows 0.1*randn"
        elif name.endswith("weight") and t.dim() == 2:
            v = 0.1 * randn(shape)
            kind = "0.1*randn"
        else:
            raise RuntimeError(f"unhandled tensor {name} {tuple(shape)}")
        t.copy_(v)
        kinds[name] = kind
    return kinds


def experts_from_mxfp4(model, gen):
    """Draw MXFP4 codes/scales for every routed expert in HF layout and return
    {hf_base_key (no language_model. prefix): (codes, scales)}."""
    cfg = model.config
    m = cfg.moe_intermediate_size
    z = cfg.routed_expert_hidden_size
    out = {}
    for li, layer in model.model.layers.items():
        if not layer.is_moe_layer:
            continue
        for e in range(cfg.num_experts):
            for proj, (o, i) in (("w1", (m, z)), ("w3", (m, z)), ("w2", (z, m))):
                out[f"model.layers.{li}.block_sparse_moe.experts.{e}.{proj}.weight"] = random_mxfp4(o, i, gen)
    return out


# ----------------------------------------------------------------------------- KDA via naive recurrence
def install_naive_kda():
    """Make AutoModel's KDA core use FLA's naive_recurrent_kda (torch loop) instead of chunk_kda."""
    import importlib.util

    import nemo_automodel.components.models.kimi_k3.model as am

    try:
        from fla.ops.kda.naive import naive_recurrent_kda
    except Exception:  # pragma: no cover
        import fla
        path = os.path.join(os.path.dirname(fla.__file__), "ops", "kda", "naive.py")
        spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        naive_recurrent_kda = mod.naive_recurrent_kda

    def l2(x):
        # FLA in-kernel l2norm: x / sqrt(sum x^2 + 1e-6), fp32
        xf = x.float()
        return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def naive_kernel(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
                     use_qk_l2norm_in_kernel=True, scale=None, **kw):
        assert initial_state is None
        if use_qk_l2norm_in_kernel:
            q, k = l2(q), l2(k)
        if cu_seqlens is None:
            o, _ = naive_recurrent_kda(q, k, v, g, beta, scale=scale)
            return o, None
        assert q.shape[0] == 1
        outs = []
        cs = cu_seqlens.tolist()
        for s, e in zip(cs[:-1], cs[1:]):
            o, _ = naive_recurrent_kda(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale=scale)
            outs.append(o)
        return torch.cat(outs, dim=1), None

    am.chunk_kda = naive_kernel
    am.fused_recurrent_kda = naive_kernel
    return "fla.ops.kda.naive.naive_recurrent_kda (monkeypatched into kimi_k3.model.chunk_kda)"


# ----------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kda", choices=["triton", "naive"], default="triton")
    ap.add_argument("--out", default="/work/peer/fixture")
    ap.add_argument("--no-packed", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(SEED)
    if os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter has no benchmarking driver: make the autotuner skip timing (first config wins).
        from triton.runtime import autotuner as _at
        _at.Autotuner.do_bench = property(lambda self: (lambda fn, quantiles=None, **kw: [0.0, 0.0, 0.0]))
        # tl.gather is not implemented by the interpreter: take FLA's non-gather branch (same math).
        import fla.ops.kda.chunk_intra as _ci
        _ci.IS_GATHER_SUPPORTED = False
        # NOTE: venv fla/ops/common/chunk_delta_h.py line 176 was patched (i_t.to(tl.int64) -> i_t + int64 zero),
        # see /work/peer/fla_interpreter_patch.diff; the interpreter's range() yields Python ints.
    if args.kda == "naive":
        kda_desc = install_naive_kda()
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
        kda_desc = "FLA chunk_kda Triton kernels under TRITON_INTERPRET=1 on CPU"

    cfg, model = build_model()
    model.eval()
    for n, p in model.state_dict().items():
        assert p.dtype == torch.float32, (n, p.dtype)

    gen = torch.Generator().manual_seed(SEED)
    kinds = init_nontrivial(model, gen)
    expert_codes = experts_from_mxfp4(model, gen)

    adapter = model.state_dict_adapter
    # Native -> HF names via AutoModel's own adapter (pads A_log to 128 with zeros).
    hf = adapter.to_hf({k: v.detach().clone() for k, v in model.state_dict().items()})
    # Replace expert weights with the MXFP4-representable ones, and packed representation.
    hf_packed = {}
    for key, value in hf.items():
        base = key.removeprefix("language_model.")
        if base in expert_codes:
            codes, scales = expert_codes[base]
            packed, sc = pack_mxfp4(codes, scales)
            hf_packed[key + "_packed"] = packed
            hf_packed[key + "_scale"] = sc
        else:
            hf_packed[key] = value.detach().to(torch.float32).contiguous()
    assert len([k for k in hf if k.removeprefix("language_model.") in expert_codes]) == len(expert_codes)

    # Load back into the model through AutoModel's own from_hf (its MXFP4 decoder + A_log slicing).
    adapter.dtype = torch.float32
    native = adapter.from_hf({k: v.clone() for k, v in hf_packed.items()})
    missing, unexpected = model.load_state_dict(native, strict=True)
    assert not missing and not unexpected

    # Verify: our own decode of the packed bytes == model's expert weights, bit-exact.
    from nemo_automodel.components.models.kimi_k3.state_dict_adapter import dequantize_mxfp4
    n_checked = 0
    for li, layer in model.model.layers.items():
        if not layer.is_moe_layer:
            continue
        gu = layer.mlp.experts.gate_and_up_projs.detach()  # [E, Z, 2m]
        dn = layer.mlp.experts.down_projs.detach()  # [E, m, Z]
        m = cfg.moe_intermediate_size
        for e in range(cfg.num_experts):
            model_w = {"w1": gu[e][:, :m].T, "w3": gu[e][:, m:].T, "w2": dn[e].T}
            for proj in ("w1", "w2", "w3"):
                key = f"language_model.model.layers.{li}.block_sparse_moe.experts.{e}.{proj}.weight"
                packed, sc = hf_packed[key + "_packed"], hf_packed[key + "_scale"]
                # independent unpack of the bytes
                codes = torch.stack(((packed & 0x0F).long(), (packed >> 4).long()), dim=-1).reshape(packed.shape[0], -1)
                mine = decode_codes(codes, sc.long())
                theirs = dequantize_mxfp4(packed, sc, dtype=torch.float32)
                assert torch.equal(mine.view(torch.int32), model_w[proj].contiguous().view(torch.int32)) or \
                    torch.equal(mine, model_w[proj]), key
                assert torch.equal(mine, theirs), key
                n_checked += 1
    # Also: all other model tensors equal what we store (after A_log slicing).
    sd_after = model.state_dict()
    hf_after = adapter.to_hf({k: v.detach().clone() for k, v in sd_after.items()})
    for key, value in hf_after.items():
        if key in hf_packed:
            assert torch.equal(hf_packed[key], value), key

    # ---------------------------------------------------------------- logits (plain causal)
    g2 = torch.Generator().manual_seed(SEED + 1)
    input_ids = torch.randint(0, TEXT_CONFIG["vocab_size"], (2, 24), generator=g2, dtype=torch.int64)
    with torch.no_grad():
        out = model(input_ids)
    logits = out.logits if hasattr(out, "logits") else out
    logits = logits.float().contiguous()
    assert logits.shape == (2, 24, 256) and torch.isfinite(logits).all()

    # Routing sanity: how often does the correction bias change the selected set?
    bias_changes = route_bias_stats(model, input_ids)

    tensors = {"input_ids": input_ids, "logits": logits}
    packed_info = None
    if not args.no_packed:
        try:
            packed_ids = torch.randint(0, TEXT_CONFIG["vocab_size"], (1, 24), generator=g2, dtype=torch.int64)
            doc_ids = torch.tensor([[1] * 10 + [2] * 14], dtype=torch.int64)
            with torch.no_grad():
                pout = model(
                    packed_ids,
                    attention_mask=doc_ids,
                    packed_token_indices=torch.arange(24, dtype=torch.int64)[None],
                    cu_seqlens=torch.tensor([[0, 10, 24]], dtype=torch.int32),
                )
            plog = (pout.logits if hasattr(pout, "logits") else pout).float().contiguous()
            # Cross-check: each document run alone (plain causal) must match.
            with torch.no_grad():
                a = model(packed_ids[:, :10])
                b = model(packed_ids[:, 10:])
            a = (a.logits if hasattr(a, "logits") else a).float()
            b = (b.logits if hasattr(b, "logits") else b).float()
            sep = torch.cat([a, b], dim=1)
            packed_info = {
                "max_abs_diff_vs_separate_docs": float((plog - sep).abs().max()),
            }
            tensors.update(packed_input_ids=packed_ids, packed_document_ids=doc_ids, packed_logits=plog)
        except Exception as exc:  # noqa: BLE001
            packed_info = {"error": repr(exc)}

    # ---------------------------------------------------------------- write
    os.makedirs(args.out, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(args.out, "inputs.safetensors"))
    write_checkpoint(hf_packed, args.out)

    stats = {
        "kda": kda_desc,
        "logits_mean": float(logits.mean()),
        "logits_std": float(logits.std()),
        "logits_max_abs": float(logits.abs().max()),
        "experts_checked_bit_exact": n_checked,
        "route_bias_changes": bias_changes,
        "packed": packed_info,
        "init": sorted(set(kinds.values())),
    }
    if "packed_logits" in tensors:
        pl = tensors["packed_logits"]
        stats.update(packed_logits_mean=float(pl.mean()), packed_logits_std=float(pl.std()),
                     packed_logits_max_abs=float(pl.abs().max()))
    with open(os.path.join(args.out, "stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
    print(json.dumps(stats, indent=2))


def route_bias_stats(model, input_ids):
    """Hook the MoE gates; count tokens whose top-k set differs with vs without the bias."""
    res = {}
    hooks = []
    for li, layer in model.model.layers.items():
        if not layer.is_moe_layer:
            continue
        gate = layer.mlp.gate

        def hook(mod, inp, outp, li=li):
            x = inp[0]
            logits = torch.nn.functional.linear(x.float(), mod.weight.float())
            s = logits.sigmoid()
            with_b = (s + mod.e_score_correction_bias).topk(mod.topk, dim=-1)[1].sort(-1)[0]
            without = s.topk(mod.topk, dim=-1)[1].sort(-1)[0]
            res[f"layer{li}"] = int((with_b != without).any(-1).sum())
        hooks.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids)
    for h in hooks:
        h.remove()
    res["tokens"] = int(input_ids.numel())
    return res


def write_checkpoint(hf_packed: dict, out: str):
    from safetensors.torch import save_file

    cfg = dict(TEXT_CONFIG)
    quant = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4, "type": "float", "group_size": 32, "strategy": "group",
                    "symmetric": True, "scale_dtype": "torch.uint8", "dynamic": False,
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": [
            "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*",
        ],
    }
    config = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"],
        "tie_word_embeddings": False,
        "dtype": "float32",
        "text_config": cfg,
        "quantization_config": quant,
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    # 3 shards: shard 1 = layers 0-1, shard 2 = layers 2-3, shard 3 = embed/head/norm/output attn-res
    def shard_of(k):
        if ".layers." in k:
            li = int(k.split(".layers.")[1].split(".")[0])
            return 1 if li < 2 else 2
        return 3

    n = 3
    names = {i: f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)}
    shards = {i: {} for i in range(1, n + 1)}
    for k, v in hf_packed.items():
        shards[shard_of(k)][k] = v.contiguous()
    weight_map = {}
    total = 0
    for i, tens in shards.items():
        save_file(tens, os.path.join(out, names[i]), metadata={"format": "pt"})
        for k, v in tens.items():
            weight_map[k] = names[i]
            total += v.numel() * v.element_size()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)


if __name__ == "__main__":
    main()
