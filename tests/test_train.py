"""train.py and kimi/lora.py on CPU: a 2-layer model (KDA with a dense MLP, then MLA with an indexer and MoE,
attention residuals) saved as a checkpoint, trained for a few short steps on a small generated corpus."""

import dataclasses
import json
import os
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import kimi
from kimi.tokenizer import ByteTokenizer
from kimi import lora
from kimi.params import tree_items

from helpers import rel_err, tiny

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402  (train.py at the repository root)

WORDS = "the model reads a token and writes the next one while the state decays".split()


def small_cfg() -> kimi.ModelConfig:
    """2 layers (KDA + dense MLP, MLA + indexer + MoE), one attention-residual block per layer."""
    return tiny(num_hidden_layers=2, attn_res_block_size=1, index_topk=4,
                linear_attn_config=dataclasses.replace(kimi.preset("tiny").linear_attn_config,
                                                       kda_layers=(1,), full_attn_layers=(2,)))


@pytest.fixture
def setup(tmp_path):
    """A fresh-weight checkpoint folder and a text corpus of short documents (fresh random words each run)."""
    cfg = small_cfg()
    ckpt = tmp_path / "base"
    kimi.save_checkpoint(ckpt, cfg, kimi.init_params(cfg, seed=random.randrange(1000)))
    corpus = tmp_path / "corpus.jsonl"
    rng = random.Random(torch.initial_seed())
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4)))})
                              + "\n" for _ in range(40)))
    return cfg, ckpt, corpus


def config(ckpt, corpus, out, **kw) -> train.TrainConfig:
    base = dict(model=str(ckpt), out=str(out), data=train.DataConfig(paths=(str(corpus),), seq_len=32),
                steps=4, batch_size=2, micro_batch_size=2, lr=3e-3, warmup_steps=1, log_every=1, eval_every=0,
                eval_rows=2, ckpt_every=0, device="cpu", dtype="float32", compile="off")
    return train.TrainConfig(**(base | kw))


def state(out: Path) -> dict:
    return torch.load(train.latest_checkpoint(out) / "state.pt", weights_only=False)


def losses(out: Path, key: str = "loss") -> list[float]:
    return [m[key] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if key in m]


def grad_norms(out: Path) -> list[float]:
    return losses(out, "grad_norm")


# ---------------------------------------------------------------------------------------------- training

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
        train.loss_sum(params, adapters, ids, ids, torch.zeros_like(ids), cfg=model_cfg, backend=kimi.Backend(),
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


def test_lora_targets():
    cfg = small_cfg()
    params = kimi.init_params(cfg, seed=0)
    paths = lora.target_paths(params, lora.ATTENTION_TARGETS + lora.EXPERT_TARGETS)
    assert "model.layers.1.self_attn.kv_b_proj.weight" in paths
    assert "model.layers.1.block_sparse_moe.experts.w2" in paths
    assert not [p for p in paths if "indexer" in p]
    ad = lora.init_adapters(params, ("experts",), 3)
    assert ad["model.layers.1.block_sparse_moe.experts.w1"]["A"].shape == (cfg.num_experts, 3, 64)
    with pytest.raises(lora.LoRAError, match="wq_b"):
        lora.target_paths(params, ("wq_b",))


# ---------------------------------------------------------------------------------------------- data

def test_packed_and_padded_rows_give_the_same_loss(setup):
    cfg, ckpt, corpus = setup
    _, params = kimi.load_checkpoint(ckpt)
    tok = ByteTokenizer()
    docs = train.read_documents([corpus], tok)[:8]
    results = []
    for pack in (True, False):
        rows = train.make_rows(docs, 40, pack, tok.pad_id)
        assert len(rows) == (len(docs) if not pack else len(rows))
        s = train.loss_sum(params, {}, rows.input_ids, rows.labels, rows.document_ids, cfg=cfg,
                           backend=kimi.Backend(), dtype=torch.float32, fp32_paths=frozenset(), lora_scale=1.0)
        results.append((s / (rows.labels != train.IGNORE).sum()).item())
        assert (rows.labels != train.IGNORE).sum() == sum(len(d.labels) for d in docs)
    assert len(train.make_rows(docs, 40, True, 0)) < len(docs)               # packing did pack
    assert abs(results[0] - results[1]) < 1e-5 * abs(results[1])


def test_chat_loss_only_on_assistant_tokens():
    tok = ByteTokenizer()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    doc = train._chat_document(msgs, tok, "x")
    ids, mask = tok.encode_chat(msgs)
    assert doc.inputs == ids[:-1]
    assert [lab != train.IGNORE for lab in doc.labels] == mask[1:]
    assert tok.decode([lab for lab in doc.labels if lab != train.IGNORE]).count("hello") == 1


def test_bad_data_errors(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(train.DataError, match="does not exist"):
        train.read_documents([tmp_path / "nope.jsonl"], tok)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": "broken\n')
    with pytest.raises(train.DataError, match=r"bad.jsonl:3: malformed JSON"):
        train.read_documents([bad], tok)
    bad.write_text('{"text": "fine"}\n{"text": "   "}\n')
    with pytest.raises(train.DataError, match=r"bad.jsonl:2: empty text"):
        train.read_documents([bad], tok)
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(train.DataError, match=r"bad.jsonl:1: expected an object with 'text' or 'messages'"):
        train.read_documents([bad], tok)
    bad.write_text('{"messages": [{"role": "user", "content": "only a question"}]}\n')
    with pytest.raises(train.DataError, match=r"bad.jsonl:1: no assistant tokens"):
        train.read_documents([bad], tok)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(train.DataError, match="empty.txt: empty text"):
        train.read_documents([empty], tok)
    bad.write_text('{"text": "short"}\n{"text": "' + "x" * 100 + '"}\n')
    docs = train.read_documents([bad], tok)
    with pytest.raises(train.DataError, match=r"bad.jsonl:2: document has 102 tokens, more than seq_len"):
        train.fit_documents(docs, 64, "error")
    pieces = train.fit_documents(docs, 64, "split")
    assert [len(d.inputs) for d in pieces] == [len(docs[0].inputs), 64, 37]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_blockwise_head_loss_equals_full_cross_entropy(dtype):
    """The vocabulary-blocked loss (blocks of 7 over 30 words: a ragged last block of 2; labels at both edges of
    every block, ignored rows) gives the loss and gradients of cross-entropy over the whole logits in float64,
    with the logits kept or recomputed; recomputing, it keeps no [N, V]-sized tensor for the backward, keeping,
    only the compute-dtype logits blocks; and it rejects labels outside the vocabulary."""
    N, D, V = 15, 8, 30
    h = torch.randn(N, D, dtype=torch.float64)
    w = torch.randn(V, D, dtype=torch.float64)
    labels = torch.tensor([0, 6, 7, 13, 14, 20, 21, 27, 28, 29, train.IGNORE, 3, train.IGNORE, 17, 29])
    h64, w64 = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(h64 @ w64.T, labels, ignore_index=train.IGNORE, reduction="sum")
    (want * 0.5).backward()
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    for block_logits in (7 * N, N * V, 1):             # blocks of 7, one block, blocks of one word
        for keep_logits in (0, N * V):
            hd, wd = h.to(dtype, copy=True).requires_grad_(), w.to(dtype, copy=True).requires_grad_()
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                got = train.token_loss_sum(hd[None], wd, labels[None], block_logits=block_logits,
                                           keep_logits=keep_logits)
            (got * 0.5).backward()
            assert got.dtype == torch.promote_types(dtype, torch.float32) and rel_err(got, want) < max(tol, 1e-6)
            assert rel_err(hd.grad, h64.grad) < tol and rel_err(wd.grad, w64.grad) < tol
            assert hd.grad.dtype == wd.grad.dtype == dtype
            assert all(t.numel() <= max(N * D, V * D) for t in saved[:4])   # h, w, labels, log-sum-exp
            kept = saved[4:]                                                  # the logits blocks, when kept
            assert sum(t.numel() for t in kept) == (N * V if keep_logits else 0)
            assert all(t.dtype == dtype and t.shape[0] == N for t in kept)
    for bad in (V, -1):
        with pytest.raises(ValueError, match=f"label {bad} at position 4 .* outside the vocabulary"):
            train.token_loss_sum(h[None], w, torch.where(torch.arange(N) == 4, bad, labels)[None])


def test_compiled_cast_equals_eager_cast():
    """The compiled weight casts of the layer-wise compiled step (Dynamo with AOT autograd here, Inductor on a GPU)
    give the eager casts bit for bit and keep the fp32 leaves; their backward writes the same fp32 gradients into
    `.grad`, also when accumulating over two backward passes; frozen leaves (the indexer) get none; each leaf is
    its own autograd node (its gradient is cast as soon as it exists, not when the last one arrives)."""
    from kimi.config import KDAConfig
    cfg = tiny(num_hidden_layers=2, linear_attn_config=KDAConfig(num_heads=4, head_dim=32, kda_layers=(1,),
                                                                  full_attn_layers=(2,)))
    params = kimi.init_params(cfg, seed=0)
    fp32 = frozenset(p for p, s in tree_items(kimi.param_specs(cfg)) if s.fp32)
    compiled = train.compiled_cast(backend="aot_eager")
    want = dict(tree_items(train.cast_tree(params, torch.bfloat16, fp32)))
    got = dict(tree_items(compiled(params, torch.bfloat16, fp32)))
    assert got.keys() == want.keys() and fp32 and any(v.dtype == torch.bfloat16 for v in want.values())
    for k, v in want.items():
        assert got[k].dtype == v.dtype == (torch.float32 if k in fp32 else torch.bfloat16) and torch.equal(got[k], v)
    nodes = [got[k].grad_fn for k in want if k not in fp32 and got[k].requires_grad]
    assert len(nodes) > 10 and len(set(map(id, nodes))) == len(nodes)   # one autograd node per leaf, none shared
    probes = [{k: torch.randn(v.shape) for k, v in want.items()} for _ in range(2)]
    grads = []
    for cast in (compiled, train.cast_tree):
        for probe in probes:                          # two passes: the second accumulates into .grad
            tree = dict(tree_items(cast(params, torch.bfloat16, fp32)))
            sum((tree[k].float() * probe[k]).sum() for k in tree).backward()
        grads.append({k: v.grad for k, v in tree_items(params)})
        for _, v in tree_items(params):
            v.grad = None
    assert grads[0].keys() == grads[1].keys()
    for k, g in grads[1].items():
        assert (g is None) == (grads[0][k] is None)
        assert g is None or (grads[0][k].dtype == torch.float32 and torch.equal(g, grads[0][k]))
    assert any(g is None for g in grads[1].values()) and sum(g is not None for g in grads[1].values()) > 10

    class NoGrad(torch.autograd.Function):   # a consumer that passes no gradient to its input
        @staticmethod
        def forward(ctx, x):
            return x.float().sum()

        @staticmethod
        def backward(ctx, g):
            return None

    path = next(k for k in want if k not in fp32 and got[k].requires_grad)
    for cast in (compiled, train.cast_tree):     # the weight keeps no gradient (None), not zeros
        tree = dict(tree_items(cast(params, torch.bfloat16, fp32)))
        (NoGrad.apply(tree[path]) + sum(t.float().sum() for k, t in tree.items() if k != path)).backward()
        assert dict(tree_items(params))[path].grad is None
        for _, v in tree_items(params):
            v.grad = None


@pytest.mark.parametrize("fused", [True, False])
def test_clipped_step_equals_clip_then_step(fused):
    """`clipped_step` against clip_grad_norm_ + AdamW.step over two steps whose gradients differ 100x in size (so
    Adam sees whether they were clipped), with clipping active (norms ~450 and ~4.5), inactive (norms < 1) and off
    (max_norm 0): a fused AdamW (here on the CPU) takes the clipping as its grad_scale (equal to rounding), the
    unfused one is scaled first (bit for bit)."""
    for scales, max_norm in (((10.0, 0.1), 1.0), ((1e-3, 1e-5), 1.0), ((10.0, 0.1), 0.0)):
        ref = [torch.randn(64, 32, requires_grad=True) for _ in range(3)]
        got = [p.detach().clone().requires_grad_() for p in ref]
        opts = [torch.optim.AdamW(ps, lr=1e-2, fused=fused) for ps in (ref, got)]
        for scale in scales:
            for a, b in zip(ref, got):
                a.grad = torch.randn_like(a) * scale
                b.grad = a.grad.clone()
            if max_norm:
                torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=True)
            opts[0].step()
            train.clipped_step(opts[1], got, torch.nn.utils.get_total_norm([p.grad for p in got]), max_norm)
        for a, b in zip(ref, got):
            assert torch.equal(a, b) if not fused else rel_err(b, a) < 1e-6
        assert not hasattr(opts[1], "grad_scale") and not hasattr(opts[1], "found_inf")


def test_auto_kda_choice():
    """--kda auto: the opaque core when compiling on a CPU (compile time), the traced one eagerly; on a GPU the
    Triton state pass when Triton is there."""
    cpu = torch.device("cpu")
    assert train.auto_kda(cpu, True) == "chunk_opaque" and train.auto_kda(cpu, False) == "chunk"
    gpu = torch.device("cuda")
    assert train.auto_kda(gpu, True) == ("chunk_triton" if train.kernels.triton is not None else "chunk")


def test_lr_schedules():
    c = train.TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert train.lr_at(0, c) == pytest.approx(0.1) and train.lr_at(9, c) == pytest.approx(1.0)
    assert train.lr_at(99, c) == pytest.approx(0.1)
    lrs = [train.lr_at(s, c) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    w = dataclasses.replace(c, schedule="wsd", decay_fraction=0.2)
    assert train.lr_at(79, w) == 1.0 and train.lr_at(99, w) == pytest.approx(0.1)
    assert train.lr_at(89, w) == pytest.approx(0.55)


def test_non_finite_loss_is_skipped_then_stops(setup, tmp_path, monkeypatch):
    _, ckpt, corpus = setup
    monkeypatch.setattr(train, "token_loss_sum", lambda h, head, labels, **kw: h.sum() * float("nan"))
    _, before = kimi.load_checkpoint(ckpt)
    with pytest.warns(UserWarning, match="non-finite"), pytest.raises(train.TrainingDiverged, match="2 consecutive"):
        train.train(config(ckpt, corpus, tmp_path / "nan", max_bad_steps=2))
    assert not (tmp_path / "nan" / "model").exists()


# ---------------------------------------------------------------------------------------------- two processes

def test_fsdp_two_processes_match_one(setup, tmp_path):
    """torchrun with 2 CPU processes (gloo, FSDP2) and one process on the same global batch: same losses, same
    updated weights."""
    _, ckpt, corpus = setup
    args = ["--model", str(ckpt), "--data.paths", str(corpus), "--data.seq-len", "32", "--steps", "2",
            "--batch-size", "4", "--micro-batch-size", "2", "--device", "cpu", "--warmup-steps", "1",
            "--log-every", "1", "--eval-every", "0", "--eval-rows", "2", "--ckpt-every", "0"]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                        "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one", tmp_path / "two"
    train.main([*args, "--out", str(one)])
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(ROOT / "train.py"), *args, "--out", str(two)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    la, lb = losses(one), losses(two)
    assert len(la) == len(lb) == 2
    assert all(abs(a - b) < 1e-5 * abs(a) for a, b in zip(la, lb)), (la, lb)
    # AdamW hides a gradient scale error in the weights; the gradient norm does not
    ga, gb = (grad_norms(one), grad_norms(two))
    assert all(abs(a - b) < 1e-4 * a for a, b in zip(ga, gb)), (ga, gb)
    _, pa = kimi.load_checkpoint(one / "model")
    _, pb = kimi.load_checkpoint(two / "model")
    _, p0 = kimi.load_checkpoint(ckpt)
    p0 = dict(tree_items(p0))
    for (path, a), (_, b) in zip(tree_items(pa), tree_items(pb)):
        moved = (a - p0[path]).norm()
        assert (a - b).norm() <= 1e-4 * moved + 1e-7, path


def test_model_flops_and_unflatten():
    cfg = small_cfg()
    n = kimi.param_count(cfg, active=True, embedding=False)
    f64, f128 = train.model_flops_per_token(cfg, 64), train.model_flops_per_token(cfg, 128)
    assert 6 * n * 0.9 < f64 < f128 < 6 * n * 2        # indexer counted once, not 6 times; attention grows with T
    params = kimi.init_params(cfg, seed=0)
    back = train.unflatten(dict(tree_items(params)))
    got, want = list(tree_items(back)), list(tree_items(params))
    assert [p for p, _ in got] == [p for p, _ in want] and all(a is b for (_, a), (_, b) in zip(got, want))
