"""Generation: cached prefill, then one token per step (docs/architecture.md#decode-cache). The prompts are
left-padded into one batch and written into a preallocated cache (`kimi.init_cache`) by the prefill, optionally in
chunks; each decode step then feeds one token per row. On a GPU the decode step is compiled per distinct layer and
captured as one CUDA graph (`CudaGraphStep`, docs/compile.md#cuda-graphs), and the prefill is compiled per distinct
layer."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch
from torch import Tensor

from .cache import check_room, init_cache, left_pad, reset_cache
from .config import Backend, ModelConfig
from .model import compile_layers, forward

DEFAULT_BACKEND = Backend()
"""generate's default: every field 'auto' (`kimi.ops.resolve`). On a GPU in bf16 that is the Triton KDA kernels
(K3.1's bounded gate) and, past 8,192 cache slots, the Triton indexer and sparse attention over the cache, several
times faster at long prompts than the opaque chunk core and the torch gather (docs/performance.md#long-context).
Under torch.compile on a CPU the KDA core is the opaque chunk op (a short compile); the MLA form resolves to
absorbed with a cache, attention over the shared latent."""


class GenerateError(ValueError):
    """Bad generation input: empty prompt, prompt longer than the cache, bad sampling settings."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.7
    """0 means greedy (argmax)."""
    top_k: int | None = None
    """Keep only the k most likely tokens."""
    top_p: float | None = None
    """Keep the smallest set of tokens whose probability reaches p (nucleus sampling)."""
    min_p: float | None = None
    """Keep the tokens at least min_p times as likely as the most likely one."""
    repetition_penalty: float = 1.0
    """> 1 makes tokens already in the row (prompt or generated) less likely: their logit is divided by it when
    positive, multiplied when negative (CTRL's rule). 1: off."""
    seed: int = 0
    """Seed of the sampling noise (the same seed, prompts and model give the same tokens)."""

    def __post_init__(self):
        if not self.temperature >= 0:
            raise GenerateError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise GenerateError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise GenerateError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise GenerateError(f"min_p must lie in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise GenerateError(f"repetition_penalty must be positive, got {self.repetition_penalty}")


def sample(logits: Tensor, s: Sampling, generator: torch.Generator | None = None, seen: Tensor | None = None
           ) -> Tensor:
    """Next ids [B] from logits [B, V] (any float dtype; computed in fp32). seen [B, V] bool: the tokens each row
    already holds (for `repetition_penalty`)."""
    logits = logits.float()
    if s.repetition_penalty != 1 and seen is not None:
        p = s.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if s.min_p is not None and s.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < s.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p is not None and s.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs               # mass of the strictly more likely tokens
        drop = before >= s.top_p                        # the first token is always kept (before = 0)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    # Gumbel-max in its exponential form: argmax p / E with E ~ Exp(1) is a draw from p, with no host sync.
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(-1)


@dataclasses.dataclass
class Result:
    tokens: list[list[int]]        # generated ids per prompt (stop token included when one was hit)
    stopped: list[bool]            # whether each row hit a stop id
    prompt_tokens: int             # real (unpadded) prompt tokens
    prefill_s: float
    decode_s: float                # steps after the first two (compile / graph capture land in those)
    decode_steps: int              # steps timed in decode_s
    first_steps_s: float           # the first two decode steps
    compiled: bool = False         # a compiled prefill's first call includes its compilation

    def report(self) -> str:
        B = len(self.tokens)
        rate = ("compiled: a first call includes the compilation" if self.compiled else
                f"{self.prompt_tokens / max(self.prefill_s, 1e-9):.0f} tokens/s")
        lines = [f"prefill: {self.prompt_tokens} tokens in {self.prefill_s:.2f} s ({rate})"]
        if self.decode_steps:
            per_row = self.decode_steps / self.decode_s
            lines.append(f"decode: {self.decode_steps} steps x {B} rows in {self.decode_s:.2f} s "
                         f"({per_row:.1f} tokens/s per row, {per_row * B:.1f} tokens/s in all; the first 2 steps, "
                         f"{self.first_steps_s:.2f} s, are not counted)")
        return "\n".join(lines)


class CudaGraphStep:
    """`fn(params, ids, cache) -> Tensor` captured as one CUDA graph on its first CUDA call, then replayed.

    Each call copies `ids` into the graph's static input and replays every kernel of the step with one launch; the
    returned tensor is the graph's static output (read it before the next call). The replay reads the parameters
    and reads and writes the cache's buffers at the addresses they had at capture, so both must keep their tensors
    (`kimi.reset_cache` a cache, do not swap its buffers). Another cache or parameter tree (a different dict) or
    another batch shape captures again; the captured ones are held until then, so their memory cannot be reused
    under the graph. Each call checks the free cache slots on the host (the graph itself cannot raise) against a
    host copy of `pos`: it is read from the device (a sync) only when its tensor was written outside the graph,
    which autograd's version counter tells (prefill, `kimi.reset_cache`, `fill_`); a replay advances the copy. An
    inference-mode `pos` has no counter and is read every call. (Writes the counter cannot see: `.data`, numpy or
    DLPack writes, another captured graph on the same cache; an overflow then stops at the device's index check.)
    The warm-up calls that compile and autotune run on a scratch cache that shares the MLA buffers
    (the step rewrites the slot they touch) and copies the rest, so the real cache advances exactly once per call.
    Off CUDA, `fn` is simply called."""

    def __init__(self, fn: Callable, warmup: int = 2):
        self.fn, self.warmup = fn, warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.params: dict | None = None
        self.cache: dict | None = None
        self.ids: Tensor | None = None
        self.out: Tensor | None = None
        self.pos: tuple[Tensor, int, int] | None = None     # (pos tensor, its version counter, its value)

    def __call__(self, params: dict, ids: Tensor, cache: dict) -> Tensor:
        if ids.device.type != "cuda":
            return self.fn(params, ids, cache)
        pos = self._host_pos(cache["pos"])
        check_room(pos, ids.shape[1], cache["max_len"])
        if params is not self.params or cache is not self.cache or self.ids is None or \
                self.ids.shape != ids.shape or self.ids.dtype != ids.dtype:
            self._capture(params, ids, cache)
            self._track(cache["pos"], pos)            # capturing bumped the counter, not the value
        self.ids.copy_(ids)
        self.graph.replay()
        self._track(cache["pos"], pos + ids.shape[1])
        return self.out

    def _host_pos(self, t: Tensor) -> int:
        if t.is_inference():
            return int(t)
        if self.pos is None or self.pos[0] is not t or self.pos[1] != t._version:
            self.pos = (t, t._version, int(t))
        return self.pos[2]

    def _track(self, t: Tensor, value: int):
        self.pos = None if t.is_inference() else (t, t._version, value)

    def _capture(self, params: dict, ids: Tensor, cache: dict):
        self.graph = self.out = self.ids = self.params = self.cache = self.pos = None   # release the previous one
        shared = ("kv", "index_k")
        scratch = {"pos": cache["pos"].clone(), "start": cache["start"], "max_len": cache["max_len"],
                   "layers": [{k: t if k in shared else t.clone() for k, t in layer.items()}
                              for layer in cache["layers"]]}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):      # compile, autotune and allocate outside the capture
            for _ in range(self.warmup):
                scratch["pos"].copy_(cache["pos"])
                self.fn(params, ids, scratch)
        torch.cuda.current_stream().wait_stream(side)
        del scratch
        self.ids = ids.clone()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.fn(params, self.ids, cache)
        self.params, self.cache = params, cache


def make_steps(cfg: ModelConfig, backend: Backend, compile: bool,
               compile_options: dict | None = None) -> tuple[Callable, Callable]:
    """(prefill, decode): each takes (params, ids [B, T], cache) and returns the last position's logits [B, V]
    in fp32.

    Compiled, both run the decoder layers through `kimi.compile_layers`: one graph per distinct layer, so compile
    time grows with the number of layer kinds, not with depth (the release's 93 layers are 7 graphs; one
    whole-model graph would take many minutes). The prefill compiles for its first length and, on another length,
    once more with dynamic shapes (Dynamo's automatic dynamic). On CUDA the whole decode step (embedding, every
    layer, head) is then captured as one CUDA graph (`CudaGraphStep`): a step is one launch. `compile_options` go
    to `torch.compile`."""
    compile_options = compile_options or {}

    def last_logits(fwd):
        def run(params, ids, cache):
            logits, _ = fwd(params, ids, cfg, backend, cache=cache)
            return logits[:, -1].float()
        return run

    if not compile:
        eager = last_logits(forward)
        return eager, eager
    # `mode` is dropped: "reduce-overhead" would put Inductor's own CUDA graphs inside the manual capture.
    options = {"fullgraph": True} | {k: v for k, v in compile_options.items() if k != "mode"}
    regional = last_logits(compile_layers(**options))
    return regional, CudaGraphStep(regional)


def generate(params: dict, cfg: ModelConfig, prompts: list[list[int]], *, max_new_tokens: int,
             sampling: Sampling = Sampling(), stop_ids: tuple[int, ...] = (), backend: Backend | None = None,
             max_len: int | None = None, prefill_chunk: int | None = None, compile: bool = False,
             on_token: Callable[[Tensor], None] | None = None, steps: tuple[Callable, Callable] | None = None,
             on_prefill: Callable[[int, int, float], None] | None = None) -> Result:
    """Continue each prompt (a list of token ids) by up to `max_new_tokens` tokens.

    Rows stop at any of `stop_ids`; the batch stops when every row has. `on_token(ids [B])` sees each step's tokens
    (for streaming). `max_len` is the cache length (default: longest prompt + max_new_tokens). `backend` defaults
    to `DEFAULT_BACKEND`; `steps` (prefill, decode) to `make_steps(cfg, backend, compile)`. `on_prefill(done,
    total, seconds)` is called after each prefill chunk (it synchronizes the device to time it: progress for long
    prompts)."""
    backend = backend or DEFAULT_BACKEND
    if not prompts or any(len(p) == 0 for p in prompts):
        raise GenerateError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    bad = [(b, t) for b, p in enumerate(prompts) for t in p if not 0 <= t < cfg.vocab_size]
    if bad:
        raise GenerateError(f"prompt {bad[0][0]} holds token id {bad[0][1]}, outside the model's vocabulary "
                            f"[0, {cfg.vocab_size})")
    T0 = max(len(p) for p in prompts)
    max_len = max_len or T0 + max_new_tokens - 1
    if T0 + max_new_tokens - 1 > max_len:   # the last sampled token is never fed back
        raise GenerateError(f"the longest prompt ({T0} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                            f"cache length max_len={max_len}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise GenerateError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    emb = params["model"]["embed_tokens"]["weight"]
    device, dtype = emb.device, emb.dtype
    ids, start = left_pad(prompts, cfg.pad_token_id if cfg.pad_token_id is not None else 0)
    ids = ids.to(device)
    cache = init_cache(cfg, len(prompts), max_len, dtype=dtype, device=device, start=start.to(device))
    prefill, decode = steps or make_steps(cfg, backend, compile)
    gen = torch.Generator(device).manual_seed(sampling.seed)
    stops = torch.tensor(sorted(set(stop_ids)) or [-1], device=device)

    logits, prefill_s = _prefill(prefill, params, ids, cache, prefill_chunk, on_prefill)

    seen = None
    if sampling.repetition_penalty != 1:     # each row's tokens so far: its prompt (not the left padding), then
        real = torch.arange(T0, device=device)[None, :] >= start.to(device)[:, None]      # what it generates
        seen = torch.zeros(len(prompts), cfg.vocab_size + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, torch.where(real, ids, cfg.vocab_size), True)
        seen = seen[:, :cfg.vocab_size].contiguous()
    out, steps_timed, first_steps_s, decode_s = _decode(params, cache, logits, decode, max_new_tokens, sampling,
                                                        gen, stops, seen, on_token)
    tokens, stopped = _cut_at_stops(out, stop_ids)
    return Result(tokens=tokens, stopped=stopped, prompt_tokens=sum(map(len, prompts)), prefill_s=prefill_s,
                  decode_s=decode_s, decode_steps=steps_timed, first_steps_s=first_steps_s, compiled=compile)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prefill(prefill: Callable, params: dict, ids: Tensor, cache: dict, chunk: int | None,
             on_prefill: Callable[[int, int, float], None] | None) -> tuple[Tensor, float]:
    """Write ids [B, T] into the cache, `chunk` tokens a call (default all), reporting to `on_prefill` after each.
    Returns the last position's logits and the seconds taken."""
    T = ids.shape[1]
    t0 = time.perf_counter()
    chunk = chunk or T
    for c0 in range(0, T, chunk):
        logits = prefill(params, ids[:, c0:c0 + chunk], cache)
        if on_prefill is not None:
            _sync(ids.device)
            on_prefill(min(c0 + chunk, T), T, time.perf_counter() - t0)
    _sync(ids.device)
    return logits, time.perf_counter() - t0


def _decode(params: dict, cache: dict, logits: Tensor, decode: Callable, max_new_tokens: int, sampling: Sampling,
            gen: torch.Generator, stops: Tensor, seen: Tensor | None, on_token: Callable | None
            ) -> tuple[Tensor, int, float, float]:
    """Sample from `logits` [B, V], then one decode step per token until every row hit a stop id or
    `max_new_tokens` were drawn (the last token drawn is not fed back). `seen` [B, V] bool (repetition penalty)
    is updated in place. Returns (tokens [B, n], timed steps, seconds of the first two steps, seconds of the
    rest)."""
    device = logits.device
    B = logits.shape[0]
    out = torch.empty(B, max_new_tokens, dtype=torch.int64, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    n = 0
    first_steps_s, t_decode = 0.0, time.perf_counter()
    for n in range(max_new_tokens):
        if n == 2:
            _sync(device)
            first_steps_s, t_decode = time.perf_counter() - t_decode, time.perf_counter()
        nxt = sample(logits, sampling, gen, seen)
        if seen is not None:
            seen[torch.arange(B, device=device), nxt] = True
        out[:, n] = nxt
        if on_token is not None:
            on_token(nxt)
        done |= torch.isin(nxt, stops)
        if n + 1 == max_new_tokens or bool(done.all()):
            break
        logits = decode(params, nxt[:, None].clone(), cache)
    _sync(device)
    # decode calls were made at n' = 0 .. n-1; the first two are compile / graph capture, the rest are timed
    steps_timed = max(n - 2, 0)
    decode_s = time.perf_counter() - t_decode if steps_timed else 0.0
    return out[:, :n + 1], steps_timed, first_steps_s, decode_s


def _cut_at_stops(out: Tensor, stop_ids: tuple[int, ...]) -> tuple[list[list[int]], list[bool]]:
    tokens, stopped = [], []
    stop_set = set(stop_ids)
    for row in out.tolist():
        cut = next((j for j, t in enumerate(row) if t in stop_set), None)
        tokens.append(row if cut is None else row[:cut + 1])
        stopped.append(cut is not None)
    return tokens, stopped


class Conversation:
    """One row whose cache lives across turns (`generate.py --interactive`): `reply(ids)` prefills only the new
    tokens, after everything already in the cache, then samples until a stop id; the reply stays in the cache, so
    the next turn costs its own tokens, not the whole history again. The last token drawn is fed at the start of
    the next turn (as `generate` never feeds it back). `reset()` empties the cache (the compiled steps and the
    captured decode graph are kept)."""

    def __init__(self, params: dict, cfg: ModelConfig, *, max_len: int, sampling: Sampling = Sampling(),
                 stop_ids: tuple[int, ...] = (), backend: Backend | None = None, compile: bool = False,
                 prefill_chunk: int | None = None, steps: tuple[Callable, Callable] | None = None):
        if prefill_chunk is not None and prefill_chunk < 1:
            raise GenerateError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        emb = params["model"]["embed_tokens"]["weight"]
        self.params, self.cfg, self.sampling, self.stop_ids = params, cfg, sampling, tuple(stop_ids)
        self.device, self.prefill_chunk, self.compiled = emb.device, prefill_chunk, compile
        self.cache = init_cache(cfg, 1, max_len, dtype=emb.dtype, device=emb.device)
        self.prefill, self.decode = steps or make_steps(cfg, backend or DEFAULT_BACKEND, compile)
        self.gen = torch.Generator(self.device).manual_seed(sampling.seed)
        self.stops = torch.tensor(sorted(set(stop_ids)) or [-1], device=self.device)
        self.tokens: list[int] = []      # the conversation as the model has seen it (fed or pending)
        self.fed = 0                     # how many of them are in the cache

    @property
    def max_len(self) -> int:
        return self.cache["max_len"]

    def reset(self) -> None:
        reset_cache(self.cache)
        self.tokens, self.fed = [], 0

    def reply(self, ids: list[int], *, max_new_tokens: int, on_token: Callable[[Tensor], None] | None = None,
              on_prefill: Callable[[int, int, float], None] | None = None) -> Result:
        """Append `ids` (a turn, e.g. a user message and the generation prompt) and sample up to `max_new_tokens`.
        Raises `GenerateError` when the cache has no room for them (then nothing is written)."""
        if not ids:
            raise GenerateError("a turn needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise GenerateError(f"token id {bad[0]} is outside the model's vocabulary [0, {self.cfg.vocab_size})")
        if max_new_tokens < 1:
            raise GenerateError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        new = self.tokens[self.fed:] + list(ids)
        if self.fed + len(new) + max_new_tokens - 1 > self.max_len:
            raise GenerateError(f"the conversation is full: {len(self.tokens)} tokens so far, {len(ids)} new and up to "
                                f"{max_new_tokens} to generate exceed the cache's {self.max_len} (/reset starts over; "
                                "--max-len sets the cache)")
        x = torch.tensor([new], dtype=torch.int64, device=self.device)
        logits, prefill_s = _prefill(self.prefill, self.params, x, self.cache, self.prefill_chunk, on_prefill)
        self.tokens += list(ids)
        self.fed = len(self.tokens)
        seen = None
        if self.sampling.repetition_penalty != 1:
            seen = torch.zeros(1, self.cfg.vocab_size, dtype=torch.bool, device=self.device)
            seen[0, torch.tensor(self.tokens, device=self.device)] = True
        out, steps_timed, first_steps_s, decode_s = _decode(self.params, self.cache, logits, self.decode,
                                                            max_new_tokens, self.sampling, self.gen, self.stops, seen,
                                                            on_token)
        tokens, stopped = _cut_at_stops(out, self.stop_ids)
        self.tokens += tokens[0]
        self.fed = len(self.tokens) - 1                 # the last token drawn waits for the next turn
        return Result(tokens=tokens, stopped=stopped, prompt_tokens=len(new), prefill_s=prefill_s, decode_s=decode_s,
                      decode_steps=steps_timed, first_steps_s=first_steps_s, compiled=self.compiled)
