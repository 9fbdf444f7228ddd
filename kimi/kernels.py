"""Hand-written Triton kernels, each beside its naive reference. Registered as opaque ops in `kimi/ops.py`.

Triton is optional: without it (or without a GPU and without `TRITON_INTERPRET=1`) the references run. On the CPU
the kernels run through Triton's interpreter (`TRITON_INTERPRET=1`, set by tests/conftest.py when there is no
GPU), which is how CI tests them; the H200 runs the same tests compiled.

`moe_gemv`: the routed experts' matmuls for a few tokens (decode). Rows arrive sorted by expert (`offs` the
cumulative row counts, as for `F.grouped_mm`). The grid runs over row slots x blocks of BLOCK_M outputs, not over
experts: the program at the first row of an expert's group streams that block of the expert's weight through
once per 16 rows of the group (once at decode sizes) and writes all of them; the programs at the other rows do
nothing. So the launch scales with the rows (16 at batch 1), not with the experts (896 in the release, most
unchosen). Decode is weight-bandwidth bound: at batch 1 16 of 64 experts are touched, each by one row, where the
grouped GEMM's 128-row tiles reach ~60 % of the copy bandwidth (tests/bench/decode.py --profile).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:   # the references below still run
    triton = None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of `device`."""
    return triton is not None and (device.type == "cuda" or interpreted())


# ---------------------------------------------------------------------------------------------- moe_gemv

def moe_gemv_reference(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """y[r] = w[e] @ x[r] for the rows r of expert e (rows offs[e-1]:offs[e]). x [N, K], w [E, M, K], offs [E]
    int32 cumulative -> y [N, M] in x's dtype (fp32 accumulation)."""
    y = x.new_zeros(x.shape[0], w.shape[1])
    bounds = [0, *offs.tolist()]
    for e in range(w.shape[0]):
        a, b = bounds[e], bounds[e + 1]
        if b > a:
            y[a:b] = (x[a:b].float() @ w[e].float().t()).to(x.dtype)
    return y


if triton is not None:
    @triton.jit
    def _moe_gemv_kernel(x_ptr, w_ptr, offs_ptr, eid_ptr, y_ptr, M, K, stride_xn, stride_we, stride_wm,
                         stride_wk, stride_yn, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr, UPCAST: tl.constexpr):
        i = tl.program_id(0)                    # a row slot; only the first row of each expert's group works
        mt = tl.program_id(1)
        e = tl.load(eid_ptr + i)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        end = tl.where(i == start, tl.load(offs_ptr + e), start)
        m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        w_base = w_ptr + e.to(tl.int64) * stride_we + m[:, None] * stride_wm
        for r0 in range(start, end, ROWS):      # no iteration unless this slot starts its group
            r = r0 + tl.arange(0, ROWS)
            acc = tl.zeros((ROWS, BLOCK_M), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                w = tl.load(w_base + k[None, :] * stride_wk, mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
                xv = tl.load(x_ptr + r[:, None] * stride_xn + k[None, :], mask=(r[:, None] < end) & (k[None, :] < K),
                             other=0.0)
                if UPCAST:   # the interpreter's 16-bit dot is wrong (triton 3.9); fp32 is exact there
                    acc += tl.dot(xv.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
                elif IEEE:
                    acc += tl.dot(xv, tl.trans(w), input_precision="ieee")
                else:
                    acc += tl.dot(xv, tl.trans(w))
            tl.store(y_ptr + r[:, None] * stride_yn + m[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=(r[:, None] < end) & (m[None, :] < M))


if triton is not None:
    # Block shapes for the GPU, tuned on the first call per (M, K) (decode warm-up, outside any CUDA-graph capture;
    # every config writes y only, so the tuning reruns are harmless).
    _moe_gemv_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=nw, num_stages=ns)
                 for bm, bk, nw, ns in [(32, 128, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4), (64, 128, 8, 4),
                                        (64, 256, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3)]],
        key=["M", "K"])(_moe_gemv_kernel)


def moe_gemv(x: Tensor, w: Tensor, offs: Tensor, *, block_m: int | None = None, block_k: int | None = None) -> Tensor:
    """The Triton kernel of `moe_gemv_reference` (same contract; w may be any strided view). Block shapes are
    autotuned on a GPU unless given (the interpreter uses 64 x 128 by default)."""
    if not available(x.device):
        raise RuntimeError("moe_gemv needs Triton and a CUDA tensor (or TRITON_INTERPRET=1)")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        raise ValueError(f"moe_gemv: x and w must share a float32/bfloat16/float16 dtype, got {x.dtype}, {w.dtype}")
    x = x.contiguous()
    N, K = x.shape
    M = w.shape[1]
    y = x.new_empty(N, M)
    if N == 0:
        return y
    # the expert of each sorted row: the number of group ends at or before it (static shapes, no host sync)
    eid = torch.searchsorted(offs, torch.arange(N, device=x.device, dtype=offs.dtype), right=True, out_int32=True)
    args = (x, w, offs, eid, y, M, K, x.stride(0), w.stride(0), w.stride(1), w.stride(2), y.stride(0))
    flags = dict(ROWS=16, IEEE=x.dtype == torch.float32, UPCAST=interpreted() and x.dtype != torch.float32)
    if block_m is None and block_k is None and not interpreted():
        _moe_gemv_tuned[lambda meta: (N, triton.cdiv(M, meta["BLOCK_M"]))](*args, **flags)
    else:
        block_m, block_k = block_m or 64, block_k or 128
        _moe_gemv_kernel[(N, triton.cdiv(M, block_m))](*args, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4,
                                                       num_stages=4, **flags)
    return y


# ---------------------------------------------------------------------------------------------- delta_states

def delta_states_reference(u: Tensor, w: Tensor, k: Tensor, d: Tensor, s0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The sequential part of chunked KDA (`kda.kda_chunk`): chunk n's entering state S_n, its corrected values U_n
    and the final state, for chunks n = 0..N-1 of every row (b, h) folded into the first dim:

        U_n     = u_n − w_n S_n                [C, V]
        S_{n+1} = diag(d_n) S_n + k_nᵀ U_n     [K, V],   S_0 = s0

    u [R, N, C, V], w and k [R, N, C, K], d [R, N, K], s0 [R, K, V] -> (S_n stacked [R, N, K, V], U [R, N, C, V],
    S_N [R, K, V]), all in the inputs' dtype. A Python loop over chunks: the float64 reference of the kernels."""
    S, Hs, Us = s0, [], []
    for n in range(u.shape[1]):
        Hs.append(S)
        U = u[:, n] - w[:, n] @ S
        Us.append(U)
        S = d[:, n, :, None] * S + k[:, n].transpose(-1, -2) @ U
    return torch.stack(Hs, 1), torch.stack(Us, 1), S


if triton is not None:
    @triton.jit
    def _delta_tiles(C, K, V, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        """Offsets and masks of the [K, V] state block, the [C, V] value tile and the [C, K] key tile of this
        program's column block (program_id 1; rows are axis 0, which allows 2^31 of them), within one chunk."""
        c = tl.arange(0, BC)
        kk = tl.arange(0, BK)
        vv = tl.program_id(1) * BV + tl.arange(0, BV)
        m_kv = (kk[:, None] < K) & (vv[None, :] < V)
        m_cv = (c[:, None] < C) & (vv[None, :] < V)
        m_ck = (c[:, None] < C) & (kk[None, :] < K)
        return kk, kk[:, None] * V + vv[None, :], c[:, None] * V + vv[None, :], c[:, None] * K + kk[None, :], \
            m_kv, m_cv, m_ck

    @triton.jit
    def _delta_states_fwd_kernel(u_ptr, w_ptr, k_ptr, d_ptr, s0_ptr, h_ptr, U_ptr, sN_ptr, N,
                                 su_n, su_c, sw_n, sw_c, C, K, V,
                                 BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
        # one program: one row r, one block of BV state columns (the columns never mix), all K rows of the state,
        # every chunk in order; the state stays in registers between chunks. u and w may have row strides (chunk
        # su_n / sw_n, token su_c / sw_c: KDA's are column slices of one [w | u] tensor); everything else is dense.
        r = tl.program_id(0).to(tl.int64)
        kk, kv, cv, ck, m_kv, m_cv, m_ck = _delta_tiles(C, K, V, BC, BK, BV)
        c = tl.arange(0, BC)
        cv_u = c[:, None] * su_c + (tl.program_id(1) * BV + tl.arange(0, BV))[None, :]
        ck_w = c[:, None] * sw_c + kk[None, :]
        S = tl.load(s0_ptr + r * K * V + kv, mask=m_kv, other=0.0)
        for n in range(N):
            rn = r * N + n
            tl.store(h_ptr + rn * K * V + kv, S, mask=m_kv)
            w = tl.load(w_ptr + rn * sw_n + ck_w, mask=m_ck, other=0.0)
            u = tl.load(u_ptr + rn * su_n + cv_u, mask=m_cv, other=0.0)
            U = u - tl.dot(w, S, input_precision=PREC)
            tl.store(U_ptr + rn * C * V + cv, U, mask=m_cv)
            kt = tl.load(k_ptr + rn * C * K + ck, mask=m_ck, other=0.0)
            dn = tl.load(d_ptr + rn * K + kk, mask=kk < K, other=0.0)
            S = dn[:, None] * S + tl.dot(tl.trans(kt), U, input_precision=PREC)
        tl.store(sN_ptr + r * K * V + kv, S, mask=m_kv)

    @triton.jit
    def _delta_states_bwd_kernel(w_ptr, k_ptr, d_ptr, dh_ptr, dUx_ptr, dsN_ptr, dU_ptr, L_ptr, ds0_ptr, N,
                                 sw_n, sw_c, C, K, V,
                                 BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
        # the same tiling, chunks in reverse; L is the gradient of the state entering the next chunk
        r = tl.program_id(0).to(tl.int64)
        kk, kv, cv, ck, m_kv, m_cv, m_ck = _delta_tiles(C, K, V, BC, BK, BV)
        ck_w = tl.arange(0, BC)[:, None] * sw_c + kk[None, :]
        L = tl.load(dsN_ptr + r * K * V + kv, mask=m_kv, other=0.0)
        for i in range(N):
            rn = r * N + (N - 1 - i)
            kt = tl.load(k_ptr + rn * C * K + ck, mask=m_ck, other=0.0)
            dU = tl.load(dUx_ptr + rn * C * V + cv, mask=m_cv, other=0.0) + tl.dot(kt, L, input_precision=PREC)
            tl.store(dU_ptr + rn * C * V + cv, dU, mask=m_cv)
            tl.store(L_ptr + rn * K * V + kv, L, mask=m_kv)
            w = tl.load(w_ptr + rn * sw_n + ck_w, mask=m_ck, other=0.0)
            dn = tl.load(d_ptr + rn * K + kk, mask=kk < K, other=0.0)
            dh = tl.load(dh_ptr + rn * K * V + kv, mask=m_kv, other=0.0)
            L = dh + dn[:, None] * L - tl.dot(tl.trans(w), dU, input_precision=PREC)
        tl.store(ds0_ptr + r * K * V + kv, L, mask=m_kv)


if triton is not None:
    # On a GPU the column block and warps are tuned on the first call per (C, K, V) (both kernels only write their
    # outputs, so the tuning reruns are harmless): more, narrower blocks give more programs, wider ones fewer loads
    # of the key tiles; which wins depends on the register pressure of the [K, BV] state. With TF32 dots Triton
    # 3.6 runs them as wgmma on the H200, staging the operands in shared memory: the forward's 32 and 64 column
    # blocks need more than an SM's 227 KiB (the backward's 64 too), and its 16-column block with 8 warps faults
    # (illegal memory access, at every shape tried), so TF32 is tuned over the configs that ran and matched the
    # float64 loop there (`test_delta_states_every_tuned_config`).
    def _delta_configs(blocks):
        return [triton.Config({"BV": bv}, num_warps=nw) for bv, nw in blocks]

    _ALL_BLOCKS = [(bv, nw) for bv in (16, 32, 64) for nw in (4, 8)]
    _DELTA_BLOCKS = {
        ("fwd", "ieee"): _ALL_BLOCKS, ("fwd", "tf32"): [(16, 4)],
        ("bwd", "ieee"): _ALL_BLOCKS, ("bwd", "tf32"): [(16, 4), (16, 8), (32, 4), (32, 8)],
    }
    _DELTA_KERNELS = {"fwd": _delta_states_fwd_kernel, "bwd": _delta_states_bwd_kernel}
    _DELTA_TUNED = {(which, prec): triton.autotune(configs=_delta_configs(blocks), key=["C", "K", "V"])(
        _DELTA_KERNELS[which]) for (which, prec), blocks in _DELTA_BLOCKS.items()}


def _launch_delta(which: str, R: int, C: int, K: int, V: int, block_v: int | None, tf32: bool | None, *args):
    """Run a delta_states kernel (`which`: "fwd" or "bwd") over (rows, column blocks): autotuned on a GPU unless
    `block_v` is given; fixed blocks (32 columns, 4 warps) under the interpreter. The dots in TF32 when `tf32`
    (None: when torch's float32 matmul precision makes fp32 matmuls run in TF32 too), else in IEEE fp32 (a
    K3.1-width training step on the H200: 20.3 ms of the two kernels in IEEE, 10.6 ms in TF32 with the strided
    reads). A given `block_v` must be one the precision runs with on a GPU (`_DELTA_BLOCKS`), also when
    interpreted."""
    BC, BK, BV = _delta_blocks(C, K, V, block_v)
    if tf32 is None:
        tf32 = _fp32_matmuls_in_tf32()
    prec = "tf32" if tf32 else "ieee"
    warps = 4
    if block_v is not None:
        fits = [nw for bv, nw in _DELTA_BLOCKS[which, prec] if bv == block_v]
        if not fits:
            raise ValueError(f"delta_states: block_v={block_v} does not run with {prec} dots on a GPU (Triton 3.6); "
                             f"the {which} pass takes {sorted({bv for bv, _ in _DELTA_BLOCKS[which, prec]})}")
        warps = fits[0]
    if block_v is None and not interpreted():
        _DELTA_TUNED[which, prec][lambda meta: (R, triton.cdiv(V, meta["BV"]))](*args, C, K, V, BC=BC, BK=BK,
                                                                                 PREC=prec)
    else:
        _DELTA_KERNELS[which][(R, triton.cdiv(V, BV))](*args, C, K, V, BC=BC, BK=BK, BV=BV, PREC=prec,
                                                       num_warps=warps)


def _fp32_matmuls_in_tf32() -> bool:
    """Whether torch runs fp32 CUDA matmuls in TF32. The new-API attribute (torch >= 2.10) follows the legacy
    `set_float32_matmul_precision` too, while the legacy getter raises once anyone used the new API."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision is not None:
        return precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


def _delta_blocks(C: int, K: int, V: int, block_v: int | None) -> tuple[int, int, int]:
    if K > 256:
        raise ValueError(f"delta_states: the key dim K={K} must be at most 256 (the state rows stay in registers)")
    if block_v is not None and (block_v < 16 or block_v & (block_v - 1)):
        raise ValueError(f"delta_states: block_v={block_v} must be a power of two >= 16 (a tl.dot operand dim)")
    pow2 = triton.next_power_of_2
    return max(16, pow2(C)), max(16, pow2(K)), block_v or max(16, min(32, pow2(V)))


def _check_delta(name: str, tensors: dict[str, Tensor]):
    bad = {n: t.dtype for n, t in tensors.items() if t.dtype != torch.float32}
    if bad:
        raise ValueError(f"{name}: float32 tensors expected (the state pass accumulates in fp32), got {bad}")
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1 or not available(devices.pop()):
        raise RuntimeError(f"{name} needs Triton and its tensors on one CUDA device (or TRITON_INTERPRET=1), got "
                           f"{ {n: str(t.device) for n, t in tensors.items()} }")


def delta_states(u: Tensor, w: Tensor, k: Tensor, d: Tensor, s0: Tensor, *, block_v: int | None = None,
                 tf32: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The Triton kernel of `delta_states_reference` (same contract, float32 only): one launch for all chunks,
    programs over (rows, state column blocks), each carrying its block of the state through the chunks in
    registers. fp32 dots, in TF32 when `tf32` (default: as torch's fp32 matmuls, `_launch_delta`), else IEEE; the
    state and the sums stay fp32 either way. `block_v` fixes the column block (else autotuned on a GPU)."""
    _check_delta("delta_states", dict(u=u, w=w, k=k, d=d, s0=s0))
    R, N, C, V = u.shape
    K = w.shape[-1]
    _delta_blocks(C, K, V, block_v)                        # validate before allocating
    u, w = _row_strided(u), _row_strided(w)
    k, d, s0 = (t.contiguous() for t in (k, d, s0))
    hs, U, sN = u.new_empty(R, N, K, V), u.new_empty(R, N, C, V), s0.new_empty(R, K, V)
    if R:
        _launch_delta("fwd", R, C, K, V, block_v, tf32,
                      u, w, k, d, s0, hs, U, sN, N, u.stride(1), u.stride(2), w.stride(1), w.stride(2))
    return hs, U, sN


def _row_strided(t: Tensor) -> Tensor:
    """t [R, N, C, X] as the kernels read it: unit stride along X and R's stride N times N's (rows r·N + n evenly
    spaced); any C and N strides. KDA's w and u, column slices of one [.., C, K + V] tensor, pass as they are
    (`.contiguous()` copied them: 15 same-dtype copies, 6.2 ms, in the H200 profile of a K3.1-width training step,
    gone since)."""
    ok = t.stride(-1) == 1 and (t.shape[0] <= 1 or t.shape[1] == 0 or t.stride(0) == t.shape[1] * t.stride(1))
    return t if ok else t.contiguous()


def delta_states_bwd(w: Tensor, k: Tensor, d: Tensor, dh: Tensor, dU_in: Tensor, dsN: Tensor, *,
                     block_v: int | None = None, tf32: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The sequential part of `delta_states`' backward, chunks in reverse (first order: no double backward).
    dh [R, N, K, V], dU_in [R, N, C, V] and dsN [R, K, V] are the gradients reaching S_n, U_n and S_N from outside.
    With Λ_N = dsN:

        dU_n = dU_in_n + k_n Λ_{n+1},    Λ_n = dh_n + diag(d_n) Λ_{n+1} − w_nᵀ dU_n

    Returns (dU [R, N, C, V] the total gradient of each U_n, Λ_{n+1} stacked [R, N, K, V], Λ_0 = the gradient of
    s0). The parallel rest (du = dU, dw = −dU Sᵀ, dk = U Λᵀ, dd = Σ_v S ⊙ Λ) is ordinary batched algebra."""
    _check_delta("delta_states_bwd", dict(w=w, k=k, d=d, dh=dh, dU_in=dU_in, dsN=dsN))
    R, N, C, V = dU_in.shape
    K = w.shape[-1]
    _delta_blocks(C, K, V, block_v)
    w = _row_strided(w)
    k, d, dh, dU_in, dsN = (t.contiguous() for t in (k, d, dh, dU_in, dsN))
    dU, lam, ds0 = torch.empty_like(dU_in), torch.empty_like(dh), torch.empty_like(dsN)
    if R:
        _launch_delta("bwd", R, C, K, V, block_v, tf32,
                      w, k, d, dh, dU_in, dsN, dU, lam, ds0, N, w.stride(1), w.stride(2))
    return dU, lam, ds0
