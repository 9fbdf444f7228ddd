"""The training checkpoint (docs/checkpoints.md#training-checkpoints), written through `torch.distributed.checkpoint`
(DCP) so that every process writes its own shards and a run resumes at another number of processes:

    out/ckpt-NNNNNN/__R_0.distcp   tensors written by process R: the trained leaves ("params.<name>") and AdamW's
                                   state ("optimizer.<name>.<key>"), each piece once (DTensors by their shards,
                                   replicated tensors by one process, DCP balancing them)
    out/ckpt-NNNNNN/.metadata      DCP's index of those shards (DCP writes it with pickle)
    out/ckpt-NNNNNN/trainer.json   the step, the data position, the RNG states, the count of skipped steps and the
                                   run's config, as JSON

Nothing of ours is pickled and nothing is gathered whole. A checkpoint is written into `.tmp-ckpt-NNNNNN` and
renamed once complete, `trainer.json` last, so a process killed mid-save leaves no folder that resume picks.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor

from .runs import STATE_FILE, checkpoints

FORMAT = 2
"""`trainer.json`'s format (1 was a pickled `state.pt`)."""


# ---------------------------------------------------------------------------------------------- RNG states as JSON

def rng_state() -> dict:
    """This process's RNG states (torch CPU, every CUDA device, Python, NumPy) as JSON values."""
    b64 = lambda t: base64.b64encode(t.numpy().tobytes()).decode()
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": b64(torch.get_rng_state()), "python": _lists(random.getstate()),
             "numpy": [kind, key.tolist(), pos, has_gauss, gauss]}
    if torch.cuda.is_available():
        state["cuda"] = [b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    bytes_of = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
    torch.set_rng_state(bytes_of(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(key, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():     # the devices this process sees (a resume may see fewer)
        torch.cuda.set_rng_state_all([bytes_of(s) for s in state["cuda"]][:torch.cuda.device_count()])


def _lists(x):
    return [_lists(v) for v in x] if isinstance(x, tuple) else x


# ---------------------------------------------------------------------------------------------- save and load

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _quiet(fn, *args, **kwargs):
    """A DCP call without its warning that one process saves or loads alone (that is what no_dist asks for)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return fn(*args, **kwargs)


def _tensors(named: dict[str, Tensor], opt: torch.optim.Optimizer) -> dict[str, Tensor]:
    """The flat DCP state of a run: its leaves and their optimizer state, under the checkpoint's names."""
    names = {id(p): n for n, p in named.items()}
    out = {f"params.{n}": p.detach() for n, p in named.items()}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, v in opt.state.get(p, {}).items():
                if not isinstance(v, Tensor):
                    raise TypeError(f"optimizer state {names[id(p)]}.{key} is a {type(v).__name__}, not a tensor")
                out[f"optimizer.{names[id(p)]}.{key}"] = v
    return out


def save_training_state(folder: Path, step: int, named: dict[str, Tensor], opt: torch.optim.Optimizer, sampler, *,
                        bad_steps: int, config: dict, keep: int, rank: int) -> Path:
    """Write folder/ckpt-{step:06d}: the trained leaves `named` (plain tensors or FSDP2's DTensors), AdamW's state
    by the same names, and in trainer.json the step, `sampler.state()` (a `kimi.data.Sampler`), the RNG states of
    process 0, `bad_steps` and `config` (a plain dict). Atomic: written into a temporary folder renamed when
    complete, so a crash leaves the previous checkpoint intact. Only the newest `keep` checkpoints are kept
    (0: all). A collective under torch.distributed: every process calls it; `rank` 0 writes the JSON and renames.
    Returns the checkpoint's folder."""
    folder = Path(folder)
    final, tmp = folder / f"ckpt-{step:06d}", folder / f".tmp-ckpt-{step:06d}"
    distributed = _distributed()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if distributed:
        dist.barrier()
    _quiet(dcp.save, _tensors(named, opt), checkpoint_id=tmp, no_dist=not distributed)
    if rank == 0:
        trainer = {"format": FORMAT, "step": step, "bad_steps": bad_steps, "data": sampler.state(),
                   "rng": rng_state(), "world_size": dist.get_world_size() if distributed else 1, "config": config}
        part = tmp / (STATE_FILE + ".tmp")
        with open(part, "w") as f:
            f.write(json.dumps(trainer, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, tmp / STATE_FILE)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        old = checkpoints(folder)[:-keep] if keep > 0 else []     # by step, so the newest steps stay
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
    if distributed:
        dist.barrier()
    return final


def _trainer(path: Path) -> dict:
    state = json.loads((Path(path) / STATE_FILE).read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: a training checkpoint of format {state.get('format')}, this kimi reads {FORMAT}")
    return state


def _saved(path: Path) -> dict:
    """DCP's metadata: flat name -> TensorStorageMetadata (global size, dtype)."""
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def load_training_state(path: Path, named: dict[str, Tensor], opt: torch.optim.Optimizer, sampler) -> tuple[int, int]:
    """Restore what `save_training_state` wrote into this run's leaves, optimizer, sampler and RNGs: each process
    reads the parts of every tensor it holds, whatever the number of processes that saved it (DCP reshards).
    A collective under torch.distributed. Returns (step, bad_steps)."""
    path = Path(path)
    trainer = _trainer(path)
    saved = _saved(path)
    params = {k.removeprefix("params."): v for k, v in saved.items() if k.startswith("params.")}
    if set(params) != set(named):
        missing, extra = sorted(set(named) - set(params)), sorted(set(params) - set(named))
        raise ValueError(f"{path}: checkpoint does not match this run's trained parameters "
                         f"(missing {missing[:5]}, unexpected {extra[:5]}); same --model and --lora?")
    target = {f"params.{n}": p.detach() for n, p in named.items()}
    states: dict[str, dict[str, Tensor]] = {}
    for k, meta in saved.items():
        if not k.startswith("optimizer."):
            continue
        n, key = k.removeprefix("optimizer.").rsplit(".", 1)      # state keys hold no dot; names may
        p = named.get(n)
        if p is None:
            raise ValueError(f"{path}: optimizer state for {n!r}, which this run does not train")
        if key == "step":                                 # AdamW's step counter, a scalar
            t = torch.zeros((), dtype=meta.properties.dtype)
        elif tuple(meta.size) == tuple(p.shape):          # moments: placed like the leaf (sharded under FSDP)
            t = torch.empty_like(p.detach(), dtype=meta.properties.dtype)
        else:
            raise ValueError(f"{path}: optimizer state {n}.{key} has shape {list(meta.size)}, the leaf "
                             f"{list(p.shape)}")
        states.setdefault(n, {})[key] = target[k] = t
    _quiet(dcp.load, target, checkpoint_id=path, no_dist=not _distributed())
    fused = bool(opt.defaults.get("fused"))
    names = {id(p): n for n, p in named.items()}
    for group in opt.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            if name in states:
                st = states[name]
                if fused and "step" in st:                # the fused kernel reads the step on the leaf's device
                    st["step"] = st["step"].to(p.device)
                opt.state[p] = st
    sampler.restore(trainer["data"])
    set_rng_state(trainer["rng"])
    return trainer["step"], trainer["bad_steps"]


def read_checkpoint(path: Path) -> dict:
    """A training checkpoint as plain CPU tensors in one process (inspection, tests): trainer.json's fields plus
    "params" {name: tensor} and "optimizer" {name: {key: tensor}}, every tensor whole."""
    path = Path(path)
    state = _trainer(path)
    saved = _saved(path)
    tensors = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in saved.items()}
    _quiet(dcp.load, tensors, checkpoint_id=path, no_dist=True)
    state["params"] = {k.removeprefix("params."): v for k, v in tensors.items() if k.startswith("params.")}
    state["optimizer"] = {}
    for k, v in tensors.items():
        if k.startswith("optimizer."):
            name, key = k.removeprefix("optimizer.").rsplit(".", 1)
            state["optimizer"].setdefault(name, {})[key] = v
    return state
