"""Shared test helpers."""

import dataclasses
import json
import random

import torch

import kimi


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ computed in float64."""
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def tiny(**changes) -> kimi.ModelConfig:
    return dataclasses.replace(kimi.preset("tiny"), **changes)


def small_cfg() -> kimi.ModelConfig:
    """2 layers (KDA + dense MLP, MLA + indexer + MoE), one attention-residual block per layer: every kind of
    leaf the training code handles, cheap on a CPU."""
    return tiny(num_hidden_layers=2, attn_res_block_size=1, index_topk=4,
                linear_attn_config=dataclasses.replace(kimi.preset("tiny").linear_attn_config,
                                                       kda_layers=(1,), full_attn_layers=(2,)))


WORDS = "the model reads a token and writes the next one while the state decays".split()


def write_corpus(path, n: int = 40) -> None:
    """A .jsonl corpus of n short {"text": ...} documents of random words (drawn from torch's seed)."""
    rng = random.Random(torch.initial_seed())
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4)))})
                            + "\n" for _ in range(n)))


def without_indexer(cfg: kimi.ModelConfig) -> kimi.ModelConfig:
    return dataclasses.replace(cfg, index_n_heads=None, index_head_dim=None, index_topk=None)


def drop_indexer(params):
    """The same tree without the indexer subtrees (a K3-style tree)."""
    layers = []
    for layer in params["model"]["layers"]:
        attn = {k: v for k, v in layer["self_attn"].items() if k != "indexer"}
        layers.append({**layer, "self_attn": attn})
    return {**params, "model": {**params["model"], "layers": layers}}


def train_bpe(text: str, merges: int) -> dict[bytes, int]:
    """A small byte-level BPE (ranks as in a `tiktoken.model`): the 256 bytes, then `merges` merges of the most
    frequent adjacent pair inside whitespace-led words of `text`."""
    import collections
    import re

    words = collections.Counter(tuple(bytes([b]) for b in w.encode()) for w in re.findall(r"\s?\S+|\s+", text))
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(merges):
        pairs = collections.Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks.setdefault(a + b, len(ranks))
        merged = collections.Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return ranks


def write_tiktoken_model(ranks: dict[bytes, int], path) -> None:
    import base64

    lines = (f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))
    path.write_text("\n".join(lines) + "\n")


def resets(B: int, T: int, positions) -> torch.Tensor:
    """reset [B, T] bool, True at the given positions of each row (those < T): document starts for KDA."""
    r = torch.zeros(B, T, dtype=torch.bool)
    for b, ps in enumerate(positions):
        r[b, [p for p in ps if p < T]] = True
    return r


def router_params(cfg: kimi.ModelConfig, dtype=torch.float64) -> dict:
    """A router with a spread of scores and a nonzero choice bias."""
    E, D = cfg.num_experts, cfg.hidden_size
    return {"weight": torch.randn(E, D, dtype=dtype) * 0.3,
            "e_score_correction_bias": torch.randn(E, dtype=dtype) * 0.3}



def run_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's document as a run number within its row (a new run wherever the id changes), -1 on padding:
    the oracle's view of packed documents, computed independently of kimi.ranges."""
    new = torch.ones_like(document_ids, dtype=torch.bool)
    new[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.where(document_ids < 0, -1, new.long().cumsum(1) - 1)


def visible_of(document_ids: torch.Tensor) -> torch.Tensor:
    """The document-causal candidate mask [B, T, T] from the run numbers: s <= t, same run, t not padding."""
    seg = run_ids(document_ids)
    T = seg.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return causal & (seg[:, :, None] == seg[:, None, :]) & (seg >= 0)[:, :, None]


def undocumented_fields(cls) -> list[str]:
    """The fields of dataclass `cls` without a docstring (the string after the field that tyro's --help prints)."""
    import ast
    import inspect
    body = ast.parse(inspect.getsource(cls)).body[0].body
    missing = []
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign):
            doc = nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) else None
            if not (isinstance(doc, str) and len(doc) > 10):
                missing.append(node.target.id)
    return missing


class OpOutputs:
    """A context manager that records, for every op run while it is active, the op and the shape of each tensor
    it returns: `.outputs` [(op, shape)], `.shapes` the shapes alone."""

    def __init__(self):
        self.outputs = []

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [shape for _, shape in self.outputs]

    def _record(self, func, out: torch.Tensor) -> None:
        self.outputs.append((func, tuple(out.shape)))

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        record = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for o in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(o, torch.Tensor):
                        record._record(func, o)
                return out
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


class LargestTensor(OpOutputs):
    """`OpOutputs` keeping only the largest tensor any op creates: `.numel` (elements) and `.bytes` (the "nothing
    of size T×S" checks)."""

    def __init__(self):
        super().__init__()
        self.numel = self.bytes = 0

    def _record(self, func, out: torch.Tensor) -> None:
        self.numel = max(self.numel, out.numel())
        self.bytes = max(self.bytes, out.numel() * out.element_size())


def assert_backend_equals_gather(backend: "kimi.Backend", **cfg_changes) -> None:
    """`backend` through a 2-layer model with an indexer (packed documents, padding; the caller sets a small
    QUERY_BLOCK for several query blocks), fp32: the logits and every parameter's gradient of attn='gather'
    (relative errors 1e-5 and 1e-4), and under torch.compile (fullgraph, aot_eager) the same logits."""
    from kimi.config import KDAConfig
    from kimi.params import tree_items, unflatten
    cfg = tiny(num_hidden_layers=2, index_topk=4, linear_attn_config=KDAConfig(
        num_heads=4, head_dim=32, kda_layers=(1,), full_attn_layers=(2,)), **cfg_changes)
    params = kimi.init_params(cfg, seed=int(torch.randint(1000, ())))
    doc = torch.tensor([[0] * 13 + [1] * 6 + [2] * 3, [5] * 18 + [-1] * 4])
    ids = torch.randint(0, cfg.vocab_size, doc.shape)
    probe = torch.randn(*doc.shape, cfg.vocab_size)

    def run(b):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in tree_items(params)}
        logits = kimi.forward(unflatten(leaves), ids, cfg, b, document_ids=doc)
        (logits * probe * (doc >= 0)[..., None]).sum().backward()
        return logits.detach(), {k: v.grad for k, v in leaves.items() if v.grad is not None}
    want, want_g = run(dataclasses.replace(backend, attn="gather", sparse_fwd="auto"))
    got, got_g = run(backend)
    real = doc >= 0
    assert rel_err(got[real], want[real]) < 1e-5
    assert got_g.keys() == want_g.keys()
    for k, g in want_g.items():
        assert rel_err(got_g[k], g) < 1e-4, k
    compiled = torch.compile(kimi.forward, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        out = compiled(params, ids, cfg, backend, document_ids=doc)
    assert rel_err(out[real], want[real]) < 1e-5
