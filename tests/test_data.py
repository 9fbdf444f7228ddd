"""kimi/data.py: documents from text and chat files, packed and padded rows, the held-out split, the sampler."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import kimi
from kimi.data import (DataError, Document, Sampler, chat_document, fit_documents, make_rows, read_documents,
                       split_documents)
from kimi.loss import IGNORE
from kimi.tokenizer import ByteTokenizer
from kimi.training import loss_sum

from helpers import small_cfg, write_corpus


def test_packed_and_padded_rows_give_the_same_loss(tmp_path):
    cfg = small_cfg()
    params = kimi.init_params(cfg, seed=int(torch.randint(1000, ())))
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    tok = ByteTokenizer()
    docs = read_documents([corpus], tok)[:8]
    results = []
    for pack in (True, False):
        rows = make_rows(docs, 40, pack, tok.pad_id)
        assert len(rows) == (len(docs) if not pack else len(rows))
        s = loss_sum(params, {}, rows.input_ids, rows.labels, rows.document_ids, cfg=cfg,
                     backend=kimi.Backend(), dtype=torch.float32, fp32_paths=frozenset(), lora_scale=1.0)
        results.append((s / (rows.labels != IGNORE).sum()).item())
        assert (rows.labels != IGNORE).sum() == sum(len(d.labels) for d in docs)
    assert len(make_rows(docs, 40, True, 0)) < len(docs)               # packing did pack
    assert abs(results[0] - results[1]) < 1e-5 * abs(results[1])


def test_chat_loss_only_on_assistant_tokens():
    tok = ByteTokenizer()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    doc = chat_document(msgs, tok, "x")
    ids, mask = tok.encode_chat(msgs)
    assert doc.inputs == ids[:-1]
    assert [lab != IGNORE for lab in doc.labels] == mask[1:]
    assert tok.decode([lab for lab in doc.labels if lab != IGNORE]).count("hello") == 1


def test_bad_data_errors(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(DataError, match="does not exist"):
        read_documents([tmp_path / "nope.jsonl"], tok)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": "broken\n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: malformed JSON"):
        read_documents([bad], tok)
    bad.write_text('{"text": "fine"}\n{"text": "   "}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: empty text"):
        read_documents([bad], tok)
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: expected an object with 'text' or 'messages'"):
        read_documents([bad], tok)
    bad.write_text('{"messages": [{"role": "user", "content": "only a question"}]}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: no assistant tokens"):
        read_documents([bad], tok)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="empty.txt: empty text"):
        read_documents([empty], tok)
    bad.write_text('{"text": "short"}\n{"text": "' + "x" * 100 + '"}\n')
    docs = read_documents([bad], tok)
    with pytest.raises(DataError, match=r"bad.jsonl:2: document has 102 tokens, more than seq_len"):
        fit_documents(docs, 64, "error")
    pieces = fit_documents(docs, 64, "split")
    assert [len(d.inputs) for d in pieces] == [len(docs[0].inputs), 64, 37]


@settings(max_examples=30)
@given(st.integers(0, 40), st.floats(0.0, 0.9), st.integers(0, 2**31 - 1))
def test_split_holds_out_a_seeded_fraction(n, fraction, seed):
    """Every document lands in exactly one part, in its original order; at least one is held out when asked (and
    there are two); the same seed gives the same split."""
    docs = [Document([i], [i], f"d{i}") for i in range(n)]
    train, evals = split_documents(docs, fraction, seed)
    assert sorted(d.where for d in train + evals) == sorted(d.where for d in docs)
    for part in (train, evals):
        assert [d.inputs[0] for d in part] == sorted(d.inputs[0] for d in part)
    want = 0 if fraction <= 0 or n < 2 else max(1, round(fraction * n))
    assert len(evals) == want
    assert split_documents(docs, fraction, seed) == (train, evals)


@settings(max_examples=30)
@given(st.integers(1, 12), st.lists(st.integers(1, 30), min_size=1, max_size=6), st.integers(0, 100))
def test_sampler_epochs_and_resume(n, takes, seed):
    """Each epoch is a permutation of the rows; a sampler restored from another's state draws what that one
    would have drawn next."""
    a = Sampler(n, seed)
    drawn = []
    for k in takes:
        b = Sampler(n, seed)
        b.restore(a.state())
        got = a.take(k)
        assert len(got) == k and b.take(k) == got and b.state() == a.state()
        drawn += got
    for e in range(len(drawn) // n):
        assert sorted(drawn[e * n:(e + 1) * n]) == list(range(n))
