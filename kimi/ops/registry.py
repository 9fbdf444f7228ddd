"""How ops are registered, and where the Triton kernels can run.

Two kinds of `kimi::` operator (docs/architecture.md#op-layer):

- `traceable(schema, fn)`: a pure-PyTorch implementation registered as CompositeImplicitAutograd. torch.compile
  sees the op by name and traces through `fn`, so Inductor fuses it with its neighbours and autograd
  differentiates it; no fake kernel or backward is written by hand.
- `torch.library.custom_op` (used directly in the op files): a library or hand-written kernel, one graph node
  Inductor does not look into, with a fake kernel giving exact output shapes, dtypes and strides, and a registered
  backward. Outputs are contiguous and fakes use `new_empty`, so real and fake strides agree
  (docs/compile.md#fake-strides).

Each registered function has the op's signature (tensors positional, scalars keyword-only), so
`torch.ops.kimi.<name>` and the Python function of that name are called the same way.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # the references still run
    triton = tl = None

LIB = torch.library.Library("kimi", "DEF")   # kept alive for the life of the process: ops vanish with it


def traceable(schema: str, fn: Callable) -> torch._ops.OpOverload:
    """Register `fn` as `kimi::<name>` (CompositeImplicitAutograd); returns the op."""
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, fn, "CompositeImplicitAutograd")
    return getattr(torch.ops.kimi, name).default


def interpreted() -> bool:
    """Whether Triton runs through its CPU interpreter (`TRITON_INTERPRET=1`, set by the tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of `device`."""
    return triton is not None and (device.type == "cuda" or interpreted())


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (8 elsewhere: the interpreter's launch shapes)."""
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fp32_matmuls_in_tf32() -> bool:
    """Whether torch runs fp32 CUDA matmuls in TF32 (the Triton kernels' fp32 dots follow it). The new-API
    attribute (torch >= 2.10) follows the legacy `set_float32_matmul_precision` too, while the legacy getter raises
    once anyone used the new API."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision is not None:
        return precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest"
