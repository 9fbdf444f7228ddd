"""Run folders (kimi/runs.py, through train.py): a run never deletes or overwrites another run's files, --overwrite
replaces one on request, --resume continues only the run the folder holds and with its own settings (bookkeeping
may change), checkpoints rotate by step, stale temporary folders go, and every refusal is one line."""

import json
import os
import subprocess
import sys

import pytest

from kimi import runs
from kimi.train_state import latest_checkpoint

from test_train import ROOT, config, losses, setup, train  # noqa: F401  (setup is a fixture)


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_new_run_never_replaces_an_old_one(setup, tmp_path):
    _, ckpt, corpus = setup
    out = tmp_path / "run"
    train.train(config(ckpt, corpus, out, steps=3, ckpt_every=1, keep_checkpoints=5))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(runs.RunFolderError, match="already holds a run .*--resume .*--overwrite"):
        train.train(config(ckpt, corpus, out, steps=2))
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before      # nothing touched
    saved = json.loads((out / "run.json").read_text())
    assert saved["config"]["steps"] == 3 and {"python", "torch", "kimi"} <= set(saved["versions"])
    # --overwrite replaces it: the old checkpoints and metrics are gone, the new run's are there
    train.train(config(ckpt, corpus, out, steps=2, overwrite=True, ckpt_every=1, keep_checkpoints=5))
    assert [p.name for p in runs.checkpoints(out)] == ["ckpt-000001", "ckpt-000002"]
    assert len(losses(out)) == 2


def test_resume_keeps_the_runs_settings(setup, tmp_path):
    _, ckpt, corpus = setup
    out = tmp_path / "run"
    train.train(config(ckpt, corpus, out, steps=4, stop_after=2, export=False))
    with pytest.raises(runs.RunFolderError, match=r"lr: 0\.003 -> 0\.01"):
        train.train(config(ckpt, corpus, out, steps=4, lr=1e-2, resume=True))
    with pytest.raises(runs.RunFolderError, match="at step 2, so --steps 2 leaves nothing to train"):
        train.train(config(ckpt, corpus, out, steps=2, resume=True))
    with pytest.raises(runs.RunFolderError, match="exclude each other"):
        train.train(config(ckpt, corpus, out, resume=True, overwrite=True))
    with pytest.raises(runs.RunFolderError, match="no checkpoint in"):
        train.train(config(ckpt, corpus, tmp_path / "empty", resume=True))
    summary = train.train(config(ckpt, corpus, out, steps=5, resume=True, export=False))   # a longer run: allowed
    assert summary["steps"] == 5 and latest_checkpoint(out).name == "ckpt-000005"
    record = json.loads((out / "run.json").read_text())
    assert record["config"]["steps"] == 5 and record["resumed_from"]["config"]["steps"] == 4


def test_checkpoints_rotate_by_step_and_stale_temporaries_go(tmp_path):
    for name in ("ckpt-999999", "ckpt-1000000", "ckpt-000010", "ckpt-notastep", ".tmp-ckpt-000011-123"):
        (tmp_path / name).mkdir()
    assert [p.name for p in runs.checkpoints(tmp_path)] == ["ckpt-000010", "ckpt-999999", "ckpt-1000000"]
    runs.claim(tmp_path, {"steps": 1}, resume=True, overwrite=False)
    assert not list(tmp_path.glob(".tmp-ckpt-*")) and (tmp_path / "ckpt-1000000").is_dir()


def test_a_refused_folder_is_a_one_line_error(setup, tmp_path):
    _, ckpt, corpus = setup
    out = tmp_path / "run"
    (out / "ckpt-000003").mkdir(parents=True)
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--model", str(ckpt), "--data.paths", str(corpus),
                        "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: RunFolderError: --out ")
    assert _files(out) == ["ckpt-000003"]
