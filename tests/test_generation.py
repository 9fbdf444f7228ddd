"""kimi/generation.py: cached generation equals recomputing the full forward, rows stop at stop ids, sampling is
seeded and stays inside its filters, the compiled steps give the eager tokens. (The CUDA-graph capture of the decode
step: tests/test_gpu.py.)"""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import kimi
from kimi import generation as gen
from kimi.config import KDAConfig

from helpers import tiny

CFG = tiny(index_topk=8)   # selection matters from the 9th token on


@pytest.fixture(scope="module")
def params():
    return kimi.init_params(CFG, seed=3)


def is_greedy_without_cache(params, prompt, new):
    """The definition of greedy decoding without a cache: each new token is the argmax of a full forward over
    everything before it. By causality one forward over prompt + new gives all those logits at once."""
    with torch.no_grad():
        logits = kimi.forward(params, torch.tensor([prompt + new]), CFG)[0]
    return logits[len(prompt) - 1:-1].argmax(-1).tolist() == new


def test_cached_greedy_equals_full_recompute(params):
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (12, 5)]
    res = gen.generate(params, CFG, prompts, max_new_tokens=5, sampling=gen.Sampling(temperature=0))
    assert all(is_greedy_without_cache(params, p, new) for p, new in zip(prompts, res.tokens))
    chunked = gen.generate(params, CFG, prompts, max_new_tokens=5, sampling=gen.Sampling(temperature=0),
                           prefill_chunk=5, max_len=40)
    assert chunked.tokens == res.tokens
    assert res.prompt_tokens == 17 and res.decode_steps == 2 and not any(res.stopped)


def test_rows_stop_at_stop_ids(params):
    prompts = [torch.randint(0, 256, (7,)).tolist(), torch.randint(0, 256, (9,)).tolist()]
    full = gen.generate(params, CFG, prompts, max_new_tokens=5, sampling=gen.Sampling(temperature=0))
    stop = full.tokens[0][2]
    res = gen.generate(params, CFG, prompts, max_new_tokens=5, sampling=gen.Sampling(temperature=0),
                       stop_ids=(stop,))
    first = full.tokens[0].index(stop)
    assert res.tokens[0] == full.tokens[0][:first + 1] and res.stopped[0]
    other = full.tokens[1]
    cut = other.index(stop) + 1 if stop in other else len(other)
    assert res.tokens[1] == other[:cut]


def test_sampling_is_seeded_and_top_k_1_is_greedy(params):
    prompts = [torch.randint(0, 256, (6,)).tolist()]
    s = gen.Sampling(temperature=1.0, seed=7)
    a = gen.generate(params, CFG, prompts, max_new_tokens=3, sampling=s).tokens
    assert gen.generate(params, CFG, prompts, max_new_tokens=3, sampling=s).tokens == a
    greedy = gen.generate(params, CFG, prompts, max_new_tokens=3, sampling=gen.Sampling(temperature=0)).tokens
    top1 = gen.generate(params, CFG, prompts, max_new_tokens=3, sampling=gen.Sampling(temperature=2.0, top_k=1))
    assert top1.tokens == greedy


@settings(max_examples=30)
@given(st.integers(1, 12), st.floats(0.05, 1.0), st.floats(0.3, 3.0), st.integers(0, 2**31 - 1))
def test_samples_stay_in_the_top_k_and_nucleus(k, p, temperature, seed):
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(seed)) * 3
    g = torch.Generator().manual_seed(seed)
    s = gen.Sampling(temperature=temperature, top_k=k, top_p=p)
    for _ in range(5):
        ids = gen.sample(logits, s, g)
        for row, i in zip(logits, ids.tolist()):
            order = (row / temperature).argsort(descending=True).tolist()
            probs = (row / temperature)[order[:k]].softmax(-1)   # top-k first, then the nucleus of what is left
            n = int((probs.cumsum(-1) - probs < p).sum())
            assert i in order[:max(n, 1)]


def test_top_p_keeps_the_smallest_set():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {int(gen.sample(logits, gen.Sampling(temperature=1, top_p=0.8, seed=0),
                           torch.Generator().manual_seed(s))) for s in range(200)}
    assert seen == {0, 1}


def test_min_p_keeps_the_tokens_near_the_best():
    """min_p = 0.25 of the top probability 0.5 keeps 0.5, 0.3 and 0.15 (>= 0.125), never 0.05."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {int(gen.sample(logits, gen.Sampling(temperature=1, min_p=0.25), torch.Generator().manual_seed(s)))
            for s in range(300)}
    assert seen == {0, 1, 2}


def test_repetition_penalty_follows_the_ctrl_rule(params):
    """A seen token's positive logit is divided by the penalty, a negative one multiplied; unseen ones stay. In
    generation the prompt (not its left padding) and the generated tokens count as seen: with a huge penalty and
    greedy decoding no token repeats."""
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    s = gen.Sampling(temperature=0, repetition_penalty=4.0)
    assert int(gen.sample(logits, s, seen=seen)) == 2                       # 2.0 -> 0.5 falls below 1.5
    assert int(gen.sample(logits, gen.Sampling(temperature=0), seen=seen)) == 0
    prompts = [[5, 6, 7], [9]]
    res = gen.generate(params, CFG, prompts, max_new_tokens=12, stop_ids=(),
                       sampling=gen.Sampling(temperature=0, repetition_penalty=1e9))
    for p, row in zip(prompts, res.tokens):
        assert len(set(p + row)) == len(p + row), (p, row)


def test_prefill_reports_progress_per_chunk(params):
    calls = []
    gen.generate(params, CFG, [list(range(1, 23))], max_new_tokens=1, prefill_chunk=8,
                 on_prefill=lambda done, total, s: calls.append((done, total)))
    assert calls == [(8, 22), (16, 22), (22, 22)]


def test_generate_errors():
    with pytest.raises(gen.GenerateError, match="outside the model's vocabulary"):
        gen.generate(kimi.init_params(CFG, seed=0), CFG, [[1, 600]], max_new_tokens=2)
    with pytest.raises(gen.GenerateError, match="top_p"):
        gen.Sampling(top_p=0)
    with pytest.raises(gen.GenerateError, match="min_p"):
        gen.Sampling(min_p=1.5)
    with pytest.raises(gen.GenerateError, match="repetition_penalty"):
        gen.Sampling(repetition_penalty=0)


def test_compiled_steps_equal_eager():
    """The compiled wiring (regional prefill over the cache in chunks, regional decode step) through Dynamo's eager
    backend: same tokens as the eager loop. The CUDA-graph capture of the decode step is the GPU's part
    (tests/test_gpu.py).
    A 4-layer model (KDA, MLA, KDA, MLA) keeps the tracing cheap."""
    cfg = tiny(num_hidden_layers=4, index_topk=4,
               linear_attn_config=KDAConfig(num_heads=4, head_dim=32, kda_layers=(1, 3), full_attn_layers=(2, 4)))
    params = kimi.init_params(cfg, seed=5)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (10, 4)]   # two prefill chunks of 5
    ref = gen.generate(params, cfg, prompts, max_new_tokens=4, sampling=gen.Sampling(temperature=0))
    steps = gen.make_steps(cfg, kimi.Backend(mla_form="absorbed", kda="chunk"), True,
                           {"backend": "eager", "mode": None, "dynamic": False})
    got = gen.generate(params, cfg, prompts, max_new_tokens=4, sampling=gen.Sampling(temperature=0), steps=steps,
                       compile=True, prefill_chunk=5, max_len=30)
    assert got.tokens == ref.tokens


_SECOND_CALL = """
import torch, kimi
from kimi import generation as gen
from kimi.config import scaled
cfg = scaled(kimi.preset("tiny"), num_layers=4, num_experts=8)
params = kimi.init_params(cfg, seed=0)
steps = gen.make_steps(cfg, kimi.Backend(), True, {"backend": "aot_eager"})
prompt = torch.randint(0, cfg.vocab_size, (40,)).tolist()
graphs = lambda *_: print(torch._dynamo.utils.counters["stats"]["unique_graphs"])
for _ in range(2):   # two chunks of 20: the second has the first's shapes, only the cache behind it is fuller
    gen.generate(params, cfg, [prompt], max_new_tokens=3, steps=steps, compile=True, prefill_chunk=20,
                 on_prefill=graphs)
graphs()
"""


def test_same_shapes_compile_nothing_new():
    """In a fresh interpreter, so that no global state is left over from other tests: a prefill chunk with the
    previous chunk's shapes, and a second `generate` with the same steps and shapes, reuse the graphs made before.
    A guard on state that the first trace changes (einops' registry of tensor types was one) recompiles them on the
    second chunk. AOT autograd traces (it runs the custom ops' fake kernels); Inductor is left out."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", _SECOND_CALL], capture_output=True, text=True, env=env, cwd=root,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    chunk1, chunk2, again1, again2, end = map(int, out.stdout.split())
    assert chunk1 > 0 and chunk2 == chunk1, f"graphs after the first chunk {chunk1}, after the second {chunk2}"
    assert again1 == again2 == end, f"the second call compiled again: {again1}, {again2}, {end} graphs"


def test_conversation_keeps_its_cache_across_turns(params):
    """Two turns through one cache: the second prefills only its own tokens (and the first reply's last token),
    and its greedy reply is the one a fresh generation over the whole conversation gives. A turn that does not fit
    is refused without touching the cache; reset starts over."""
    conv = gen.Conversation(params, CFG, max_len=64, sampling=gen.Sampling(temperature=0))
    first, second = torch.randint(0, 256, (9,)).tolist(), torch.randint(0, 256, (6,)).tolist()
    r1 = conv.reply(first, max_new_tokens=4)
    assert r1.prompt_tokens == 9 and conv.tokens == first + r1.tokens[0] and conv.fed == 12
    r2 = conv.reply(second, max_new_tokens=5)
    assert r2.prompt_tokens == 1 + 6
    whole = first + r1.tokens[0] + second
    assert gen.generate(params, CFG, [whole], max_new_tokens=5, sampling=gen.Sampling(temperature=0)).tokens == r2.tokens
    assert is_greedy_without_cache(params, whole, r2.tokens[0])
    before = (list(conv.tokens), int(conv.cache["pos"]))
    with pytest.raises(gen.GenerateError, match="the conversation is full"):
        conv.reply(torch.randint(0, 256, (40,)).tolist(), max_new_tokens=4)
    assert (conv.tokens, int(conv.cache["pos"])) == before
    conv.reset()
    assert conv.tokens == [] and int(conv.cache["pos"]) == 0
    assert conv.reply(first, max_new_tokens=4).tokens == r1.tokens      # the same start, the same reply
