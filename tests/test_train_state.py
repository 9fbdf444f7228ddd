"""kimi/train_state.py: the training checkpoint (DCP shards + trainer.json) restores leaves, optimizer state, data
position and RNGs exactly, is written atomically (a crash mid-save leaves the previous one the newest), keeps the
newest few, and refuses a checkpoint of other parameters. At other process counts: tests/test_train.py."""

import json
import random

import numpy as np
import pytest
import torch

from kimi.data import Sampler
from kimi import train_state
from kimi.runs import latest_complete
from kimi.train_state import load_training_state, read_checkpoint, save_training_state


def _run(seed: int):
    """Two trained leaves (a matrix and a vector), AdamW with state after one step, a sampler in its second epoch."""
    g = torch.Generator().manual_seed(seed)
    named = {"a.weight": torch.randn(4, 3, generator=g).requires_grad_(),
             "b.bias": torch.randn(3, generator=g).requires_grad_()}
    opt = torch.optim.AdamW(list(named.values()), lr=1e-2)
    for p in named.values():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    sampler = Sampler(10, 3)     # the seed is the run's config; the position is the state
    sampler.take(13 + 5 * seed)
    return named, opt, sampler


def test_round_trip_is_exact(tmp_path):
    named, opt, sampler = _run(0)
    torch.manual_seed(123)
    random.seed(4)
    np.random.seed(5)
    save_training_state(tmp_path, 7, named, opt, sampler, bad_steps=1, config={"lr": 1e-2}, keep=2, rank=0)
    want_draws = (torch.rand(3), random.random(), np.random.rand())
    ckpt = latest_complete(tmp_path)
    assert ckpt == tmp_path / "ckpt-000007" and not list(tmp_path.glob(".tmp-*"))
    assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", "__0_0.distcp", "trainer.json"]
    trainer = json.loads((ckpt / "trainer.json").read_text())      # ours is JSON; DCP's .metadata is its own
    assert trainer["config"] == {"lr": 1e-2} and trainer["data"] == {"epoch": 1, "offset": 3}
    assert trainer["step"] == 7 and trainer["world_size"] == 1
    state = read_checkpoint(ckpt)
    assert state["params"].keys() == named.keys() and all(torch.equal(state["params"][n], p) for n, p in named.items())
    assert state["optimizer"].keys() == named.keys()
    assert set(state["optimizer"]["a.weight"]) == {"step", "exp_avg", "exp_avg_sq"}

    other, opt2, sampler2 = _run(1)   # different values everywhere, restored from the checkpoint
    step, bad = load_training_state(ckpt, other, opt2, sampler2)
    assert (step, bad) == (7, 1) and sampler2.state() == sampler.state() and sampler2.take(5) == sampler.take(5)
    for n, p in named.items():
        assert torch.equal(other[n], p)
        q = other[n]
        for k, v in opt.state[p].items():
            assert torch.equal(opt2.state[q][k], v), (n, k)
    assert torch.equal(torch.rand(3), want_draws[0]) and random.random() == want_draws[1]
    assert np.random.rand() == want_draws[2]


def test_keeps_the_newest_and_rejects_other_parameters(tmp_path):
    named, opt, sampler = _run(0)
    for step in (1, 2, 3):
        save_training_state(tmp_path, step, named, opt, sampler, bad_steps=0, config={}, keep=2, rank=0)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-000002", "ckpt-000003"]
    (tmp_path / "ckpt-000004").mkdir()             # a folder without trainer.json is not a checkpoint
    assert latest_complete(tmp_path) == tmp_path / "ckpt-000003"
    assert latest_complete(tmp_path / "nothing") is None
    wrong = {"a.weight": named["a.weight"], "c.weight": named["b.bias"]}
    with pytest.raises(ValueError, match=r"missing \['c.weight'\], unexpected \['b.bias'\]"):
        load_training_state(tmp_path / "ckpt-000003", wrong, opt, sampler)


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """A process that dies after DCP wrote its shards but before trainer.json (here: the JSON write fails) leaves
    only a temporary folder: the newest checkpoint is still the previous one, and it loads."""
    named, opt, sampler = _run(0)
    save_training_state(tmp_path, 1, named, opt, sampler, bad_steps=0, config={}, keep=0, rank=0)

    def crash(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(train_state, "rng_state", crash)
    with pytest.raises(OSError, match="disk full"):
        save_training_state(tmp_path, 2, named, opt, sampler, bad_steps=0, config={}, keep=0, rank=0)
    assert (tmp_path / ".tmp-ckpt-000002" / ".metadata").is_file()
    assert latest_complete(tmp_path) == tmp_path / "ckpt-000001"
    assert load_training_state(latest_complete(tmp_path), *_run(1)) == (1, 0)
