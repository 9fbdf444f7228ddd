"""Test setup: fresh random inputs each run (the seed is printed so a failure can be replayed with
KIMI_TEST_SEED=N), hypothesis without deadlines, a `gpu` marker that skips cleanly without CUDA, and a fresh
Inductor cache directory per session (a stale cache can reuse old fake-kernel strides: docs/compile.md#fake-strides;
removed at exit), and Triton's interpreter on machines without a GPU (with tests/interpreter_speedups.py)."""

import atexit
import os
import random
import shutil
import tempfile

import pytest
import torch
from hypothesis import settings

import interpreter_speedups

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kimi-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
if not torch.cuda.is_available():   # Triton kernels (kimi/ops/*_triton.py) run through the interpreter; set before kimi
    os.environ.setdefault("TRITON_INTERPRET", "1")   # is imported: @triton.jit reads it when a kernel is defined
settings.register_profile("default", deadline=None, print_blob=True)
settings.load_profile("default")
# pytest-xdist's workers share the cores: one intra-op thread pool each of cores / workers threads (at most 4)
torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)))))


if os.environ.get("TRITON_INTERPRET") == "1":   # the interpreter without two of its bookkeeping costs
    interpreter_speedups.install()


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
