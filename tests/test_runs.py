"""Run folders (kimi/runs.py, through train.py): a run never deletes or overwrites another run's files, --overwrite
replaces one on request, --resume continues only the run the folder holds and with its own settings (bookkeeping
may change), checkpoints rotate by step, stale temporary folders go, and every refusal is one line; the metrics
log (metrics.jsonl, TensorBoard)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimi import runs

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
    with pytest.raises(runs.RunFolderError, match="no complete checkpoint in"):
        train.train(config(ckpt, corpus, tmp_path / "empty", resume=True))
    (tmp_path / "half" / "ckpt-000003").mkdir(parents=True)       # a folder without its state: not resumable
    with pytest.raises(runs.RunFolderError, match="no complete checkpoint in .*ckpt-000003"):
        train.train(config(ckpt, corpus, tmp_path / "half", resume=True))
    (tmp_path / "old" / "ckpt-000003").mkdir(parents=True)
    (tmp_path / "old" / "ckpt-000003" / "state.pt").write_bytes(b"")          # a run of the pickled format
    with pytest.raises(runs.RunFolderError, match="old format"):
        train.train(config(ckpt, corpus, tmp_path / "old", resume=True))
    summary = train.train(config(ckpt, corpus, out, steps=5, resume=True, export=False))   # a longer run: allowed
    assert summary["steps"] == 5 and runs.latest_complete(out).name == "ckpt-000005"
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


def _cli(ckpt, corpus, out, *extra):
    return [sys.executable, str(ROOT / "train.py"), "--model", str(ckpt), "--data.paths", str(corpus),
            "--data.seq-len", "32", "--batch-size", "2", "--micro-batch-size", "2", "--warmup-steps", "1",
            "--log.every", "1", "--eval-every", "0", "--eval-rows", "2", "--ckpt-every", "0", "--device", "cpu",
            "--dtype", "float32", "--compile", "off", "--no-export", "--out", str(out), *extra]


def test_sigint_saves_and_resume_continues_exactly(setup, tmp_path):
    """Ctrl-C during training: the step finishes, a checkpoint is saved, one line, exit 130, no traceback; --resume
    then ends with the losses of a run that was never interrupted."""
    import signal
    _, ckpt, corpus = setup
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    subprocess.run(_cli(ckpt, corpus, straight, "--steps", "12"), check=True, capture_output=True, timeout=300,
                   env=env)
    p = subprocess.Popen(_cli(ckpt, corpus, stopped, "--steps", "12"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    for line in p.stdout:
        if line.startswith("step      2/"):
            p.send_signal(signal.SIGINT)
            break
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("stopped: SIGINT at step "), err[-3000:]
    at = runs.checkpoint_step(runs.latest_complete(stopped))
    assert 2 <= at < 12
    subprocess.run(_cli(ckpt, corpus, stopped, "--steps", "12", "--resume"), check=True, capture_output=True,
                   timeout=300, env=env)
    assert losses(stopped) == losses(straight) and len(losses(straight)) == 12


def test_degenerate_settings_are_warned(setup, tmp_path, capsys):
    _, ckpt, corpus = setup
    train.train(config(ckpt, corpus, tmp_path / "run", steps=2, warmup_steps=2,
                       data=train.DataConfig(paths=(str(corpus),), seq_len=6, long_documents="split"),
                       export=False))
    err = capsys.readouterr().err
    assert "warning: the warm-up (2 steps) is not shorter than the run (2 steps)" in err
    assert "warning: --data.seq-len 6: rows this short" in err
    assert train.degenerate_settings(config(ckpt, corpus, tmp_path, batch_size=8), 5) == [
        "a step takes 8 rows but the training data has 5: rows repeat within a step"]
    assert train.degenerate_settings(config(ckpt, corpus, tmp_path), 100) == []


@pytest.mark.parametrize("args, message", [
    (["--device", "cuda"], "--device cuda: no CUDA device is usable here"),
    (["--lr", "-1"], "lr must be positive, got -1.0"),
    (["--model", "{ckpt}/config.json"], "is a file; pass the checkpoint folder"),
])
def test_user_mistakes_are_one_line_errors(setup, tmp_path, args, message):
    import torch
    if args[0] == "--device" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is not a mistake here")
    _, ckpt, corpus = setup
    args = [a.format(ckpt=ckpt) for a in args]
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--model", str(ckpt), "--data.paths", str(corpus),
                        "--device", "cpu", "--out", str(tmp_path / "out"), *args], capture_output=True, text=True,
                       timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, last


def test_every_option_is_described():
    """Every train.py option carries a docstring (what --help prints for it)."""
    from helpers import undocumented_fields
    for cls in (train.TrainConfig, train.DataConfig, train.LoRAConfig):
        assert undocumented_fields(cls) == [], cls.__name__


def test_metrics_rows_are_stamped_and_go_to_tensorboard(tmp_path, monkeypatch):
    """Each row gets the UTC time and the elapsed seconds; with TensorBoard every number of the row is a scalar at
    the row's step (a fake writer stands in for the optional package); a resumed run drops the rows past its
    checkpoint and purges the events past it."""
    import time
    written = []

    class FakeWriter:
        def __init__(self, folder, purge_step):
            written.append(("open", Path(folder).name, purge_step))

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            written.append(("close",))
    monkeypatch.setattr(runs, "_summary_writer", FakeWriter)
    m = runs.Metrics(tmp_path, t0=time.perf_counter() - 2.0, tensorboard=True)
    for step in (1, 2, 3):
        m.record({"step": step, "loss": 1.0 / step, "lr": 1e-3, "finite": True})
    m.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["elapsed_s"] >= 2.0 for r in rows)
    assert rows[0]["time"].endswith("+00:00")
    assert written[0] == ("open", "tensorboard", None) and ("loss", 0.5, 2) in written and ("lr", 1e-3, 3) in written
    assert not any(w[0] in ("step", "finite") for w in written) and written[-1] == ("close",)
    written.clear()
    runs.Metrics(tmp_path, t0=time.perf_counter(), tensorboard=True, resumed_at=2).close()
    assert [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert written[0] == ("open", "tensorboard", 3)


def test_tensorboard_without_the_package_is_a_one_line_error(setup, tmp_path, monkeypatch):
    _, ckpt, corpus = setup
    monkeypatch.setattr(runs, "tensorboard_missing", lambda: "TensorBoard logging needs the tensorboard package")
    with pytest.raises(ValueError, match="needs the tensorboard package"):
        train.train(config(ckpt, corpus, tmp_path / "run", log=train.LogConfig(tensorboard=True)))
    assert not (tmp_path / "run").exists()
