"""The training checkpoint (docs/checkpoints.md#training-checkpoints): `ckpt-NNNNNN/state.pt` in the run's folder
holds the trained leaves and the AdamW state by name, the step, the data position, every RNG state, the count of
skipped steps and the run's config, so that a resumed run continues exactly as the straight run would have."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .fsdp import full_cpu, shard_like
from .runs import STATE_FILE, checkpoints, latest_complete


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training_state(folder: Path, step: int, named: dict[str, Tensor], opt: torch.optim.Optimizer, sampler, *,
                        bad_steps: int, config: dict, keep: int, rank: int) -> None:
    """Write folder/ckpt-{step:06d}/state.pt: the trained leaves `named`, AdamW's state by the same names, the step,
    `sampler.state()` (a `kimi.data.Sampler`), the RNG states, `bad_steps` and `config` (a plain dict). Atomic: it is
    written to a temporary folder that then replaces the checkpoint, so a crash leaves the previous one intact.
    Only the newest `keep` checkpoints are kept (0: all). Every process takes part (DTensor gathers); `rank` 0
    writes."""
    ids = {id(p): n for n, p in named.items()}
    opt_state = {}
    for group in opt.param_groups:
        for p in group["params"]:
            opt_state[ids[id(p)]] = {k: full_cpu(v) if isinstance(v, Tensor) and v.dim() else v
                                     for k, v in opt.state.get(p, {}).items()}
    state = {"step": step, "params": {n: full_cpu(p) for n, p in named.items()}, "optimizer": opt_state,
             "data": sampler.state(), "rng": rng_state(), "bad_steps": bad_steps, "config": config}
    if rank != 0:
        return
    final = folder / f"ckpt-{step:06d}"
    tmp = folder / f".tmp-ckpt-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / STATE_FILE, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    old = checkpoints(folder)[:-keep] if keep > 0 else []     # by step, so the newest steps stay
    for p in old:
        shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(folder: Path) -> Path | None:
    """The complete checkpoint (one with a state.pt) of the highest step in `folder`, or None."""
    return latest_complete(folder)


def load_training_state(path: Path, named: dict[str, Tensor], opt: torch.optim.Optimizer, sampler) -> tuple[int, int]:
    """Restore what `save_training_state` wrote into this run's leaves, optimizer, sampler and RNGs (each leaf
    placed like the run's own: sharded under FSDP); returns (step, bad_steps)."""
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    if set(state["params"]) != set(named):
        missing, extra = sorted(set(named) - set(state["params"])), sorted(set(state["params"]) - set(named))
        raise ValueError(f"{path}: checkpoint does not match this run's trained parameters "
                         f"(missing {missing[:5]}, unexpected {extra[:5]}); same --model and --lora?")
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(shard_like(state["params"][n].to(p.dtype), p))
    for group in opt.param_groups:
        for p in group["params"]:
            name = next(n for n, q in named.items() if q is p)
            saved = state["optimizer"][name]
            if saved:
                opt.state[p] = {k: shard_like(v, p) if isinstance(v, Tensor) and v.dim() else
                                (v.clone() if isinstance(v, Tensor) else v) for k, v in saved.items()}
                if isinstance(opt.state[p].get("step"), Tensor) and opt.defaults.get("fused"):
                    opt.state[p]["step"] = opt.state[p]["step"].to(p.device)
    sampler.restore(state["data"])
    set_rng_state(state["rng"])
    return state["step"], state["bad_steps"]
