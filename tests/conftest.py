"""Test setup: fresh random inputs each run (the seed is printed so a failure can be replayed with
KIMI_TEST_SEED=N), hypothesis without deadlines, a `gpu` marker that skips cleanly without CUDA, and a fresh
Inductor cache directory per session (a stale cache can reuse old fake-kernel strides: docs/compile.md#fake-strides;
removed at exit), and Triton's interpreter on machines without a GPU (`_share_interpreter_patches`)."""

import atexit
import os
import random
import shutil
import tempfile

import pytest
import torch
from hypothesis import settings

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kimi-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
if not torch.cuda.is_available():   # Triton kernels (kimi/ops/*_triton.py) run through the interpreter; set before kimi
    os.environ.setdefault("TRITON_INTERPRET", "1")   # is imported: @triton.jit reads it when a kernel is defined
settings.register_profile("default", deadline=None, print_blob=True)
settings.load_profile("default")
# pytest-xdist's workers share the cores: one intra-op thread pool each of cores / workers threads (at most 4)
torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)))))


def _share_interpreter_patches() -> bool:
    """Triton's interpreter patches `triton.language` for the interpreter at every launch (undone when the kernel
    returns) and again at every call of a @triton.jit function inside the kernel (`tl.sum`, our helpers), each
    time walking the members of tl, tl.core, tl.tensor and tl.math (45 % of the CPU time of an indexer launch on
    triton 3.9; 3.6's interpreter does the same). A nested call's patch is never undone before the kernel returns,
    so once a language module is patched in a launch, patching it again for a nested call changes nothing: here it
    is skipped. What the kernels compute is untouched (the same interpreter, the same patches in force at every
    line). Without those internals (another Triton) nothing is replaced."""
    try:
        from triton.runtime import interpreter as ti
        patch_lang, no_patch, launch = ti._patch_lang, ti._LangPatchScope, ti.GridExecutor.__call__
        modules = (ti.tl, ti.tl.core)
    except (ImportError, AttributeError):
        return False
    patched: list[set[int]] = []    # per running launch: the language modules patched in it
    seen: dict = {}

    def langs(fn) -> set[int]:
        if fn not in seen:
            seen[fn] = {id(v) for v in fn.__globals__.values() if any(v is m for m in modules)}
        return seen[fn]

    def _patch_lang(fn):
        if patched and langs(fn) and langs(fn) <= patched[-1]:   # (none: the interpreter's own assertion)
            return no_patch()
        scope = patch_lang(fn)
        if patched:
            patched[-1] |= langs(fn)
        return scope

    def __call__(self, *args, **kwargs):
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    ti._patch_lang, ti.GridExecutor.__call__ = _patch_lang, __call__
    return True


if os.environ.get("TRITON_INTERPRET") == "1":
    _share_interpreter_patches()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (runs on the H200 through the device tool)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed():
    seed = int(os.environ.get("KIMI_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(seed)
    print(f"torch seed {seed} (replay with KIMI_TEST_SEED={seed})")
    yield
