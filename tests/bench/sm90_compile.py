"""Compile the project's Triton kernels for SM90 without a GPU and report what the H200 would run: registers,
spilled bytes, shared memory, wgmma (HGMMA) and mma.sync (HMMA) instructions, cp.async copies and layout
conversions. Launch arguments are specialized as Triton's launcher does (16-byte-aligned pointers and ints
divisible by 16 marked so, ints equal to 1 made constants): without that every gather compiles to 2-byte loads
and the spills come out several times too large.

    python tests/bench/sm90_compile.py indexer sparse-fwd sparse-dq sparse-dkv kda-fwd
    python tests/bench/sm90_compile.py kda-bwd

Needs a Triton with its NVIDIA backend (a Linux wheel; the device's version is 3.6: `pip install triton==3.6.0`
into a separate environment). Registers and spills decide occupancy and show where a launch configuration will
lose time; they are no substitute for timing on the GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kimi.ops import indexer_triton as it  # noqa: E402
from kimi.ops import kda_bwd_triton as kb  # noqa: E402
from kimi.ops import kda_triton as kt  # noqa: E402
from kimi.ops import sparse_mla_triton as sm  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def report(fn, ptrs: dict, scalars: dict, consts: dict, **opts) -> dict:
    """Compile `fn` for sm_90 with pointer dtypes `ptrs`, scalar values `scalars` (specialized by value) and
    constexprs `consts`; returns the resource counts."""
    sig, cx, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name], cx[name] = "constexpr", consts[name]
        elif name in ptrs:
            sig[name], attrs[(i,)] = ptrs[name], [["tt.divisibility", 16]]
        elif isinstance(scalars[name], float):
            sig[name] = "fp32"
        elif scalars[name] == 1:
            sig[name], cx[name] = "constexpr", 1
        else:
            sig[name] = "i32" if abs(scalars[name]) < 2 ** 31 else "i64"
            if scalars[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                       target=GPUTarget("cuda", 90, 64), options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    try:
        usage = subprocess.run([f"{BIN}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return dict(regs=int(re.search(r"REG:(\d+)", usage).group(1)), spill_bytes=int(re.search(r"STACK:(\d+)",
                usage).group(1)), smem=c.metadata.shared, HGMMA=sass.count("HGMMA"), HMMA=sass.count("HMMA"),
                cp_async=sass.count("LDGSTS"), converts=c.asm["ttgir"].count("ttg.convert_layout"))


BF, F32, I32, I64 = "*bf16", "*fp32", "*i32", "*i64"
T, H, K, D, DV = 8192, 96, 2048, 576, 512


def indexer():
    c = it.launch_config(1, T, T, 64, 128, K, causal=True, sms=132, interpret=False)
    ptrs = dict(q_ptr=BF, k_ptr=BF, w_ptr=F32, lo_ptr=I64, hi_ptr=I64, out_ptr=I32, bk_ptr=I32, bp_ptr=I32,
                bn_ptr=I32)
    cap = it._capacity(K, c.block_k, T, c.capacity)
    scalars = dict(B=1, T=T, S=T, H=64, D=128, K=K, NTB=T // c.block_q, NSPLIT=1, SPLIT=T, CAP=cap,
                   SLACK=it._slack(cap, K, c.block_k))
    for v in (c._replace(histogram=False, scan_counts=False), c._replace(scan_counts=False), c,
              c._replace(histogram_compactions=True, move_stages=3)):
        consts = dict(BM=v.block_q, BN=v.block_k, HP=64, DP=128, CH=v.chunk, NB=v.histogram_bins,
                      HIST=v.histogram, HIST_COMPACT=v.histogram_compactions, CAUSAL=True, SPLIT_OUT=False,
                      MS=v.move_stages, SCAN_COUNT=v.scan_counts, PREC=None, UPCAST=False, PAD_HEADS=False)
        yield f"indexer {v}", report(it._indexer_stream_kernel, ptrs, scalars, consts, num_warps=c.num_warps,
                                     num_stages=c.num_stages)


def sparse_fwd():
    import torch
    cfg = sm.fwd_config(1, T, H, K, D, DV, torch.device("cpu"))
    ptrs = dict(q_ptr=BF, lat_ptr=BF, idx_ptr=I32, o_ptr=BF, lse_ptr=F32)
    scalars = dict(R=T, T=T, S=T, H=H, K=K, D=D, DV=DV, h_start=0, NT=len(cfg.heads), NS=1, KS=K, scale2=0.1)
    consts = dict(BH=cfg.heads[0], BK=cfg.block_k, BV=DV // cfg.split_v, NV=cfg.split_v, DTP=64, IB=256, F32=False)
    kernel = sm._fwd_kernel_sm if cfg.slot_major else sm._fwd_kernel
    yield f"sparse forward {cfg}", report(kernel, ptrs, scalars, consts, num_warps=cfg.num_warps,
                                          num_stages=cfg.num_stages)


def _bwd():
    import torch
    return sm.bwd_config(1, T, H, K, D, DV, torch.device("cpu"))


def sparse_dq():
    cfg = _bwd()
    ptrs = dict(q_ptr=BF, lat_ptr=BF, idx_ptr=I32, o_ptr=BF, lse_ptr=F32, do_ptr=BF, dlse_ptr=F32, dq_ptr=BF,
                delta_ptr=F32, dlat_ptr=F32, pds_ptr=BF)
    scalars = dict(row0=0, T=T, S=T, H=H, K=K, D=D, DV=DV, h_start=0, NT=len(cfg.heads), scale=0.1, scale2=0.1)
    consts = dict(BH=cfg.heads[0], BK=cfg.block_k, DVP=DV, DTP=64, IB=256, HAS_DLSE=False, FUSED=cfg.fused_dkv,
                  PDS=cfg.dkv_gemm and not cfg.fused_dkv,
                  DQ=not (cfg.dkv_gemm and cfg.gemm_cols and cfg.gemm_cols_dq), F32=False)
    kernel = sm._bwd_dq_kernel_sm if cfg.slot_major else sm._bwd_dq_kernel
    yield f"sparse dq {cfg}", report(kernel, ptrs, scalars, consts, num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages)


def sparse_dkv():
    cfg = _bwd()
    ptrs = dict(q_ptr=BF, lat_ptr=BF, idx_ptr=I32, lse_ptr=F32, do_ptr=BF, delta_ptr=F32, out_ptr=F32)
    scalars = dict(row0=0, NKB=K // cfg.dkv_block_k, T=T, S=T, H=H, K=K, D=D, DV=DV, scale=0.1, scale2=0.1)
    consts = dict(BK=cfg.dkv_block_k, BH=cfg.dkv_block_h, DVP=DV, DTP=64, ATOMIC=True, F32=False)
    kernel = sm._bwd_dkv_kernel_sm if cfg.dkv_slot_major else sm._bwd_dkv_kernel
    warps = dict(num_warps=cfg.dkv_num_warps or cfg.num_warps, num_stages=cfg.dkv_num_stages or cfg.num_stages)
    yield f"sparse dlatent (recomputing) {cfg}", report(kernel, ptrs, scalars, consts, **warps)
    # `dkv_gemm`: [ds | p]·[q; do] over the value columns, ds·q over the tail
    ptrs = dict(pds_ptr=BF, q_ptr=BF, do_ptr=BF, idx_ptr=I32, out_ptr=F32)
    for c_lo, c_hi, bn, J in ((0, DV, cfg.gemm_block_n, 2 * H), (DV, D, min(cfg.gemm_block_n, 64), H)):
        scalars = dict(row0=0, NKB=K // cfg.gemm_block_k, NCB=(c_hi - c_lo) // bn, c_lo=c_lo, c_hi=c_hi, J=J, T=T,
                       S=T, H=H, K=K, D=D, DV=DV)
        consts = dict(BK=cfg.gemm_block_k, BN=bn, BJ=cfg.gemm_block_j, ATOMIC=True, F32=False)
        yield f"sparse dlatent GEMM, columns {c_lo}..{c_hi}", report(sm._bwd_dkv_gemm_kernel, ptrs, scalars, consts,
                                                                     **warps)
    # `gemm_cols` / `gemm_cols_dq`: a slot block's ds, p held, the columns walked (without and with dq's atomics)
    ptrs = dict(pds_ptr=BF, q_ptr=BF, do_ptr=BF, lat_ptr=BF, idx_ptr=I32, out_ptr=F32, dq_ptr=F32)
    scalars = dict(row0=0, NKB=K // cfg.gemm_block_k, T=T, S=T, H=H, K=K, D=D, DV=DV)
    for dq in (False, True):
        consts = dict(BK=cfg.gemm_block_k, BN=cfg.gemm_block_n, BT=min(cfg.gemm_block_n, 64), HP=128, DQ=dq,
                      ATOMIC=True, F32=False)
        yield f"sparse dlatent GEMM walking the columns{' + dq atomics' if dq else ''}", report(
            sm._bwd_dkv_gemm_cols_kernel, ptrs, scalars, consts, **warps)


KDA_N, KDA_C, KDA_D = T // 64, 64, 128     # K3's chunked KDA: chunks of 64, K = V = 128


def _kda_prec(name):
    prec = {w.upper(): kt.PRECISION[w] if name == "bf16" else "ieee" for w in ("pair", "solve", "state")}
    return prec, dict(DT=getattr(triton.language, "bfloat16" if name == "bf16" else "float32"), EMULATE=False)


def _kda_intra(name, sc, inverse):
    """`_intra3_kernel` for `name` inputs ("bf16", "fp32") with scratch `sc`, (I+L)^-1 stored or not."""
    x = BF if name == "bf16" else F32
    prec, common = _kda_prec(name)
    c = kt.intra3_config(KDA_C, KDA_D, KDA_D, ieee=name == "fp32")
    ptrs = dict(q_ptr=x, k_ptr=x, v_ptr=x, g_ptr=F32, beta_ptr=F32, reset_ptr=I32, w_ptr=sc, u_ptr=F32,
                qd_ptr=sc, kd_ptr=sc, A_ptr=F32, d_ptr=F32, M_ptr=F32)
    consts = dict(C=KDA_C, BC=kt.SUB_CHUNK, HAS_RESET=True, LOG_BC=4, LEVELS=6, INVERSE=inverse, BK=c["BK"],
                  BKW=c["BKW"], BV=c["BV"], PAIR=prec["PAIR"], SOLVE=prec["SOLVE"], **common)
    label = f"kda intra {name}{', (I+L)^-1' if inverse else ''}, scratch {sc[1:]} {c}"
    return label, report(kt._intra3_kernel, ptrs, dict(T=T, H=H, K=KDA_D, V=KDA_D, N=KDA_N, scale=0.1), consts,
                         num_warps=c["num_warps"], num_stages=c["num_stages"])


def _kda_state(name, sc, block_v):
    """`_state_kernel` for `name` inputs storing S_n and U_n, w / k~ / S_n in `sc`, `block_v` state columns."""
    prec, common = _kda_prec(name)
    c = kt.state_config(KDA_D, KDA_D, ieee=name == "fp32", block_v=block_v)
    ptrs = dict(w_ptr=sc, u_ptr=F32, kd_ptr=sc, d_ptr=F32, s0_ptr=F32, sN_ptr=F32, h_ptr=sc)
    consts = dict(C=KDA_C, BK=c["BK"], BV=c["BV"], S0=1, HAS_U=True, STORE=True, STATE=prec["STATE"], **common)
    return f"kda state pass (S_n, U_n) {name}, w/k~/S_n {sc[1:]} {c}", report(
        kt._state_kernel, ptrs, dict(K=KDA_D, V=KDA_D, N=KDA_N), consts, num_warps=c["num_warps"],
        num_stages=c["num_stages"])


def kda_fwd():
    """The chunked KDA forward at K = V = 128, C = 64 (T = 8192, H = 96), bf16 (bf16 scratch, `kt.V3`) and fp32:
    `_intra3_kernel`, the split `_strips3_kernel` / `_solve3_kernel`, the state pass and `_output_kernel`."""
    N, C, KD = KDA_N, KDA_C, KDA_D
    scalars = dict(T=T, H=H, K=KD, V=KD, N=N, scale=0.1)
    for name in ("bf16", "fp32"):
        x = BF if name == "bf16" else F32
        sc = BF if name == "bf16" else F32
        prec, common = _kda_prec(name)
        yield _kda_intra(name, sc, inverse=False)
        c = kt.intra3_config(C, KD, KD, ieee=name == "fp32")
        blocks = dict(C=C, BC=kt.SUB_CHUNK, HAS_RESET=True, SOLVE=prec["SOLVE"], **common)
        sp = dict(q_ptr=x, k_ptr=x, g_ptr=F32, beta_ptr=F32, reset_ptr=I32, A_ptr=F32, M_ptr=F32)
        yield f"kda strips {name} BK={c['BK']} warps=4", report(
            kt._strips3_kernel, sp, {n: scalars[n] for n in ("T", "H", "K", "N", "scale")},
            dict(BK=c["BK"], DIAG=True, PAIR=prec["PAIR"], **blocks), num_warps=4, num_stages=c["num_stages"])
        ptrs = dict(q_ptr=x, k_ptr=x, v_ptr=x, g_ptr=F32, beta_ptr=F32, reset_ptr=I32, w_ptr=sc, u_ptr=F32,
                    qd_ptr=sc, kd_ptr=sc, d_ptr=F32, M_ptr=F32)
        yield f"kda solve {name}, scratch {sc[1:]} BK={c['BKW']} BV={c['BV']} warps={c['num_warps']}", report(
            kt._solve3_kernel, ptrs, scalars, dict(BK=c["BKW"], BV=c["BV"], LOG_BC=4, LEVELS=6, INVERSE=False,
                                                   **blocks), num_warps=c["num_warps"], num_stages=c["num_stages"])
        yield _kda_state(name, sc, kt.V3["state_block"] if name == "bf16" else None)
        c = kt.output_config(KD, KD, ieee=name == "fp32")
        yield f"kda output {name}, q~/S_n {sc[1:]} {c}", report(
            kt._output_kernel, dict(qd_ptr=sc, A_ptr=F32, U_ptr=F32, h_ptr=sc, o_ptr=x),
            dict(T=T, H=H, K=KD, V=KD, N=N), dict(C=C, BK=c["BK"], BV=c["BV"], STATE=prec["STATE"],
                                                  QS="16" if name == "bf16" else "", **common),
            num_warps=c["num_warps"], num_stages=c["num_stages"])


def kda_bwd():
    """The chunked KDA backward at K = V = 128, C = 64, bf16 and fp32: the recompute (`_intra3_kernel` with
    (I+L)^-1, fp32 scratch), the state pass storing S_n and U_n, the reverse pass (`_state_bwd_kernel`), and
    kda_bwd_triton's `_bwd_dav_kernel` and `_bwd_dqkg_kernel`."""
    N, C, KD = KDA_N, KDA_C, KDA_D
    for name in ("bf16", "fp32"):
        x = BF if name == "bf16" else F32
        prec, common = _kda_prec(name)
        yield _kda_intra(name, F32, inverse=True)
        yield _kda_state(name, F32, kt.V3["state_block"] if name == "bf16" else None)
        c = kt.state_config(KD, KD, ieee=name == "fp32")
        ptrs = dict(qd_ptr=F32, kd_ptr=F32, w_ptr=F32, A_ptr=F32, d_ptr=F32, do_ptr=x, dsN_ptr=F32, dh_ptr=F32,
                    dU_ptr=F32, dh0_ptr=F32)
        consts = dict(C=C, BK=c["BK"], BV=c["BV"], HAS_DSN=True, HAS_DH0=True, STATE=prec["STATE"], **common)
        yield f"kda reverse state pass {name} {c}", report(
            kt._state_bwd_kernel, ptrs, dict(T=T, H=H, K=KD, V=KD, N=N), consts, num_warps=c["num_warps"],
            num_stages=c["num_stages"])
        pair = BF if prec["PAIR"] == "16" else F32
        c = kb.dav_config(C, KD, ieee=name == "fp32")
        ptrs = dict(v_ptr=x, beta_ptr=F32, reset_ptr=I32, M_ptr=F32, U_ptr=F32, dU_ptr=F32, do_ptr=x, dA_ptr=pair,
                    dL_ptr=pair, dAd_ptr=F32, dbv_ptr=F32, dv_ptr=x)
        consts = dict(C=C, BV=c["BV"], HAS_RESET=True, SOLVE=prec["SOLVE"], STATE=prec["STATE"], **common)
        yield f"kda bwd dAqk/dL/dv {name} {c}", report(kb._bwd_dav_kernel, ptrs, dict(T=T, H=H, V=KD, N=N, scale=0.1),
                                                       consts, num_warps=c["num_warps"], num_stages=c["num_stages"])
        c = kb.dqkg_config(C, KD, KD, ieee=name == "fp32")
        ptrs = dict(q_ptr=x, k_ptr=x, g_ptr=F32, beta_ptr=F32, reset_ptr=I32, M_ptr=F32, U_ptr=F32, h_ptr=F32,
                    dh_ptr=F32, dU_ptr=F32, do_ptr=x, dA_ptr=pair, dL_ptr=pair, dAd_ptr=F32, dq_ptr=x, dk_ptr=x,
                    dg_ptr=F32, dbk_ptr=F32)
        consts = dict(C=C, BC=kt.SUB_CHUNK, BK=c["BK"], BV=c["BV"], HAS_RESET=True, **prec, **common)
        yield f"kda bwd dq/dk/dg {name} {c}", report(kb._bwd_dqkg_kernel, ptrs,
                                                     dict(T=T, H=H, K=KD, V=KD, N=N, scale=0.1), consts,
                                                     num_warps=c["num_warps"], num_stages=c["num_stages"])


KERNELS = {"indexer": indexer, "sparse-fwd": sparse_fwd, "sparse-dq": sparse_dq, "sparse-dkv": sparse_dkv,
           "kda-fwd": kda_fwd, "kda-bwd": kda_bwd}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernels", nargs="*", help=f"of {list(KERNELS)} (default: all)")
    a = ap.parse_args()
    unknown = set(a.kernels) - set(KERNELS)
    if unknown:
        ap.error(f"unknown kernels {sorted(unknown)}: choose from {list(KERNELS)}")
    print(f"triton {triton.__version__}, sm_90, T = {T:,}\n| launch | regs | spill B | smem | HGMMA | HMMA | "
          "cp.async | converts |\n|---|---|---|---|---|---|---|---|")
    for name in a.kernels or KERNELS:
        for what, r in KERNELS[name]():
            print(f"| {what} | {r['regs']} | {r['spill_bytes']} | {r['smem']} | {r['HGMMA']} | {r['HMMA']} | "
                  f"{r['cp_async']} | {r['converts']} |", flush=True)


if __name__ == "__main__":
    main()
