"""kimi/train_state.py: the training checkpoint restores leaves, optimizer state, data position and RNGs exactly, is
written atomically, keeps the newest few, and refuses a checkpoint of other parameters."""

import random

import numpy as np
import pytest
import torch

from kimi.data import Sampler
from kimi.train_state import latest_checkpoint, load_training_state, save_training_state


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
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt == tmp_path / "ckpt-000007" and not list(tmp_path.glob(".tmp-*"))
    state = torch.load(ckpt / "state.pt", weights_only=False)
    assert set(state) == {"step", "params", "optimizer", "data", "rng", "bad_steps", "config"}
    assert state["config"] == {"lr": 1e-2} and state["data"] == {"epoch": 1, "offset": 3}

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
    (tmp_path / "ckpt-000004").mkdir()             # a folder without state.pt is not a checkpoint
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-000003"
    assert latest_checkpoint(tmp_path / "nothing") is None
    save_training_state(tmp_path, 9, named, opt, sampler, bad_steps=0, config={}, keep=2, rank=1)
    assert not (tmp_path / "ckpt-000009").exists()  # only process 0 writes
    wrong = {"a.weight": named["a.weight"], "c.weight": named["b.bias"]}
    with pytest.raises(ValueError, match=r"missing \['c.weight'\], unexpected \['b.bias'\]"):
        load_training_state(tmp_path / "ckpt-000003", wrong, opt, sampler)
