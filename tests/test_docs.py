"""Every document the code, the scripts and the README cite ships in the repository, and every cited anchor is a
heading there; nothing cites the team's notes outside it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*ROOT.glob("kimi/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("tests/**/*.md"), ROOT / "train.py",
           ROOT / "generate.py", ROOT / "README.md", *ROOT.glob("docs/*.md")]
OUTSIDE = re.compile(r"\b(MODEL|KDA|DSA|COMPILE|PERF)\.md\b")
CITATION = re.compile(r"(?:docs/)?([a-z_]+\.md)(#[a-z0-9-]+)?")


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in doc.read_text().splitlines():
        if m := re.match(r"#+ (.+)", line):
            out.add("#" + re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_citations_resolve():
    docs = {p.name: _anchors(p) for p in (ROOT / "docs").glob("*.md")}
    assert {"architecture.md", "numerics.md", "checkpoints.md", "compile.md", "performance.md"} <= set(docs)
    bad = []
    for src in SOURCES:
        text = src.read_text()
        if src.name != "test_docs.py":
            bad += [f"{src.relative_to(ROOT)}: cites {m.group(0)}, which is not in the repository"
                    for m in OUTSIDE.finditer(text)]
        for m in CITATION.finditer(text):
            name, anchor = m.groups()
            if name not in docs:
                continue   # README.md, STYLE.md and other non-docs names
            if anchor and anchor not in docs[name]:
                bad.append(f"{src.relative_to(ROOT)}: {m.group(0)} names no heading of docs/{name}")
    assert not bad, "\n".join(bad)
