"""Two costs of Triton's interpreter (TRITON_INTERPRET=1, the CPU test runs) that are Python bookkeeping rather than
the kernels' arithmetic, removed for the test session by `install` (tests/conftest.py). Neither changes a value a
kernel computes; tests/test_interpreter_speedups.py checks the scan against Triton's own bit for bit.

- `share_patches`: the interpreter patches `triton.language` at every launch (undone when the kernel returns) and
  again at every call of a @triton.jit function inside the kernel (`tl.sum`, our helpers), each time walking the
  members of tl, tl.core, tl.tensor and tl.math: 45 % of the CPU time of an indexer launch (triton 3.9; 3.6's
  interpreter does the same). A nested call's patch is never undone before the kernel returns, so once a language
  module is patched in a launch, patching it again for a nested call changes nothing: it is skipped.
- `row_scan`: `tl.associative_scan` with a combine function of its own (not tl.cumsum's) runs element by element,
  one Python call of the combine function per element (the KDA backward's exclusive prefix sums: 60 % of its
  CPU time). `row_scan` folds the same way along the axis, left to right, but applies the combine function to
  whole slices across the other axes: the same elementwise operations in the same order. A combine function
  that would not give the same values so (one that branches on a value) goes to Triton's scan.

Both replace private functions of `triton.runtime.interpreter` (3.6 to 3.9); where those are missing (another
Triton), `install` replaces nothing and the tests run at the interpreter's own speed.
"""

from __future__ import annotations

import numpy as np

TRITON_GENERIC_SCAN = None
"""The interpreter's own `ScanOps.generic_scan`, kept by `install` (None before it, or where it found none)."""


def share_patches(ti) -> None:
    patch_lang, no_patch, launch = ti._patch_lang, ti._LangPatchScope, ti.GridExecutor.__call__
    modules = (ti.tl, ti.tl.core)
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


class _NotElementwise(Exception):
    """The combine function does something a slice-wise fold would not reproduce."""


def row_scan(self, input):
    """`ScanOps.generic_scan`'s result (out[0] = x[0], out[i] = combine(out[i − 1], x[i]) along the axis, each
    member stored in its input's dtype after every step), one combine call per position along the axis. A combine
    function that branches on a value (`if`, `and`, `min()`: a block's truth value would take one branch for every
    row), returns another number of members or another dtype than its inputs' goes to Triton's own scan instead."""
    import triton.language as tl
    tensor = tl.core.tensor                     # the interpreter's patched class during a launch
    as_bool = tensor.__bool__

    def one_value(t):
        if t.handle.data.size != 1:
            raise _NotElementwise
        return as_bool(t)

    tensor.__bool__ = one_value
    try:
        return _fold_slices(self, input)
    except Exception as e:      # ours, or the interpreter's wrapper of it (a jit function the combine one calls)
        cause = e
        while cause is not None and not isinstance(cause, _NotElementwise):
            cause = cause.__cause__
        if cause is None:
            raise
    finally:
        tensor.__bool__ = as_bool
    return TRITON_GENERIC_SCAN(self, input)


def _fold_slices(self, input):
    data = [arg.handle.data for arg in input]
    out = [np.empty_like(d) for d in data]
    axis, n = self.axis, data[0].shape[self.axis]

    def at(i):
        return (slice(None),) * axis + (i,)

    def member(x, arg):
        return self.to_tensor(np.array(x), arg.dtype)     # a copy (0-d for a 1-d input: a scalar, as Triton's)

    for o, d in zip(out, data):
        o[at(0)] = d[at(0)]
    for i in range(1, n):
        acc = [member(o[at(i - 1)], arg) for o, arg in zip(out, input)]
        cur = [member(d[at(i)], arg) for d, arg in zip(data, input)]
        ret = self.combine_fn.fn(*acc, *cur)
        ret = ret if isinstance(ret, tuple) else (ret,)
        if len(ret) != len(out):
            raise _NotElementwise
        for o, r in zip(out, ret):
            value = r.handle.data if hasattr(r, "handle") else r
            if isinstance(value, np.ndarray) and value.dtype != o.dtype:
                raise _NotElementwise
            o[at(i)] = np.broadcast_to(np.reshape(value, -1)[0] if np.size(value) == 1 else value, o[at(i)].shape)
    return [self.to_tensor(o, arg.dtype) for o, arg in zip(out, input)]


def install() -> bool:
    """Both speed-ups, where this Triton's interpreter has the functions they replace."""
    try:
        from triton.runtime import interpreter as ti
        ti._patch_lang, ti._LangPatchScope, ti.GridExecutor.__call__, ti.ScanOps.generic_scan   # noqa: B018
    except (ImportError, AttributeError):
        return False
    global TRITON_GENERIC_SCAN
    if ti.ScanOps.generic_scan is not row_scan:
        TRITON_GENERIC_SCAN = ti.ScanOps.generic_scan
        share_patches(ti)
        ti.ScanOps.generic_scan = row_scan
    return True
