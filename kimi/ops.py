"""The op registry: every backend-dependent computation is a `kimi::` operator, and the one place backends plug in.

Two kinds of registration:

- `traceable(schema, fn)` for pure-PyTorch implementations (the references and the torch backends). The op is
  registered as CompositeImplicitAutograd: torch.compile sees `torch.ops.kimi.<name>` by name, then traces
  through `fn`, so Inductor fuses its arithmetic with the code around it and autograd differentiates it. No
  fake kernel or backward is written by hand: both come from `fn` itself.
- `torch.library.custom_op` (used directly) for a library or hand-written kernel: one graph
  node that Inductor does not look into, with a fake (meta) kernel giving exact output shapes, dtypes and
  strides, and a registered backward. Outputs are made contiguous and fakes use `new_empty`, so real and fake
  strides agree (COMPILE.md B.3). `grouped_mm` is the first; later Triton/cuDNN kernels follow the same form.

| op (torch.ops.kimi.*)       | Backend field             | kind      | differentiable        |
|-----------------------------|---------------------------|-----------|-----------------------|
| kda_recurrent, kda_chunk    | kda                       | traceable | yes                   |
| kda_chunk_opaque (+ _bwd)   | kda                       | opaque    | yes (recompute + vjp) |
| kda_chunk_triton            | kda                       | traceable | yes                   |
| kda_states (+ _bwd, Triton) | (inside kda_chunk_triton) | opaque    | yes (registered)      |
| kda_step (decode update)    | -                         | traceable | yes                   |
| indexer_topk                | -                         | traceable | no (integer output)   |
| sparse_mla_eager, _sdpa     | attn, mla_form            | traceable | yes                   |
| moe_experts_dense, _grouped | moe                       | traceable | yes                   |
| moe_experts_gemv            | moe (few tokens on GPU)   | traceable | yes                   |
| grouped_mm (+ _wgrad)       | (inside _grouped)         | opaque    | yes (registered)      |
| moe_gemv (Triton)           | (inside _gemv)            | opaque    | yes (via grouped_mm)  |

The model calls the functions at the bottom (`kda_core`, `indexer_topk`, `sparse_mla`, `moe_experts`); each
picks its op from the frozen `Backend` in plain Python, which torch.compile resolves at trace time. Nothing
falls back silently: an implementation that cannot run the inputs raises.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import indexer, kda, kernels, mla, moe
from .common import compute_dtype
from .config import Backend

_LIB = torch.library.Library("kimi", "DEF")   # kept alive for the life of the process: ops vanish with it


def traceable(schema: str, fn: Callable):
    """Register `fn` (positional arguments in schema order) as `kimi::<name>` with CompositeImplicitAutograd."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, fn, "CompositeImplicitAutograd")
    return getattr(torch.ops.kimi, name).default


# ---------------------------------------------------------------------------------------------- opaque: grouped_mm

@torch.library.custom_op("kimi::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Row-grouped matmul: rows offs[e-1]:offs[e] of x [N, Kd] times w[e] [Kd, M] -> [N, M].
    Wraps torch's grouped_mm kernel, whose compile-time meta function accepts only bfloat16 although the CPU
    kernel runs float32 too; this op's fake kernel serves every dtype."""
    return F.grouped_mm(x, w, offs=offs).contiguous()


@grouped_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("kimi::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(x: Tensor, dy: Tensor, offs: Tensor) -> Tensor:
    """Per-group xᵀ·dy: [E, Kd, M] from x [N, Kd], dy [N, M] split by offs (grouped_mm's weight gradient)."""
    return F.grouped_mm(x.t(), dy, offs=offs).contiguous()


@grouped_mm_wgrad.register_fake
def _(x, dy, offs):
    return x.new_empty(offs.shape[0], x.shape[1], dy.shape[1])


def _wgrad_setup(ctx, inputs, output):
    x, dy, offs = inputs
    ctx.save_for_backward(x, dy, offs)


def _wgrad_backward(ctx, gw):  # gw [E, Kd, M]: d/dx = dy·gwᵀ, d/ddy = x·gw, per group
    x, dy, offs = ctx.saved_tensors
    gw = gw.contiguous()
    return grouped_mm(dy, gw.transpose(1, 2), offs), grouped_mm(x, gw, offs), None


grouped_mm_wgrad.register_autograd(_wgrad_backward, setup_context=_wgrad_setup)


def _grouped_mm_setup(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _grouped_mm_backward(ctx, dy):   # only the gradients autograd asks for (frozen experts under LoRA: no [E, ...] dw)
    x, w, offs = ctx.saved_tensors
    dy = dy.contiguous()
    dx = grouped_mm(dy, w.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_wgrad(x, dy, offs) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


# ---------------------------------------------------------------------------------------------- opaque: moe_gemv

@torch.library.custom_op("kimi::moe_gemv", mutates_args=())
def moe_gemv(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Rows offs[e-1]:offs[e] of x [N, K] times w[e]ᵀ (w [E, M, K], any strides) -> [N, M]: `grouped_mm(x,
    w.transpose(1, 2), offs)` for a few rows (decode), as the Triton kernel in kimi/kernels.py where it can run,
    else its reference."""
    if kernels.available(x.device):
        return kernels.moe_gemv(x, w, offs)
    return kernels.moe_gemv_reference(x, w, offs)


@moe_gemv.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[1])


def _moe_gemv_backward(ctx, dy):   # y = x wᵀ per group: dx = dy w, dw = dyᵀ x (each only when asked for)
    x, w, offs = ctx.saved_tensors
    dy = dy.contiguous()
    dx = grouped_mm(dy, w.contiguous(), offs) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_wgrad(dy, x, offs) if ctx.needs_input_grad[1] else None
    return dx, dw, None


moe_gemv.register_autograd(_moe_gemv_backward, setup_context=_grouped_mm_setup)   # saves x, w, offs too


def _gemv_mm(x: Tensor, w_t: Tensor, offs: Tensor) -> Tensor:
    """`moe_gemv` behind `experts_grouped`'s grouped-matmul signature (w_t [E, K, M])."""
    return moe_gemv(x, w_t.transpose(1, 2), offs)


# ---------------------------------------------------------------------------------------------- opaque: KDA chunk

def _kda_chunk_fn(scale: float, chunk_size: int):
    return lambda q, k, v, g, beta, s0, reset: kda.kda_chunk(q, k, v, g, beta, scale=scale, initial_state=s0,
                                                            reset=reset, chunk_size=chunk_size)


@torch.library.custom_op("kimi::kda_chunk_opaque", mutates_args=())
def kda_chunk_opaque(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                     initial_state: Tensor | None, reset: Tensor | None, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """`kda.kda_chunk` as one graph node: Inductor does not trace the chunk algebra (which costs most of a KDA
    layer's compile time: its 6- and 7-dimensional masked intermediates make slow kernels to generate), and
    autograd saves only the inputs. Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32)."""
    o, s = _kda_chunk_fn(scale, chunk_size)(q, k, v, g, beta, initial_state, reset)
    return o.contiguous(), s.contiguous()


@kda_chunk_opaque.register_fake
def _(q, k, v, g, beta, scale, initial_state, reset, chunk_size=64):
    B, T, H, K = q.shape
    return v.new_empty(B, T, H, v.shape[-1]), q.new_empty(B, H, K, v.shape[-1], dtype=compute_dtype(q.dtype))


@torch.library.custom_op("kimi::kda_chunk_opaque_bwd", mutates_args=())
def kda_chunk_opaque_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                         initial_state: Tensor | None, reset: Tensor | None, chunk_size: int, do: Tensor,
                         ds: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `kda_chunk_opaque` by recomputation: the forward runs again under `torch.func.vjp` (which
    differentiates even here, below the autograd dispatch key, where `torch.autograd.grad` cannot). Returns the
    gradients of q, k, v, g, beta and the initial state (zeros when there was none)."""
    fn = _kda_chunk_fn(scale, chunk_size)
    B, T, H, K = q.shape
    s0 = initial_state if initial_state is not None else q.new_zeros(B, H, K, v.shape[-1],
                                                                    dtype=compute_dtype(q.dtype))
    _, vjp = torch.func.vjp(lambda q, k, v, g, beta, s0: fn(q, k, v, g, beta, s0, reset), q, k, v, g, beta, s0)
    return tuple(t.contiguous() for t in vjp((do, ds)))


@kda_chunk_opaque_bwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, reset, chunk_size, do, ds):
    B, H, K, V = q.shape[0], q.shape[2], q.shape[3], v.shape[-1]
    s_dtype = initial_state.dtype if initial_state is not None else compute_dtype(q.dtype)
    return (*(t.new_empty(t.shape) for t in (q, k, v, g, beta)),    # contiguous, like the real outputs
            q.new_empty(B, H, K, V, dtype=s_dtype))


def _kda_setup(ctx, inputs, output):
    q, k, v, g, beta, scale, s0, reset, chunk_size = inputs
    ctx.save_for_backward(q, k, v, g, beta, s0, reset)
    ctx.scale, ctx.chunk_size, ctx.has_s0 = scale, chunk_size, s0 is not None


def _kda_backward(ctx, do, ds):
    q, k, v, g, beta, s0, reset = ctx.saved_tensors
    grads = kda_chunk_opaque_bwd(q, k, v, g, beta, ctx.scale, s0, reset, ctx.chunk_size, do.contiguous(),
                                 ds.contiguous())
    return (*grads[:5], None, grads[5] if ctx.has_s0 else None, None, None)


kda_chunk_opaque.register_autograd(_kda_backward, setup_context=_kda_setup)


# ---------------------------------------------------------------------------------------------- opaque: KDA states

@torch.library.custom_op("kimi::kda_states", mutates_args=())
def kda_states(u: Tensor, w: Tensor, k: Tensor, d: Tensor, s0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The chunk-to-chunk state recurrence of chunked KDA in one Triton launch (`kernels.delta_states`):
    u [R, N, C, V], w, k [R, N, C, K], d [R, N, K], s0 [R, K, V] fp32 -> (entering states [R, N, K, V],
    U [R, N, C, V], final state [R, K, V])."""
    return kernels.delta_states(u, w, k, d, s0)


@kda_states.register_fake
def _(u, w, k, d, s0):
    R, N, C, V = u.shape
    return u.new_empty(R, N, w.shape[-1], V), u.new_empty(u.shape), s0.new_empty(s0.shape)


@torch.library.custom_op("kimi::kda_states_bwd", mutates_args=())
def kda_states_bwd(w: Tensor, k: Tensor, d: Tensor, dh: Tensor, dU: Tensor, dsN: Tensor) -> tuple[Tensor, Tensor,
                                                                                                   Tensor]:
    """The reverse recurrence of `kda_states`' backward (`kernels.delta_states_bwd`)."""
    return kernels.delta_states_bwd(w, k, d, dh, dU, dsN)


@kda_states_bwd.register_fake
def _(w, k, d, dh, dU, dsN):
    return dU.new_empty(dU.shape), dh.new_empty(dh.shape), dsN.new_empty(dsN.shape)


def _kda_states_setup(ctx, inputs, output):
    u, w, k, d, s0 = inputs
    hs, U, _ = output
    ctx.save_for_backward(w, k, d, hs, U)


def _kda_states_backward(ctx, dh, dU, dsN):
    w, k, d, hs, U = ctx.saved_tensors
    dh = torch.zeros_like(hs) if dh is None else dh
    dU = torch.zeros_like(U) if dU is None else dU
    dsN = hs.new_zeros(hs.shape[0], *hs.shape[2:]) if dsN is None else dsN
    dU, lam, ds0 = kda_states_bwd(w, k, d, dh, dU, dsN)      # lam[:, n]: the gradient of the state leaving chunk n
    return dU, -(dU @ hs.transpose(-1, -2)), U @ lam.transpose(-1, -2), (hs * lam).sum(-1), ds0


kda_states.register_autograd(_kda_states_backward, setup_context=_kda_states_setup)


# ---------------------------------------------------------------------------------------------- traceable ops

kda_recurrent = traceable(
    "kda_recurrent(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
    "Tensor? reset) -> (Tensor, Tensor)",
    lambda q, k, v, g, beta, scale, s0, reset: kda.kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=s0,
                                                                 reset=reset))
kda_chunk = traceable(
    "kda_chunk(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
    "Tensor? reset, int chunk_size=64) -> (Tensor, Tensor)",
    lambda q, k, v, g, beta, scale, s0, reset, chunk=64: kda.kda_chunk(q, k, v, g, beta, scale=scale, initial_state=s0,
                                                                    reset=reset, chunk_size=chunk))
kda_chunk_triton = traceable(
    "kda_chunk_triton(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
    "Tensor? reset, int chunk_size=64) -> (Tensor, Tensor)",
    lambda q, k, v, g, beta, scale, s0, reset, chunk=64: kda.kda_chunk(q, k, v, g, beta, scale=scale, initial_state=s0,
                                                                    reset=reset, chunk_size=chunk, states=kda_states))
kda_step = traceable(
    "kda_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor state) -> (Tensor, Tensor)",
    lambda q, k, v, g, beta, scale, state: kda.kda_step(q, k, v, g, beta, scale=scale, state=state))
indexer_topk_op = traceable(
    "indexer_topk(Tensor q, Tensor k, Tensor w, Tensor visible, int topk) -> Tensor", indexer.indexer_topk)
sparse_mla_eager = traceable(
    "sparse_mla_eager(Tensor q, Tensor c, Tensor k_pe, Tensor kv_b, Tensor visible, Tensor? topk_idx, float scale, "
    "bool absorbed) -> Tensor",
    lambda q, c, k_pe, kv_b, vis, idx, scale, absorbed: mla.sparse_mla_masked(q, c, k_pe, kv_b, vis, idx, scale=scale,
                                                                              attn="eager", absorbed=absorbed))
sparse_mla_sdpa = traceable(
    "sparse_mla_sdpa(Tensor q, Tensor c, Tensor k_pe, Tensor kv_b, Tensor visible, Tensor? topk_idx, float scale, "
    "bool absorbed) -> Tensor",
    lambda q, c, k_pe, kv_b, vis, idx, scale, absorbed: mla.sparse_mla_masked(q, c, k_pe, kv_b, vis, idx, scale=scale,
                                                                              attn="sdpa", absorbed=absorbed))
moe_experts_dense = traceable(
    "moe_experts_dense(Tensor z, Tensor idx, Tensor weight, Tensor w1, Tensor w2, Tensor w3, float beta, "
    "float? beta_lin) -> Tensor",
    lambda z, idx, w, w1, w2, w3, b, bl: moe.experts_dense(z, idx, w, w1, w2, w3, beta=b, beta_lin=bl))
moe_experts_grouped = traceable(
    "moe_experts_grouped(Tensor z, Tensor idx, Tensor weight, Tensor w1, Tensor w2, Tensor w3, float beta, "
    "float? beta_lin) -> Tensor",
    lambda z, idx, w, w1, w2, w3, b, bl: moe.experts_grouped(z, idx, w, w1, w2, w3, beta=b, beta_lin=bl,
                                                             mm=grouped_mm))

moe_experts_gemv = traceable(
    "moe_experts_gemv(Tensor z, Tensor idx, Tensor weight, Tensor w1, Tensor w2, Tensor w3, float beta, "
    "float? beta_lin) -> Tensor",
    lambda z, idx, w, w1, w2, w3, b, bl: moe.experts_grouped(z, idx, w, w1, w2, w3, beta=b, beta_lin=bl,
                                                             mm=_gemv_mm))

GEMV_MAX_TOKENS = 64
"""`Backend(moe="grouped")` runs the experts through `moe_gemv` (one pass over each chosen expert's weights) for
at most this many tokens on a GPU (decode), through `grouped_mm` above it."""


def use_gemv(z: Tensor) -> bool:
    return z.shape[0] <= GEMV_MAX_TOKENS and z.is_cuda and kernels.available(z.device)


# ---------------------------------------------------------------------------------------------- dispatch points

def kda_core(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float, backend: Backend,
             initial_state: Tensor | None = None, reset: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The KDA delta-rule recurrence (KDA.md §7). q, k [B, T, H, K] (already L2-normalized), v [B, T, H, V],
    g [B, T, H, K] log-decay, beta [B, T, H], reset [B, T] bool (state zeroed before token t).
    Returns o [B, T, H, V] in v's dtype and the final state [B, H, K, V] (fp32, or fp64 for fp64 inputs)."""
    if backend.kda == "recurrent":
        return kda_recurrent(q, k, v, g, beta, scale, initial_state, reset)
    if backend.kda == "chunk_opaque":
        return kda_chunk_opaque(q, k, v, g, beta, scale, initial_state, reset)
    if backend.kda == "chunk_triton":
        return kda_chunk_triton(q, k, v, g, beta, scale, initial_state, reset)
    return kda_chunk(q, k, v, g, beta, scale, initial_state, reset)


def indexer_topk(q: Tensor, k: Tensor, w: Tensor, visible: Tensor, topk: int, backend: Backend) -> Tensor:
    """Indexer scores and top-k (DSA.md §3): q [B, T, n, d], k [B, S, d], w [B, T, n] (scales folded in),
    visible [B, T, S] bool the candidate keys (`indexer.visible_keys(seg)` without a cache; the valid cache slots
    with one). Returns int32 [B, T, topk]: valid key positions ascending, then -1."""
    return indexer_topk_op(q, k, w, visible, topk)


def sparse_mla(q: Tensor, c: Tensor, k_pe: Tensor, kv_b: Tensor, visible: Tensor, topk_idx: Tensor | None, *,
               scale: float, backend: Backend) -> Tensor:
    """Gated MLA's attention over the selected keys (DSA.md §4): q [B, T, H, d_qk], latent c [B, S, R],
    k_pe [B, S, d_r], kv_b_proj weight, visible [B, T, S] bool the keys each query may see (document-causal, or
    the valid cache slots), top-k [B, T, k] or None (all visible keys). Returns o [B, T, H, d_v].
    See `mla.sparse_mla_masked`."""
    op = sparse_mla_eager if backend.attn == "eager" else sparse_mla_sdpa
    return op(q, c, k_pe, kv_b, visible, topk_idx, scale, backend.mla_form == "absorbed")


def moe_experts(z: Tensor, idx: Tensor, weight: Tensor, experts: dict, *, cfg, backend: Backend) -> Tensor:
    """Routed latent experts with post-down-projection weighting (MODEL.md §6.4). z [N, Z], idx [N, k] int64,
    weight [N, k] fp32, experts {w1, w3: [E, m, Z], w2: [E, Z, m]}. Returns the weighted sum [N, Z] in z's dtype."""
    if backend.moe == "dense":
        op = moe_experts_dense
    else:
        op = moe_experts_gemv if use_gemv(z) else moe_experts_grouped
    return op(z, idx, weight, experts["w1"], experts["w2"], experts["w3"], cfg.activation_situ_beta,
              cfg.activation_situ_linear_beta)
