"""kimi/training.py: the weight casts, one optimizer step over micro-batches, clipping, the learning-rate schedule,
AdamW's groups, the trained leaves and the FLOP count."""

import math

import pytest
import torch

import kimi
from kimi import lora
from kimi.config import KDAConfig
from kimi.loss import IGNORE
from kimi.params import tree_items, unflatten
from kimi.training import (adamw, cast_tree, clipped_step, compiled_cast, fp32_paths, loss_sum, lr_at,
                           lora_flop_params, model_flops_per_token, train_step, trainable_named)

from helpers import rel_err, small_cfg, tiny


def test_compiled_cast_equals_eager_cast():
    """The compiled weight casts of the layer-wise compiled step (Dynamo with AOT autograd here, Inductor on a GPU)
    give the eager casts bit for bit and keep the fp32 leaves; their backward writes the same fp32 gradients into
    `.grad`, also when accumulating over two backward passes; frozen leaves (the indexer) get none; each leaf is
    its own autograd node (its gradient is cast as soon as it exists, not when the last one arrives)."""
    cfg = tiny(num_hidden_layers=2, linear_attn_config=KDAConfig(num_heads=4, head_dim=32, kda_layers=(1,),
                                                                  full_attn_layers=(2,)))
    params = kimi.init_params(cfg, seed=0)
    fp32 = fp32_paths(cfg)
    compiled = compiled_cast(backend="aot_eager")
    want = dict(tree_items(cast_tree(params, torch.bfloat16, fp32)))
    got = dict(tree_items(compiled(params, torch.bfloat16, fp32)))
    assert got.keys() == want.keys() and fp32 and any(v.dtype == torch.bfloat16 for v in want.values())
    for k, v in want.items():
        assert got[k].dtype == v.dtype == (torch.float32 if k in fp32 else torch.bfloat16) and torch.equal(got[k], v)
    nodes = [got[k].grad_fn for k in want if k not in fp32 and got[k].requires_grad]
    assert len(nodes) > 10 and len(set(map(id, nodes))) == len(nodes)   # one autograd node per leaf, none shared
    probes = [{k: torch.randn(v.shape) for k, v in want.items()} for _ in range(2)]
    grads = []
    for cast in (compiled, cast_tree):
        for probe in probes:                          # two passes: the second accumulates into .grad
            tree = dict(tree_items(cast(params, torch.bfloat16, fp32)))
            sum((tree[k].float() * probe[k]).sum() for k in tree).backward()
        grads.append({k: v.grad for k, v in tree_items(params)})
        for _, v in tree_items(params):
            v.grad = None
    assert grads[0].keys() == grads[1].keys()
    for k, g in grads[1].items():
        assert (g is None) == (grads[0][k] is None)
        assert g is None or (grads[0][k].dtype == torch.float32 and torch.equal(g, grads[0][k]))
    assert any(g is None for g in grads[1].values()) and sum(g is not None for g in grads[1].values()) > 10

    class NoGrad(torch.autograd.Function):   # a consumer that passes no gradient to its input
        @staticmethod
        def forward(ctx, x):
            return x.float().sum()

        @staticmethod
        def backward(ctx, g):
            return None

    path = next(k for k in want if k not in fp32 and got[k].requires_grad)
    for cast in (compiled, cast_tree):     # the weight keeps no gradient (None), not zeros
        tree = dict(tree_items(cast(params, torch.bfloat16, fp32)))
        (NoGrad.apply(tree[path]) + sum(t.float().sum() for k, t in tree.items() if k != path)).backward()
        assert dict(tree_items(params))[path].grad is None
        for _, v in tree_items(params):
            v.grad = None


@pytest.mark.parametrize("fused", [True, False])
def test_clipped_step_equals_clip_then_step(fused):
    """`clipped_step` against clip_grad_norm_ + AdamW.step over two steps whose gradients differ 100x in size (so
    Adam sees whether they were clipped), with clipping active (norms ~450 and ~4.5), inactive (norms < 1) and off
    (max_norm 0): a fused AdamW (here on the CPU) takes the clipping as its grad_scale (equal to rounding), the
    unfused one is scaled first (bit for bit)."""
    for scales, max_norm in (((10.0, 0.1), 1.0), ((1e-3, 1e-5), 1.0), ((10.0, 0.1), 0.0)):
        ref = [torch.randn(64, 32, requires_grad=True) for _ in range(3)]
        got = [p.detach().clone().requires_grad_() for p in ref]
        opts = [torch.optim.AdamW(ps, lr=1e-2, fused=fused) for ps in (ref, got)]
        for scale in scales:
            for a, b in zip(ref, got):
                a.grad = torch.randn_like(a) * scale
                b.grad = a.grad.clone()
            if max_norm:
                torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=True)
            opts[0].step()
            clipped_step(opts[1], got, torch.nn.utils.get_total_norm([p.grad for p in got]), max_norm)
        for a, b in zip(ref, got):
            assert torch.equal(a, b) if not fused else rel_err(b, a) < 1e-6
        assert not hasattr(opts[1], "grad_scale") and not hasattr(opts[1], "found_inf")


def _batch(cfg, B: int, T: int):
    """A micro-batch with two documents in row 0, padding at the end of row 1 and an ignored label."""
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    labels = torch.roll(ids, -1, dims=1)
    doc = torch.zeros_like(ids)
    doc[0, T // 2:] = 1
    doc[1, -3:] = -1
    labels[1, -3:] = IGNORE
    labels[2, 0] = IGNORE
    return ids, labels, doc


def test_train_step_accumulation_equals_one_batch():
    """Two micro-batches of 2 rows and one of 4 give one step over the same global batch: the mean loss per label
    token, the gradient norm of the whole batch's mean loss, and (plain SGD, so the update is the clipped gradient
    itself) the weights p − lr · g · min(1, max_norm / ‖g‖); the gradients are dropped after the step."""
    cfg = small_cfg()
    base = kimi.init_params(cfg, seed=int(torch.randint(1000, ())), dtype="float64")   # the update exactly visible
    ids, labels, doc = _batch(cfg, 4, 12)
    n_labels = int((labels != IGNORE).sum())
    kw = dict(cfg=cfg, backend=kimi.Backend(), dtype=torch.float64, fp32_paths=fp32_paths(cfg), lora_scale=1.0)

    def fresh():
        return {p: v.detach().clone().requires_grad_(v.requires_grad) for p, v in tree_items(base)}

    ref = fresh()
    tree = unflatten(ref)
    loss = loss_sum(tree, {}, ids, labels, doc, **kw) / n_labels
    loss.backward()
    grads = {p: v.grad for p, v in ref.items() if v.grad is not None}
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()
    max_norm = norm / 3   # clipping active
    for micro in (4, 2):
        leaves = fresh()
        tree = unflatten(leaves)
        named = trainable_named(tree, {})
        opt = torch.optim.SGD(list(named.values()), lr=0.1)
        batches = [(ids[i:i + micro], labels[i:i + micro], doc[i:i + micro]) for i in range(0, 4, micro)]
        result = train_step(lambda *b: loss_sum(tree, {}, *b, **kw), batches, opt, named.values(),
                            label_tokens=n_labels, grad_clip=max_norm)
        assert result.finite and abs(result.loss - loss.item()) < 1e-12 * loss.item()
        assert abs(result.grad_norm - norm) < 1e-10 * norm
        assert all(p.grad is None for p in named.values())
        start = dict(tree_items(base))
        for path, g in grads.items():   # the update against the whole batch's clipped gradient
            assert rel_err(leaves[path] - start[path], -0.1 * g * min(1.0, max_norm / (norm + 1e-6))) < 1e-9, path


def test_train_step_skips_non_finite():
    """A non-finite loss or gradient: no optimizer step (weights and optimizer state untouched), the gradients
    dropped, and the result says so."""
    w = torch.randn(8, requires_grad=True)
    before = w.detach().clone()
    opt = torch.optim.AdamW([w], lr=1.0)
    for bad in (float("nan"), float("inf")):
        result = train_step(lambda x, y, d: (w * x).sum() * bad, [(torch.ones(8), None, None)] * 2, opt, [w],
                            label_tokens=4, grad_clip=1.0)
        assert not result.finite and not math.isfinite(result.loss)
        assert torch.equal(w, before) and w.grad is None and not opt.state
    result = train_step(lambda x, y, d: (w * x).sum(), [(torch.ones(8), None, None)] * 2, opt, [w], label_tokens=4,
                        grad_clip=0.0)
    assert result.finite and result.loss == pytest.approx(2 * before.sum().item() / 4)
    assert result.grad_norm == pytest.approx(math.sqrt(8) * 2 / 4) and not torch.equal(w, before)


def test_adamw_decays_matrices_only_and_trained_leaves():
    """Weight decay on the matrices, not on norms, A_log, dt_bias or the convs; the trained leaves are the
    adapters under LoRA, else every leaf that requires a gradient (not the indexer)."""
    cfg = small_cfg()
    params = kimi.init_params(cfg, seed=0)
    named = trainable_named(params, {})
    assert named and not [n for n in named if ".indexer." in n]
    assert set(named) == {p for p, v in tree_items(params) if v.requires_grad}
    opt = adamw(named, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=False)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    by_id = {id(p): n for n, p in named.items()}
    decayed = {by_id[id(p)] for p in decayed["params"]}
    plain = {by_id[id(p)] for p in plain["params"]}
    assert decayed | plain == set(named) and not decayed & plain
    assert "model.layers.1.self_attn.kv_b_proj.weight" in decayed and "lm_head.weight" in decayed
    assert all(named[n].dim() < 2 or "conv1d" in n for n in plain)
    assert {"model.layers.0.self_attn.A_log", "model.layers.0.self_attn.q_conv1d.weight",
            "model.norm.weight"} <= plain
    adapters = lora.init_adapters(params, lora.ATTENTION_TARGETS, 2)
    named = trainable_named(params, adapters)
    assert set(named) == {f"{p}:{k}" for p in adapters for k in ("A", "B")}


def test_lr_schedules():
    c = dict(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, **c) == pytest.approx(0.1) and lr_at(9, **c) == pytest.approx(1.0)
    assert lr_at(99, **c) == pytest.approx(0.1)
    lrs = [lr_at(s, **c) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    w = c | dict(schedule="wsd", decay_fraction=0.2)
    assert lr_at(79, **w) == 1.0 and lr_at(99, **w) == pytest.approx(0.1)
    assert lr_at(89, **w) == pytest.approx(0.55)


def test_model_flops():
    cfg = small_cfg()
    n = kimi.param_count(cfg, active=True, embedding=False)
    f64, f128 = model_flops_per_token(cfg, 64), model_flops_per_token(cfg, 128)
    assert 6 * n * 0.9 < f64 < f128 < 6 * n * 2        # indexer counted once, not 6 times; attention grows with T
    # LoRA: the frozen base 4 FLOPs a parameter (no weight gradient), the adapters 6; routed experts' adapters k of E
    n_idx = sum(p.numel() for path, p in kimi.params.tree_items(kimi.init_params(cfg)) if ".indexer." in path)
    assert model_flops_per_token(cfg, 64, adapters=0) == pytest.approx(f64 - 2 * (n - n_idx))
    assert model_flops_per_token(cfg, 64, adapters=1000) == pytest.approx(f64 - 2 * (n - n_idx) + 6000)
    ab = lambda *shape: {"A": torch.zeros(*shape), "B": torch.zeros(3)}
    adapters = {"model.layers.0.self_attn.q_proj.weight": ab(10),
                "model.layers.1.block_sparse_moe.experts.w1": ab(cfg.num_experts, 7)}
    routed = cfg.num_experts_per_token / cfg.num_experts
    assert lora_flop_params(cfg, adapters) == pytest.approx(13 + (cfg.num_experts * 7 + 3) * routed)
