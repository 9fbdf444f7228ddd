"""A training run's output folder: which run owns it, the configuration it ran with, what may change on resume
(docs/checkpoints.md#run-folders).

    out/run.json        the resolved configuration, the versions of Python, torch and kimi, the start time
    out/ckpt-NNNNNN/    training checkpoints (kimi/train_state.py), rotated by step
    out/metrics.jsonl   one JSON row per step (and evaluation), stamped with the time and elapsed seconds
    out/tensorboard/    the same scalars as TensorBoard event files, when asked for (`Metrics`)
    out/loss.png, out/model/

A new run into a folder that already holds a run stops (`RunFolderError`) unless it resumes that run or the caller
asks to overwrite it; nothing of another run is ever deleted silently. Stale temporary checkpoint folders (left by
a process killed while saving) are removed when a run claims its folder.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import platform
import shutil
import signal
import threading
import time
from pathlib import Path

import torch

RUN_FILE = "run.json"
STATE_FILE = "trainer.json"
"""The file a complete checkpoint folder holds (kimi/train_state.py writes it last, by renaming its folder)."""
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
RUN_ENTRIES = (RUN_FILE, METRICS_FILE, TENSORBOARD_DIR, "loss.png", "model")
"""What a run writes besides its checkpoints (ckpt-*)."""


class RunFolderError(ValueError):
    """An output folder that holds another run, or a resume that cannot continue the run it names."""


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint folder `ckpt-NNNNNN`, or None for any other name."""
    digits = path.name.removeprefix("ckpt-")
    return int(digits) if path.name.startswith("ckpt-") and digits.isdigit() else None


def checkpoints(folder: Path) -> list[Path]:
    """The checkpoint folders in `folder`, oldest step first (by number: ckpt-1000000 sorts after ckpt-999999)."""
    found = [p for p in Path(folder).glob("ckpt-*") if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def latest_complete(folder: Path) -> Path | None:
    """The checkpoint of the highest step that holds its state file, or None."""
    found = [p for p in checkpoints(folder) if (p / STATE_FILE).is_file()]
    return found[-1] if found else None


def holds_run(folder: Path) -> list[str]:
    """The names in `folder` that belong to a run (empty: the folder is free)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    names = [n for n in RUN_ENTRIES if (folder / n).exists()]
    return names + [p.name for p in checkpoints(folder)]


def check(folder: Path, config: dict, *, resume: bool, overwrite: bool, allowed: frozenset[str]) -> list[str]:
    """Whether a run with `config` may use `folder`, without touching it (every process may call it). Returns the
    configuration changes of a resume that `allowed` covers (for the log); raises `RunFolderError` for:

    - a new run (neither flag) into a folder holding a run, naming `--resume` and `--overwrite`;
    - `resume` without a checkpoint, with `steps` not beyond the newest checkpoint's step, or with changes to the
      saved configuration outside `allowed` (they would break exact resumption), each listed;
    - both flags, or a path that is a file."""
    folder = Path(folder)
    if resume and overwrite:
        raise RunFolderError("--resume and --overwrite exclude each other: continue the run or replace it")
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"--out {folder} is a file, not a folder")
    held = holds_run(folder)
    if not resume:
        if held and not overwrite:
            raise RunFolderError(f"--out {folder} already holds a run ({', '.join(held[:4])}"
                                 f"{', ...' if len(held) > 4 else ''}); pass --resume to continue it or --overwrite "
                                 "to replace it")
        return []
    latest = latest_complete(folder)
    if latest is None:
        if any((p / "state.pt").is_file() for p in checkpoints(folder)):
            raise RunFolderError(f"--resume: the checkpoints in {folder} are of the old format (one pickled "
                                 f"state.pt); this kimi writes and reads sharded ones ({STATE_FILE} and DCP shards), so "
                                 "that run cannot be continued here")
        raise RunFolderError(f"--resume: no complete checkpoint in {folder}" + (f" (it holds {', '.join(held)})"
                                                                                if held else ""))
    step = checkpoint_step(latest)
    if config.get("steps") is not None and config["steps"] <= step:
        raise RunFolderError(f"--resume: the newest checkpoint is at step {step}, so --steps {config['steps']} "
                             "leaves nothing to train; raise --steps")
    saved = json.loads((folder / RUN_FILE).read_text())["config"] if (folder / RUN_FILE).is_file() else None
    if saved is None:
        return []
    before, now = _flat(saved), _flat(json.loads(json.dumps(config, default=str)))
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    refused = [k for k in changed if k not in allowed]
    if refused:
        lines = "; ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in refused)
        raise RunFolderError(f"--resume: the run was started with other settings ({lines}); resume with the same "
                             "ones, or start a new run in another --out")
    return [f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed]


def claim(folder: Path, config: dict, *, resume: bool, overwrite: bool) -> None:
    """Make `folder` this run's, after `check`: with `overwrite` the old run's files and checkpoints are removed;
    stale `.tmp-ckpt-*` folders are removed; `run.json` records `config`, the versions and the start time (and, on
    resume, the record it replaces). Call on the main process only."""
    folder = Path(folder)
    if overwrite and not resume:
        for name in holds_run(folder):
            path = folder / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    for tmp in folder.glob(".tmp-ckpt-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    record = {"config": config, "versions": versions(),
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if resume and (folder / RUN_FILE).is_file():
        record["resumed_from"] = json.loads((folder / RUN_FILE).read_text())
    tmp = folder / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    tmp.replace(folder / RUN_FILE)


def versions() -> dict:
    try:
        kimi = importlib.metadata.version("kimi")
    except importlib.metadata.PackageNotFoundError:
        kimi = "not installed"
    return {"python": platform.python_version(), "torch": torch.__version__, "kimi": kimi}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def tensorboard_missing() -> str | None:
    """Why TensorBoard logging cannot run here (one sentence), or None when it can."""
    if importlib.util.find_spec("tensorboard") is None:
        return "TensorBoard logging needs the tensorboard package: pip install 'kimi[tensorboard]' (or tensorboard)"
    return None


def _summary_writer(folder: Path, purge_step: int | None):
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(log_dir=str(folder), purge_step=purge_step)


class Metrics:
    """A run's metrics: `record(row)` appends one JSON line to out/metrics.jsonl, stamped with the UTC time and the
    seconds since `t0` (a `time.perf_counter()` value), and with `tensorboard` writes every number of the row as a
    scalar at its "step" into out/tensorboard. A resumed run (`resumed_at`: its checkpoint's step) first drops the
    rows past that step (steps the interrupted run took after its checkpoint are taken again), and TensorBoard
    purges its events past it too. Only the main process writes (`enabled`)."""

    def __init__(self, folder: Path, *, t0: float, tensorboard: bool = False, resumed_at: int | None = None,
                 enabled: bool = True):
        self.path, self.t0, self.enabled = Path(folder) / METRICS_FILE, t0, enabled
        self.writer = None
        if not enabled:
            return
        kept = []
        if resumed_at is not None and self.path.exists():
            kept = [ln for ln in self.path.read_text().splitlines() if _step_of(ln, resumed_at + 1) <= resumed_at]
        self.path.write_text("".join(ln + "\n" for ln in kept))
        if tensorboard:
            self.writer = _summary_writer(Path(folder) / TENSORBOARD_DIR,
                                          None if resumed_at is None else resumed_at + 1)

    def record(self, row: dict) -> None:
        if not self.enabled:
            return
        stamp = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
                 "elapsed_s": round(time.perf_counter() - self.t0, 3)}
        with open(self.path, "a") as f:
            f.write(json.dumps(row | stamp) + "\n")
        if self.writer is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.writer.add_scalar(k, v, row["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _step_of(line: str, default: int) -> int:
    """A metrics row's step; `default` for a line that is not a row (one cut short by a killed process)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return default


class Interrupted(Exception):
    """The run stopped on a signal after saving a checkpoint (train.py exits with 128 + the signal's number)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class StopSignals:
    """SIGINT and SIGTERM ask the training loop to stop: the first sets `signum` (the loop finishes its step, saves
    a checkpoint and raises `Interrupted`), a second SIGINT aborts at once (KeyboardInterrupt). A context manager;
    outside the main thread it installs nothing (signals are delivered there only)."""

    def __init__(self, say=print):
        self.signum: int | None = None
        self._say = say
        self._old: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        self._say(f"{signal.Signals(signum).name}: finishing this step and saving a checkpoint (Ctrl-C again to "
                  "abort at once)")
