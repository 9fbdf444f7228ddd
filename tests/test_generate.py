"""generate.py, the CLI: prompts from the command line, a batch file or chat messages, streaming, and its errors.
(Generation itself: tests/test_generation.py.)"""

import importlib.util
import io
import sys
from pathlib import Path

import pytest

import kimi

from helpers import tiny

spec = importlib.util.spec_from_file_location("generate", Path(__file__).parents[1] / "generate.py")
gen = importlib.util.module_from_spec(spec)
sys.modules["generate"] = gen
spec.loader.exec_module(gen)

CFG = tiny(index_topk=8)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "ckpt"
    kimi.save_checkpoint(path, CFG, kimi.init_params(CFG, seed=3))
    return path


def test_cli_batch_file_and_stream(ckpt, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("first prompt\n\nsecond, longer prompt\n")
    out, err = io.StringIO(), io.StringIO()
    res = gen.run(gen.Args(checkpoint=ckpt, prompts_file=f, max_new_tokens=3, ignore_stop=True), out, err)
    assert len(res.tokens) == 2 and out.getvalue().count("--- ") == 2
    assert "prefill: 35 tokens" in err.getvalue()   # 12 + 21 bytes, each after [BOS]
    out = io.StringIO()
    res = gen.run(gen.Args(checkpoint=ckpt, prompt="hi", max_new_tokens=3, ignore_stop=True, bos=False,
                           sampling=gen.Sampling(temperature=0)), out, io.StringIO())
    assert res.prompt_tokens == 2
    tok = kimi.tokenizer.ByteTokenizer()
    assert out.getvalue() == tok.decode(res.tokens[0]) + "\n"


def test_cli_output_jsonl_is_written_once(ckpt, tmp_path):
    import json
    f, out = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    f.write_text("first prompt\nsecond\n")
    res = gen.run(gen.Args(checkpoint=ckpt, prompts_file=f, max_new_tokens=3, ignore_stop=True, output=out),
                  io.StringIO(), io.StringIO())
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1] and [r["tokens"] for r in rows] == res.tokens
    assert rows[0]["text"] == kimi.tokenizer.ByteTokenizer().decode(res.tokens[0])
    with pytest.raises(gen.GenerateError, match="exists"):
        gen.run(gen.Args(checkpoint=ckpt, prompts_file=f, max_new_tokens=3, output=out), io.StringIO(),
                io.StringIO())


def test_cli_long_prompts_print_prefill_progress(ckpt, monkeypatch):
    monkeypatch.setattr(gen, "LONG_PROMPT", 16)
    err = io.StringIO()
    gen.run(gen.Args(checkpoint=ckpt, prompt="x" * 40, max_new_tokens=1, ignore_stop=True), io.StringIO(), err)
    progress = [ln for ln in err.getvalue().splitlines() if ln.startswith("prefill: ") and " tokens, " in ln]
    assert [ln.split(",")[0] for ln in progress] == ["prefill: 16/41 tokens", "prefill: 32/41 tokens",
                                                     "prefill: 41/41 tokens"]


def test_cli_help_describes_every_option(capsys):
    """Every option of generate.py and of its sampling settings carries a docstring (what --help prints for it),
    and --help runs."""
    from helpers import undocumented_fields
    for cls in (gen.Args, gen.Sampling):
        assert undocumented_fields(cls) == [], cls.__name__
    with pytest.raises(SystemExit) as e:
        gen.main(["--help"])
    assert e.value.code == 0 and "--sampling.repetition-penalty" in capsys.readouterr().out


def test_cli_chat_prompt(ckpt):
    res = gen.run(gen.Args(checkpoint=ckpt, prompt="hi", chat=True, thinking=False, max_new_tokens=2,
                           ignore_stop=True), io.StringIO(), io.StringIO())
    tok = kimi.tokenizer.ByteTokenizer()
    want = tok.encode_chat([{"role": "user", "content": "hi"}], thinking=False, add_generation_prompt=True)[0]
    assert res.prompt_tokens == len(want)


@pytest.mark.parametrize("change, match", [
    (dict(prompt="   "), "empty"),
    (dict(prompt="abc", max_len=5), "exceeds the cache length"),
    (dict(prompt="abc", max_new_tokens=0), "max_new_tokens"),
    (dict(prompt=None), "exactly one of --prompt"),
    (dict(prompt="abc", preset="tiny"), "exactly one of --checkpoint"),
])
def test_cli_errors(ckpt, change, match):
    args = dict(checkpoint=ckpt, prompt="abc", max_new_tokens=4) | change
    with pytest.raises(gen.GenerateError, match=match):
        gen.run(gen.Args(**args), io.StringIO(), io.StringIO())


def test_cli_file_errors(ckpt, tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    with pytest.raises(gen.GenerateError, match=r"p.jsonl:2"):
        gen.run(gen.Args(checkpoint=ckpt, prompts_file=bad), io.StringIO(), io.StringIO())
    assert gen.main(["--checkpoint", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "nope" in capsys.readouterr().err


def test_cli_interactive_chat_through_stdin(ckpt):
    """Turns from stdin: each reply streams on its own line, /reset starts a new conversation (its first turn is
    the first turn's tokens again), a turn too long for the cache is one error line and the loop goes on, EOF
    ends. Only the new turn is prefilled."""
    tok = kimi.tokenizer.ByteTokenizer()
    out, err = io.StringIO(), io.StringIO()
    inp = io.StringIO("hello\n\nhow are you?\n" + "x" * 400 + "\n/reset\nhello\n")
    gen.run(gen.Args(checkpoint=ckpt, interactive=True, thinking=False, max_new_tokens=3, max_len=420,
                     sampling=gen.Sampling(temperature=0), ignore_stop=True), out, err, inp)
    replies = out.getvalue().splitlines()
    assert len(replies) == 3 and replies[0] == replies[2], replies
    log = err.getvalue()
    assert "the conversation is full" in log and "(a new conversation)" in log
    turn = lambda text: tok.encode_chat([{"role": "user", "content": text}], thinking=False,
                                        add_generation_prompt=True)[0]
    closing = tok.encode(f"{gen.CLOSE}response{gen.SEP}{gen.CLOSE}message{gen.SEP}{gen.END_OF_MSG}",
                         allow_special=True)     # the first reply was cut at 3 tokens: closed before turn 2
    assert f"prefill: {len(turn('hello'))} tokens" in log
    assert f"prefill: {1 + len(closing) + len(turn('how are you?'))} tokens" in log


def test_cli_closes_a_cut_reply():
    tok = kimi.tokenizer.ByteTokenizer()
    close = lambda reply, opened: tok.decode(gen._closing(tok, tok.encode(reply, allow_special=True), opened))
    end = f"{gen.CLOSE}message{gen.SEP}{gen.END_OF_MSG}"
    assert close("still thinking", "think") == f"{gen.CLOSE}think{gen.SEP}{gen.OPEN}response{gen.SEP}" \
                                               f"{gen.CLOSE}response{gen.SEP}{end}"
    assert close(f"done{gen.CLOSE}think{gen.SEP}{gen.OPEN}response{gen.SEP}the ans", "think") == \
        f"{gen.CLOSE}response{gen.SEP}{end}"
    assert close("an answer", "response") == f"{gen.CLOSE}response{gen.SEP}{end}"
    assert close(f"done{gen.CLOSE}think{gen.SEP}", "think") == f"{gen.OPEN}response{gen.SEP}{gen.CLOSE}response" \
                                                             f"{gen.SEP}{end}"   # the response channel is never left out


def test_cli_warns_past_the_trained_context(tmp_path):
    import dataclasses
    path = tmp_path / "short"
    cfg = dataclasses.replace(CFG, max_position_embeddings=8)
    kimi.save_checkpoint(path, cfg, kimi.init_params(cfg, seed=0))
    assert kimi.load_checkpoint(path)[0].max_position_embeddings == 8
    import json
    config = json.loads((path / "config.json").read_text())        # a user's edit: the wrapper's top level
    config.get("text_config", config).pop("max_position_embeddings")
    (path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 8}))
    assert kimi.load_checkpoint(path)[0].max_position_embeddings == 8
    err = io.StringIO()
    gen.run(gen.Args(checkpoint=path, prompt="abc", max_new_tokens=4, ignore_stop=True, bos=False), io.StringIO(),
            err)
    assert "warning:" not in err.getvalue()
    gen.run(gen.Args(checkpoint=path, prompt="abcdef", max_new_tokens=4, ignore_stop=True, bos=False),
            io.StringIO(), err)
    assert "warning: 9 tokens" in err.getvalue() and "trained for" in err.getvalue()


def test_cli_interactive_process_ends_at_eof(ckpt):
    """The real script on a pipe: one turn, then end of input (Ctrl-D at a terminal): exit 0, no traceback."""
    import os
    import subprocess
    root = Path(__file__).parents[1]
    r = subprocess.run([sys.executable, str(root / "generate.py"), "--checkpoint", str(ckpt), "--interactive",
                        "--max-new-tokens", "2", "--no-thinking"], input="hi\n", capture_output=True, text=True,
                       timeout=300, env=os.environ | {"PYTHONPATH": str(root)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stdout.splitlines()) == 1 and r.stderr.count("> ") == 2
