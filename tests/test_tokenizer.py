"""Tokenizers (tiktoken BPE and the byte-level fallback) and the K3 chat format (docs/checkpoints.md#chat-format)."""

import json
import re

import pytest
from hypothesis import given, strategies as st

from kimi.tokenizer import (ByteTokenizer, TiktokenTokenizer, TokenizerError, _split_long, load_tokenizer,
                            parse_reply, read_bpe_ranks, render_chat)

from helpers import tiny, train_bpe, write_tiktoken_model

CORPUS = ("The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs 12345 times!\n"
          "Kimi K3 mixes delta attention with sparse latent attention. 你好世界，模型。 Ünïcödé text, "
          "tabs\tand  double  spaces, <|open|> markers in plain text, and numbers 2026 11 30.\n"
          + "1234567890 " * 10) * 4
RANKS = train_bpe(CORPUS, 120)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    write_tiktoken_model(RANKS, d / "tiktoken.model")
    return d


@pytest.fixture(scope="module")
def bpe(bpe_dir):
    return load_tokenizer(bpe_dir)


@pytest.fixture(params=["bytes", "bpe"])
def tok(request, bpe):
    return ByteTokenizer() if request.param == "bytes" else bpe


texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)


@given(texts)
def test_byte_round_trip(s):
    t = ByteTokenizer()
    ids = t.encode(s)
    assert ids == list(s.encode()) and t.decode(ids) == s


@given(st.lists(st.sampled_from(["the", " fox", "你好", "12345", "\n\n", "  ", "<|open|>", "Ü", "x!?", "'s"]),
                max_size=30) | texts)
def test_bpe_round_trip(bpe, s):
    ids = bpe.encode("".join(s) if isinstance(s, list) else s)
    text = "".join(s) if isinstance(s, list) else s
    assert all(0 <= i < len(RANKS) for i in ids)   # plain text never yields a special id
    assert bpe.decode(ids) == text


def test_bpe_merges_and_pre_tokenizer(bpe):
    ids = bpe.encode(CORPUS)
    assert len(ids) < 0.7 * len(CORPUS.encode())   # the merges are used
    # digits are pre-split in groups of at most 3, so no token spans 4 digits even where merges would allow it
    pieces = [bpe.decode([i]) for i in bpe.encode("12345 2026 1234567")]
    assert all(len(re.findall(r"\d", p)) <= 3 for p in pieces) and "".join(pieces) == "12345 2026 1234567"
    # Han runs split from latin letters
    pieces = [bpe.decode([i]) for i in bpe.encode("你好fox")]
    assert not any(re.search("[你好]", p) and re.search("[a-z]", p) for p in pieces)


def test_special_ids_follow_the_base_vocabulary(tok):
    base = tok.vocab_size - 256
    assert (tok.bos_id, tok.eos_id, tok.end_of_msg_id, tok.pad_id) == (base, base + 1, base + 2, base + 255)
    assert tok.specials["<|open|>"] == base + 3 and tok.specials["<|media_pad|>"] == base + 21
    assert tok.specials[f"<|reserved_token_{base + 10}|>"] == base + 10
    assert tok.stop_ids == (base + 2, base + 1)


def test_allow_special(tok):
    text = "a<|open|>b<|end_of_msg|>"
    ids = tok.encode(text, allow_special=True)
    assert ids == tok.encode("a") + [tok.specials["<|open|>"]] + tok.encode("b") + [tok.end_of_msg_id]
    plain = tok.encode(text)
    assert not set(plain) & set(tok.specials.values()) and tok.decode(plain) == text
    assert tok.decode(ids) == text and tok.decode(ids, skip_special=True) == "ab"


def test_long_runs_are_split():
    s = "a" * 60_000 + " " * 30_000 + "b"
    parts = list(_split_long(s))
    runs = [len(r) for p in parts for r in re.findall(r"\s+|\S+", p)]
    assert "".join(parts) == s and max(runs) == 25_000 and len(parts) == 4
    assert all(len(p) <= 400_000 for p in _split_long("x y " * 150_001))


def test_long_input_round_trips(bpe):
    s = ("word " * 90_000) + "z" * 30_000
    assert bpe.decode(bpe.encode(s)) == s


CHAT_PROMPT = re.compile(
    re.escape('<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides') + r"[^\n]*"
    + re.escape("`max`.\nNow the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>"
                '<|open|>message role="user"<|sep|>Hello<|close|>message<|sep|><|end_of_msg|>'
                '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'))


def test_chat_prompt_matches_the_spec_example(tok):
    ids, mask = tok.encode_chat([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    assert CHAT_PROMPT.fullmatch(tok.decode(ids)), tok.decode(ids)
    assert not any(mask)
    # markers are control ids, not their spelled-out bytes; plain text like the tag name is not
    assert ids.count(tok.specials["<|open|>"]) == 4 and ids.count(tok.end_of_msg_id) == 2
    # no BOS/EOS is added
    assert tok.bos_id not in ids and tok.eos_id not in ids


def test_each_segment_is_encoded_alone(bpe):
    segments = render_chat([{"role": "user", "content": "the fox"}], thinking=False)
    ids, _ = bpe.encode_chat([{"role": "user", "content": "the fox"}], thinking=False)
    assert ids == [i for s in segments for i in bpe.encode(s.text, allow_special=s.control)]
    assert [s.text for s in segments[:4]] == ["<|open|>", "message", " role", '="']


def test_assistant_mask_covers_exactly_the_assistant_turn(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "reasoning_content": "add", "content": "4"},
                {"role": "user", "content": "thanks"}]
    ids, mask = tok.encode_chat(messages)
    assert len(ids) == len(mask)
    picked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert picked == ("<|open|>think<|sep|>add<|close|>think<|sep|><|open|>response<|sep|>4<|close|>response<|sep|>"
                      "<|close|>message<|sep|><|end_of_msg|>")
    # without thinking the think channel is gone; with thinking but no reasoning it is present and empty
    ids, mask = tok.encode_chat(messages[1:3], thinking=False)
    assert "think" not in tok.decode(ids)
    ids, _ = tok.encode_chat([{"role": "assistant", "content": "4"}], thinking_effort=None)
    assert tok.decode(ids).startswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think')


def test_tool_calls_and_results():
    t = ByteTokenizer()
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "b": 1, "a": 2}}}]
    calls = [{"id": "c1", "function": {"name": "add", "arguments": json.dumps({"x": 1, "s": "hi", "ok": True})}},
             {"id": "c2", "function": {"name": "echo", "arguments": "{not json"}}]
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c2", "content": "E"}, {"role": "tool", "tool_call_id": "c1",
                                                                         "content": "3"}]
    text = t.decode(t.encode_chat(messages, tools=tools, thinking=False, tool_choice="required")[0])
    assert text.startswith('<|open|>message role="system" type="tool-declare"<|sep|># Tools\n')
    assert '{"function":{"name":"add","parameters":{"a":2,"b":1,"type":"object"}},"type":"function"}' in text
    assert ('<|open|>call<|sep|>' not in text and '<|open|>call tool="add" index="1"<|sep|>'
            '<|open|>argument key="x" type="number"<|sep|>1<|close|>argument<|sep|>'
            '<|open|>argument key="s" type="string"<|sep|>hi<|close|>argument<|sep|>'
            '<|open|>argument key="ok" type="boolean"<|sep|>true<|close|>argument<|sep|><|close|>call<|sep|>') in text
    assert '<|open|>json type="object"<|sep|>{not json<|close|>json<|sep|>' in text
    # results re-sorted into call order, named after the matched call
    first = text.index('role="tool" tool="add" index="1"<|sep|>3')
    assert first < text.index('role="tool" tool="echo" index="2"<|sep|>E')
    assert text.endswith('type="tool-choice"<|sep|>The system is invoked with `tool_choice=required`.\n'
                         'You MUST call tools in the next message.<|close|>message<|sep|><|end_of_msg|>')


def test_attribute_escaping():
    t = ByteTokenizer()
    text = t.decode(t.encode_chat([{"role": "user", "name": 'a"&b', "content": "x"}], thinking=False)[0])
    assert 'name="a&quot;&amp;b"' in text


def test_parse_reply():
    reply = "hmm<|close|>think<|sep|><|open|>response<|sep|>42<|close|>response<|sep|><|close|>message<|sep|>"
    assert parse_reply(reply) == {"think": "hmm", "response": "42"}
    assert parse_reply("partial answ", opened="response") == {"response": "partial answ"}
    assert parse_reply("still thinking\n") == {"think": "still thinking\n"}


def test_chat_errors():
    with pytest.raises(TokenizerError, match="role"):
        render_chat([{"role": "bot", "content": "x"}])
    with pytest.raises(TokenizerError, match="thinking_effort"):
        render_chat([], thinking_effort="extreme")
    with pytest.raises(TokenizerError, match="image"):
        render_chat([{"role": "user", "content": [{"type": "image", "url": "x"}]}])
    with pytest.raises(TokenizerError, match="tool result"):
        render_chat([{"role": "tool", "content": "3"}])
    with pytest.raises(TokenizerError, match="no function name"):
        render_chat([{"role": "assistant", "tool_calls": [{"arguments": "{}"}]}])
    with pytest.raises(TokenizerError, match="parts"):
        render_chat([{"role": "user", "content": ["plain"]}])
    with pytest.raises(TokenizerError, match="JSON object"):
        render_chat([{"role": "assistant", "tool_calls": [{"name": "f", "arguments": "[1, 2]"}]}])


def test_token_id_errors(tok):
    with pytest.raises(TokenizerError, match="outside"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerError, match="str"):
        tok.encode(b"bytes")


def test_load_tokenizer(tmp_path, bpe_dir):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)   # no tiktoken.model: byte fallback
    assert isinstance(load_tokenizer(bpe_dir, tiny(vocab_size=1024)), TiktokenTokenizer)
    with pytest.raises(TokenizerError, match="vocab_size"):
        load_tokenizer(bpe_dir, tiny())   # 376 + 256 ids do not fit 512
    with pytest.raises(TokenizerError, match="no such"):
        load_tokenizer(tmp_path / "missing")
    load_tokenizer(None, tiny())   # the tiny preset holds the byte fallback exactly
    with pytest.raises(TokenizerError, match="byte-level"):
        load_tokenizer(None, tiny(vocab_size=300))


def test_named_special_tokens_from_tokenizer_config(tmp_path):
    write_tiktoken_model(RANKS, tmp_path / "tiktoken.model")
    base = len(RANKS)
    names = {base + o: n for o, n in [(0, "[BOS]"), (1, "[EOS]"), (2, "<|end_of_msg|>"), (3, "<|open|>"),
                                      (4, "<|close|>"), (5, "<|sep|>"), (7, "<|custom|>"), (254, "[UNK]"),
                                      (255, "[PAD]")]}
    config = {"added_tokens_decoder": {str(i): {"content": n, "special": True} for i, n in names.items()}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    t = load_tokenizer(tmp_path)
    assert t.specials["<|custom|>"] == base + 7 and f"<|reserved_token_{base + 6}|>" in t.specials
    config["added_tokens_decoder"][str(base + 256)] = {"content": "<|late|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="outside the reserved ids"):
        load_tokenizer(tmp_path)
    del config["added_tokens_decoder"][str(base + 256)]
    config["added_tokens_decoder"][str(base + 8)] = {"content": "<|custom|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="more than once"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8}))
    assert load_tokenizer(tmp_path).specials["[EOS]"] == base + 1   # no added tokens: the release names


def test_bad_tiktoken_file(tmp_path):
    write_tiktoken_model(RANKS, tmp_path / "tiktoken.model")
    lines = (tmp_path / "tiktoken.model").read_text().splitlines()
    lines[300] = "not-base64!! 300"
    (tmp_path / "tiktoken.model").write_text("\n".join(lines))
    with pytest.raises(TokenizerError, match=r"tiktoken.model:301:"):
        read_bpe_ranks(tmp_path / "tiktoken.model")
    (tmp_path / "tiktoken.model").write_text("\n".join(lines[:10]))
    with pytest.raises(TokenizerError, match="256 single bytes"):
        read_bpe_ranks(tmp_path / "tiktoken.model")
