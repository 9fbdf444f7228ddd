"""FSDP2 over several processes (docs/architecture.md#fsdp): the leaves of each decoder layer are owned by a thin
`nn.Module` unit that `fully_shard` wraps; the root unit owns the rest (embedding, output mix, final norm, head) and
runs `kimi.forward`'s own layer loop with the layer units in the place of the layers' subtrees.

Why units and not DTensor leaves in the functional forward: FSDP2's hooks all-gather one layer just before it runs
and free it after, with prefetching, on stock PyTorch; the DTensor route would gather the whole tree up front in
eager mode and relies on compiler passes to get per-layer memory (docs/compile.md#fsdp). Each unit is compiled on
its own: FSDP2's hooks cannot be traced.
"""

from __future__ import annotations

import warnings

from torch import Tensor, nn

from . import lora, model
from .config import Backend, ModelConfig
from .ranges import KeyRanges
from .loss import token_loss_sum
from .model import compile_options, head_weight, layer_step, recomputed
from .params import tree_items, unflatten
from .training import cast_tree


class _Unit(nn.Module):
    """An FSDP2 unit: owns some leaves of the tree (and their adapters) and calls a pure function with the
    subtree rebuilt at call time. Parameter names are the dotted paths with '/' for '.' (a module's parameter
    names cannot hold dots); adapters are 'lora:<path>:A' and 'lora:<path>:B'."""

    def __init__(self, leaves: dict[str, nn.Parameter], adapters: dict, prefix: str, ctx: dict):
        super().__init__()
        self.prefix, self.ctx = prefix, ctx
        for path, p in leaves.items():
            self.register_parameter(path.replace(".", "/"), p)
        for path, ab in adapters.items():
            for k, p in ab.items():
                self.register_parameter(f"lora:{path.replace('.', '/')}:{k}", p)

    def subtree(self):
        """The owned subtree (paths relative to `prefix`), adapters applied, in the compute dtype."""
        base, adapters = {}, {}
        for name, p in self.named_parameters(recurse=False):
            if name.startswith("lora:"):
                _, path, k = name.split(":")
                adapters.setdefault(path.replace("/", ".")[len(self.prefix):], {})[k] = p
            else:
                base[name.replace("/", ".")[len(self.prefix):]] = p
        tree = unflatten(base)
        c = self.ctx
        if adapters:
            tree = lora.apply(tree, adapters, c["lora_scale"])
        return cast_tree(tree, c["dtype"], c["fp32_paths"], self.prefix)


class _Layer(_Unit):
    """One decoder layer: `kimi.model.layer_step` on the gathered subtree (its casts and adapters inside the
    recomputed region with activation checkpointing, so they are not kept either)."""

    def forward(self, h: Tensor, R: list[Tensor], plan: tuple[str, bool, bool], ranges: KeyRanges, reset: Tensor,
                cp=None):
        c = self.ctx
        run = recomputed(self._step) if c["recompute"] else self._step
        extra = {} if cp is None else {"cp": cp}
        return run(None, h, list(R), plan, c["cfg"], c["backend"], ranges=ranges, reset=reset, **extra)

    def _step(self, _, h, R, plan, cfg, backend, **kwargs):
        return layer_step(self.subtree(), h, R, plan, cfg, backend, **kwargs)


def _run_unit(unit: _Layer, h, R, plan, cfg, backend, *, ranges, reset, cache=None, step=None, cp=None):
    """`kimi.forward`'s `layer=`: the tree's entry for layer i is its unit, called through its FSDP2 hooks."""
    return unit(h, R, plan, ranges, reset, cp)


class _Root(_Unit):
    """Everything outside the layers, and the layer units in order."""

    def __init__(self, leaves, adapters, layers: list[_Layer], ctx):
        super().__init__(leaves, adapters, "", ctx)
        self.layers = nn.ModuleList(layers)

    def forward(self, input_ids: Tensor, labels: Tensor, document_ids: Tensor) -> Tensor:
        """The summed label-token loss of a micro-batch (each [B, T]; the arguments of `kimi.training.loss_sum`
        after the trees). The head's weight is gathered only inside this call. Under context parallelism the
        micro-batch holds whole rows and the loss is that of this rank's tokens (as `loss_sum(cp=)`)."""
        c = self.ctx
        tree = self.subtree()
        tree["model"]["layers"] = list(self.layers)
        cp = c["cp"]
        if cp is not None:
            input_ids, labels, document_ids = (cp.shard(t) for t in (input_ids, labels, document_ids))
        h = model.forward(tree, input_ids, c["cfg"], c["backend"], document_ids=document_ids,
                          max_document_len=c["max_document_len"], head=False, layer=_run_unit,
                          **({} if cp is None else {"cp": cp}))
        return token_loss_sum(h, head_weight(tree, c["cfg"]), labels)


def build_fsdp(params, adapters: dict, *, cfg: ModelConfig, backend: Backend, dtype, fp32_paths: frozenset[str],
               lora_scale: float, compile_units: bool, max_document_len: int | None = None,
               recompute: bool = False, cp=None) -> _Root:
    """Shard the tree (and the adapters) over all processes: one FSDP2 unit per decoder layer, the root unit for the
    rest. Calling the root gives a micro-batch's summed loss, as `kimi.training.loss_sum` does in one process
    (`max_document_len` as `kimi.forward` takes it). `recompute`: activation checkpointing of every layer unit
    (`kimi.model.recomputed`). `cp`: context parallelism (`kimi.cp.ContextParallel` over a subgroup of the
    processes, e.g. a mesh's "cp" dimension): the ranks of a group share each row; the weights stay sharded over
    all processes, whose gradient average then covers data-parallel rows and context-parallel shares alike."""
    from torch.distributed.fsdp import fully_shard

    # A layer returns the attention-residual entries R, some of which are views; nothing here updates a unit's
    # output in place (the case that warning is about), so it is noise on every call.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

    ctx = dict(cfg=cfg, backend=backend, dtype=dtype, fp32_paths=fp32_paths, lora_scale=lora_scale,
               max_document_len=max_document_len, recompute=recompute, cp=cp)
    flat = dict(tree_items(params))
    layers = []
    for i in range(len(params["model"]["layers"])):
        pre = f"model.layers.{i}."
        unit = _Layer({p: v for p, v in flat.items() if p.startswith(pre)},
                      {p: v for p, v in adapters.items() if p.startswith(pre)}, pre, ctx)
        if compile_units:
            unit.compile(**compile_options(fullgraph=True))
        fully_shard(unit)
        layers.append(unit)
    root = _Root({p: v for p, v in flat.items() if not p.startswith("model.layers.")},
                 {p: v for p, v in adapters.items() if not p.startswith("model.layers.")}, layers, ctx)
    fully_shard(root)
    return root


def sharded_trainable_named(root: _Root) -> dict[str, nn.Parameter]:
    """The trained (sharded) leaves by the names `kimi.training.trainable_named` gives them in one process, sorted:
    what the optimizer steps and the training checkpoint holds."""
    out = {}
    for name, p in root.named_parameters():
        name = name.split(".")[-1]
        if p.requires_grad:
            out[name[5:].replace("/", ".") if name.startswith("lora:") else name.replace("/", ".")] = p
    return dict(sorted(out.items()))


def gather(root: _Root) -> tuple[dict, dict]:
    """(params, adapters) as full CPU tensors, the tree rebuilt: a collective, every process must call it."""
    full = {name.split(".")[-1]: full_cpu(p) for name, p in root.named_parameters()}
    params = unflatten({n.replace("/", "."): v for n, v in full.items() if not n.startswith("lora:")})
    adapters = {}
    for n, v in full.items():
        if n.startswith("lora:"):
            _, path, k = n.split(":")
            adapters.setdefault(path.replace("/", "."), {})[k] = v
    return params, adapters


def full_cpu(t: Tensor) -> Tensor:
    """A full CPU copy (a DTensor is gathered: a collective, every process must call it)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True)
