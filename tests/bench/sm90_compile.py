"""Compile the project's Triton kernels for SM90 without a GPU and report what the H200 would run: registers,
spilled bytes, shared memory, wgmma (HGMMA) instructions and the waits on them (one a wgmma where ptxas
serialized them), mma.sync (HMMA) instructions, cp.async copies, layout conversions, barriers (BAR.SYNC) and SASS
instructions. Launch arguments are specialized as Triton's launcher does (16-byte-aligned pointers and ints
divisible by 16 marked so, ints equal to 1 made constants): without that every gather compiles to 2-byte loads and
the spills come out several times too large.

    python tests/bench/sm90_compile.py indexer indexer-select sparse-fwd sparse-dq sparse-dkv kda-fwd
    python tests/bench/sm90_compile.py kda-bwd kda-decode
    python tests/bench/sm90_compile.py kda-fwd --v3 strip_warps=4      # under other kda_triton.V3 options

Needs a Triton with its NVIDIA backend (a Linux wheel; the device's version is 3.6: `pip install triton==3.6.0`
into a separate environment). Registers and spills decide occupancy and show where a launch configuration will
lose time; they are no substitute for timing on the GPU.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kimi.ops import indexer_triton as it  # noqa: E402
from kimi.ops import kda_bwd_triton as kb  # noqa: E402
from kimi.ops import kda_decode_triton as kd  # noqa: E402
from kimi.ops import kda_triton as kt  # noqa: E402
from kimi.ops import sparse_mla_triton as sm  # noqa: E402
from kda import parse_v3  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def report(fn, ptrs: dict, scalars: dict, consts: dict, **opts) -> dict:
    """Compile `fn` for sm_90 with pointer dtypes `ptrs`, scalar values `scalars` (specialized by value) and
    constexprs `consts` (arguments named in none of them at their defaults); returns the resource counts."""
    sig, cx, attrs = {}, {}, {}
    defaults = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items() if p.default is not p.empty}
    for i, name in enumerate(fn.arg_names):
        if name not in consts and name not in ptrs and name not in scalars and name in defaults:
            sig[name], cx[name] = "constexpr", defaults[name]   # an argument left at its default
        elif name in consts:
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
                usage).group(1)), smem=c.metadata.shared, HGMMA=sass.count("HGMMA"),
                wgmma_waits=sass.count("WARPGROUP.DEPBAR"), HMMA=sass.count("HMMA"),
                cp_async=sass.count("LDGSTS"), converts=c.asm["ttgir"].count("ttg.convert_layout"),
                barriers=len(re.findall(r"\bBAR\.SYNC", sass)),
                instructions=len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M)))


BF, F32, I32, I64 = "*bf16", "*fp32", "*i32", "*i64"
T, H, K, D, DV = 8192, 96, 2048, 576, 512


def indexer():
    c = it.launch_config(1, T, T, 64, 128, K, causal=True, sms=132, interpret=False)
    ptrs = dict(q_ptr=BF, k_ptr=BF, w_ptr=F32, lo_ptr=I64, hi_ptr=I64, out_ptr=I32, bk_ptr=I32, bp_ptr=I32,
                bn_ptr=I32, next_ptr=I32)
    cap = it._capacity(K, c.block_k, T, c.capacity)
    scalars = dict(B=1, T=T, S=T, H=64, D=128, K=K, NTB=T // c.block_q, NSPLIT=1, SPLIT=T, CAP=cap,
                   SLACK=it._slack(cap, K, c.block_k))
    one_dot = c._replace(halves=False, order="cyclic", num_stages=2)       # the launch before `halves`
    for v in (one_dot._replace(histogram=False, scan_counts=False), one_dot, c, one_dot._replace(num_warps=8),
              one_dot._replace(num_warps=8, num_stages=3, overlap=True)):
        flags = it._stream_flags(v, 64, 128, None, False, False)
        opts = {o: flags.pop(o) for o in ("num_warps", "num_stages", "maxnreg") if o in flags}
        consts = dict(flags, CAUSAL=True, SPLIT_OUT=False, ORDER=it.TASK_ORDERS[v.order])
        yield f"indexer {v}", report(it._indexer_stream_kernel, ptrs, scalars, consts, **opts)


def indexer_select():
    """The causal prefill's default, scores then selection, at S = 8,192 (rows in registers) and 65,536 (sampled):
    the scores kernel and the selection kernel as `_scores_then_select` launches them."""
    for S in (8192, 65536):
        c = it.launch_config(1, S, S, 64, 128, K, causal=True, sms=132, interpret=False)
        cap = max(it._select_capacity(K, c.sample, S), K)
        scalars = dict(T=S, S=S, H=64, D=128, K=K, C0=c.select_rows, CT=c.select_rows, WS=S, SPLIT=c.key_split,
                       ROWS=c.select_rows)
        consts = dict(BM=c.block_q, BN=c.block_k, HP=64, DP=128, CAUSAL=True, HALVES=True, PREC=None, UPCAST=False,
                      PAD_HEADS=False, ALIGN=c.select_align)
        yield f"indexer scores, S = {S:,}", report(
            it._indexer_scores_kernel, dict(q_ptr=BF, k_ptr=BF, w_ptr=F32, lo_ptr=I64, hi_ptr=I64, ws_ptr=I32),
            scalars, consts, num_warps=c.num_warps, num_stages=c.num_stages)
        flags = it._select_flags(c, cap)
        opts = {o: flags.pop(o) for o in ("num_warps", "maxnreg") if o in flags}
        yield f"indexer selection, S = {S:,} ({c.select_rows} rows a chunk)", report(
            it._indexer_select_kernel, dict(ws_ptr=I32, lo_ptr=I64, hi_ptr=I64, out_ptr=I32, pb_ptr=I32), scalars,
            flags, **opts)


def sparse_fwd():
    import torch
    cfg = sm.fwd_config(1, T, H, K, D, DV, torch.device("cpu"))
    ptrs = dict(q_ptr=BF, lat_ptr=BF, idx_ptr=I32, o_ptr=BF, lse_ptr=F32)
    scalars = dict(R=T, T=T, S=T, H=H, K=K, D=D, DV=DV, h_start=0, NT=len(cfg.heads), NS=1, KS=K, scale2=0.1)
    for lazy, off64 in ((cfg.lazy_rescale, False), (cfg.lazy_rescale, True), (not cfg.lazy_rescale, False)):
        consts = dict(BH=cfg.heads[0], BK=cfg.block_k, BV=DV, NC=cfg.value_chunks, DTP=64, IB=256, F32=False,
                      LAZY=lazy, FULL=True, OFF64=off64)
        yield f"sparse forward {cfg}, lazy_rescale={lazy}, 64-bit offsets {off64}", report(
            sm._fwd_chunks_kernel, ptrs, scalars, consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _bwd():
    import torch
    return sm.bwd_config(1, T, H, K, D, DV, torch.device("cpu"))


def _bwd_dq_path():
    """The default launch, or where it runs `_bwd_pds_kernel` and the dq GEMM (reported by sparse-dkv), the tiles
    the dq kernels and the dlatent GEMM had as the default before."""
    import dataclasses
    cfg = _bwd()
    if cfg.pds_all_heads:
        cfg = dataclasses.replace(cfg, block_k=64, num_warps=4, num_stages=2, pds_all_heads=False, gemm_dq=False,
                                  gemm_block_k=128, dkv_num_warps=None, dkv_num_stages=None)
    return cfg


def sparse_dq():
    cfg = _bwd_dq_path()
    ptrs = dict(q_ptr=BF, lat_ptr=BF, idx_ptr=I32, o_ptr=BF, lse_ptr=F32, do_ptr=BF, dlse_ptr=F32, dq_ptr=BF,
                delta_ptr=F32, pds_ptr=BF)
    scalars = dict(row0=0, T=T, S=T, H=H, K=K, D=D, DV=DV, h_start=0, NT=len(cfg.heads), scale=0.1, scale2=0.1)
    consts = dict(BH=cfg.heads[0], BK=cfg.block_k, DVP=DV, DTP=64, IB=256, HAS_DLSE=False, PDS=cfg.dkv_gemm, DQ=True,
                  F32=False)
    kernel = sm._bwd_dq_kernel_sm if cfg.slot_major else sm._bwd_dq_kernel
    yield f"sparse dq {cfg}", report(kernel, ptrs, scalars, consts, num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages)
    # `gemm_dq`: the same kernel storing ds and p only (dq from the GEMM); 32-head tiles, and the 64 of 64 + 32
    for bh, st in ((32, cfg.num_stages), (64, 1)):
        yield f"sparse ds, p only (gemm_dq), {bh} heads, {st} stages", report(
            kernel, ptrs, scalars, dict(consts, BH=bh, PDS=True, DQ=False), num_warps=cfg.num_warps, num_stages=st)


def sparse_dkv():
    cfg = _bwd_dq_path()
    ptrs = dict(q_ptr=BF, lat_ptr=BF, idx_ptr=I32, lse_ptr=F32, do_ptr=BF, delta_ptr=F32, out_ptr=F32)
    scalars = dict(row0=0, NKB=K // cfg.dkv_block_k, T=T, S=T, H=H, K=K, D=D, DV=DV, scale=0.1, scale2=0.1)
    consts = dict(BK=cfg.dkv_block_k, BH=cfg.dkv_block_h, DVP=DV, DTP=64, ATOMIC=True, F32=False)
    kernel = sm._bwd_dkv_kernel
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
    # `gemm_dq`: a column block walking the slots, dlatent and dq from ds, p (the dq kernel without its dq: DQ=False)
    ptrs = dict(pds_ptr=BF, q_ptr=BF, do_ptr=BF, lat_ptr=BF, idx_ptr=I32, out_ptr=F32, dq_ptr=BF)
    ha, hb = sm._head_groups(H)
    for bk, bn, ns, w, st, dlat in ((64, 64, 1, 4, 2, True), (64, 128, 1, 8, 2, True), (64, 64, 1, 4, 2, False),
                                    (64, 64, 3, 4, 2, False)):
        scalars = dict(row0=0, NCB=-(-D // (bn * ns)), T=T, S=T, H=H, K=K, D=D, DV=DV)
        consts = dict(BK=bk, BN=bn, NSUB=ns, HA=ha, HB=hb, IB=256, DLAT=dlat, ATOMIC=True, F32=False)
        yield f"sparse {'dlatent + ' if dlat else ''}dq GEMM, {bk} slots x {ns} x {bn} columns, {w} warps", report(
            sm._bwd_dkv_dq_gemm_kernel, ptrs, scalars, consts, num_warps=w, num_stages=st)
    # `pds_all_heads`: ds and p of all heads of a query, the columns streamed (`pds_dlat`: dlatent there too)
    ptrs = dict(q_ptr=BF, lat_ptr=BF, idx_ptr=I32, o_ptr=BF, lse_ptr=F32, do_ptr=BF, dlse_ptr=F32, pds_ptr=BF,
                out_ptr=F32)
    scalars = dict(row0=0, T=T, S=T, H=H, K=K, D=D, DV=DV, scale=0.1, scale2=0.1)
    for bk, w, st, dlat, one in ((128, 8, 3, False, False), (128, 8, 3, True, False), (128, 8, 3, True, True),
                                 (128, 8, 4, True, True)):
        consts = dict(BK=bk, BC=64, HA=ha, HB=hb, IB=256, HAS_DLSE=False, DLAT=dlat, BN=64, ONE_LOOP=one, ATOMIC=True,
                      F32=False)
        yield (f"sparse ds, p{' + dlatent' if dlat else ''} of all heads, {bk} slots, {w} warps, {st} stages"
               f"{', one loop' if one else ''}", report(sm._bwd_pds_kernel, ptrs, scalars, consts, num_warps=w,
                                                      num_stages=st))


KDA_N, KDA_C, KDA_D = T // 64, 64, 128     # K3's chunked KDA: chunks of 64, K = V = 128


def _kda_prec(name):
    prec = {w.upper(): kt.PRECISION[w] if name == "bf16" else "ieee" for w in ("pair", "solve", "state")}
    return prec, dict(DT=getattr(triton.language, "bfloat16" if name == "bf16" else "float32"), EMULATE=False)


def _kda_intra(name, sc, inverse):
    """The intra-chunk launches as `kt.kda_intra_triton` runs them for `name` inputs ("bf16": `_gamma_kernel`,
    `_strips6_kernel`, the solve reading Γ·log2 e; "fp32": `_strips4_kernel`, the solve) with scratch `sc`,
    (I+L)^-1 stored or not."""
    x = BF if name == "bf16" else F32
    prec, common = _kda_prec(name)
    c = kt.solve_config(KDA_C, KDA_D, KDA_D, ieee=name == "fp32")
    scalars = dict(T=T, H=H, K=KDA_D, V=KDA_D, N=KDA_N, scale=0.1)
    blocks = dict(C=KDA_C, BC=kt.SUB_CHUNK, HAS_RESET=True, SOLVE=prec["SOLVE"], **common)
    s16 = name == "bf16" and sc == BF
    a_ptr = BF if s16 and kt.V3["a16"] else F32
    v6 = name == "bf16" and kt.V3["strips"] == "v6"
    qkd_strips = not v6 or kt.V3["strips_qkd"]
    if v6:
        yield "kda _gamma_kernel BK=64 warps=4", report(kt._gamma_kernel, dict(g_ptr=F32, r_ptr=F32),
                                                        dict(T=T, H=H, K=KDA_D, N=KDA_N), dict(C=KDA_C, BK=64),
                                                        num_warps=4)
        bk, warps = kt.V3["block_k6"], kt.V3["strip_warps"]
        yield f"kda _strips6_kernel {name}, scratch {sc[1:]}, BK={bk} warps={warps}", report(
            kt._strips6_kernel, dict(q_ptr=x, k_ptr=x, beta_ptr=F32, reset_ptr=I32, r_ptr=F32, A_ptr=a_ptr, M_ptr=F32,
                                     qd_ptr=sc, kd_ptr=sc, d_ptr=F32),
            {n: scalars[n] for n in ("T", "H", "K", "N", "scale")},
            dict(BK=bk, PAIR=prec["PAIR"], QKD=qkd_strips, **blocks), num_warps=warps, num_stages=c["num_stages"])
    else:
        bk, warps = (kt.V3["block_k4"], kt.V3["strip_warps"]) if name == "bf16" else (16, 4)
        yield f"kda _strips4_kernel {name}, scratch {sc[1:]}, BK={bk} warps={warps}", report(
            kt._strips4_kernel, dict(q_ptr=x, k_ptr=x, g_ptr=F32, beta_ptr=F32, reset_ptr=I32, qd_ptr=sc, kd_ptr=sc,
                                     A_ptr=a_ptr, M_ptr=F32, d_ptr=F32),
            {n: scalars[n] for n in ("T", "H", "K", "N", "scale")}, dict(BK=bk, PAIR=prec["PAIR"], **blocks),
            num_warps=warps, num_stages=c["num_stages"])
    ptrs = dict(q_ptr=x, k_ptr=x, v_ptr=x, g_ptr=F32, beta_ptr=F32, reset_ptr=I32, w_ptr=sc,
                u_ptr=BF if s16 and kt.V3["u16"] is True else F32, qd_ptr=sc, kd_ptr=sc, d_ptr=F32, M_ptr=F32,
                r_ptr=F32)
    label = f"kda solve {name}{', (I+L)^-1' if inverse else ''}, scratch {sc[1:]} {c}"
    yield label, report(kt._solve3_kernel, ptrs, scalars,
                        dict(BK=c["BKW"], BV=c["BV"], LOG_BC=4, LEVELS=6, INVERSE=inverse, QKD=not qkd_strips,
                             GAMMA=v6, **blocks), num_warps=c["num_warps"], num_stages=c["num_stages"])


def _kda_state(name, sc, options):
    """`_state_kernel` for `name` inputs storing S_n and U_n, w / k~ / S_n in `sc`, its launch and dots as
    `kt.state_launch` resolves `options` (`_state_pass`'s block_v, launch, dots) at H = 96."""
    prec, common = _kda_prec(name)
    dtype = torch.bfloat16 if name == "bf16" else torch.float32
    c, dots = kt.state_launch(H, KDA_D, KDA_D, dtype, torch.bfloat16 if sc == BF else torch.float32,
                              torch.device("cpu"), **options)
    prec["STATE"] = dots["STATE"]
    ptrs = dict(w_ptr=sc, u_ptr=sc if kt.V3["u16"] is True else F32, kd_ptr=sc, d_ptr=F32, s0_ptr=F32, sN_ptr=F32,
                h_ptr=sc, U_ptr=sc if kt.V3["u16"] else F32)
    consts = dict(C=KDA_C, BK=c["BK"], BV=c["BV"], S0=1, HAS_U=True, STORE=True, STATE=prec["STATE"], **common)
    return f"kda state pass (S_n, U_n) {name}, w/k~/S_n {sc[1:]} {c} dots {prec['STATE']}", report(
        kt._state_kernel, ptrs, dict(K=KDA_D, V=KDA_D, N=KDA_N), consts, num_warps=c["num_warps"],
        num_stages=c["num_stages"])


def kda_fwd():
    """The chunked KDA forward at K = V = 128, C = 64 (T = 8192, H = 96), bf16 (bf16 scratch, `kt.V3`) and fp32:
    the intra-chunk launches (`_kda_intra`), the state pass and `_output_kernel`."""
    N, C, KD = KDA_N, KDA_C, KDA_D
    for name in ("bf16", "fp32"):
        x = BF if name == "bf16" else F32
        sc = BF if name == "bf16" else F32
        prec, common = _kda_prec(name)
        yield from _kda_intra(name, sc, inverse=False)
        yield _kda_state(name, sc, kt.forward_state_options(torch.bfloat16 if name == "bf16" else torch.float32,
                                                            torch.bfloat16 if sc == BF else torch.float32))
        c = kt.output_config(KD, KD, ieee=name == "fp32")
        yield f"kda output {name}, q~/S_n {sc[1:]} {c}", report(
            kt._output_kernel, dict(qd_ptr=sc, A_ptr=sc if kt.V3["a16"] else F32,
                                    U_ptr=sc if kt.V3["u16"] else F32, h_ptr=sc, o_ptr=x),
            dict(T=T, H=H, K=KD, V=KD, N=N), dict(C=C, BK=c["BK"], BV=c["BV"], STATE=prec["STATE"],
                                                  QS="16" if name == "bf16" else "",
                                                  AU="16" if name == "bf16" and kt.V3["u16"] and kt.V3["a16"] else "",
                                                  **common),
            num_warps=c["num_warps"], num_stages=c["num_stages"])


def kda_bwd():
    """The chunked KDA backward at K = V = 128, C = 64, bf16 and fp32: the recompute (the intra-chunk launches with
    (I+L)^-1, fp32 scratch), the state pass storing S_n and U_n, the reverse pass (`_state_bwd_kernel`), and
    kda_bwd_triton's `_bwd_dav_kernel` and `_bwd_dqkg_kernel`."""
    N, C, KD = KDA_N, KDA_C, KDA_D
    for name in ("bf16", "fp32"):
        x = BF if name == "bf16" else F32
        prec, common = _kda_prec(name)
        yield from _kda_intra(name, F32, inverse=True)
        yield _kda_state(name, F32, dict(block_v=kt.V3["state_block"]))   # the backward's recompute
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
        yield f"kda bwd dAqk/dL/dv {name} {c}", report(kb._bwd_dav_kernel, ptrs,
                                                       dict(T=T, H=H, V=KD, N=N, scale=0.1), consts,
                                                       num_warps=c["num_warps"], num_stages=c["num_stages"])
        c = kb.dqkg_config(C, KD, KD, ieee=name == "fp32")
        ptrs = dict(q_ptr=x, k_ptr=x, g_ptr=F32, beta_ptr=F32, reset_ptr=I32, M_ptr=F32, U_ptr=F32, h_ptr=F32,
                    dh_ptr=F32, dU_ptr=F32, do_ptr=x, dA_ptr=pair, dL_ptr=pair, dAd_ptr=F32, dq_ptr=x, dk_ptr=x,
                    dg_ptr=F32, dbk_ptr=F32, dqs_ptr=x, dks_ptr=x, dgs_ptr=F32)
        consts = dict(C=C, BC=kt.SUB_CHUNK, BK=c["BK"], BV=c["BV"], HAS_RESET=True, WIDE=False, SPLIT=False, **prec,
                      **common)
        yield f"kda bwd dq/dk/dg {name} {c}", report(kb._bwd_dqkg_kernel, ptrs,
                                                     dict(T=T, H=H, K=KD, V=KD, N=N, scale=0.1), consts,
                                                     num_warps=c["num_warps"], num_stages=c["num_stages"])


def kda_fwd_v4():
    """The forward's candidate launches (`kt.V3` options) at K = V = 128, C = 64: `_strips4_kernel` ("strips": "v4",
    bf16 and fp32), the solve after it (no q~ / k~ / d) by w pieces and warps, "v6" (`_gamma_kernel`,
    `_strips6_kernel` by key pieces, with q~ / k~ / d or not, the solve reading Γ·log2 e), the state pass with
    "x2" / "16" dots by columns, warps and stages."""
    N, C, KD = KDA_N, KDA_C, KDA_D
    scalars = dict(T=T, H=H, K=KD, V=KD, N=N, scale=0.1)
    for name in ("bf16", "fp32"):
        x = BF if name == "bf16" else F32
        prec, common = _kda_prec(name)
        blocks = dict(C=C, BC=kt.SUB_CHUNK, HAS_RESET=True, SOLVE=prec["SOLVE"], **common)
        bk, warps = (kt.V3["block_k4"], kt.V3["strip_warps"]) if name == "bf16" else (16, 4)
        sp = dict(q_ptr=x, k_ptr=x, g_ptr=F32, beta_ptr=F32, reset_ptr=I32, qd_ptr=x, kd_ptr=x, A_ptr=F32, M_ptr=F32,
                  d_ptr=F32)
        yield f"kda _strips4_kernel {name} BK={bk} warps={warps}", report(
            kt._strips4_kernel, sp, {n: scalars[n] for n in ("T", "H", "K", "N", "scale")},
            dict(BK=bk, PAIR=prec["PAIR"], **blocks), num_warps=warps, num_stages=1)
        ptrs = dict(q_ptr=x, k_ptr=x, v_ptr=x, g_ptr=F32, beta_ptr=F32, reset_ptr=I32, w_ptr=x, u_ptr=F32,
                    qd_ptr=x, kd_ptr=x, d_ptr=F32, M_ptr=F32, r_ptr=F32)
        for bkw, warps in ((32, 4), (64, 4), (64, 8)) if name == "bf16" else ((16, 8),):
            yield f"kda v4 solve {name} BK={bkw} warps={warps}", report(
                kt._solve3_kernel, ptrs, scalars, dict(BK=bkw, BV=64, LOG_BC=4, LEVELS=6, INVERSE=False, QKD=False,
                                                       GAMMA=False, **blocks), num_warps=warps, num_stages=2)
    prec, common = _kda_prec("bf16")
    blocks = dict(C=C, BC=kt.SUB_CHUNK, HAS_RESET=True, SOLVE=prec["SOLVE"], **common)
    yield "kda _gamma_kernel BK=64 warps=4", report(kt._gamma_kernel, dict(g_ptr=F32, r_ptr=F32),
                                                    dict(T=T, H=H, K=KD, N=N), dict(C=C, BK=64), num_warps=4)
    for bk, qkd, a16 in ((32, False, False), (64, False, False), (32, True, True)):
        label = f"kda _strips6_kernel bf16 BK={bk} warps=4{', q~ k~ d' if qkd else ''}, Aqk {'bf16' if a16 else 'fp32'}"
        yield label, \
            report(kt._strips6_kernel, dict(q_ptr=BF, k_ptr=BF, beta_ptr=F32, reset_ptr=I32, r_ptr=F32,
                                            A_ptr=BF if a16 else F32, M_ptr=F32, qd_ptr=BF, kd_ptr=BF, d_ptr=F32),
                   {n: scalars[n] for n in ("T", "H", "K", "N", "scale")},
                   dict(BK=bk, PAIR=prec["PAIR"], QKD=qkd, **blocks), num_warps=4, num_stages=2)
    for qkd, u in ((True, F32), (False, F32), (False, BF)):
        ptrs = dict(q_ptr=BF, k_ptr=BF, v_ptr=BF, g_ptr=F32, beta_ptr=F32, reset_ptr=I32, w_ptr=BF, u_ptr=u,
                    qd_ptr=BF, kd_ptr=BF, d_ptr=F32, M_ptr=F32, r_ptr=F32)
        yield f"kda v6 solve bf16 BK=32 warps=4 (Γ read){', q~ k~ d' if qkd else ''}, u {u[1:]}", report(
            kt._solve3_kernel, ptrs, scalars, dict(BK=32, BV=64, LOG_BC=4, LEVELS=6, INVERSE=False, QKD=qkd,
                                                   GAMMA=True, **blocks), num_warps=4, num_stages=2)
    for dots, bv, warps, stages in (("x2", 16, 8, 2), ("x2", 32, 8, 2), ("x2", 64, 8, 2), ("16", 16, 8, 2),
                                    ("x2", 16, 8, 3), ("x2n", 16, 8, 3), ("x2n", 16, 4, 2), ("x2n", 64, 4, 2),
                                    ("x2n", 64, 8, 2), ("x2n", 8, 8, 3), ("x2n", 32, 8, 3)):
        yield f"kda state pass bf16, dots {dots}, {bv} columns, {warps} warps, {stages} stages", report(
            kt._state_kernel, dict(w_ptr=BF, u_ptr=F32, kd_ptr=BF, d_ptr=F32, s0_ptr=F32, sN_ptr=F32, h_ptr=BF,
                                   U_ptr=BF),
            dict(K=KD, V=KD, N=N),
            dict(C=C, BK=KD, BV=bv, S0=1, HAS_U=True, STORE=True, STATE=dots, **common), num_warps=warps,
            num_stages=stages)
    # O_n formed in the pass (`V3["out"]`): the forward alone (nothing stored) and with S_n, U_n kept for a backward
    for dots, bv, warps, stages, out, store in (("x2n", 32, 8, 3, "x2n", False), ("x2n", 32, 8, 2, "x2n", False),
                                                ("x2n", 32, 8, 3, "x2n", True), ("x2n", 8, 8, 3, "x2n", False),
                                                ("x2", 64, 4, 2, "x2n", False)):
        yield (f"kda state pass bf16 forming O_n ({out} dots){', S_n U_n stored' if store else ''}, dots {dots}, "
               f"{bv} columns, {warps} warps, {stages} stages"), report(
            kt._state_kernel, dict(w_ptr=BF, u_ptr=F32, kd_ptr=BF, d_ptr=F32, s0_ptr=F32, sN_ptr=F32, h_ptr=BF,
                                   U_ptr=BF, qd_ptr=BF, A_ptr=BF, o_ptr=BF),
            dict(K=KD, V=KD, N=N, T=T, H=H),
            dict(C=C, BK=KD, BV=bv, S0=1, HAS_U=True, STORE=store, STATE=dots, OUT=out, **common), num_warps=warps,
            num_stages=stages)


def kda_bwd_saved():
    """The KDA backward's candidates from the forward's scratch (`kb.SAVE = "forward"`) at K = V = 128, C = 64:
    `_state_bwd2_kernel` on bf16 q~ / k~ / w (`kb.REVERSE`'s columns, warps, stages, q~ dO on bf16, bf16 dS), and
    `_bwd_dqkg_kernel` on bf16 S_n, batched and wide (`kb.PAIRWISE`) by key channels and warps, with the state's
    terms inside or split off (`kb.STATE_TERMS`, `_bwd_state_kernel`); bf16 and fp32."""
    N, C, KD = KDA_N, KDA_C, KDA_D
    prec, common = _kda_prec("bf16")
    A16, U16 = (BF if kt.V3["a16"] else F32), (BF if kt.V3["u16"] else F32)   # the saved scratch's dtypes
    for bv, warps, stages, qd16, dh in ((32, 4, 1, False, F32), (32, 4, 1, True, F32), (64, 4, 1, False, F32),
                                        (64, 8, 1, False, F32), (64, 8, 1, True, F32), (16, 4, 1, False, F32),
                                        (32, 4, 2, False, F32), (64, 8, 1, False, BF)):
        ptrs = dict(qd_ptr=BF, kd_ptr=BF, w_ptr=BF, A_ptr=A16, d_ptr=F32, do_ptr=BF, dsN_ptr=F32, dh_ptr=dh,
                    dU_ptr=F32, dh0_ptr=F32)
        consts = dict(C=C, BK=KD, BV=bv, HAS_DSN=True, HAS_DH0=True, QD16=qd16, STATE=prec["STATE"], CHAIN="",
                      **common)
        yield (f"kda reverse state pass (own) bf16, {bv} columns, {warps} warps, {stages} stages, q~ dO "
               f"{'bf16' if qd16 else 'tf32'}, dS {dh[1:]}"), report(
            kb._state_bwd2_kernel, ptrs, dict(T=T, H=H, K=KD, V=KD, N=N), consts, num_warps=warps,
            num_stages=stages)
    # `REVERSE["dots"]` "x2n" launches
    for bv, warps, stages in ((16, 4, 2), (16, 4, 1), (16, 8, 2), (64, 4, 2), (8, 4, 2), (32, 8, 2), (32, 4, 2)):
        ptrs = dict(qd_ptr=BF, kd_ptr=BF, w_ptr=BF, A_ptr=A16, d_ptr=F32, do_ptr=BF, dsN_ptr=F32, dh_ptr=BF,
                    dU_ptr=F32, dh0_ptr=F32)
        consts = dict(C=C, BK=KD, BV=bv, HAS_DSN=True, HAS_DH0=True, QD16=False, STATE=prec["STATE"], CHAIN="x2n",
                      **common)
        yield f"kda reverse state pass (own) bf16, x2n dots, {bv} columns, {warps} warps, {stages} stages", report(
            kb._state_bwd2_kernel, ptrs, dict(T=T, H=H, K=KD, V=KD, N=N), consts, num_warps=warps,
            num_stages=stages)
    for name in ("bf16", "fp32"):
        x = BF if name == "bf16" else F32
        prec, common = _kda_prec(name)
        pair = BF if prec["PAIR"] == "16" else F32
        c = kb.dqkg_config(C, KD, KD, ieee=name == "fp32")
        ptrs = dict(q_ptr=x, k_ptr=x, g_ptr=F32, beta_ptr=F32, reset_ptr=I32, M_ptr=F32,
                    U_ptr=U16 if name == "bf16" else F32, h_ptr=x,
                    dh_ptr=F32, dU_ptr=F32, do_ptr=x, dA_ptr=pair, dL_ptr=pair, dAd_ptr=F32, dq_ptr=x, dk_ptr=x,
                    dg_ptr=F32, dbk_ptr=F32, dqs_ptr=F32, dks_ptr=F32, dgs_ptr=F32)
        for wide, split, bk, warps in ((False, False, 16, c["num_warps"]), (True, False, 16, c["num_warps"]),
                                       (True, False, 16, 8), (True, False, 32, 8), (False, True, 16, 4),
                                       (True, True, 16, 4)):
            if split and name == "fp32":
                continue
            consts = dict(C=C, BC=kt.SUB_CHUNK, BK=bk, BV=c["BV"], HAS_RESET=True, WIDE=wide, SPLIT=split, **prec,
                          **common)
            yield (f"kda bwd dq/dk/dg {name}, {'wide' if wide else 'batched'}{', state terms split' if split else ''}"
                   f", BK={bk}, {warps} warps"), report(
                kb._bwd_dqkg_kernel, ptrs, dict(T=T, H=H, K=KD, V=KD, N=N, scale=0.1), consts, num_warps=warps,
                num_stages=1)
    prec, common = _kda_prec("bf16")
    ptrs = dict(q_ptr=BF, k_ptr=BF, g_ptr=F32, beta_ptr=F32, reset_ptr=I32, M_ptr=F32, U_ptr=U16, h_ptr=BF,
                dh_ptr=BF, dU_ptr=F32, do_ptr=BF, dqs_ptr=F32, dks_ptr=F32, dgs_ptr=F32, dbs_ptr=F32)
    for bk, bv, warps, stages, su16 in ((64, 64, 8, 1, False), (64, 64, 8, 1, True), (32, 64, 4, 1, True),
                                        (64, 64, 8, 2, True), (32, 64, 4, 2, True)):
        consts = dict(C=C, BK=bk, BV=bv, HAS_RESET=True, SOLVE=prec["SOLVE"], STATE=prec["STATE"], SU16=su16,
                      **common)
        yield (f"kda bwd state terms (`_bwd_state_kernel`) bf16, BK={bk}, BV={bv}, {warps} warps, {stages} stages"
               f"{', bf16 operands' if su16 else ''}"), report(
            kb._bwd_state_kernel, ptrs, dict(T=T, H=H, K=KD, V=KD, N=N, scale=0.1), consts, num_warps=warps,
            num_stages=stages)
    c = kb.dav_config(C, KD, ieee=False)
    pair = BF if prec["PAIR"] == "16" else F32
    ptrs = dict(v_ptr=BF, beta_ptr=F32, reset_ptr=I32, M_ptr=F32, U_ptr=U16, dU_ptr=F32, do_ptr=BF, dA_ptr=pair,
                dL_ptr=pair, dAd_ptr=F32, dbv_ptr=F32, dv_ptr=BF)
    for ou16 in (False, True):
        consts = dict(C=C, BV=c["BV"], HAS_RESET=True, SOLVE=prec["SOLVE"], STATE=prec["STATE"], OU16=ou16, **common)
        yield f"kda bwd dAqk/dL/dv (saved) bf16 {c}{', bf16 operands' if ou16 else ''}", report(
            kb._bwd_dav_kernel, ptrs, dict(T=T, H=H, V=KD, N=N, scale=0.1), consts, num_warps=c["num_warps"],
            num_stages=c["num_stages"])


def kda_decode():
    """The decode step at K = V = 128, bf16 activations, as `kda_decode_triton._launch` runs it: the fused step (the
    three short convs of width 4, norms, the step; one program a row and head walking its column blocks; v's conv
    before the loop, every prologue load issued first and the state loaded a block ahead), the same without those
    options and at the launches the decode sweep times, and the in-place step (column blocks over the grid)."""
    B, HD, KD, W = 64, 96, 128, 4
    # the in-place step's conv weights and tails are None at launch and unused (CONV off): typed alike here
    ptrs = dict(q_ptr=BF, k_ptr=BF, v_ptr=BF, wq_ptr=BF, wk_ptr=BF, wv_ptr=BF, tq_ptr=BF, tk_ptr=BF, tv_ptr=BF,
                reset_ptr="*u8", g_ptr=F32, beta_ptr=F32, state_ptr=F32, o_ptr=BF)
    BK, BV, warps = kd.decode_config(KD, KD, fused=True)
    # (BK, BV, warps, v_first, state_ahead, hoist); v_first None: the in-place step
    fused = [(BK, BV, warps, True, True, True), (BK, BV, warps, True, False, True), (BK, BV, warps, True, True, False),
             (BK, BV, warps, True, False, False), (BK, BV, warps, False, False, True)] + [
        (128, bv, w, True, True, True) for bv, w in ((16, 2), (32, 2), (64, 8), (128, 8))]
    for BK, BV, warps, v_first, ahead, hoist in fused + [(*kd.decode_config(KD, KD, fused=False), None, False, True)]:
        conv = v_first is not None
        consts = dict(W=W if conv else 1, BW=triton.next_power_of_2(W if conv else 1), BK=BK, BV=BV,
                      NB=KD // BV if conv else 1, CONV=conv, HAS_RESET=conv, DT=triton.language.bfloat16,
                      EMULATE=False, STREAM=False, STAGES=1, V_FIRST=bool(v_first), BVA=KD, AHEAD=ahead,
                      HOIST=bool(hoist and v_first))
        what = ("in-place step" if not conv else "fused step" + ("" if v_first else ", v's conv in the loop")
                + ("" if hoist or not v_first else ", the convs in turn")
                + ("" if ahead or not v_first else ", no state ahead"))
        yield (f"kda decode {what}, B = {B}, H = {HD}, [{BK}, {BV}] blocks, {warps} warps"), report(
            kd._decode_kernel, ptrs, dict(H=HD, K=KD, V=KD, scale=0.1, eps=1e-6), consts, num_warps=warps)


KERNELS = {"indexer": indexer, "indexer-select": indexer_select, "sparse-fwd": sparse_fwd, "sparse-dq": sparse_dq,
           "sparse-dkv": sparse_dkv,
           "kda-fwd": kda_fwd, "kda-fwd-v4": kda_fwd_v4, "kda-bwd": kda_bwd, "kda-bwd-saved": kda_bwd_saved,
           "kda-decode": kda_decode}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernels", nargs="*", help=f"of {list(KERNELS)} (default: all)")
    ap.add_argument("--v3", nargs="*", default=[], metavar="OPTION=VALUE",
                    help="kda_triton.V3 options for the KDA kernels (integers as such), e.g. strip_warps=4 block_k6=32")
    a = ap.parse_args()
    try:
        options = parse_v3(a.v3)
    except ValueError as e:
        ap.error(f"--v3 {e}")
    if {"scratch", "states"} & set(options):
        ap.error("--v3: the report's scratch and states are bf16 (scratch, states not taken)")
    kt.V3.update(options)
    unknown = set(a.kernels) - set(KERNELS)
    if unknown:
        ap.error(f"unknown kernels {sorted(unknown)}: choose from {list(KERNELS)}")
    print(f"triton {triton.__version__}, sm_90, T = {T:,}\n| launch | regs | spill B | smem | HGMMA | wgmma waits | "
          "HMMA | cp.async | converts | barriers | SASS |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for name in a.kernels or KERNELS:
        for what, r in KERNELS[name]():
            print(f"| {what} | {r['regs']} | {r['spill_bytes']} | {r['smem']} | {r['HGMMA']} | {r['wgmma_waits']} | "
                  f"{r['HMMA']} | {r['cp_async']} | {r['converts']} | {r['barriers']} | {r['instructions']} |",
                  flush=True)


if __name__ == "__main__":
    main()
