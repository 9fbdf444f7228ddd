"""kimi/fsdp.py in one process (a gloo group of one, on the CPU): the FSDP2 root, which runs `kimi.forward`'s layer
loop with the layer units, gives the loss and gradients of the single-process objective, names its trained leaves
as the single-process run does, and gathers back the same tree. Two processes: tests/test_train.py."""

import pytest
import torch
import torch.distributed as dist

import kimi
from kimi import lora
from kimi.fsdp import build_fsdp, gather, sharded_trainable_named
from kimi.loss import IGNORE
from kimi.params import tree_items, tree_map
from kimi.training import fp32_paths, loss_sum, trainable_named

from helpers import rel_err, small_cfg


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _copy(tree, trainable: bool):
    return tree_map(lambda _, p: torch.nn.Parameter(p.detach().clone(), requires_grad=trainable and p.requires_grad),
                    tree)


@pytest.mark.parametrize("rank", [0, 2])
def test_root_equals_single_process_loss(group, rank):
    """Full training (rank 0) and LoRA adapters (rank 2, nonzero B so they matter): same loss, same gradient of
    every trained leaf by name, and `gather` returns the tree and adapters it was given."""
    cfg = small_cfg()
    base = kimi.init_params(cfg, seed=int(torch.randint(1000, ())))
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    labels = torch.roll(ids, -1, dims=1)
    labels[1, -4:] = IGNORE
    doc = torch.tensor([[0] * 5 + [1] * 7, [0] * 8 + [-1] * 4])
    kw = dict(cfg=cfg, backend=kimi.Backend(), dtype=torch.float32, fp32_paths=fp32_paths(cfg), lora_scale=0.5)
    runs = []
    for _ in range(2):
        params = _copy(base, trainable=not rank)
        adapters = {}
        if rank:
            adapters = lora.init_adapters(params, lora.ATTENTION_TARGETS, rank, seed=0)
            for ab in adapters.values():
                with torch.no_grad():
                    ab["B"].normal_(generator=torch.Generator().manual_seed(1))
        runs.append((params, adapters))
    (params, adapters), (sharded, sharded_adapters) = runs

    want = loss_sum(params, adapters, ids, labels, doc, **kw)
    want.backward()
    root = build_fsdp(sharded, sharded_adapters, **kw, compile_units=False)
    got = root(ids, labels, doc)
    got.backward()
    assert rel_err(got, want) < 1e-6

    named, sharded_named = trainable_named(params, adapters), sharded_trainable_named(root)
    assert sorted(named) == list(sharded_named) and named
    assert all(n.endswith((":A", ":B")) for n in named) == bool(rank)
    for n, p in named.items():   # (layer 0's attention-residual mix has nothing to mix: no gradient either way)
        g = sharded_named[n].grad
        assert (g is None) == (p.grad is None), n
        assert g is None or rel_err(g.full_tensor() if hasattr(g, "full_tensor") else g, p.grad) < 1e-5, n
    assert sum(p.grad is not None for p in named.values()) > len(named) // 2

    tree, ads = gather(root)
    tree, want_tree = dict(tree_items(tree)), dict(tree_items(params))   # the root's leaves come first
    assert tree.keys() == want_tree.keys() and all(torch.equal(tree[k], want_tree[k]) for k in tree)
    assert ads.keys() == adapters.keys()
    assert all(torch.equal(ads[k][ab], adapters[k][ab]) for k in adapters for ab in ("A", "B"))
