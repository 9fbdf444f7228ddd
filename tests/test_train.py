"""train.py end to end on CPU: a 2-layer model (KDA with a dense MLP, then MLA with an indexer and MoE, attention
residuals) saved as a checkpoint, trained for a few short steps on a small generated corpus: the loss falls, the
export loads, resume is exact, LoRA, the indexer stays frozen, non-finite steps, two FSDP processes, bad data.
The pieces the script calls are tested in their own files (test_data, test_loss, test_training, test_fsdp, ...)."""

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import kimi
import kimi.training
from kimi import lora, runs
from kimi.params import tree_items
from kimi.train_state import read_checkpoint
from kimi.training import loss_sum

from helpers import rel_err, small_cfg, write_corpus

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("train", ROOT / "train.py")
train = importlib.util.module_from_spec(spec)
sys.modules["train"] = train
spec.loader.exec_module(train)


@pytest.fixture
def setup(tmp_path):
    """A fresh-weight checkpoint folder and a text corpus of short documents (fresh random words each run)."""
    cfg = small_cfg()
    ckpt = tmp_path / "base"
    kimi.save_checkpoint(ckpt, cfg, kimi.init_params(cfg, seed=int(torch.randint(1000, ()))))   # replayable
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    return cfg, ckpt, corpus


def config(ckpt, corpus, out, **kw) -> "train.TrainConfig":
    base = dict(model=str(ckpt), out=str(out), data=train.DataConfig(paths=(str(corpus),), seq_len=32),
                steps=4, batch_size=2, micro_batch_size=2, lr=3e-3, warmup_steps=1, log=train.LogConfig(every=1),
                eval_every=0, eval_rows=2, ckpt_every=0, device="cpu", dtype="float32", compile="off")
    return train.TrainConfig(**(base | kw))


def state(out: Path) -> dict:
    return read_checkpoint(runs.latest_complete(out))


def losses(out: Path, key: str = "loss") -> list[float]:
    return [m[key] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if key in m]


def grad_norms(out: Path) -> list[float]:
    return losses(out, "grad_norm")


def test_loss_falls_and_export_loads(setup, tmp_path):
    cfg, ckpt, corpus = setup
    out = tmp_path / "run"
    summary = train.train(config(ckpt, corpus, out, steps=6, batch_size=4, micro_batch_size=4, lr=1e-2))
    got = losses(out)
    assert len(got) == 6 and got[-1] < got[0] - 1.0, got
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and zlib.crc32(png[12:29]) == int.from_bytes(png[29:33], "big")
    assert summary["eval_loss"] is not None and summary["tokens_per_s"] > 0
    # the export holds the trained weights and loads back
    cfg2, params = kimi.load_checkpoint(out / "model")
    assert cfg2 == cfg
    trained = state(out)["params"]
    for path, p in tree_items(params):
        if path in trained:
            assert torch.equal(p, trained[path]), path


def test_resume_is_exact(setup, tmp_path):
    _, ckpt, corpus = setup
    a, b = tmp_path / "straight", tmp_path / "stopped"
    train.train(config(ckpt, corpus, a))
    first = train.train(config(ckpt, corpus, b, stop_after=2, export=False))
    assert first["steps"] == 2
    train.train(config(ckpt, corpus, b, resume=True, export=False))
    assert losses(a) == losses(b)
    sa, sb = state(a), state(b)
    assert sa["step"] == sb["step"] == 4 and sa["data"] == sb["data"]
    for name, t in sa["params"].items():
        assert torch.equal(t, sb["params"][name]), name
    for name, st in sa["optimizer"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["optimizer"][name][k]), (name, k)


def test_activation_checkpointing_gives_the_same_run(setup, tmp_path, capsys):
    """--activation-checkpointing layers on a CPU (eager): the losses and gradient norms of the plain run, bit for
    bit; the log says which was used."""
    _, ckpt, corpus = setup
    train.train(config(ckpt, corpus, tmp_path / "plain", steps=3, export=False))
    assert "activation checkpointing none" in capsys.readouterr().out
    train.train(config(ckpt, corpus, tmp_path / "recomputed", steps=3, export=False,
                       activation_checkpointing="layers"))
    assert "activation checkpointing layers" in capsys.readouterr().out
    assert losses(tmp_path / "plain") == losses(tmp_path / "recomputed")
    assert grad_norms(tmp_path / "plain") == grad_norms(tmp_path / "recomputed")


def test_indexer_is_frozen(setup, tmp_path):
    cfg, ckpt, corpus = setup
    _, base = kimi.load_checkpoint(ckpt)
    out = tmp_path / "run"
    train.train(config(ckpt, corpus, out, steps=2))
    s = state(out)
    assert not [n for n in [*s["params"], *s["optimizer"]] if ".indexer." in n]
    assert [n for n in s["params"] if ".self_attn.q_a_proj" in n]        # the MLA itself is trained
    _, after = kimi.load_checkpoint(out / "model")
    base, after = dict(tree_items(base)), dict(tree_items(after))
    idx = [p for p in base if ".indexer." in p]
    assert idx and all(torch.equal(base[p], after[p]) for p in idx)
    assert not torch.equal(base["model.layers.1.self_attn.q_a_proj.weight"],
                           after["model.layers.1.self_attn.q_a_proj.weight"])
    # no gradient reaches the indexer, with or without LoRA
    for rank in (0, 2):
        run = dataclasses.replace(config(ckpt, corpus, out), lora=train.LoRAConfig(rank=rank))
        model_cfg, params, adapters, _ = train.build_model(run, torch.device("cpu"), torch.float32)
        ids = torch.randint(0, 256, (1, 16))
        loss_sum(params, adapters, ids, ids, torch.zeros_like(ids), cfg=model_cfg, backend=kimi.Backend(),
                 dtype=torch.float32, fp32_paths=frozenset(), lora_scale=1.0).backward()
        for path, p in tree_items(params):
            if ".indexer." in path:
                assert not p.requires_grad and p.grad is None, path


def test_lora_trains_adapters_only_and_merges(setup, tmp_path):
    cfg, ckpt, corpus = setup
    out = tmp_path / "lora"
    run = config(ckpt, corpus, out, steps=3, lora=train.LoRAConfig(rank=4, alpha=8.0))
    train.train(run)
    s = state(out)
    names = set(s["params"])
    assert names and all(n.endswith((":A", ":B")) for n in names)
    assert "model.layers.1.self_attn.kv_b_proj.weight:B" in names
    assert not any(".indexer." in n for n in names)
    adapters = {}
    for n, t in s["params"].items():
        path, k = n.rsplit(":", 1)
        adapters.setdefault(path, {})[k] = t
    assert all(ab["B"].abs().max() > 0 for ab in adapters.values())      # every adapter moved off zero
    _, base = kimi.load_checkpoint(ckpt)
    _, merged = kimi.load_checkpoint(out / "model")
    for path, p in tree_items(merged):
        changed = not torch.equal(p, dict(tree_items(base))[path])
        assert changed == (path in adapters), path
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    doc = torch.tensor([[0] * 10 + [1] * 14, [0] * 20 + [-1] * 4])
    scale = lora.scale_of(4, 8.0)
    for form in ("expanded", "absorbed"):
        backend = kimi.Backend(mla_form=form)
        want = kimi.forward(lora.apply(base, adapters, scale), ids, cfg, backend, document_ids=doc)
        got = kimi.forward(merged, ids, cfg, backend, document_ids=doc)
        assert rel_err(got, want) < 1e-5


def test_non_finite_loss_is_skipped_then_stops(setup, tmp_path, monkeypatch):
    _, ckpt, corpus = setup
    monkeypatch.setattr(kimi.training, "token_loss_sum", lambda h, head, labels, **kw: h.sum() * float("nan"))
    _, before = kimi.load_checkpoint(ckpt)
    with pytest.warns(UserWarning, match="non-finite"), pytest.raises(train.TrainingDiverged, match="2 consecutive"):
        train.train(config(ckpt, corpus, tmp_path / "nan", max_bad_steps=2))
    assert not (tmp_path / "nan" / "model").exists()


def test_bad_data_is_a_one_line_error(setup, tmp_path):
    """A user's mistake in the data stops the script with exit code 2 and one line naming the file and line."""
    _, ckpt, _ = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n')
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--model", str(ckpt), "--data.paths", str(bad),
                        "--device", "cpu", "--out", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: DataError: ") and "bad.jsonl:2: malformed JSON" in last, r.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- two processes

def test_fsdp_two_processes_match_one_and_resume_at_either_count(setup, tmp_path, capsys):
    """torchrun with 2 CPU processes (gloo, FSDP2) against one process on the same global batch: the 2-process run
    stops after 2 of 4 steps (each process writes its DCP shards), then resumes once in 1 process and once in 2.
    Both give the straight 1-process run's losses, gradient norms and final weights."""
    _, ckpt, corpus = setup
    args = ["--model", str(ckpt), "--data.paths", str(corpus), "--data.seq-len", "32", "--steps", "4",
            "--batch-size", "4", "--micro-batch-size", "2", "--device", "cpu", "--warmup-steps", "1",
            "--log.every", "1", "--eval-every", "0", "--eval-rows", "2", "--ckpt-every", "0"]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                        "OMP_NUM_THREADS": "1"}

    def torchrun(*extra):
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            str(ROOT / "train.py"), *args, *extra], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r.stdout

    one, two, two_again = tmp_path / "one", tmp_path / "two", tmp_path / "two_again"
    train.main([*args, "--out", str(one)])
    torchrun("--out", str(two), "--stop-after", "2")
    saved = read_checkpoint(runs.latest_complete(two))
    assert saved["step"] == 2 and saved["world_size"] == 2
    assert sorted(p.name for p in runs.latest_complete(two).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    shutil.copytree(two, two_again)
    train.main([*args, "--out", str(two), "--resume"])                # 2 -> 1 process
    assert "ckpt-000002 at step 2" in capsys.readouterr().out          # resumed, not restarted
    assert "ckpt-000002 at step 2" in torchrun("--out", str(two_again), "--resume")     # 2 -> 2 processes
    _, p0 = kimi.load_checkpoint(ckpt)
    p0 = dict(tree_items(p0))
    _, pa = kimi.load_checkpoint(one / "model")
    la, ga = losses(one), grad_norms(one)
    assert len(la) == 4
    for run in (two, two_again):
        lb, gb = losses(run), grad_norms(run)
        assert len(lb) == 4 and all(abs(a - b) < 1e-5 * abs(a) for a, b in zip(la, lb)), (run.name, la, lb)
        # AdamW hides a gradient scale error in the weights; the gradient norm does not
        assert all(abs(a - b) < 1e-4 * a for a, b in zip(ga, gb)), (run.name, ga, gb)
        _, pb = kimi.load_checkpoint(run / "model")
        for (path, a), (_, b) in zip(tree_items(pa), tree_items(pb)):
            moved = (a - p0[path]).norm()
            assert (a - b).norm() <= 1e-4 * moved + 1e-7, (run.name, path)
