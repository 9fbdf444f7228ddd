"""tests/interpreter_speedups.py's scan against the Triton interpreter's own (`ScanOps.generic_scan`), bit for bit:
the KDA backward's combine functions (two exclusive prefix sums in one scan, a pair of sums), both axes, both
directions, and a 1-d scan, on inputs whose sums depend on their order (magnitudes 1e-4 to 1e4 of both signs); a
combine function that branches on its values goes to Triton's scan."""

import os

import numpy as np
import pytest
import torch

import interpreter_speedups
from kimi.ops.registry import tl, triton

pytestmark = pytest.mark.skipif(triton is None or os.environ.get("TRITON_INTERPRET") != "1"
                                or interpreter_speedups.TRITON_GENERIC_SCAN is None,
                                reason="the interpreter's scan, replaced (CPU runs)")

if triton is not None:
    from kimi.ops import kda_bwd_triton as kb

    @triton.jit
    def _scans_kernel(x_ptr, y_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, AXIS: tl.constexpr,
                      REVERSE: tl.constexpr):
        offs = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
        x = tl.load(x_ptr + offs)
        y = tl.load(y_ptr + offs)
        z = tl.zeros([M, N], tl.float32)
        a, pa, b, pb = tl.associative_scan((x, z, y, z), AXIS, kb._excl_combine2, reverse=REVERSE)
        s, t = tl.associative_scan((x, y), AXIS, kb._add2, reverse=REVERSE)
        tl.store(out_ptr + offs, a)
        tl.store(out_ptr + M * N + offs, pa)
        tl.store(out_ptr + 2 * M * N + offs, b)
        tl.store(out_ptr + 3 * M * N + offs, pb)
        tl.store(out_ptr + 4 * M * N + offs, s)
        tl.store(out_ptr + 5 * M * N + offs, t)
        x1 = tl.load(x_ptr + tl.arange(0, N))
        _, p1 = tl.associative_scan((x1, tl.zeros([N], tl.float32)), 0, kb._excl_combine1, reverse=REVERSE)
        tl.store(out_ptr + 6 * M * N + tl.arange(0, N), p1)


    @triton.jit
    def _max_by_branch(a, b):
        if a > b:
            return a
        return b

    @triton.jit
    def _branch_kernel(x_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr):
        offs = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
        tl.store(out_ptr + offs, tl.associative_scan(tl.load(x_ptr + offs), 0, _max_by_branch))


def _scans(x, y, axis, reverse):
    out = torch.zeros(7 * x.numel(), dtype=torch.float32)
    _scans_kernel[(1,)](x, y, out, M=x.shape[0], N=x.shape[1], AXIS=axis, REVERSE=reverse)
    return out


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("reverse", [False, True])
def test_row_scan_equals_the_interpreters(axis, reverse, monkeypatch):
    from triton.runtime import interpreter as ti
    assert ti.ScanOps.generic_scan is interpreter_speedups.row_scan
    x, y = (torch.randn(8, 16) * 10.0 ** torch.empty(8, 16).uniform_(-4, 4) for _ in range(2))
    fast = _scans(x, y, axis, reverse)
    monkeypatch.setattr(ti.ScanOps, "generic_scan", interpreter_speedups.TRITON_GENERIC_SCAN)
    slow = _scans(x, y, axis, reverse)
    assert np.array_equal(fast.numpy(), slow.numpy())
    # and it is the scan asked for: the exclusive prefix sums of x along the axis (after it when reversed)
    x64 = x.double().flip(axis) if reverse else x.double()
    excl = x64.cumsum(axis) - x64
    excl = excl.flip(axis) if reverse else excl
    scale = x64.abs().cumsum(axis).flip(axis) if reverse else x64.abs().cumsum(axis)
    assert ((fast[128:256].view(8, 16).double() - excl).abs() <= 1e-5 * scale).all()


def test_a_branching_combine_goes_to_tritons_scan():
    """A block's truth value would send every row down one branch: such a scan is Triton's own, a running max."""
    x = torch.randn(8, 16)
    out = torch.zeros_like(x)
    _branch_kernel[(1,)](x, out, M=8, N=16)
    assert torch.equal(out, x.cummax(0).values)
