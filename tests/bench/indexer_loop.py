"""The indexer's scoring loop alone, in variants, to find what bounds it (no selection: the keys that would be
taken are counted, not kept). Each variant runs the prefill's causal loop of `kimi/ops/indexer_triton.py` over
T queries (64 heads × 128, bf16, B = 1): a persistent grid, query blocks of 4 longest first, keys ascending up to
the block's last query.

    PYTHONPATH=. python tests/bench/indexer_loop.py --tokens 65536 8192

Modes, each adding work to the one before: `dot` chains the dots into one accumulator (the tensor cores and the
key loads alone); `sum` takes each block's ReLU, head weights and sum over heads into a running max; `keep`
turns the scores into order keys and tests them against a threshold no key passes, with the prefix sum and the
masked stores of an append (the production loop when nothing is taken); `branch` the same with the append under
a test for any key taken; `window` tests each dot's scores in the layout the head sum leaves them and stores
the keys that pass at their position in a per-query window (no prefix sum); `dense` stores every key (FLOOR
where not taken: one layout change a dot instead of two); `any` stores only after a CTA-wide test that some key
of the block passes. Shapes: `halves` two dots of 2 queries a key block (the default), `one` one dot of 4
queries, `quarters` four dots of 1 query; `bn` keys a block; `tma` key tiles by tensor descriptors instead of
pointer loads. TFLOP/s count the causal half, 2·n·d·T²/2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kimi.ops.registry import sm_count, tl, triton  # noqa: E402
from sparse_kernels import measure  # noqa: E402

NI, DI = 64, 128
MODES = {"dot": 0, "sum": 1, "keep": 2, "branch": 3, "window": 4, "dense": 5, "any": 6}


@triton.jit
def _keys(k_ptr, kdesc, s0, T, cn, dd, TMA: tl.constexpr):
    if TMA:
        return kdesc.load([s0, 0])
    s = s0 + cn
    return tl.load(k_ptr + s[:, None].to(tl.int64) * 128 + dd[None, :], mask=s[:, None] < T, other=0.0)


@triton.jit
def _q_operand(q_ptr, w_ptr, t0, T, NQ: tl.constexpr):
    ch = tl.arange(0, NQ * 64)
    dd = tl.arange(0, 128)
    r = tl.minimum(t0 + ch // 64, T - 1).to(tl.int64)
    q = tl.load(q_ptr + ((r * 64 + ch % 64) * 128)[None, :] + dd[:, None])
    w = tl.load(w_ptr + r * 64 + ch % 64)
    return q, w


@triton.jit
def _scores(kt, q, w, BN: tl.constexpr, NQ: tl.constexpr):
    x = tl.dot(kt, q)
    x = tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]
    return tl.sum(tl.reshape(x, [BN, NQ, 64]), axis=2)            # [BN, NQ]


@triton.jit
def _window_take(kt, q, w, thr_ptr, win, s0, t0, cn, BN: tl.constexpr, NQ: tl.constexpr, MODE: tl.constexpr):
    sc = _scores(kt, q, w, BN, NQ)                                # [BN, NQ]
    bits = sc.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    qq = tl.arange(0, NQ)
    thr = tl.load(thr_ptr + qq)
    s = s0 + cn
    keep = (s[:, None] < t0 + qq[None, :] + 1) & (key > thr[None, :])
    ptr = win + qq[None, :] * 8192 + (s % 8192)[:, None]
    if MODE == 5:
        tl.store(ptr, tl.where(keep, key, -2147483648))
    elif MODE == 6:
        if tl.max(keep.to(tl.int32)) > 0:
            tl.store(ptr, key, mask=keep)
    else:
        tl.store(ptr, key, mask=keep)


@triton.jit
def _loop_kernel(q_ptr, k_ptr, w_ptr, thr_ptr, out_ptr, buf_ptr, kdesc, T, NTB, BN: tl.constexpr,
                 NQ: tl.constexpr, MODE: tl.constexpr, TMA: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cn = tl.arange(0, BN)
    dd = tl.arange(0, 128)
    rm = tl.arange(0, 4)
    task = pid
    while task < NTB:
        t0 = (NTB - 1 - task) * 4
        hi = t0 + 4
        rows = t0 + rm
        thr = tl.load(thr_ptr + rm)
        kb = (buf_ptr + pid.to(tl.int64) * 4 * 8192 + rm * 8192)[:, None]
        cnt = tl.zeros([4], tl.int32)
        if NQ == 4:
            q0, w0 = _q_operand(q_ptr, w_ptr, t0, T, 4)
        elif NQ == 2:
            q0, w0 = _q_operand(q_ptr, w_ptr, t0, T, 2)
            q1, w1 = _q_operand(q_ptr, w_ptr, t0 + 2, T, 2)
        else:
            q0, w0 = _q_operand(q_ptr, w_ptr, t0, T, 1)
            q1, w1 = _q_operand(q_ptr, w_ptr, t0 + 1, T, 1)
            q2, w2 = _q_operand(q_ptr, w_ptr, t0 + 2, T, 1)
            q3, w3 = _q_operand(q_ptr, w_ptr, t0 + 3, T, 1)
        if MODE >= 4:
            win = buf_ptr + pid.to(tl.int64) * 4 * 8192
            for s0 in range(0, hi, BN):
                kt = _keys(k_ptr, kdesc, s0, T, cn, dd, TMA)
                if NQ == 4:
                    _window_take(kt, q0, w0, thr_ptr, win, s0, t0, cn, BN, 4, MODE)
                else:
                    _window_take(kt, q0, w0, thr_ptr, win, s0, t0, cn, BN, 2, MODE)
                    _window_take(kt, q1, w1, thr_ptr, win + 2 * 8192, s0, t0 + 2, cn, BN, 2, MODE)
            tl.store(out_ptr + pid * 4 + rm, tl.zeros([4], tl.float32))
        elif MODE == 0:
            acc = tl.zeros([BN, NQ * 64], tl.float32)
            for s0 in range(0, hi, BN):
                kt = _keys(k_ptr, kdesc, s0, T, cn, dd, TMA)
                acc = tl.dot(kt, q0, acc)
                if NQ <= 2:
                    acc = tl.dot(kt, q1, acc)
                if NQ == 1:
                    acc = tl.dot(kt, q2, acc)
                    acc = tl.dot(kt, q3, acc)
            tl.store(out_ptr + pid * 4 + rm, tl.zeros([4], tl.float32) + tl.sum(acc), mask=rm < 1)
        else:
            run = tl.full([4, BN], float("-inf"), tl.float32)
            for s0 in range(0, hi, BN):
                kt = _keys(k_ptr, kdesc, s0, T, cn, dd, TMA)
                if NQ == 4:
                    sc = tl.trans(_scores(kt, q0, w0, BN, 4))
                elif NQ == 2:
                    sa = _scores(kt, q0, w0, BN, 2)
                    sb = _scores(kt, q1, w1, BN, 2)
                    sc = tl.reshape(tl.permute(tl.join(sa, sb), (2, 0, 1)), [4, BN])
                else:
                    s01 = tl.join(_scores(kt, q0, w0, BN, 1), _scores(kt, q1, w1, BN, 1))
                    s23 = tl.join(_scores(kt, q2, w2, BN, 1), _scores(kt, q3, w3, BN, 1))
                    sc = tl.reshape(tl.permute(tl.join(s01, s23), (3, 2, 0, 1)), [4, BN])
                if MODE == 1:
                    run = tl.maximum(run, sc)
                else:
                    bits = sc.to(tl.int32, bitcast=True)
                    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
                    s = s0 + cn
                    keep = (s[None, :] < rows[:, None] + 1) & (key > thr[:, None])
                    if MODE == 3:
                        if tl.max(keep.to(tl.int32)) > 0:
                            ki = keep.to(tl.int32)
                            csum = tl.cumsum(ki, axis=1)
                            tl.store(kb + cnt[:, None] + csum - ki, key, mask=keep)
                            cnt += tl.max(csum, axis=1)
                    else:
                        ki = keep.to(tl.int32)
                        csum = tl.cumsum(ki, axis=1)
                        tl.store(kb + cnt[:, None] + csum - ki, key, mask=keep)
                        cnt += tl.max(csum, axis=1)
            if MODE == 1:
                tl.store(out_ptr + pid * 4 + rm, tl.max(run, axis=1))
            else:
                tl.store(out_ptr + pid * 4 + rm, cnt.to(tl.float32))
        task += nprog


VARIANTS = {                  # name: (mode, NQ, BN, TMA, warps, stages, programs an SM)
    "dot halves": ("dot", 2, 64, False, 4, 3, 2),
    "sum halves": ("sum", 2, 64, False, 4, 3, 2),
    "keep halves": ("keep", 2, 64, False, 4, 3, 2),
    "branch halves": ("branch", 2, 64, False, 4, 3, 2),
    "keep halves tma": ("keep", 2, 64, True, 4, 3, 2),
    "branch halves tma": ("branch", 2, 64, True, 4, 3, 2),
    "window halves": ("window", 2, 64, False, 4, 3, 2),
    "window halves tma": ("window", 2, 64, True, 4, 3, 2),
    "window one": ("window", 4, 64, False, 4, 3, 2),
    "dense halves": ("dense", 2, 64, False, 4, 3, 2),
    "dense halves tma": ("dense", 2, 64, True, 4, 3, 2),
    "any halves": ("any", 2, 64, False, 4, 3, 2),
    "any halves tma": ("any", 2, 64, True, 4, 3, 2),
    "any one": ("any", 4, 64, False, 4, 3, 2),
    "window halves bn128 w8": ("window", 2, 128, False, 8, 3, 1),
    "dot one": ("dot", 4, 64, False, 4, 3, 2),
    "keep one": ("keep", 4, 64, False, 4, 3, 2),
    "dot quarters bn128": ("dot", 1, 128, False, 4, 2, 2),
    "keep quarters bn128": ("keep", 1, 128, False, 4, 2, 2),
    "branch quarters bn128": ("branch", 1, 128, False, 4, 2, 2),
    "branch quarters bn128 tma": ("branch", 1, 128, True, 4, 2, 2),
    "keep halves bn128 w8": ("keep", 2, 128, False, 8, 3, 1),
    "branch halves bn128 w8 tma": ("branch", 2, 128, True, 8, 3, 1),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="*", default=[65536, 8192])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    a = ap.parse_args()
    dev = torch.device("cuda")
    sms = sm_count(dev)
    from triton.tools.tensor_descriptor import TensorDescriptor

    def alloc(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8, device=dev)
    triton.set_allocator(alloc)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    for T in a.tokens:
        q = torch.randn(T, NI, DI, device=dev).bfloat16()
        k = torch.randn(T, DI, device=dev).bfloat16()
        w = torch.randn(T, NI, device=dev) * (NI ** -0.5 * DI ** -0.5)
        thr = torch.full((4,), 2 ** 31 - 1, dtype=torch.int32, device=dev)
        flops = 2 * NI * DI * T * T / 2
        print(f"\nT = {T:,} ({flops / 1e12:.2f} TFLOP on the causal half)", flush=True)
        print("| variant | ms | TFLOP/s | regs | spills | smem KiB |", flush=True)
        print("|---|---|---|---|---|---|", flush=True)
        for name in a.variants:
            mode, nq, bn, tma, warps, stages, per_sm = VARIANTS[name]
            programs = min(T // 4, per_sm * sms)
            out = torch.empty(programs * 4, device=dev)
            buf = torch.empty(programs * 4 * 8192, dtype=torch.int32, device=dev)
            desc = TensorDescriptor.from_tensor(k, [bn, DI]) if tma else k

            def run():
                return _loop_kernel[(programs,)](q, k, w, thr, out, buf, desc, T, T // 4, BN=bn, NQ=nq,
                                                 MODE=MODES[mode], TMA=tma, num_warps=warps, num_stages=stages)
            try:
                kern = run()
                ms = measure(run, a.iters)[0]
                print(f"| {name} | {ms:.2f} | {flops / ms / 1e9:.0f} | {kern.n_regs} | {kern.n_spills} | "
                      f"{kern.metadata.shared // 1024} |", flush=True)
            except Exception as e:   # a variant that does not compile or fit: report it, go on
                print(f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:150]} | | | | |", flush=True)


if __name__ == "__main__":
    main()
