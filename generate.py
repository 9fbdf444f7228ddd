"""Generate text with Kimi K3.1 Pro (or any checkpoint in its format): cached prefill, then one token per step.

    python generate.py --checkpoint ckpt --prompt "Once upon a time"
    python generate.py --checkpoint ckpt --chat --prompt "What is 2+2?" --sampling.temperature 0
    python generate.py --checkpoint ckpt --prompts-file prompts.txt --max-new-tokens 64     # a batch, one per line
    python generate.py --checkpoint ckpt --interactive                                     # a chat, turn by turn

How it runs: the prompts are tokenized (the checkpoint's `tiktoken.model`, else bytes), left-padded into one batch
and written into a preallocated cache (`kimi.init_cache`) by the prefill, optionally in chunks. Each decode step then
feeds one token per row: KDA advances its recurrent state by one token, the indexer scores the new query against
every cached index key and keeps the top-k, and sparse MLA attends over those cached latents. On a GPU the decode
step is compiled per distinct layer and captured as one CUDA graph, and the prefill is compiled per distinct layer.
The generation itself is `kimi.generation.generate`; this script reads the prompts and prints the tokens. With
--interactive the turns come from stdin and one cache lives through the conversation (`kimi.generation.Conversation`):
each turn prefills only its own tokens.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

import kimi
from kimi.generation import DEFAULT_BACKEND, Conversation, GenerateError, Result, Sampling, generate
from kimi.tokenizer import CLOSE, END_OF_MSG, OPEN, SEP, Tokenizer, TokenizerError, load_tokenizer


@dataclasses.dataclass
class Args:
    """Generate from a Kimi checkpoint. Give --prompt, --prompts-file, --messages or --interactive."""

    checkpoint: Path | None = None
    """Checkpoint folder (config.json + safetensors; tiktoken.model if it has one)."""
    preset: str | None = None
    """Instead of a checkpoint: a preset with random weights (for timing, not for text)."""
    prompt: str | None = None
    """One prompt, as text (raw, or a user turn with --chat)."""
    prompts_file: Path | None = None
    """A batch: one prompt per line (a literal \\n in a line is a newline), or a .jsonl file of
    {"prompt": ...} or {"messages": [...]} lines."""
    messages: Path | None = None
    """A JSON file with a list of chat messages ({"role": ..., "content": ...})."""
    chat: bool = False
    """Render each prompt as a user turn in the chat format (with a generation prompt)."""
    interactive: bool = False
    """Chat on stdin, one line a user turn (a literal \\n is a newline): the reply streams, the cache keeps the whole
    conversation so each turn prefills only its own tokens. /reset starts over, /exit or Ctrl-D ends. The cache
    holds --max-len tokens (default 16,384); a turn that does not fit is refused with a line, not an exit."""
    system: str | None = None
    """A system message for --chat."""
    thinking: bool = True
    """Chat prompts: let the model think before it answers (the chat format's thinking mode)."""
    thinking_effort: Literal["low", "medium", "high", "max"] | None = "max"
    """Chat prompts in thinking mode: how much the model is asked to think."""
    max_new_tokens: int = 128
    """Tokens to generate per prompt at most (a row stops earlier at a stop token)."""
    sampling: Sampling = Sampling()
    """How the next token is drawn from the logits."""
    stop_ids: tuple[int, ...] = ()
    """More token ids that end a row (the tokenizer's <|end_of_msg|> and [EOS] always do)."""
    ignore_stop: bool = False
    """Generate max_new_tokens whatever comes."""
    max_len: int | None = None
    """Cache length (default: the longest prompt + max_new_tokens)."""
    prefill_chunk: int | None = None
    """Prefill in chunks of this many tokens (default: 8,192 for prompts longer than that, printing progress after
    each chunk; shorter prompts at once)."""
    output: Path | None = None
    """Also write the results to this .jsonl file, one line per prompt: {"index", "text", "tokens", "stopped"}.
    Refused if the file exists."""
    device: str = "auto"
    """auto (cuda if present), cpu or cuda."""
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    """auto: bfloat16 on CUDA, float32 on the CPU."""
    compile: bool | None = None
    """Compile the prefill and decode steps (default: on CUDA)."""
    backend: kimi.Backend = DEFAULT_BACKEND
    """The implementations (`kimi.Backend`). Default: every choice automatic: on a GPU in bf16 the Triton KDA
    kernels, and sparse attention over the cache (the Triton indexer and kernels; 'gather' on a CPU), nothing of
    size prompt x cache, once the cache has more than 8,192 slots or a prefill chunk would score more than 2^24
    query-key pairs densely."""
    stream: bool = True
    """Print tokens as they come (one prompt only)."""
    bos: bool = True
    """Start raw (non-chat) prompts with [BOS], as train.py's text documents do. Chat prompts never get one."""


LONG_PROMPT = 8192
"""Prompts longer than this are prefilled in chunks of it by default, with a progress line after each."""
CHAT_MAX_LEN = 16384
"""--interactive's cache length unless --max-len is given."""


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


def run(a: Args, out=sys.stdout, err=sys.stderr, inp=sys.stdin) -> Result | None:
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
    if a.backend.attn == "cudnn":          # the forward under cuDNN's backward, said once ("auto" resolved)
        forward = kimi.ops.resolve(a.backend, device=device, dtype=getattr(torch, dtype)).sparse_fwd
        print(f"attn=cudnn: sparse forward {forward}", file=err)
    compile = a.compile if a.compile is not None else device.type == "cuda"
    if a.interactive:
        return chat(a, params, cfg, tok, compile, inp, out, err)
    prompts = _read_prompts(a, tok)
    if a.output is not None and a.output.exists():
        raise GenerateError(f"--output {a.output} exists; pass another path (nothing is overwritten)")
    longest = max(map(len, prompts))
    _warn_context(cfg, a.max_len or longest + a.max_new_tokens - 1, err)
    chunk = a.prefill_chunk or (LONG_PROMPT if longest > LONG_PROMPT else None)

    def on_prefill(done: int, total: int, seconds: float) -> None:
        print(f"prefill: {done:,}/{total:,} tokens, {done / max(seconds, 1e-9):,.0f} tokens/s, "
              f"{seconds:.1f} s", file=err, flush=True)
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
                       backend=a.backend, max_len=a.max_len, prefill_chunk=chunk, compile=compile,
                       on_token=on_token if stream else None,
                       on_prefill=on_prefill if chunk is not None and longest > chunk else None)
    if stream:
        out.write(decoder.decode(b"", final=True) + "\n")
    else:
        for b, ids in enumerate(res.tokens):
            out.write(f"--- {b}\n{tok.decode(ids)}\n")
    if a.output is not None:
        rows = [json.dumps({"index": b, "text": tok.decode(ids), "tokens": ids, "stopped": stop})
                for b, (ids, stop) in enumerate(zip(res.tokens, res.stopped))]
        tmp = a.output.with_name(a.output.name + ".tmp")
        tmp.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
        tmp.replace(a.output)
        print(f"wrote {len(rows)} results to {a.output}", file=err)
    print(res.report(), file=err)
    return res


def _warn_context(cfg: kimi.ModelConfig, tokens: int, err) -> None:
    trained = cfg.max_position_embeddings
    if trained is not None and tokens > trained:
        print(f"warning: {tokens:,} tokens (prompt and generation, or the cache) exceed the {trained:,} the "
              "checkpoint was trained for (max_position_embeddings); quality past it is unknown", file=err)


def _closing(tok: Tokenizer, reply: list[int], opened: str) -> list[int]:
    """The tokens that close a chat reply cut at --max-new-tokens (its open channel, the message, end of message),
    so that the next turn follows a well-formed assistant message."""
    text = f"{OPEN}{opened}{SEP}" + tok.decode(reply)
    is_open = lambda ch: text.rfind(f"{OPEN}{ch}{SEP}") > text.rfind(f"{CLOSE}{ch}{SEP}")
    tail = ""
    if is_open("think"):
        tail += f"{CLOSE}think{SEP}"
    if f"{OPEN}response{SEP}" not in text:        # a thinking reply always carries its response channel
        tail += f"{OPEN}response{SEP}"
    if is_open("think") or is_open("response") or f"{OPEN}response{SEP}" not in text:
        tail += f"{CLOSE}response{SEP}"
    return tok.encode(tail + f"{CLOSE}message{SEP}{END_OF_MSG}", allow_special=True)


def chat(a: Args, params: dict, cfg: kimi.ModelConfig, tok: Tokenizer, compile: bool, inp, out, err) -> Result | None:
    """--interactive: read user turns from `inp` until EOF or /exit, stream each reply to `out`. Returns the last
    turn's result (None if there was none)."""
    if any(x is not None for x in (a.prompt, a.prompts_file, a.messages)) or a.output is not None:
        raise GenerateError("--interactive reads the turns from stdin: drop --prompt, --prompts-file, --messages and "
                            "--output")
    max_len = a.max_len or CHAT_MAX_LEN
    _warn_context(cfg, max_len, err)
    conv = Conversation(params, cfg, max_len=max_len, sampling=a.sampling, backend=a.backend, compile=compile,
                        stop_ids=() if a.ignore_stop else tuple(tok.stop_ids) + tuple(a.stop_ids),
                        prefill_chunk=a.prefill_chunk or LONG_PROMPT)
    opened = "think" if a.thinking else "response"
    print(f"chat ({max_len:,}-token cache): type a message and press Enter; /reset starts over, /exit or Ctrl-D "
          "ends", file=err)
    res, first, pending = None, True, []
    while True:
        err.write("> ")
        err.flush()
        line = inp.readline()
        text = line.rstrip("\r\n").replace("\\n", "\n")
        if not line or text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            conv.reset()
            first, pending = True, []
            print("(a new conversation)", file=err)
            continue
        if not text.strip():
            continue
        msgs = ([{"role": "system", "content": a.system}] if first and a.system else []) + \
            [{"role": "user", "content": text}]
        ids = pending + tok.encode_chat(msgs, thinking=a.thinking, add_generation_prompt=True,
                                        thinking_effort=a.thinking_effort if a.thinking and first else None)[0]
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            res = conv.reply(ids, max_new_tokens=a.max_new_tokens,
                             on_token=lambda t: (out.write(decoder.decode(tok.decode_bytes(t.tolist()))), out.flush()))
        except GenerateError as e:
            print(f"error: {e}", file=err)
            continue
        out.write(decoder.decode(b"", final=True) + "\n")
        out.flush()
        first = False
        ended = res.tokens[0][-1:] == [tok.end_of_msg_id]     # not a cut reply, nor another --stop-ids hit
        pending = [] if ended else _closing(tok, res.tokens[0], opened)
        print(f"({len(conv.tokens):,} of {max_len:,} tokens; {res.report().replace(chr(10), '; ')})", file=err)
    return res


def main(argv: list[str] | None = None) -> int:
    import tyro

    a = tyro.cli(Args, args=argv, description=__doc__)
    try:
        run(a)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (GenerateError, TokenizerError, kimi.CacheError, kimi.checkpoint.CheckpointError,
            FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
