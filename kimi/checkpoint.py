"""Checkpoints: safetensors in and out (sharded, indexed), and the MXFP4 expert format (docs/checkpoints.md).

The parameter tree's paths are the file's tensor names without the `language_model.` prefix (params.py), with two
layout differences handled here:
- routed experts are stacked in the tree (`...experts.w1` [E, m, Z]) and stored per expert in the file
  (`...experts.{e}.w1.weight` [m, Z], or the MXFP4 pair `.weight_packed` [m, Z/2] + `.weight_scale` [m, Z/32]);
- `A_log` is [H] in the tree and [H] or zero-padded to a multiple of 128 in the file (docs/checkpoints.md#a-log).

`load_checkpoint` checks every name, shape and dtype from the headers before it reads any tensor data and reports
all problems in one `CheckpointError`; `save_checkpoint` writes into a temporary sibling folder and renames it into
place, so `path` always holds either the old or the new checkpoint.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from .config import DTYPES, ModelConfig
from .params import Spec, Tree, leaf_dtype, param_specs, to_dtype, tree_items, tree_map

PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
INDEX_FILE = "model.safetensors.index.json"
A_LOG_PAD = 128  # A_log is stored zero-padded to a multiple of this (docs/checkpoints.md#a-log)


class CheckpointError(ValueError):
    """A checkpoint folder that does not match the config: missing, unexpected or mis-shaped tensors, missing
    shards, a bad index or config. The message lists every problem found."""


# ============================================================================================== MXFP4

# E2M1 code -> value. Bit 3 is the sign; code 8 is -0.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between consecutive E2M1 magnitudes (codes 0..7), for round-to-nearest.
_E2M1_MID = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
GROUP = 32


@functools.cache
def _pow2_table(dtype: torch.dtype) -> Tensor:
    """2^(s-127) for every E8M0 byte s, exact (math.ldexp), then cast: in float32/bfloat16 s = 255 is inf and
    no special case is made (as the reference implementation's ldexp)."""
    return torch.tensor([math.ldexp(1.0, s - 127) for s in range(256)], dtype=torch.float64).to(dtype)


def _lookup(table: Tensor, idx: Tensor) -> Tensor:
    """table[idx] for an integer tensor of any shape (index_select: CPU advanced indexing is ~1000x slower here)."""
    return table.index_select(0, idx.reshape(-1).long()).view(idx.shape)


def _check_mxfp4(packed: Tensor, scale: Tensor) -> None:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"mxfp4: weight_packed and weight_scale must be uint8, got {packed.dtype} and {scale.dtype}")
    if packed.ndim < 1 or packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] != 16 * scale.shape[-1]:
        raise ValueError(f"mxfp4: weight_packed {list(packed.shape)} and weight_scale {list(scale.shape)} do not "
                         "match: expected [..., in/2] and [..., in/32] (one scale byte per 16 packed bytes)")


def mxfp4_decode(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16, *,
                 out: Tensor | None = None) -> Tensor:
    """MXFP4 -> float (docs/checkpoints.md#mxfp4). packed uint8 [..., out, in/2], scale uint8 [..., out, in/32] ->
    [..., out, in].

    Byte j of a row holds element 2j in its low nibble and 2j+1 in its high nibble; element value is
    E2M1[code] · 2^(s-127) with s the group's scale byte (groups of 32 along the row). Exact: the product is
    formed in float32 (float64 for a float64 result), where it is a power-of-two multiple of a 2-bit value, so
    only overflow (s near 255) or a narrower result dtype (float16) rounds. `out`, if given, receives the result
    (any strides, e.g. one expert of a stacked tensor) and is returned.
    """
    _check_mxfp4(packed, scale)
    if out is not None:
        dtype = out.dtype
    work = torch.float64 if dtype == torch.float64 else torch.float32
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)  # [..., in], low nibble first
    values = _lookup(torch.tensor(_E2M1, dtype=work, device=packed.device), codes)
    pow2 = _lookup(_pow2_table(work).to(packed.device), scale)  # [..., in/32]
    w = (values.unflatten(-1, (-1, GROUP)) * pow2.unsqueeze(-1)).flatten(-2)
    if out is None:
        return w.to(dtype)
    if out.shape != w.shape:
        raise ValueError(f"mxfp4: out has shape {list(out.shape)}, the decoded weight is {list(w.shape)}")
    return out.copy_(w)


def mxfp4_encode(w: Tensor) -> tuple[Tensor, Tensor]:
    """float [..., out, in] -> (packed uint8 [..., out, in/2], scale uint8 [..., out, in/32]); inverts `mxfp4_decode`.

    Scale: per group of 32 along `in`, the smallest s in 0..255 with max|x| <= 6 · 2^(s-127) (so nothing clips;
    a group beyond 6 · 2^128 takes s = 255 and saturates at ±6 · 2^128). An all-zero group gets s = 127 (scale 1).
    Codes: each x / 2^(s-127) rounds to the nearest E2M1 value, ties to the even code (IEEE round-half-even on
    the mantissa bit: 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4). The sign bit is kept, so -0.0 and negatives that
    round to zero give code 8 (-0).
    Hence decode(encode(w)) is, per element, the nearest value on its group's grid, and a representable tensor
    comes back bit-exactly; encode(decode(p, s)) == (p, s) whenever each group's largest magnitude is 4 or 6 (else
    the scale is the equivalent smaller one; see tests/test_checkpoint.py).
    """
    if not w.is_floating_point():
        raise ValueError(f"mxfp4_encode: expected a floating-point tensor, got {w.dtype}")
    if w.ndim < 1 or w.shape[-1] % GROUP:
        raise ValueError(f"mxfp4_encode: the input dim (last) must be divisible by {GROUP}, got shape {list(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("mxfp4_encode: the weight has inf or NaN entries")
    x = w.detach().to(torch.float64).unflatten(-1, (-1, GROUP))  # [..., G, 32]; float64 makes the scaling exact
    amax = x.abs().amax(-1)  # [..., G]
    pow2 = _pow2_table(torch.float64).to(x.device)
    # log2 gives s to within one; the two exact comparisons below settle it.
    est = torch.ceil(torch.log2(amax.clamp_min(1e-300) / 6.0)).clamp(-200, 200).long() + 127
    s = est.clamp(0, 255)
    for _ in range(2):
        s = torch.where((amax > 6.0 * _lookup(pow2, s)) & (s < 255), s + 1, s)
        lower = (s - 1).clamp_min(0)
        s = torch.where((amax <= 6.0 * _lookup(pow2, lower)) & (s > 0), lower, s)
    s = torch.where(amax == 0, torch.full_like(s, 127), s)
    y = (x.abs() / _lookup(pow2, s).unsqueeze(-1)).clamp_max(6.0)  # |x| in units of the scale, in [0, 6]
    down = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)  # at a midpoint: the lower code
    up = torch.zeros_like(down)  # at a midpoint: the upper code
    for m in _E2M1_MID:
        down += y > m
        up += y >= m
    mag = torch.where(down % 2 == 0, down, up)  # they differ only at ties; take the even code
    codes = (mag + 8 * torch.signbit(x).to(torch.uint8)).flatten(-2)  # [..., in]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), s.to(torch.uint8)


# ============================================================================================== names

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
              "BOOL": torch.bool}
_FLOAT_FILE_DTYPES = ("F64", "F32", "F16", "BF16")
_EXPERT_LEAF = re.compile(r"(.*\.block_sparse_moe\.experts\.)(w[123])$")


def _a_log_padded(h: int) -> int:
    return math.ceil(h / A_LOG_PAD) * A_LOG_PAD


@dataclass(frozen=True)
class _Want:
    """One expected tensor of the file (names without prefix)."""

    path: str  # tree path of the leaf it goes to
    spec: Spec
    shapes: tuple[tuple[int, ...], ...]  # accepted file shapes (A_log: [H] and padded)
    expert: int | None = None  # index into the stacked leaf


def _expected(cfg: ModelConfig) -> tuple[dict[str, _Want], dict[str, _Want]]:
    """(plain tensors by file name, routed experts by base name `...experts.{e}.w1`), both without prefix."""
    plain, experts = {}, {}
    for path, spec in tree_items(param_specs(cfg)):
        if m := _EXPERT_LEAF.match(path):
            for e in range(spec.shape[0]):
                experts[f"{m[1]}{e}.{m[2]}"] = _Want(path, spec, (spec.shape[1:],), e)
        elif path.endswith(".A_log"):
            (h,) = spec.shape
            plain[path] = _Want(path, spec, tuple(dict.fromkeys([(h,), (_a_log_padded(h),)])))
        else:
            plain[path] = _Want(path, spec, (spec.shape,))
    return plain, experts


def _natural(name: str) -> list:
    """Sort key: layers.2 before layers.10."""
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name)]


def _fmt(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


# ============================================================================================== load

@dataclass
class _Header:
    file: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string, e.g. "BF16"


class _Problems:
    """Problems by kind, reported together; at most `cap` listed per kind."""

    KINDS = ("files", "index", "missing", "unexpected", "mis-shaped", "wrong dtype")

    def __init__(self, where: str, cap: int = 20):
        self.where, self.cap = where, cap
        self.items: dict[str, list[str]] = defaultdict(list)
        self.hints: list[str] = []

    def add(self, kind: str, text: str) -> None:
        self.items[kind].append(text)

    def hint(self, text: str) -> None:
        if text not in self.hints:
            self.hints.append(text)

    def __bool__(self) -> bool:
        return any(self.items.values())

    def raise_if_any(self) -> None:
        if not self:
            return
        n = sum(len(v) for v in self.items.values())
        lines = [f"checkpoint {self.where}: {n} problem(s); nothing was loaded"]
        for kind in self.KINDS:
            got = self.items.get(kind, [])
            if got:
                lines.append(f"  {kind} ({len(got)}):")
                lines += [f"    {t}" for t in got[: self.cap]]
                if len(got) > self.cap:
                    lines.append(f"    ... and {len(got) - self.cap} more")
        lines += [f"  hint: {h}" for h in self.hints]
        raise CheckpointError("\n".join(lines))


def _read_config(folder: Path) -> ModelConfig:
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"checkpoint {folder}: no config.json")
    try:
        return ModelConfig.from_hf(folder / "config.json")
    except ValueError as e:
        raise CheckpointError(f"checkpoint {folder}: bad config.json: {e}") from e


def _scan_headers(folder: Path, problems: _Problems) -> dict[str, _Header]:
    """Every tensor name of the checkpoint -> (file, shape, dtype), from the index (if any) and the shard headers.
    Names the index places in a missing shard are left out (the missing shard is the reported problem)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError("weight_map must map tensor names to file names")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint {folder}: bad {INDEX_FILE}: {e!r}") from e
        by_file: dict[str, list[str]] = defaultdict(list)
        for name, file in weight_map.items():
            by_file[file].append(name)
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if len(files) != 1:
            raise CheckpointError(
                f"checkpoint {folder}: no {INDEX_FILE} and {len(files)} *.safetensors files {files[:5]}; "
                "expected an index (sharded) or exactly one .safetensors file")
        by_file = {files[0]: None}  # every tensor of the one file

    headers: dict[str, _Header] = {}
    for file in sorted(by_file):
        names = by_file[file]
        if not (folder / file).is_file():
            problems.add("files", f"{file}: listed in {INDEX_FILE} for {len(names)} tensor(s) but not in the folder")
            continue
        try:
            with safe_open(folder / file, framework="pt") as f:
                present = set(f.keys())
                for name in (sorted(present) if names is None else names):
                    if name not in present:
                        problems.add("index", f"{name}: {INDEX_FILE} places it in {file}, which does not hold it")
                        continue
                    sl = f.get_slice(name)
                    headers[name] = _Header(file, tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # a corrupt or truncated header: report it with the rest
            problems.add("files", f"{file}: cannot read the safetensors header ({e})")
    return headers


def _match(cfg: ModelConfig, headers: dict[str, _Header], problems: _Problems):
    """Match file tensors to the tree. Returns the read plan {file: [(name, role, want)]} where role is
    'plain', 'packed' or 'scale'. Adds every mismatch to `problems`."""
    prefixed = any(n.startswith(PREFIX) for n in headers)
    pre = PREFIX if prefixed else ""
    text: dict[str, _Header] = {}
    stray: list[str] = []  # file names that are neither text nor vision
    for name, h in headers.items():
        if name.startswith(VISION_PREFIXES):
            continue
        if prefixed and not name.startswith(PREFIX):
            stray.append(name)
        else:
            text[name[len(pre):]] = h
    plain, experts = _expected(cfg)
    plan: dict[str, list[tuple[str, str, _Want]]] = defaultdict(list)
    used: set[str] = set()
    missing: list[str] = []

    def check(name: str, want: _Want, shapes, dtypes, what: str) -> None:
        h = text[name]
        used.add(name)
        if h.shape not in shapes:
            msg = f"{pre}{name}: {_fmt(h.shape)} in {h.file}, expected {' or '.join(map(_fmt, shapes))}"
            if len(h.shape) == 2 and h.shape[::-1] in shapes:
                msg += "; is this a transposed export?"
            if name.endswith(".A_log"):
                msg += f" (A_log is [H] or zero-padded to a multiple of {A_LOG_PAD})"
            problems.add("mis-shaped", msg)
        elif h.dtype not in dtypes:
            problems.add("wrong dtype", f"{pre}{name}: {h.dtype} in {h.file}, expected {what}")
        else:
            mx = want.expert is not None and name.endswith(("_packed", "_scale"))
            plan[h.file].append((pre + name, name.rsplit("_", 1)[-1] if mx else "plain", want))

    for name, want in plain.items():
        if name in text:
            check(name, want, want.shapes, _FLOAT_FILE_DTYPES, "a float dtype")
        else:
            missing.append(name)
    for base, want in experts.items():
        (m, z) = want.shapes[0]
        w, p, s = f"{base}.weight", f"{base}.weight_packed", f"{base}.weight_scale"
        has = [n in text for n in (w, p, s)]
        if has[0] and (has[1] or has[2]):
            used.update(n for n in (w, p, s) if n in text)
            problems.add("unexpected", f"{pre}{base}: both a plain .weight and MXFP4 .weight_packed/.weight_scale")
        elif has[0]:
            check(w, want, want.shapes, _FLOAT_FILE_DTYPES, "a float dtype")
        elif has[1] or has[2]:
            if z % GROUP:
                problems.add("mis-shaped", f"{pre}{base}: MXFP4 needs the input dim {z} divisible by {GROUP}")
                used.update(n for n in (p, s) if n in text)
                continue
            for n, ok, shape in ((p, has[1], (m, z // 2)), (s, has[2], (m, z // GROUP))):
                if ok:
                    check(n, want, (shape,), ("U8",), "U8 (MXFP4)")
                else:
                    missing.append(f"{n} (its MXFP4 partner is present)")
        else:
            missing.append(f"{w} (or .weight_packed + .weight_scale)")

    unexpected = [pre + n for n in text if n not in used] + stray
    problems.items["missing"] += [pre + n for n in missing]
    problems.items["unexpected"] += sorted(unexpected, key=_natural)
    _hints(cfg, text, missing, unexpected, stray, pre, problems)
    return plan


def _hints(cfg, text, missing, unexpected, stray, pre, problems: _Problems) -> None:
    """Likely causes of whole families of missing/unexpected tensors."""
    file_idx = any(".indexer." in n for n in text)
    if any(".indexer." in n for n in missing) and not file_idx:
        problems.hint("the config has indexer fields (index_n_heads / index_head_dim / index_topk) but the checkpoint "
                      "has no indexer tensors: is this a K3 checkpoint loaded with a K3.1 Pro config? Remove the "
                      "index_* fields from config.json to load it as K3")
    if file_idx and not cfg.has_indexer:
        problems.hint("the checkpoint has indexer tensors but the config has no index_* fields: a K3.1 Pro "
                      "checkpoint with a K3 config.json?")
    L, E = cfg.num_hidden_layers, cfg.num_experts
    layer = re.compile(r"model\.layers\.(\d+)\.")
    file_layers = {int(m[1]) for n in text if (m := layer.match(n))}
    if extra := sorted(i for i in file_layers if i >= L):
        problems.hint(f"the checkpoint has layers up to {extra[-1]} but num_hidden_layers is {L}")
    if absent := sorted(set(range(L)) - file_layers):
        problems.hint(f"the checkpoint has no tensors for layer(s) {absent[:10]}{' ...' if len(absent) > 10 else ''}"
                      f" while num_hidden_layers is {L}: a truncated checkpoint?")
    expert = re.compile(r".*\.experts\.(\d+)\.")
    if any((m := expert.match(n)) and int(m[1]) >= E for n in unexpected):
        problems.hint(f"the checkpoint has experts numbered {E} or higher but num_experts is {E}")
    if any(n.startswith(("model.", "lm_head.")) for n in stray):
        problems.hint(f"some text tensors lack the {PREFIX!r} prefix that the others carry")


def load_checkpoint(path: str | os.PathLike, dtype: str | torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> tuple[ModelConfig, Tree]:
    """Load a Hugging Face checkpoint folder into a parameter tree.

    Args:
        path: folder with `config.json` (text-only or the multimodal wrapper) and either
            `model.safetensors.index.json` + shards or one `*.safetensors` file. Text tensors may carry the
            `language_model.` prefix (vision tensors are then skipped) or none (a text-only export). Routed
            experts may be plain or MXFP4, per expert.
        dtype: dtype name of the tree (default: the config's `dtype`); fp32-kept leaves stay fp32 (`leaf_dtype`).
        device: where the leaves live.
    Returns: (config, tree of `nn.Parameter` with `requires_grad = spec.trainable`).
    Raises: CheckpointError listing every missing, unexpected, mis-shaped or wrong-dtype tensor, missing shard
        and bad index entry, found from the headers alone, before any tensor data is read.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    cfg = _read_config(folder)
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    dt = to_dtype(dtype or cfg.dtype)
    device = torch.device(device)

    problems = _Problems(str(folder))
    headers = _scan_headers(folder, problems)
    if problems:   # unreadable or absent files: their tensors would all be reported "missing", with wrong hints
        problems.raise_if_any()
    plan = _match(cfg, headers, problems)
    problems.raise_if_any()

    # Everything checks out: allocate the whole tree, then read each shard once, in order.
    leaves = {p: torch.empty(s.shape, dtype=leaf_dtype(s, dt), device=device) for p, s in tree_items(param_specs(cfg))}
    pending: dict[tuple[str, int], dict[str, Tensor]] = {}  # MXFP4 halves whose partner sits in a later shard
    for file in sorted(plan):
        with safe_open(folder / file, framework="pt") as f:
            for name, role, want in plan[file]:
                t = f.get_tensor(name)
                dest = leaves[want.path]
                if role == "plain":
                    if want.expert is not None:
                        dest[want.expert].copy_(t)
                    else:  # A_log: drop the padding (its values are not used)
                        dest.copy_(t[: want.spec.shape[0]] if name.endswith(".A_log") else t)
                    continue
                half = pending.setdefault((want.path, want.expert), {})
                half[role] = t.to(device)
                if len(half) == 2:
                    mxfp4_decode(half["packed"], half["scale"], out=dest[want.expert])
                    del pending[(want.path, want.expert)]
    assert not pending, "internal: unpaired MXFP4 halves after a complete check"

    return cfg, tree_map(lambda path, spec: nn.Parameter(leaves[path], requires_grad=spec.trainable),
                         param_specs(cfg))


# ============================================================================================== save

def _quantization_config() -> dict:
    """compressed-tensors MXFP4, weight-only, as the release describes it (docs/checkpoints.md#mxfp4)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "group_size": GROUP, "strategy": "group",
                        "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"},
            "input_activations": None,
            "output_activations": None,
        }},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    }


def _model_dtype(cfg: ModelConfig, params: Tree) -> str:
    """The tree's dtype, from its non-fp32-kept leaves; checks the tree against the spec tree on the way."""
    specs = dict(tree_items(param_specs(cfg)))
    got = dict(tree_items(params))
    problems = _Problems("(save)")
    for p in specs.keys() - got.keys():
        problems.add("missing", p)
    for p in got.keys() - specs.keys():
        problems.add("unexpected", p)
    dtypes = set()
    for p in specs.keys() & got.keys():
        t, s = got[p], specs[p]
        if not isinstance(t, Tensor) or tuple(t.shape) != s.shape:
            problems.add("mis-shaped", f"{p}: {_fmt(getattr(t, 'shape', '?'))}, expected {_fmt(s.shape)}")
        elif not t.is_floating_point():
            problems.add("wrong dtype", f"{p}: {t.dtype}")
        elif not s.fp32:
            dtypes.add(str(t.dtype).removeprefix("torch."))
    if len(dtypes) > 1:
        problems.add("wrong dtype", f"leaves mix dtypes {sorted(dtypes)}")
    problems.raise_if_any()
    (name,) = dtypes or {cfg.dtype}
    if name not in DTYPES:
        raise CheckpointError(f"save: dtype {name} is not one of {DTYPES}")
    return name


def _fsync_file(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(p: Path, obj) -> None:
    with open(p, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(path: str | os.PathLike, cfg: ModelConfig, params: Tree, *, max_shard_bytes: int = 2**30,
                    experts: Literal["plain", "mxfp4"] = "plain", wrap: bool = True) -> None:
    """Write a checkpoint folder that `load_checkpoint` (and the release's layout, docs/checkpoints.md#layout) reads.

    Args:
        path: the folder. Written atomically: everything goes into a temporary sibling folder, is fsynced, and is
            renamed into place; an existing checkpoint folder at `path` is replaced (as a whole) only then.
        cfg: the model; `config.json` gets `cfg.to_hf()` with `dtype` set to the tree's actual dtype.
        params: the tree (shapes checked against `param_specs(cfg)`).
        max_shard_bytes: shards are filled in tree order up to this many tensor bytes (a bigger tensor gets its own).
        experts: "plain": routed experts stored per expert in the tree's own dtype (bit-exact round trip);
            "mxfp4": per-expert `.weight_packed` / `.weight_scale` pairs, rounded to nearest (`mxfp4_encode`),
            plus a compressed-tensors `quantization_config`.
        wrap: True writes the release layout (multimodal wrapper config, `language_model.` tensor names); False a
            text-only export (plain text config, unprefixed names).
    """
    if experts not in ("plain", "mxfp4"):
        raise ValueError(f"experts={experts!r}: expected 'plain' or 'mxfp4'")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    dtype = _model_dtype(cfg, params)
    folder = Path(path)
    if folder.exists() and not (folder.is_dir() and (not any(folder.iterdir()) or (folder / "config.json").exists())):
        raise FileExistsError(f"{folder} exists and is not a checkpoint folder (no config.json); not replacing it")

    text = cfg.to_hf() | {"dtype": dtype}
    if experts == "mxfp4":
        text["quantization_config"] = _quantization_config()
    if wrap:
        config = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
                  "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
                  "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": cfg.tie_word_embeddings,
                  "dtype": dtype, "text_config": text}
        if experts == "mxfp4":  # Transformers reads it at the top level; the release lists it in text_config too
            config["quantization_config"] = _quantization_config()
    else:
        config = text

    # The plan: (file name, tensor producer, bytes) in tree order; producers run one shard at a time.
    pre = PREFIX if wrap else ""
    leaves = dict(tree_items(params))
    entries: list[tuple[str, Callable[[], Tensor], int]] = []
    for p, spec in tree_items(param_specs(cfg)):
        t = leaves[p]
        if m := _EXPERT_LEAF.match(p):
            E, rows, cols = t.shape
            for e in range(E):
                base = f"{pre}{m[1]}{e}.{m[2]}"
                if experts == "plain":
                    entries.append((f"{base}.weight", lambda t=t, e=e: t[e], rows * cols * t.element_size()))
                else:
                    pair = _EncodeOnce(lambda t=t, e=e: mxfp4_encode(t[e]))
                    entries.append((f"{base}.weight_packed", lambda pair=pair: pair.take(0), rows * cols // 2))
                    entries.append((f"{base}.weight_scale", lambda pair=pair: pair.take(1), rows * cols // GROUP))
        elif p.endswith(".A_log"):
            h = t.shape[0]
            entries.append((pre + p, lambda t=t, h=h: torch.cat([t.detach(), t.new_zeros(_a_log_padded(h) - h)]),
                            _a_log_padded(h) * t.element_size()))
        else:
            entries.append((pre + p, lambda t=t: t, t.numel() * t.element_size()))

    shards: list[list[tuple[str, Callable[[], Tensor], int]]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry[2] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[2]

    tmp = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        n = len(shards)
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{n:05d}.safetensors"
            tensors = {}
            for name, make, _ in shard:
                # clone: safetensors refuses tensors that share storage (expert slices of one stacked leaf)
                tensors[name] = make().detach().to("cpu").contiguous().clone()
                weight_map[name] = file
            save_file(tensors, tmp / file, metadata={"format": "pt"})
            del tensors
            _readable(tmp / file)
            _fsync_file(tmp / file)
        _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": sum(e[2] for e in entries)},
                                       "weight_map": weight_map})
        _write_json(tmp / "config.json", config)
        _fsync_file(tmp)
        _swap_into_place(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class _EncodeOnce:
    """An expert's MXFP4 (packed, scale), computed on the first take and dropped after the second (the two halves
    may land in different shards)."""

    def __init__(self, fn):
        self.fn, self.value, self.left = fn, None, 2

    def take(self, i: int) -> Tensor:
        if self.value is None:
            self.value = self.fn()
        out = self.value[i]
        self.left -= 1
        if not self.left:
            self.value = None
        return out


def _readable(path: Path) -> None:
    """Give a file the permissions any new file gets here (0666 less the umask): safetensors writes 0600."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _swap_into_place(tmp: Path, folder: Path) -> None:
    """Rename the complete `tmp` to `folder`; an old `folder` is moved aside first and deleted last, so `folder`
    is never a partial checkpoint (for an instant between the two renames it does not exist)."""
    old = None
    if folder.exists():
        old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(folder, old)
    try:
        os.rename(tmp, folder)
    except BaseException:
        if old is not None:
            os.rename(old, folder)
        raise
    _fsync_file(folder.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
