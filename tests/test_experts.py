"""The routed experts (kimi/ops/experts.py): every implementation against a loop reference in the order of the
released inference code, the grouped path's gradients against the dense reference, and grouped_mm against a loop."""

import pytest
import torch

from helpers import rel_err, router_params, tiny
from kimi.common import situ_glu
from kimi.moe import route
from kimi.ops.experts import moe_experts_dense, moe_experts_grouped


def _experts(cfg, dtype):
    E, m, Z = cfg.num_experts, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    return {"w1": torch.randn(E, m, Z, dtype=dtype) * 0.2, "w3": torch.randn(E, m, Z, dtype=dtype) * 0.2,
            "w2": torch.randn(E, Z, m, dtype=dtype) * 0.2}


def _run(impl, z, idx, w, ex, cfg):
    return impl(z, idx, w, ex["w1"], ex["w2"], ex["w3"], beta=cfg.activation_situ_beta,
                beta_lin=cfg.activation_situ_linear_beta)


def _loop_reference(z, idx, w, experts, cfg):
    """HF moe_infer order: each chosen expert's output rounded to the activation dtype, then
    fp32 weight multiply and fp32 sum over slots, rounded once."""
    out = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32 if z.dtype != torch.float64 else torch.float64)
    for n in range(z.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[n, j]
            h = situ_glu(z[n] @ experts["w1"][e].T, z[n] @ experts["w3"][e].T, cfg.activation_situ_beta,
                         cfg.activation_situ_linear_beta)
            out[n] += (h @ experts["w2"][e].T).to(out.dtype) * w[n, j].to(out.dtype)
    return out.to(z.dtype)


@pytest.mark.parametrize("impl", [moe_experts_dense, moe_experts_grouped])
def test_experts_match_loop_reference(impl):
    cfg = tiny()
    for dtype, tol in [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float64, 1e-13)]:
        if impl is moe_experts_grouped and dtype == torch.float64:
            with pytest.raises(ValueError, match="dense"):
                _run(impl, torch.zeros(2, cfg.routed_expert_hidden_size, dtype=dtype),
                     torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2), _experts(cfg, dtype), cfg)
            continue
        z = torch.randn(24, cfg.routed_expert_hidden_size, dtype=dtype)
        idx, w = route(router_params(cfg, torch.float32), torch.randn(24, cfg.hidden_size), cfg)
        ex = _experts(cfg, dtype)
        assert rel_err(_run(impl, z, idx, w, ex, cfg), _loop_reference(z, idx, w, ex, cfg)) < tol


def test_grouped_gradients_equal_dense():
    cfg = tiny()
    z0 = torch.randn(40, cfg.routed_expert_hidden_size)
    idx, w0 = route(router_params(cfg, torch.float32), torch.randn(40, cfg.hidden_size), cfg)
    ex0 = _experts(cfg, torch.float32)
    probe = torch.randn(40, cfg.routed_expert_hidden_size)
    grads = []
    for impl in (moe_experts_dense, moe_experts_grouped):
        z, w = z0.clone().requires_grad_(), w0.clone().requires_grad_()
        ex = {k: v.clone().requires_grad_() for k, v in ex0.items()}
        (_run(impl, z, idx, w, ex, cfg) * probe).sum().backward()
        grads.append([z.grad, w.grad, *(ex[k].grad for k in ("w1", "w2", "w3"))])
    for a, b in zip(*grads):
        assert rel_err(a, b) < 1e-5


def test_grouped_mm_gradients_match_loop():
    offs = torch.tensor([2, 2, 7, 10], dtype=torch.int32)
    x = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(4, 16, 8, requires_grad=True)
    probe = torch.randn(10, 8)
    (torch.ops.kimi.grouped_mm(x, w, offs) * probe).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    bounds = [0, *offs.tolist()]
    ref = torch.cat([x2[a:b] @ w2[e] for e, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    (ref * probe).sum().backward()
    assert rel_err(x.grad, x2.grad) < 1e-6 and rel_err(w.grad, w2.grad) < 1e-6
