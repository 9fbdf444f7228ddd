"""The op layer's table and its one "auto" rule (kimi/ops/__init__.py): every Backend choice has an op and every op
a choice; "auto" resolves as documented; a concrete choice is what runs (no hidden switch)."""

import dataclasses
import typing

import pytest
import torch

import kimi
from kimi import ops
from kimi.config import Backend


def _concrete(field: str) -> set:
    return {v for v in typing.get_args(typing.get_type_hints(Backend)[field]) if v != "auto"}


def test_table_covers_every_backend_choice(monkeypatch):
    monkeypatch.setattr(ops.cudnn_dsa, "_READY", {"auto"})      # attn='cudnn' constructible without its GPU
    assert set(ops.IMPLEMENTATIONS["kda"]) == _concrete("kda")
    assert set(ops.IMPLEMENTATIONS["moe"]) == _concrete("moe")
    pairs = set()
    for attn in _concrete("attn"):
        for form in _concrete("mla_form"):
            try:
                Backend(attn=attn, mla_form=form)
            except ValueError:
                continue
            pairs.add((attn, form))
    assert set(ops.IMPLEMENTATIONS["attn"]) == pairs
    for table in ops.IMPLEMENTATIONS.values():
        assert all(isinstance(op, torch._ops.OpOverload) and op.namespace == "kimi" for op in table.values())


def test_bad_backends_are_named():
    with pytest.raises(ValueError, match="Backend.kda='fast'"):
        Backend(kda="fast")
    with pytest.raises(ValueError, match="SDPA has no shared-latent form"):
        Backend(attn="sdpa", mla_form="absorbed")
    with pytest.raises(ValueError, match="the gathering path attends over the shared latent"):
        Backend(attn="gather", mla_form="expanded")


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("facts, want", [
    (dict(device=CPU, dtype=torch.float32), Backend(attn="sdpa", mla_form="expanded", kda="chunk", moe="grouped")),
    (dict(device=CPU, dtype=torch.float64), Backend(attn="sdpa", mla_form="expanded", kda="chunk", moe="dense")),
    (dict(device=CPU, dtype=torch.bfloat16, cached=True, tokens=1),
     Backend(attn="eager", mla_form="absorbed", kda="chunk", moe="grouped")),
])
def test_resolve_on_the_cpu(facts, want):
    assert ops.resolve(Backend(), **facts) == want


def test_resolve_on_a_gpu(monkeypatch):
    """On CUDA with Triton: the Triton KDA kernels for 16-bit activations and a bounded gate (the Triton state pass
    otherwise) and, for a few tokens, the gemv experts (no GPU needed: resolve only reads the facts)."""
    monkeypatch.setattr(ops, "triton_available", lambda device: True)
    got = ops.resolve(Backend(), device=CUDA, dtype=torch.bfloat16, tokens=ops.GEMV_MAX_TOKENS, cached=True)
    assert got == Backend(attn="eager", mla_form="absorbed", kda="chunk_triton", moe="gemv")
    got = ops.resolve(Backend(), device=CUDA, dtype=torch.bfloat16, tokens=ops.GEMV_MAX_TOKENS + 1)
    assert got == Backend(attn="sdpa", mla_form="expanded", kda="chunk_triton", moe="grouped")   # no key count
    short = dict(device=CUDA, queries=4096, keys=4096)   # no cache: the kernels at any length, not the dense mask
    assert ops.resolve(Backend(), dtype=torch.bfloat16, **short) == Backend(
        attn="triton", mla_form="absorbed", kda="chunk_triton", moe="grouped")
    assert ops.resolve(Backend(), dtype=torch.float32, **short).attn == "sdpa"
    assert ops.resolve(Backend(mla_form="expanded"), dtype=torch.bfloat16, **short).attn == "sdpa"
    bound = ops.delta_rule.GATE_BOUND
    assert ops.resolve(Backend(), device=CUDA, dtype=torch.bfloat16, gate_lower_bound=bound).kda == "triton"
    assert ops.resolve(Backend(), device=CUDA, dtype=torch.float16, gate_lower_bound=bound + 1).kda == "triton"
    assert ops.resolve(Backend(), device=CUDA, dtype=torch.bfloat16, gate_lower_bound=bound - 1).kda == "chunk_triton"
    assert ops.resolve(Backend(), device=CUDA, dtype=torch.float32, gate_lower_bound=bound).kda == "chunk_triton"
    assert ops.resolve(Backend(), device=CUDA, dtype=torch.float64, tokens=1).kda == "chunk"
    n = ops.DENSE_MASK_MAX_KEYS + 1      # long rows and long caches: the Triton sparse kernels, in bf16 and fp16
    long = dict(device=CUDA, queries=n, keys=n)
    assert ops.resolve(Backend(), dtype=torch.bfloat16, **long).attn == "triton"
    assert ops.resolve(Backend(), dtype=torch.float32, **long).attn == "gather"
    assert ops.resolve(Backend(), dtype=torch.bfloat16, cached=True, **long).attn == "triton"
    slots = ops.DENSE_MASK_MAX_SLOTS_CACHED
    assert ops.resolve(Backend(), device=CUDA, dtype=torch.bfloat16, cached=True, queries=1, keys=slots).attn == "eager"
    assert ops.resolve(Backend(), device=CUDA, dtype=torch.bfloat16, cached=True, queries=1,
                       keys=slots + 1).attn == "triton"
    assert ops.resolve(Backend(), device=CUDA, dtype=torch.float32, cached=True, queries=1, keys=n).attn == "gather"
    assert ops.resolve(Backend(), dtype=torch.bfloat16, every_candidate=True, **long).attn == "gather"
    monkeypatch.setattr(ops, "triton_available", lambda device: False)
    assert ops.resolve(Backend(), device=CUDA, dtype=torch.bfloat16, tokens=1).moe == "grouped"


def test_resolve_attention_by_length():
    """The dense-mask SDPA path up to DENSE_MASK_MAX_KEYS keys without a cache, 'gather' beyond and for dense
    attention over ranges (every candidate attended); with a cache the absorbed dense path for short caches and few
    queries (decoding), 'gather' for long caches or long prefill chunks; an explicit expanded form keeps SDPA."""
    def attn(**facts):
        b = ops.resolve(Backend(**facts.pop("backend", {})), device=CPU, dtype=torch.bfloat16, **facts)
        return b.attn, b.mla_form
    n = ops.DENSE_MASK_MAX_KEYS
    assert attn(queries=n, keys=n) == ("sdpa", "expanded")
    assert attn(queries=n + 1, keys=n + 1) == ("gather", "absorbed")
    assert attn(queries=64, keys=64, every_candidate=True) == ("gather", "absorbed")
    assert attn(queries=n + 1, keys=n + 1, backend=dict(mla_form="expanded")) == ("sdpa", "expanded")
    assert attn(queries=1, keys=ops.DENSE_MASK_MAX_SLOTS_CACHED, cached=True) == ("eager", "absorbed")
    assert attn(queries=1, keys=ops.DENSE_MASK_MAX_SLOTS_CACHED + 1, cached=True) == ("gather", "absorbed")
    assert attn(queries=4096, keys=8192, cached=True) == ("gather", "absorbed")      # 2^25 pairs
    assert attn(queries=4, keys=64, cached=True, every_candidate=True) == ("eager", "absorbed")


def test_resolve_keeps_concrete_choices_and_the_sdpa_form(monkeypatch):
    monkeypatch.setattr(ops, "triton_available", lambda device: True)
    fixed = Backend(attn="eager", mla_form="expanded", kda="recurrent", moe="grouped")
    assert ops.resolve(fixed, device=CUDA, dtype=torch.bfloat16, tokens=1, cached=True) == fixed
    assert ops.resolve(Backend(attn="sdpa"), device=CPU, dtype=torch.float32, cached=True).mla_form == "expanded"


def test_resolve_compiling_on_the_cpu_picks_the_opaque_chunk():
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        seen.append(ops.resolve(Backend(), device=x.device, dtype=x.dtype).kda)
        return x + 1

    f(torch.zeros(2))
    assert seen == ["chunk_opaque"] and ops.resolve(Backend(), device=CPU, dtype=torch.float32).kda == "chunk"


@pytest.mark.parametrize("field, choice", [("moe", "grouped"), ("moe", "dense"), ("kda", "recurrent"),
                                           ("kda", "chunk")])
def test_the_chosen_op_is_the_one_that_runs(monkeypatch, field, choice):
    """A decode-sized batch (one token a row) with a concrete Backend runs exactly that op, and no other op of the
    same field."""
    cfg = kimi.preset("tiny")
    params = kimi.init_params(cfg, seed=0)
    calls = []
    table = {name: (lambda name, op: lambda *a, **k: calls.append(name) or op(*a, **k))(name, op)
             for name, op in ops.IMPLEMENTATIONS[field].items()}
    monkeypatch.setitem(ops.IMPLEMENTATIONS, field, table)
    kimi.forward(params, torch.randint(0, cfg.vocab_size, (2, 1)), cfg, dataclasses.replace(Backend(),
                                                                                            **{field: choice}))
    assert calls and set(calls) == {choice}
