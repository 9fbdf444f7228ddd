"""Activation checkpointing (`kimi.model.recomputed`, train.py's --activation-checkpointing): the recomputed step
gives the loss and every gradient of the plain one (eagerly bit for bit; compiled, with LoRA and inside FSDP2
units too), the layers really run twice, and the indexer's selection and the router's choice are computed once
and reused by the recompute. train.py end to end: tests/test_train.py."""

import pytest
import torch
import torch.distributed as dist

import kimi
from kimi import lora, moe
from kimi.fsdp import build_fsdp, sharded_trainable_named
from kimi.loss import IGNORE
from kimi.model import compile_layers, recomputed
from kimi.ops import lightning_index
from kimi.params import tree_map
from kimi.training import fp32_paths, hidden_states, loss_sum, make_loss, recompute_wanted, trainable_named

from helpers import rel_err, small_cfg


def _batch(cfg):
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    labels = torch.roll(ids, -1, dims=1)
    labels[1, -5:] = IGNORE
    doc = torch.tensor([[0] * 10 + [1] * 14, [0] * 20 + [-1] * 4])
    return ids, labels, doc


def _grads(loss_fn, params, adapters, batch, kw) -> tuple[torch.Tensor, dict]:
    named = trainable_named(params, adapters)
    for p in named.values():
        p.grad = None
    loss = loss_fn(params, adapters, *batch, **kw)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in named.items() if p.grad is not None}


def _setup(rank: int = 0):
    cfg = small_cfg()
    params = tree_map(lambda _, p: p.requires_grad_(not rank and p.requires_grad),
                      kimi.init_params(cfg, seed=int(torch.randint(1000, ()))))
    adapters = {}
    if rank:
        adapters = lora.init_adapters(params, lora.ATTENTION_TARGETS, rank, seed=0)
        for ab in adapters.values():
            with torch.no_grad():
                ab["B"].normal_()        # nonzero, so the adapters change the output and get gradients
    kw = dict(cfg=cfg, backend=kimi.Backend(), dtype=torch.float32, fp32_paths=fp32_paths(cfg), lora_scale=0.5)
    return cfg, params, adapters, kw


@pytest.mark.parametrize("rank", [0, 4])
def test_recomputed_step_is_the_plain_step_and_selects_once(monkeypatch, rank):
    """Eagerly, full training (rank 0) and LoRA (rank 4): same loss, same gradient of every trained leaf, bit for
    bit. The recompute reruns the layers (the router function runs twice per MoE layer) but not the indexer's
    scoring: its selection is the saved one."""
    cfg, params, adapters, kw = _setup(rank)
    batch = _batch(cfg)
    calls = {"route": 0, "scores": 0}
    route, scores = moe.route, lightning_index.scores

    def counted(name, fn):
        def run(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return run
    monkeypatch.setattr(moe, "route", counted("route", route))
    monkeypatch.setattr(lightning_index, "scores", counted("scores", scores))
    want = _grads(loss_sum, params, adapters, batch, kw)
    plain = dict(calls)
    got = _grads(make_loss(None, recompute=True), params, adapters, batch, kw)
    assert plain["route"] >= 1 and plain["scores"] >= 1
    assert calls["route"] - plain["route"] == 2 * plain["route"]      # forward + recompute
    assert calls["scores"] - plain["scores"] == plain["scores"]       # forward only
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys() and len(want[1]) > 3
    for n, g in want[1].items():
        assert torch.equal(got[1][n], g), n


def test_recomputed_layers_compile():
    """`compile_layers(layer=recomputed())` (Dynamo traces the checkpoint region with its save policy; fullgraph)
    gives the eager step's loss and gradients."""
    cfg, params, adapters, kw = _setup()
    batch = _batch(cfg)
    want = _grads(loss_sum, params, adapters, batch, kw)
    fwd = compile_layers(layer=recomputed(), fullgraph=True, backend="aot_eager")

    def hidden(*a, **k):
        return hidden_states(*a, forward=fwd, **k)

    def compiled(*a, **k):
        return loss_sum(*a, hidden=hidden, **k)
    got = _grads(compiled, params, adapters, batch, kw)
    assert rel_err(got[0], want[0]) < 1e-6
    assert got[1].keys() == want[1].keys()
    for n, g in want[1].items():
        assert rel_err(got[1][n], g) < 1e-5, n


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_recomputed_fsdp_units(group, monkeypatch):
    """Inside the FSDP2 layer units (casts and adapters in the recomputed region): the single-process loss and
    gradients, and the layers really recomputed (the router runs twice)."""
    cfg, params, adapters, kw = _setup()
    batch = _batch(cfg)
    want = _grads(loss_sum, params, adapters, batch, kw)
    copy = tree_map(lambda _, p: torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad), params)
    root = build_fsdp(copy, {}, **kw, compile_units=False, recompute=True)
    calls, route = [], moe.route
    monkeypatch.setattr(moe, "route", lambda *a, **k: (calls.append(1), route(*a, **k))[1])
    loss = root(*batch)
    forward_calls = len(calls)
    loss.backward()
    assert forward_calls >= 1 and len(calls) == 2 * forward_calls
    assert rel_err(loss.detach(), want[0]) < 1e-6
    got = {n: p.grad for n, p in sharded_trainable_named(root).items() if p.grad is not None}
    assert got.keys() == want[1].keys()
    for n, g in want[1].items():
        assert rel_err(got[n].full_tensor(), g) < 1e-5, n


def test_auto_recomputes_only_where_activations_crowd_the_gpu():
    cfg = kimi.preset("k3_1_pro")
    assert not recompute_wanted(cfg, 1 << 20, torch.device("cpu"), trainable=10 ** 12)
    if torch.cuda.is_available():
        assert recompute_wanted(cfg, 1 << 20, torch.device("cuda"), trainable=0)
        assert recompute_wanted(cfg, 16, torch.device("cuda"), trainable=10 ** 12)
        assert not recompute_wanted(cfg, 16, torch.device("cuda"), trainable=0)


def test_every_selection_op_is_kept():
    """Every registered top-k selection op (the indexer on each backend) is one whose output the recompute saves: a
    new indexer implementation left out of `RECOMPUTE_KEEPS` would be recomputed (its cost twice, and a hard
    selection recomputed from other rounding could pick other keys)."""
    from kimi.model import RECOMPUTE_KEEPS
    indexers = {getattr(torch.ops.kimi, name).default for name in dir(torch.ops.kimi)
                if name.startswith("indexer_topk")}
    assert indexers and indexers <= RECOMPUTE_KEEPS
