"""Tokenizers and the K3 chat format (docs/checkpoints.md#tokenizer, #chat-format).

Two tokenizers share one interface:
- `TiktokenTokenizer`: the checkpoint's `tiktoken.model` (BPE ranks) plus 256 reserved special ids after them, with
  Kimi's pre-tokenization regex.
- `ByteTokenizer`: the fallback for checkpoints without a `tiktoken.model` (the tiny test models). Bytes are ids
  0..255 and the 256 special ids follow at 256..511, in the same order as the real vocabulary, so a vocabulary of
  512 holds it.

Neither adds BOS or EOS. `encode(text)` treats `<|...|>` text as plain bytes unless `allow_special=True`, so user text
can never forge a control token.

Chat: `render_chat` turns messages into segments (text, is-control, is-assistant); each segment is encoded on its own,
so BPE never merges across a segment boundary (the model was trained that way). `encode_chat` returns the ids and a
per-token assistant mask for loss masking.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

NUM_SPECIAL = 256
# Named reserved ids, as offsets from the first special id (163584 in the release vocabulary).
SPECIAL_NAMES = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
                 6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]", 18: "<|media_begin|>",
                 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>", 65: "<osagent_mode>",
                 254: "[UNK]", 255: "[PAD]"}
OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"

# Kimi's pre-tokenization split; `&&` is fancy-regex class intersection, which tiktoken supports.
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
PATTERN = "|".join([
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+{_CONTRACTION}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*{_CONTRACTION}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
WINDOW_CHARS = 400_000   # tiktoken is fed at most this many characters at once
MAX_RUN_CHARS = 25_000   # and no run of whitespace / non-whitespace longer than this (it panics on huge runs)


class TokenizerError(ValueError):
    """A tokenizer file, a token id or a chat message that cannot be used."""


def _special_table(base: int, names: dict[int, str] | None = None) -> dict[str, int]:
    """{name: id} for the 256 reserved ids starting at `base`; unnamed ids are `<|reserved_token_{id}|>`."""
    names = names if names is not None else {base + off: name for off, name in SPECIAL_NAMES.items()}
    return {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + NUM_SPECIAL)}


def _split_long(text: str) -> Iterable[str]:
    """Windows of at most WINDOW_CHARS characters, also cut inside any run longer than MAX_RUN_CHARS."""
    for w0 in range(0, len(text), WINDOW_CHARS):
        window = text[w0:w0 + WINDOW_CHARS]
        start, run_start, run_space = 0, 0, None
        for i, ch in enumerate(window):
            space = ch.isspace()
            if space != run_space:
                run_start, run_space = i, space
            elif i - run_start >= MAX_RUN_CHARS:
                yield window[start:i]
                start = run_start = i
        yield window[start:]


class Tokenizer:
    """Shared interface. Subclasses set `specials` ({name: id}), `vocab_size` and implement the byte codec."""

    specials: dict[str, int]
    vocab_size: int

    def __init__(self) -> None:
        self.special_names = {i: n for n, i in self.specials.items()}
        self.bos_id = self.specials["[BOS]"]
        self.eos_id = self.specials["[EOS]"]
        self.pad_id = self.specials["[PAD]"]
        self.end_of_msg_id = self.specials[END_OF_MSG]
        self.stop_ids = (self.end_of_msg_id, self.eos_id)   # generation stops at either

    # -- to be provided by subclasses
    def _encode_plain(self, text: str) -> list[int]:
        raise NotImplementedError

    def _token_bytes(self, i: int) -> bytes:
        raise NotImplementedError

    # -- shared
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`, no BOS/EOS. With `allow_special`, special-token names become their control ids."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        if not allow_special:
            return self._encode_plain(text)
        ids: list[int] = []
        for piece in self._special_split.split(text):
            if piece in self.specials:
                ids.append(self.specials[piece])
            elif piece:
                ids.extend(self._encode_plain(piece))
        return ids

    @property
    def _special_split(self) -> re.Pattern:
        if not hasattr(self, "_split_re"):
            names = sorted(self.specials, key=len, reverse=True)
            self._split_re = re.compile("(" + "|".join(map(re.escape, names)) + ")")
        return self._split_re

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The raw bytes of `ids`; special ids become their names. For streaming, decode bytes, not strings."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} is outside the tokenizer's vocabulary [0, {self.vocab_size})")
            out.append(self.special_names[i].encode() if i in self.special_names else self._token_bytes(i))
        return b"".join(out)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        if skip_special:
            ids = [i for i in ids if int(i) not in self.special_names]
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def encode_segments(self, segments: Iterable["Segment"]) -> tuple[list[int], list[bool]]:
        ids: list[int] = []
        mask: list[bool] = []
        for s in segments:
            part = self.encode(s.text, allow_special=s.control)
            ids.extend(part)
            mask.extend([s.assistant] * len(part))
        return ids, mask

    def encode_chat(self, messages: Sequence[dict], **options: Any) -> tuple[list[int], list[bool]]:
        """Ids of a conversation in the K3 chat format and, per id, whether it belongs to an assistant turn.
        `options` are those of `render_chat`."""
        return self.encode_segments(render_chat(messages, **options))


def read_bpe_ranks(path: str | Path) -> dict[bytes, int]:
    """A `tiktoken.model` file: one `base64(token) rank` per line, ranks exactly 0..n-1.

    Read here rather than with tiktoken's loader, which caches local files by path in a temp folder (a changed file
    at the same path would read stale)."""
    ranks: dict[bytes, int] = {}
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read ({e.strerror})") from e
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise TokenizerError(f"{path}:{n}: expected `base64-token rank`, got {line[:60]!r}") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be exactly 0..{len(ranks) - 1}, each once")
    if len(ranks) < 256 or any(bytes([b]) not in ranks for b in range(256)):
        raise TokenizerError(f"{path}: a byte-level BPE must hold all 256 single bytes")
    return ranks


class TiktokenTokenizer(Tokenizer):
    """Byte-level BPE (`tiktoken.model` ranks 0..base-1), then 256 special ids named by `tokenizer_config.json`."""

    def __init__(self, ranks: dict[bytes, int], special_names: dict[int, str] | None = None):
        try:
            import tiktoken
        except ImportError as e:  # pragma: no cover - tiktoken is a dependency
            raise TokenizerError("a tiktoken.model needs the `tiktoken` package") from e
        base = len(ranks)
        self.specials = _special_table(base, special_names)
        self.vocab_size = base + NUM_SPECIAL
        self._bytes = {r: b for b, r in ranks.items()}
        self._enc = tiktoken.Encoding("kimi", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=self.specials)
        super().__init__()

    def _encode_plain(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _split_long(text):
            ids.extend(self._enc.encode(piece, disallowed_special=()))
        return ids

    def _token_bytes(self, i: int) -> bytes:
        return self._bytes[i]


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then the 256 special ids (256..511)."""

    def __init__(self) -> None:
        self.specials = _special_table(256)
        self.vocab_size = 256 + NUM_SPECIAL
        super().__init__()

    def _encode_plain(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def _token_bytes(self, i: int) -> bytes:
        return bytes([i])


def _special_names_from_config(path: Path, base: int) -> dict[int, str] | None:
    """Names of the reserved ids from `tokenizer_config.json`'s `added_tokens_decoder`, if there is one."""
    if not path.is_file():
        return None
    try:
        added = json.loads(path.read_text()).get("added_tokens_decoder")
        if added is None:
            return None
        names = {int(i): entry["content"] for i, entry in added.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise TokenizerError(f"{path}: cannot read added_tokens_decoder ({e})") from e
    if len(set(names.values())) != len(names):
        dup = sorted({n for n in names.values() if list(names.values()).count(n) > 1})
        raise TokenizerError(f"{path}: added_tokens_decoder names {dup} more than once")
    outside = [i for i in names if not base <= i < base + NUM_SPECIAL]
    if outside:
        raise TokenizerError(f"{path}: added tokens {outside[:5]} are outside the reserved ids "
                             f"[{base}, {base + NUM_SPECIAL})")
    missing = [n for n in ("[BOS]", "[EOS]", END_OF_MSG, OPEN, CLOSE, SEP, "[UNK]", "[PAD]")
               if n not in names.values()]
    if missing:
        raise TokenizerError(f"{path}: added_tokens_decoder lacks {missing}")
    return names


def load_tokenizer(checkpoint: str | Path | None, config=None) -> Tokenizer:
    """The tokenizer of a checkpoint folder: its `tiktoken.model` if present, else the byte-level fallback.

    With `config` (a `ModelConfig`), checks that every id the tokenizer can produce fits the model's vocabulary."""
    tok: Tokenizer
    folder = Path(checkpoint) if checkpoint is not None else None
    if folder is not None and not folder.exists():
        raise TokenizerError(f"{folder}: no such checkpoint folder")
    model_file = folder / "tiktoken.model" if folder is not None else None
    if model_file is not None and model_file.is_file():
        ranks = read_bpe_ranks(model_file)
        tok = TiktokenTokenizer(ranks, _special_names_from_config(folder / "tokenizer_config.json", len(ranks)))
    else:
        tok = ByteTokenizer()
    if config is not None and tok.vocab_size > config.vocab_size:
        kind = "tiktoken.model" if isinstance(tok, TiktokenTokenizer) else "byte-level fallback (no tiktoken.model)"
        raise TokenizerError(f"the {kind} tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                             f"{config.vocab_size}")
    return tok


# ---------------------------------------------------------------------------------------------------- chat format

@dataclass(frozen=True)
class Segment:
    text: str
    control: bool = False     # encode `<|...|>` names as special ids
    assistant: bool = False   # part of an assistant turn (loss mask)


THINKING_EFFORTS = ("low", "medium", "high", "max")
_THINKING_EFFORT_BODY = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
                         "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                         "Now the system is invoked with `thinking_effort={}`.")
_TOOL_CHOICE_BODY = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON = ("Your response must be raw JSON data without markdown code blocks (```json) or any additional "
             "formatting.")


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _sorted_deep(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted_deep(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_deep(v) for v in value]
    return value


class _Writer:
    """Collects segments; `assistant` marks what is written while it is set."""

    def __init__(self) -> None:
        self.out: list[Segment] = []
        self.assistant = False

    def text(self, s: Any) -> None:
        s = str(s)
        if s:
            self.out.append(Segment(s, False, self.assistant))

    def control(self, s: str) -> None:
        self.out.append(Segment(s, True, self.assistant))

    def open(self, tag: str, **attrs: Any) -> None:
        self.control(OPEN)
        self.text(tag)
        for key, value in attrs.items():
            if value is None:
                continue
            escaped = str(value).replace("&", "&amp;").replace('"', "&quot;")
            for piece in (f" {key}", '="', escaped, '"'):
                self.text(piece)
        self.control(SEP)

    def close(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def message(self, body: Any, **attrs: Any) -> None:
        self.open("message", **attrs)
        self.content(body)
        self.close("message")
        self.control(END_OF_MSG)

    def content(self, body: Any) -> None:
        if body is None or isinstance(body, str):
            self.text(body or "")
            return
        for part in body:
            if not isinstance(part, dict):
                raise TokenizerError(f"content must be a str or a list of {{'type': 'text', 'text': ...}} parts, "
                                     f"got a part of type {type(part).__name__}")
            if part.get("type") != "text":
                raise TokenizerError(f"content part of type {part.get('type')!r} is not supported by the text "
                                     f"model; only 'text' parts are")
            self.text(part["text"])


def _system_note(w: _Writer, kind: str, body: str) -> None:
    w.message(body.strip(), role="system", type=kind)


def _declare_tools(w: _Writer, tools: Any, dynamic: bool) -> None:
    fence = f"```json\n{_compact(_sorted_deep(tools))}\n```"
    if dynamic:
        body = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
                + fence)
    else:
        body = "# Tools\nHere are the available tools, described in JSONSchema.\n\n" + fence
    w.message(body, role="system", type="tool-declare")


def _call_arguments(call: dict) -> tuple[dict, str | None]:
    """(arguments as a dict, raw text if they were an unparseable string)."""
    args = call.get("arguments")
    if args is None or (isinstance(args, str) and not args.strip()):
        return {}, None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return {}, call["arguments"]
    if not isinstance(args, dict):
        raise TokenizerError(f"tool call arguments must be a JSON object, got {type(args).__name__}")
    return args, None


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", dict: "object"}.get(type(v), "array")


def _assistant(w: _Writer, m: dict, thinking: bool) -> None:
    w.open("message", role="assistant", name=m.get("name") or None)
    w.assistant = True
    if thinking:   # in thinking mode every assistant turn carries the think channel, possibly empty
        w.open("think")
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning is not None and str(reasoning).strip():
            w.text(reasoning)
        w.close("think")
    w.open("response")
    w.content(m.get("content"))
    w.close("response")
    if m.get("tool_calls"):
        w.open("tools")
        for index, call in enumerate(m["tool_calls"], start=1):
            fn = call.get("function", call)
            if not fn.get("name"):
                raise TokenizerError(f"tool call {index} of an assistant message has no function name")
            args, raw = _call_arguments(fn)
            w.open("call", tool=fn["name"], index=index)
            if raw is not None:
                w.open("json", type="object")
                w.text(raw)
                w.close("json")
            for key, value in args.items():
                w.open("argument", key=key, type=_json_type(value))
                w.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                w.close("argument")
            w.close("call")
        w.close("tools")
    w.close("message")
    w.control(END_OF_MSG)
    w.assistant = False


def _order_tool_results(messages: Sequence[dict]) -> list[dict]:
    """Each run of tool messages sorted into the order of the preceding assistant's `tool_calls`, matched by
    `tool_call_id`; the matched call's function name becomes the message's `tool`. Runs that do not match fully are
    kept as they are."""
    out: list[dict] = []
    calls: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") != "tool":
            if m.get("role") == "assistant":
                calls = {}
                for pos, c in enumerate(m.get("tool_calls") or [], start=1):
                    if c.get("id") is not None and str(c["id"]) not in calls:
                        calls[str(c["id"])] = (pos, c.get("function", c).get("name"))
            out.append(m)
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        run = messages[i:j]
        keys = [calls.get(str(t.get("tool_call_id", t.get("id")))) for t in run]
        if all(k is not None for k in keys):
            order = sorted(range(len(run)), key=lambda r: (keys[r][0], r))
            run = [{**run[r], "tool": keys[r][1]} for r in order]
        out.extend(run)
        i = j
    return out


def render_chat(messages: Sequence[dict], *, tools: list | None = None, thinking: bool = True,
                thinking_effort: str | None = "max", add_generation_prompt: bool = False,
                tool_choice: str | None = None, response_format: Any = None) -> list[Segment]:
    """The K3 chat format ("XTML", docs/checkpoints.md#chat-format) as segments.

    messages: dicts with `role` (system, user, assistant, tool) and `content` (a str or a list of text parts);
    assistant turns may carry `reasoning_content` and `tool_calls`; tool results `tool`/`name` or `tool_call_id`.
    `add_generation_prompt` ends with an open assistant message and its `think` (or `response`) channel."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise TokenizerError("messages must be a list of dicts")
    for n, m in enumerate(messages):
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise TokenizerError(f"message {n}: role must be system, user, assistant or tool, got {m.get('role')!r}")
    if thinking and thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise TokenizerError(f"thinking_effort must be one of {THINKING_EFFORTS}, got {thinking_effort!r}")
    w = _Writer()
    if tools:
        _declare_tools(w, tools, dynamic=False)
    if thinking and thinking_effort is not None:
        _system_note(w, "thinking-effort", _THINKING_EFFORT_BODY.format(thinking_effort))
    calls: list = []
    tool_index = 0
    for n, m in enumerate(_order_tool_results(list(messages))):
        role = m["role"]
        if role == "assistant":
            _assistant(w, m, thinking)
            calls, tool_index = m.get("tool_calls") or [], 0
        elif role == "system" and m.get("tools"):
            _declare_tools(w, m["tools"], dynamic=True)
        elif role in ("system", "user"):
            w.message(m.get("content"), role=role, name=m.get("name") or None)
        else:
            tool_index += 1
            name = m.get("tool", m.get("name"))
            if name is None and tool_index <= len(calls):
                name = calls[tool_index - 1].get("function", calls[tool_index - 1]).get("name")
            if name is None:
                raise TokenizerError(f"message {n}: a tool result needs `tool`/`name`, or a preceding assistant "
                                     f"tool call to take it from")
            w.message(m.get("content"), role="tool", tool=name, index=tool_index)
    if tool_choice in _TOOL_CHOICE_BODY:
        _system_note(w, "tool-choice", _TOOL_CHOICE_BODY[tool_choice])
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind == "json_object":
        _system_note(w, "response-format", f"The system is invoked with `response_format=json_object`.\n{_RAW_JSON}")
    elif kind == "json_schema":
        spec = response_format.get("json_schema", {}) if isinstance(response_format, dict) else {}
        schema = spec.get("schema", spec.get("json_schema", spec)) if isinstance(spec, dict) else spec
        _system_note(w, "response-format", "The system is invoked with `response_format=json_schema`.\n"
                     f"{_RAW_JSON}\nThe JSON data must match the following schema:\n"
                     f"```json\n{_compact(_sorted_deep(schema))}\n```")
    if add_generation_prompt:
        w.open("message", role="assistant")
        w.open("think" if thinking else "response")
    return w.out


def parse_reply(text: str, opened: str | None = "think") -> dict[str, str]:
    """Split a generated assistant reply (decoded with special names kept) into its `think` and `response` text.
    `opened`: the channel the generation prompt already opened (`think`, `response` or None)."""
    if opened is not None:
        text = f"{OPEN}{opened}{SEP}" + text
    out = {}
    for channel in ("think", "response"):
        m = re.search(re.escape(f"{OPEN}{channel}{SEP}") + r"(.*?)(?:" + re.escape(f"{CLOSE}{channel}{SEP}") + r"|\Z)",
                      text, flags=re.S)
        if m:
            out[channel] = m.group(1)
    return out
