"""Triton kernels of KDA's chunk-to-chunk state pass, beside their float64 reference
(docs/numerics.md#kda-state-pass).

Registered as `kimi::kda_states` / `kimi::kda_states_bwd` in `delta_rule.py`. On the CPU they run through Triton's
interpreter (`TRITON_INTERPRET=1`), which is how CI tests them; the H200 runs the same tests compiled.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import fp32_matmuls_in_tf32, interpreted, tl, triton, triton_available

def delta_states_reference(u: Tensor, w: Tensor, k: Tensor, d: Tensor, s0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The sequential part of chunked KDA (`delta_rule.kda_chunk`): chunk n's entering state S_n, its corrected values
    U_n and the final state, for chunks n = 0..N-1 of every row (b, h) folded into the first dim:

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
    # The column block and warps are tuned on a GPU on the first call per (C, K, V) (both kernels only write their
    # outputs, so tuning reruns are harmless). With TF32 dots Triton 3.6 stages wgmma operands in shared memory:
    # only the configs that fit and matched the float64 loop on the H200 are tuned over
    # (`test_delta_states_every_tuned_config`; docs/performance.md#kda).
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
    """Run a state-pass kernel (`which`: "fwd" or "bwd") over (rows, column blocks): autotuned on a GPU unless
    `block_v` is given; fixed blocks (32 columns, 4 warps) under the interpreter. The dots in TF32 when `tf32`
    (None: when torch's float32 matmuls run in TF32), else in IEEE fp32. A given `block_v` must be one the
    precision runs with on a GPU (`_DELTA_BLOCKS`), also when interpreted."""
    BC, BK, BV = _delta_blocks(C, K, V, block_v)
    if tf32 is None:
        tf32 = fp32_matmuls_in_tf32()
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
    if len(devices) > 1 or not triton_available(devices.pop()):
        raise RuntimeError(f"{name} needs Triton and its tensors on one CUDA device (or TRITON_INTERPRET=1), got "
                           f"{ {n: str(t.device) for n, t in tensors.items()} }")


def delta_states_triton(u: Tensor, w: Tensor, k: Tensor, d: Tensor, s0: Tensor, *, block_v: int | None = None,
                        tf32: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The Triton kernel of `delta_states_reference` (same contract, float32 only): one launch for all chunks,
    programs over (rows, state column blocks), each carrying its block of the state through the chunks in
    registers. fp32 dots, in TF32 when `tf32` (default: as torch's fp32 matmuls, `_launch_delta`), else IEEE; the
    state and the sums stay fp32 either way. `block_v` fixes the column block (else autotuned on a GPU)."""
    _check_delta("delta_states_triton", dict(u=u, w=w, k=k, d=d, s0=s0))
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
    instead of being copied."""
    ok = t.stride(-1) == 1 and (t.shape[0] <= 1 or t.shape[1] == 0 or t.stride(0) == t.shape[1] * t.stride(1))
    return t if ok else t.contiguous()


def delta_states_bwd_triton(w: Tensor, k: Tensor, d: Tensor, dh: Tensor, dU_in: Tensor, dsN: Tensor, *,
                            block_v: int | None = None, tf32: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The sequential part of `delta_states_triton`'s backward, chunks in reverse (first order: no double backward).
    dh [R, N, K, V], dU_in [R, N, C, V] and dsN [R, K, V] are the gradients reaching S_n, U_n and S_N from outside.
    With Λ_N = dsN:

        dU_n = dU_in_n + k_n Λ_{n+1},    Λ_n = dh_n + diag(d_n) Λ_{n+1} − w_nᵀ dU_n

    Returns (dU [R, N, C, V] the total gradient of each U_n, Λ_{n+1} stacked [R, N, K, V], Λ_0 = the gradient of
    s0). The parallel rest (du = dU, dw = −dU Sᵀ, dk = U Λᵀ, dd = Σ_v S ⊙ Λ) is ordinary batched algebra."""
    _check_delta("delta_states_bwd_triton", dict(w=w, k=k, d=d, dh=dh, dU_in=dU_in, dsN=dsN))
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
