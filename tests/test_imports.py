"""The package's import graph: every module imports on its own in a fresh interpreter, and no module's imports
form a cycle (the op layer never imports a layer module)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "kimi"
MODULES = sorted("kimi." + ".".join(p.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
                 for p in PKG.rglob("*.py"))
MODULES = [m.removesuffix(".__init__") for m in MODULES]


def _imports(module: str) -> set[str]:
    """The kimi modules `module` imports (relative or absolute), from its source."""
    parts = module.split(".")
    path = PKG.joinpath(*parts[1:])
    is_pkg = path.is_dir()
    src = (path / "__init__.py" if is_pkg else path.with_suffix(".py")).read_text()
    here = parts if is_pkg else parts[:-1]          # the package a relative import starts from
    found = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "kimi"}
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            if not target.startswith("kimi"):
                continue
            for a in node.names:   # `from . import x` imports the module kimi...x when there is one
                sub = f"{target}.{a.name}"
                found.add(sub if sub in MODULES else target)
    return found - {module}


def test_import_graph_has_no_cycle():
    graph = {m: _imports(m) for m in MODULES}
    assert "kimi.ops" in graph["kimi.kda"] and "kimi.ops.delta_rule" in graph["kimi.ops"]   # the parser sees imports
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]):
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in MODULES:
        if m not in state:
            visit(m, [m])


def test_op_layer_imports_no_layer_module():
    layers = {"kimi.kda", "kimi.mla", "kimi.indexer", "kimi.moe", "kimi.model"}
    for m in MODULES:
        if m.startswith("kimi.ops"):
            assert not _imports(m) & layers, m


_IMPORT_EACH = """
import importlib, os, sys, traceback
import torch   # the heavy third-party imports once, before the fork; no kimi module is imported here
try:
    import triton
except ImportError:
    pass
failed = {}
for module in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # a child per module: kimi imported from nothing, this module first
        os.close(r)
        try:
            importlib.import_module(module)
            code = 0
        except BaseException:
            os.write(w, traceback.format_exc()[-2000:].encode())
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    if os.waitpid(pid, 0)[1] != 0:
        failed[module] = err or "exited with a signal"
print(repr(failed))
"""


def test_every_module_imports_alone():
    """Each module is the first kimi module a process imports (without relying on the order in kimi/__init__.py):
    one fresh interpreter imports torch and triton, then forks a child per module."""
    assert "kimi.ops" in MODULES and len(MODULES) > 30
    out = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *MODULES], capture_output=True, text=True,
                         cwd=PKG.parent, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    failed = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert not failed, failed


def test_no_two_callables_share_a_name_with_different_signatures():
    """A name means one contract across the package (the dispatch points share their op's signature)."""
    seen: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name != "_":
                seen.setdefault(node.name, set()).add(ast.unparse(node.args))
    clashes = {name: sigs for name, sigs in seen.items() if len(sigs) > 1}
    assert not clashes, clashes
