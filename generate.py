"""Generate text with Kimi K3.1 Pro (or any checkpoint in its format): cached prefill, then one token per step.

    python generate.py --checkpoint ckpt --prompt "Once upon a time"
    python generate.py --checkpoint ckpt --chat --prompt "What is 2+2?" --sampling.temperature 0
    python generate.py --checkpoint ckpt --prompts-file prompts.txt --max-new-tokens 64     # a batch, one per line

How it runs: the prompts are tokenized (the checkpoint's `tiktoken.model`, else bytes), left-padded into one batch
and written into a preallocated cache (`kimi.init_cache`) by the prefill, optionally in chunks. Each decode step then
feeds one token per row: KDA advances its recurrent state by one token, the indexer scores the new query against
every cached index key and keeps the top-k, and sparse MLA attends over those cached latents. On a GPU the decode
step is compiled per distinct layer and captured as one CUDA graph, and the prefill is compiled per distinct layer.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable, Literal

import torch
from torch import Tensor

import kimi
from kimi.cache import check_room
from kimi.tokenizer import Tokenizer, TokenizerError, load_tokenizer


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
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise GenerateError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise GenerateError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise GenerateError(f"top_p must lie in (0, 1], got {self.top_p}")


def sample(logits: Tensor, s: Sampling, generator: torch.Generator | None = None) -> Tensor:
    """Next ids [B] from logits [B, V] (any float dtype; computed in fp32)."""
    logits = logits.float()
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits / s.temperature
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


def make_steps(cfg: kimi.ModelConfig, backend: kimi.Backend, compile: bool,
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

    def last_logits(forward):
        def run(params, ids, cache):
            logits, _ = forward(params, ids, cfg, backend, cache=cache)
            return logits[:, -1].float()
        return run

    if not compile:
        eager = last_logits(kimi.forward)
        return eager, eager
    # `mode` is dropped: "reduce-overhead" would put Inductor's own CUDA graphs inside the manual capture.
    options = {"fullgraph": True} | {k: v for k, v in compile_options.items() if k != "mode"}
    regional = last_logits(kimi.compile_layers(**options))
    return regional, CudaGraphStep(regional)


def generate(params: dict, cfg: kimi.ModelConfig, prompts: list[list[int]], *, max_new_tokens: int,
             sampling: Sampling = Sampling(), stop_ids: tuple[int, ...] = (), backend: kimi.Backend | None = None,
             max_len: int | None = None, prefill_chunk: int | None = None, compile: bool = False,
             on_token: Callable[[Tensor], None] | None = None, steps: tuple[Callable, Callable] | None = None,
             ) -> Result:
    """Continue each prompt (a list of token ids) by up to `max_new_tokens` tokens.

    Rows stop at any of `stop_ids`; the batch stops when every row has. `on_token(ids [B])` sees each step's tokens
    (for streaming). `max_len` is the cache length (default: longest prompt + max_new_tokens)."""
    backend = backend or kimi.Backend(mla_form="absorbed", kda="chunk_opaque")
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
    ids, start = kimi.left_pad(prompts, cfg.pad_token_id if cfg.pad_token_id is not None else 0)
    ids = ids.to(device)
    cache = kimi.init_cache(cfg, len(prompts), max_len, dtype=dtype, device=device, start=start.to(device))
    prefill, decode = steps or make_steps(cfg, backend, compile)
    gen = torch.Generator(device).manual_seed(sampling.seed)
    stops = torch.tensor(sorted(set(stop_ids)) or [-1], device=device)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    chunk = prefill_chunk or T0
    for c0 in range(0, T0, chunk):
        logits = prefill(params, ids[:, c0:c0 + chunk], cache)
    sync()
    prefill_s = time.perf_counter() - t0

    B = len(prompts)
    out = torch.empty(B, max_new_tokens, dtype=torch.int64, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    n = 0
    first_steps_s, t_decode = 0.0, time.perf_counter()
    for n in range(max_new_tokens):
        if n == 2:
            sync()
            first_steps_s, t_decode = time.perf_counter() - t_decode, time.perf_counter()
        nxt = sample(logits, sampling, gen)
        out[:, n] = nxt
        if on_token is not None:
            on_token(nxt)
        done |= torch.isin(nxt, stops)
        if n + 1 == max_new_tokens or bool(done.all()):
            break
        logits = decode(params, nxt[:, None].clone(), cache)
    sync()
    # decode calls were made at n' = 0 .. n-1; the first two are compile / graph capture, the rest are timed
    steps_timed = max(n - 2, 0)
    decode_s = time.perf_counter() - t_decode if steps_timed else 0.0
    tokens, stopped = [], []
    stop_set = set(stop_ids)
    for row in out[:, :n + 1].tolist():
        cut = next((j for j, t in enumerate(row) if t in stop_set), None)
        tokens.append(row if cut is None else row[:cut + 1])
        stopped.append(cut is not None)
    return Result(tokens=tokens, stopped=stopped, prompt_tokens=sum(map(len, prompts)), prefill_s=prefill_s,
                  decode_s=decode_s, decode_steps=steps_timed, first_steps_s=first_steps_s, compiled=compile)


# --------------------------------------------------------------------------------------------------------- CLI

@dataclasses.dataclass
class Args:
    """Generate from a Kimi checkpoint. Give --prompt, --prompts-file or --messages."""

    checkpoint: Path | None = None
    """Checkpoint folder (config.json + safetensors; tiktoken.model if it has one)."""
    preset: str | None = None
    """Instead of a checkpoint: a preset with random weights (for timing, not for text)."""
    prompt: str | None = None
    prompts_file: Path | None = None
    """A batch: one prompt per line (a literal \\n in a line is a newline), or a .jsonl file of
    {"prompt": ...} or {"messages": [...]} lines."""
    messages: Path | None = None
    """A JSON file with a list of chat messages ({"role": ..., "content": ...})."""
    chat: bool = False
    """Render each prompt as a user turn in the chat format (with a generation prompt)."""
    system: str | None = None
    """A system message for --chat."""
    thinking: bool = True
    thinking_effort: Literal["low", "medium", "high", "max"] | None = "max"
    max_new_tokens: int = 128
    sampling: Sampling = Sampling()
    stop_ids: tuple[int, ...] = ()
    """More token ids that end a row (the tokenizer's <|end_of_msg|> and [EOS] always do)."""
    ignore_stop: bool = False
    """Generate max_new_tokens whatever comes."""
    max_len: int | None = None
    """Cache length (default: the longest prompt + max_new_tokens)."""
    prefill_chunk: int | None = None
    """Prefill in chunks of this many tokens (default: the whole prompt at once)."""
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    """auto: bfloat16 on CUDA, float32 on the CPU."""
    compile: bool | None = None
    """Compile the prefill and decode steps (default: on CUDA)."""
    backend: kimi.Backend = kimi.Backend(mla_form="absorbed", kda="chunk_opaque")
    stream: bool = True
    """Print tokens as they come (one prompt only)."""
    bos: bool = True
    """Start raw (non-chat) prompts with [BOS], as train.py's text documents do. Chat prompts never get one."""


def _read_prompts(a: Args, tok: Tokenizer) -> list[list[int]]:
    chat_opts = dict(thinking=a.thinking, thinking_effort=a.thinking_effort if a.thinking else None,
                     add_generation_prompt=True)

    def as_chat(text: str) -> list[int]:
        msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": text}]
        return tok.encode_chat(msgs, **chat_opts)[0]

    def one(text: str, where: str) -> list[int]:
        if not text.strip():
            raise GenerateError(f"{where}: the prompt is empty")
        return as_chat(text) if a.chat else [tok.bos_id] * a.bos + tok.encode(text)

    given = [x is not None for x in (a.prompt, a.prompts_file, a.messages)]
    if sum(given) != 1:
        raise GenerateError("give exactly one of --prompt, --prompts-file, --messages")
    if a.prompt is not None:
        return [one(a.prompt, "--prompt")]
    path = a.prompts_file or a.messages
    if not path.is_file():
        raise GenerateError(f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise GenerateError(f"{path}: not UTF-8 text ({e})") from None
    if a.messages is not None:
        try:
            msgs = json.loads(text)
        except json.JSONDecodeError as e:
            raise GenerateError(f"{path}: not JSON ({e})") from e
        return [tok.encode_chat(msgs, **chat_opts)[0]]
    prompts = []
    for n, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if path.suffix != ".jsonl":
            if line.strip():
                prompts.append(one(line.replace("\\n", "\n"), f"{path}:{n}"))
            continue
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise GenerateError(f"{path}:{n}: not JSON ({e})") from e
        if isinstance(row, dict) and "messages" in row:
            prompts.append(tok.encode_chat(row["messages"], **chat_opts)[0])
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(one(row["prompt"], f"{path}:{n}"))
        else:
            raise GenerateError(f'{path}:{n}: expected {{"prompt": str}} or {{"messages": [...]}}')
    if not prompts:
        raise GenerateError(f"{path}: no prompts")
    return prompts


def run(a: Args, out=sys.stdout, err=sys.stderr) -> Result:
    device = torch.device(a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = a.dtype if a.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    if (a.checkpoint is None) == (a.preset is None):
        raise GenerateError("give exactly one of --checkpoint and --preset")
    t = time.perf_counter()
    if a.checkpoint is not None:
        cfg, params = kimi.load_checkpoint(a.checkpoint, dtype=dtype, device=device)
    else:
        cfg = kimi.preset(a.preset)
        params = kimi.init_params(cfg, seed=0, dtype=dtype, device=device)
    tok = load_tokenizer(a.checkpoint, cfg)
    print(f"loaded {kimi.param_count(cfg) / 1e6:.1f}M parameters ({dtype}, {device}) in "
          f"{time.perf_counter() - t:.1f} s; tokenizer: {type(tok).__name__}", file=err)
    prompts = _read_prompts(a, tok)
    compile = a.compile if a.compile is not None else device.type == "cuda"
    if compile:
        print("compiling: one graph per distinct layer for the prefill and the decode step, then the decode step is "
              "captured as a CUDA graph (minutes on a first run; Inductor's cache makes later runs faster; "
              "--compile False skips it)", file=err)
    stream = a.stream and len(prompts) == 1
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def on_token(ids: Tensor) -> None:
        out.write(decoder.decode(tok.decode_bytes(ids.tolist())))
        out.flush()

    with torch.no_grad():
        res = generate(params, cfg, prompts, max_new_tokens=a.max_new_tokens, sampling=a.sampling,
                       stop_ids=() if a.ignore_stop else tuple(tok.stop_ids) + tuple(a.stop_ids),
                       backend=a.backend, max_len=a.max_len, prefill_chunk=a.prefill_chunk, compile=compile,
                       on_token=on_token if stream else None)
    if stream:
        out.write(decoder.decode(b"", final=True) + "\n")
    else:
        for b, ids in enumerate(res.tokens):
            out.write(f"--- {b}\n{tok.decode(ids)}\n")
    print(res.report(), file=err)
    return res


def main(argv: list[str] | None = None) -> int:
    import tyro

    a = tyro.cli(Args, args=argv, description=__doc__)
    try:
        run(a)
    except (GenerateError, TokenizerError, kimi.CacheError, kimi.checkpoint.CheckpointError,
            FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
