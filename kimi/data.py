"""Training data: text and chat files tokenized into documents, documents packed (or padded) into rows of
`seq_len` tokens, a held-out split, and a resumable shuffled sampler over the rows."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .loss import IGNORE
from .ranges import document_ranges


class DataError(ValueError):
    """Bad training data: says which file (and line) and what is wrong."""


@dataclass
class Document:
    inputs: list[int]
    labels: list[int]
    """labels[j] is the token after inputs[j], or IGNORE where no loss is taken."""
    where: str


def default_corpus() -> list[Path]:
    """The project's own text: the kimi package's source files and the README, a small demo corpus."""
    root = Path(__file__).parent
    files = sorted(root.rglob("*.py"))
    readme = root.parent / "README.md"
    return files + ([readme] if readme.is_file() else [])


def text_document(text: str, tok, where: str) -> Document:
    """Loss on every token: [BOS] (when the tokenizer has one) + text + [EOS]."""
    if not text.strip():
        raise DataError(f"{where}: empty text")
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(text) + [tok.eos_id]
    return Document(ids[:-1], ids[1:], where)


def chat_document(messages, tok, where: str) -> Document:
    """A conversation in the chat format (docs/checkpoints.md#chat-format), loss on the assistant's tokens only."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    try:
        ids, assistant = tok.encode_chat(messages)
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{where}: {e}") from None
    if not any(assistant[1:]):
        raise DataError(f"{where}: no assistant tokens to train on")
    labels = [t if a else IGNORE for t, a in zip(ids[1:], assistant[1:])]
    return Document(ids[:-1], labels, where)


def read_documents(paths: list[str | Path], tok) -> list[Document]:
    """Tokenize every file into documents (text files: one each; .jsonl: one per line, {"text": ...} or
    {"messages": [...]})."""
    docs = []
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"data file {path} does not exist")
        if path.suffix != ".jsonl":
            try:
                docs.append(text_document(path.read_text(encoding="utf-8"), tok, str(path)))
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 text ({e})") from None
            continue
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                where = f"{path}:{n}"
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
                if isinstance(obj, dict) and "messages" in obj:
                    docs.append(chat_document(obj["messages"], tok, where))
                elif isinstance(obj, dict) and "text" in obj:
                    if not isinstance(obj["text"], str):
                        raise DataError(f"{where}: 'text' must be a string")
                    docs.append(text_document(obj["text"], tok, where))
                else:
                    raise DataError(f"{where}: expected an object with 'text' or 'messages'")
    if not docs:
        raise DataError(f"no documents in {[str(p) for p in paths]}")
    return docs


def fit_documents(docs: list[Document], seq_len: int, long_documents: str) -> list[Document]:
    """Documents of at most seq_len inputs: an error for a longer one ('error'), or it is cut into pieces
    ('split')."""
    out = []
    for d in docs:
        if len(d.inputs) <= seq_len:
            out.append(d)
        elif long_documents == "error":
            raise DataError(f"{d.where}: document has {len(d.inputs) + 1} tokens, more than seq_len + 1 = "
                            f"{seq_len + 1}; raise --data.seq-len or pass --data.long-documents split")
        else:
            out += [Document(d.inputs[i:i + seq_len], d.labels[i:i + seq_len], f"{d.where}[{i}:]")
                    for i in range(0, len(d.inputs), seq_len)]
    return out


def split_documents(docs: list[Document], eval_fraction: float, seed: int) -> tuple[list[Document], list[Document]]:
    """(train, eval): a seeded random `eval_fraction` of the documents held out (at least one when > 0 and there
    are two or more), both in their original order."""
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = 0 if eval_fraction <= 0 or len(docs) < 2 else max(1, round(eval_fraction * len(docs)))
    held = set(order[:n_eval])
    return [x for i, x in enumerate(docs) if i not in held], [x for i, x in enumerate(docs) if i in held]


@dataclass
class Rows:
    """Training rows: input_ids, labels, document_ids, each [N, T] int64 (document id < 0 is padding)."""
    input_ids: Tensor
    labels: Tensor
    document_ids: Tensor

    def __len__(self):
        return self.input_ids.shape[0]

    def select(self, idx) -> "Rows":
        return Rows(self.input_ids[idx], self.labels[idx], self.document_ids[idx])

    def longest_document(self) -> int:
        """Tokens of the longest document in any row (0 without rows): the bound `kimi.forward` takes as
        `max_document_len` (documents of at most index_topk tokens attend densely, without the indexer)."""
        if not len(self):
            return 0
        r = document_ranges(self.document_ids)
        return int((r.hi - r.lo).max())


def make_rows(docs: list[Document], seq_len: int, pack: bool, pad_id: int) -> Rows:
    """Packed: documents fill rows in order (a document that does not fit starts the next row); not packed:
    one document per row. The rest of a row is padding (pad_id, IGNORE, document id -1)."""
    rows: list[list[Document]] = []
    used = seq_len
    for d in docs:
        if not pack or used + len(d.inputs) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(d)
        used += len(d.inputs)
    N = len(rows)
    ids = torch.full((N, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((N, seq_len), IGNORE, dtype=torch.long)
    doc_ids = torch.full((N, seq_len), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        t = 0
        for k, d in enumerate(row):
            n = len(d.inputs)
            ids[r, t:t + n] = torch.tensor(d.inputs)
            labels[r, t:t + n] = torch.tensor(d.labels)
            doc_ids[r, t:t + n] = k
            t += n
    return Rows(ids, labels, doc_ids)


class Sampler:
    """Endless shuffled passes over n rows, a seeded permutation per epoch; the position (epoch, offset) is all its
    state, so a resumed run draws exactly the batches the straight run would have."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.offset = n, seed, 0, 0

    def _perm(self) -> list[int]:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def take(self, k: int) -> list[int]:
        out, perm = [], self._perm()
        while len(out) < k:
            if self.offset == self.n:
                self.epoch, self.offset = self.epoch + 1, 0
                perm = self._perm()
            m = min(k - len(out), self.n - self.offset)
            out += perm[self.offset:self.offset + m]
            self.offset += m
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def restore(self, state: dict) -> None:
        self.epoch, self.offset = state["epoch"], state["offset"]
