"""Configuration: the text model (`ModelConfig`, read from a Hugging Face `config.json`) and the choice of
implementations (`Backend`).

Field names are the `config.json` keys (docs/checkpoints.md#config), so a reader who knows the checkpoint knows the
config. Both classes are frozen and keyword-only: hashable, so `torch.compile` treats them as constants. Values that
follow from the fields are properties. Every check runs at construction, so a config that exists is valid.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, get_args

DTYPES = ("bfloat16", "float16", "float32", "float64")


def _k3_layer_lists(num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """K3's pattern (1-based): every 4th layer and the last are gated MLA, the rest KDA."""
    full = sorted(set(range(4, num_layers + 1, 4)) | {num_layers})
    kda = [i for i in range(1, num_layers + 1) if i not in full]
    return tuple(kda), tuple(full)


@dataclass(frozen=True, kw_only=True)
class KDAConfig:
    """`linear_attn_config`: the KDA layers and which layers they are."""

    num_heads: int
    head_dim: int
    short_conv_kernel_size: int = 4
    use_full_rank_gate: bool = True
    gate_lower_bound: float | None = -5.0
    """Bounded decay gate `lb·sigmoid(e^A·(f+dt_bias))` (K3); None selects the softplus gate (Kimi Linear)."""
    kda_layers: tuple[int, ...]
    """1-based layer numbers that are KDA."""
    full_attn_layers: tuple[int, ...]
    """1-based layer numbers that are gated MLA."""

    def __post_init__(self):
        _check_positive(self, "num_heads", "head_dim", "short_conv_kernel_size")
        if self.gate_lower_bound is not None and not self.gate_lower_bound < 0:
            raise ValueError(f"linear_attn_config.gate_lower_bound must be negative or null, got {self.gate_lower_bound}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The Kimi K3 / K3.1 Pro text model. Build it with `ModelConfig.from_hf(path_or_dict)` or `preset(name)`."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    """Dense-MLP width (layers below `first_k_dense_replace`)."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    """Width of the per-token key slice shared by all heads. It keeps the RoPE name but is never rotated."""
    v_head_dim: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    """Latent width Z the routed experts run in (Stable LatentMoE, docs/architecture.md#latent-moe)."""
    attn_res_block_size: int | None
    """Attention-Residual block length; None selects the plain pre-norm residual
    (docs/architecture.md#attention-residuals)."""
    linear_attn_config: KDAConfig
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    latent_moe_use_norm: bool = True
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    moe_router_activation_func: Literal["sigmoid", "softmax"] = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    index_n_heads: int | None = None
    """Indexer (DSA) fields, K3.1 Pro only. All three present: every gated-MLA layer has an indexer and attends
    to at most `index_topk` selected keys per query. All absent: dense gated MLA (K3)."""
    index_head_dim: int | None = None
    index_topk: int | None = None
    index_rope_dim: int = 0
    """Leading indexer q/k dims rotated (half-split RoPE). The release uses 0."""
    rope_theta: float = 10000.0
    """Only used by the indexer when `index_rope_dim > 0`; the MLA itself has no rotary."""
    dtype: str = "bfloat16"
    """The checkpoint's dtype; `init_params` / `load_checkpoint` use it when no dtype is given."""
    max_position_embeddings: int | None = None
    """The context the checkpoint was trained for (1,048,576 in the release). Informational: nothing positional
    depends on it (K3 has no positional embedding); generate.py warns past it."""

    # ------------------------------------------------------------------ validation
    def __post_init__(self):
        _check_positive(self, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "intermediate_size", "kv_lora_rank", "qk_nope_head_dim",
                        "qk_rope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token",
                        "num_shared_experts", "moe_intermediate_size", "routed_expert_hidden_size",
                        "moe_layer_freq", "num_expert_group", "topk_group")
        L = self.num_hidden_layers
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings must be positive or null, got {self.max_position_embeddings}")
        if self.hidden_act != "situ":
            raise ValueError(f"hidden_act={self.hidden_act!r}: K3 uses 'situ' (SiTU-GLU); nothing else is implemented")
        if not self.mla_use_nope:
            raise ValueError("mla_use_nope=false is not a K3 model: K3's MLA has no rotary")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} != num_attention_heads="
                             f"{self.num_attention_heads}: K3's MLA has no grouped-query heads")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be positive or null, got {self.q_lora_rank}")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(f"num_experts_per_token={self.num_experts_per_token} > num_experts={self.num_experts}")
        if self.num_experts % self.num_expert_group:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by num_expert_group={self.num_expert_group}")
        if self.topk_group > self.num_expert_group:
            raise ValueError(f"topk_group={self.topk_group} > num_expert_group={self.num_expert_group}")
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise ValueError(f"moe_router_activation_func={self.moe_router_activation_func!r}: "
                             "expected 'sigmoid' or 'softmax'")
        if not 0 <= self.first_k_dense_replace <= L:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} outside [0, {L}]")
        if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
            raise ValueError(f"attn_res_block_size must be positive or null, got {self.attn_res_block_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {DTYPES}")
        la = self.linear_attn_config
        kda, full = set(la.kda_layers), set(la.full_attn_layers)
        problems = []
        if len(kda) != len(la.kda_layers) or len(full) != len(la.full_attn_layers):
            problems.append("a list repeats a layer")
        if both := sorted(kda & full):
            problems.append(f"layers {both} are in both lists")
        if outside := sorted(x for x in kda | full if not 1 <= x <= L):
            problems.append(f"layers {outside} are outside 1..{L}")
        if missing := sorted(set(range(1, L + 1)) - kda - full):
            problems.append(f"layers {missing} are in neither list")
        if problems:
            raise ValueError("linear_attn_config: kda_layers and full_attn_layers (1-based) must partition "
                             f"1..{L}: " + "; ".join(problems))
        idx = (self.index_n_heads, self.index_head_dim, self.index_topk)
        if any(v is not None for v in idx):
            if any(v is None for v in idx):
                raise ValueError("indexer: index_n_heads, index_head_dim and index_topk must be all present or "
                                 f"all absent, got {idx}")
            _check_positive(self, "index_n_heads", "index_head_dim", "index_topk")
            if self.q_lora_rank is None:
                raise ValueError("the indexer reads the q LoRA latent: it needs q_lora_rank")
            if self.index_rope_dim < 0 or self.index_rope_dim % 2 or self.index_rope_dim > self.index_head_dim:
                raise ValueError(f"index_rope_dim={self.index_rope_dim}: expected an even number in "
                                 f"[0, index_head_dim={self.index_head_dim}]")

    # ------------------------------------------------------------------ derived values
    @property
    def layer_types(self) -> tuple[str, ...]:
        """'kda' or 'mla' per 0-based layer."""
        kda = set(self.linear_attn_config.kda_layers)
        return tuple("kda" if i + 1 in kda else "mla" for i in range(self.num_hidden_layers))

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """(d_nope + d_rope)^-1/2, also in the absorbed 576-wide form."""
        return self.qk_head_dim ** -0.5

    @property
    def has_indexer(self) -> bool:
        return self.index_topk is not None

    @property
    def num_attn_res_blocks(self) -> int:
        return 0 if self.attn_res_block_size is None else math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    # ------------------------------------------------------------------ Hugging Face config.json
    @classmethod
    def from_hf(cls, source: str | Path | dict) -> "ModelConfig":
        """Build from a `config.json` dict, a path to it, or a checkpoint folder holding it.

        Accepts the multimodal wrapper (`text_config` inside, as released) or a text-only config. Keys this
        model does not use are ignored; a missing required key is an error that names it.
        """
        where = "config"
        if not isinstance(source, dict):
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise FileNotFoundError(f"no config.json at {path}")
            where = str(path)
            try:
                source = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
        text = source.get("text_config", source)
        if not isinstance(text, dict):
            raise ValueError(f"{where}: text_config must be an object")
        text = dict(text)
        if "torch_dtype" in text and "dtype" not in text:
            text["dtype"] = text["torch_dtype"]
        for key in ("dtype", "max_position_embeddings"):      # the wrapper may carry them for the text model
            if key not in text and key in source:
                text[key] = source[key]
        la = text.get("linear_attn_config")
        if la is None:
            # The reference implementation's fallback when the key is absent: K3's pattern and KDA sizes.
            kda, full = _k3_layer_lists(_require(text, "num_hidden_layers", where))
            la = dict(num_heads=96, head_dim=128, kda_layers=kda, full_attn_layers=full)
        text["linear_attn_config"] = _build(KDAConfig, la, f"{where}: linear_attn_config")
        return _build(cls, text, where)

    def to_hf(self) -> dict[str, Any]:
        """The text config as `config.json` keys (`from_hf(to_hf())` round-trips)."""
        d = dataclasses.asdict(self)
        la = d.pop("linear_attn_config")
        la["kda_layers"], la["full_attn_layers"] = list(la["kda_layers"]), list(la["full_attn_layers"])
        d = {k: v for k, v in d.items() if not ((k.startswith("index_") or k == "max_position_embeddings") and v is None)}
        return {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], **d,
                "linear_attn_config": la}


# ---------------------------------------------------------------------------------------------- Backend

AttnBackend = Literal["auto", "eager", "sdpa", "gather", "triton", "cudnn"]
SparseForward = Literal["auto", "flashmla", "triton", "gather"]
MLAForm = Literal["auto", "expanded", "absorbed"]
KDABackend = Literal["auto", "recurrent", "chunk", "chunk_opaque", "chunk_triton", "triton"]
MoEBackend = Literal["auto", "dense", "grouped", "gemv"]


@dataclass(frozen=True, kw_only=True)
class Backend:
    """Which implementation runs each backend-dependent op. The implementations are the table in `kimi/ops`
    (`kimi.ops.IMPLEMENTATIONS`); every "auto" is replaced by a concrete choice in one place,
    `kimi.ops.resolve` (docs/architecture.md#backends)."""

    attn: AttnBackend = "auto"
    """Gated MLA's attention over the selected keys: 'eager' (fp32 softmax over a dense keep-mask; the reference),
    'sdpa' (`F.scaled_dot_product_attention` with the same mask; expanded form only) or 'gather' (from per-query key
    ranges with nothing of size T×S: blocked indexer top-k, attention over the gathered latents in the absorbed
    form; documents of at most index_topk tokens run as dense document-causal attention without the indexer) or
    'triton' (the 'gather' path with the attention over the selected latents in Triton kernels, 96 heads native;
    a CUDA device, or the interpreter) or 'cudnn' (the 'gather' path on cuDNN Frontend's indexer, top-k and SM90
    sparse backward, the forward `sparse_fwd`; an SM90+ GPU and `pip install 'kimi[cudnn]'`, checked here).
    'auto' picks 'triton' on a GPU in bf16/fp16 at any length without a cache and past 8,192 slots or 2^24
    (query, key) pairs with one; elsewhere 'gather' past 32,768 keys or those cache sizes; 'gather' for short
    documents (docs/architecture.md#backends)."""
    mla_form: MLAForm = "auto"
    """'expanded' (per-head K/V through kv_b_proj) or 'absorbed' (kv_b_proj folded into the query and the
    output: attention over the 576-wide shared latent, the form sparse kernels and decoding use)."""
    kda: KDABackend = "auto"
    """The KDA core: 'recurrent' (token loop, the definition), 'chunk' (chunkwise-parallel, traced by
    torch.compile), 'chunk_opaque' (the same as one opaque op: much shorter compiles, its backward recomputes the
    forward), 'chunk_triton' ('chunk' with the chunk-to-chunk state pass as one Triton kernel each way) or 'triton'
    (the chunked forward and backward as Triton kernels, and the cached decode token as one fused kernel; needs
    the bounded gate, gate_lower_bound ≥ −5, and a CUDA device or the interpreter)."""
    sparse_fwd: SparseForward = "auto"
    """With attn='cudnn', the sparse attention forward under cuDNN's backward: 'flashmla' (FlashMLA's
    `flash_mla_sparse_fwd`, built from its repository; 96 heads padded to 128), 'triton' (the project's kernels) or
    'gather' (torch); 'auto' is 'flashmla' where it imports, else 'triton' (`kimi.ops.resolve`). Only with
    attn='cudnn'."""
    moe: MoEBackend = "auto"
    """Routed experts: 'dense' (every expert on every token; the any-dtype reference), 'grouped' (tokens sorted by
    expert, one grouped matmul per projection; float32/bfloat16) or 'gemv' (a Triton kernel that reads each chosen
    expert's weights once: decoding a few tokens on a GPU)."""

    def __post_init__(self):
        for name, allowed in _BACKEND_CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"Backend.{name}={getattr(self, name)!r}: expected one of {allowed}")
        if self.sparse_fwd != "auto" and self.attn != "cudnn":
            raise ValueError(f"Backend(sparse_fwd={self.sparse_fwd!r}) chooses the forward under attn='cudnn'; got "
                             f"attn={self.attn!r}")
        if self.attn in BACKEND_CHECKS:   # the packages and the GPU, said here rather than at the first layer
            BACKEND_CHECKS[self.attn](self)
        if self.attn in ("gather", "triton", "cudnn") and self.mla_form == "expanded":
            raise ValueError(f"Backend(attn={self.attn!r}, mla_form='expanded'): the gathering path attends over the "
                             "shared latent (the absorbed form); use mla_form='auto' or 'absorbed'")
        if self.attn == "sdpa" and self.mla_form == "absorbed":
            raise ValueError("Backend(attn='sdpa', mla_form='absorbed'): SDPA has no shared-latent form (it would "
                             "copy the 576-wide latent to every head); use attn='eager' or 'auto' with the absorbed "
                             "form")


BACKEND_CHECKS: dict[str, Callable[[Backend], None]] = {}
"""attn value -> a check that the implementation can run in this process, raising a named error when not;
registered by the op layer (kimi/ops/__init__.py: attn='cudnn'), which this module does not import."""

_BACKEND_CHOICES = {"attn": get_args(AttnBackend), "mla_form": get_args(MLAForm), "kda": get_args(KDABackend),
                    "moe": get_args(MoEBackend), "sparse_fwd": get_args(SparseForward)}


# ---------------------------------------------------------------------------------------------- helpers

def _check_positive(obj, *names):
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{type(obj).__name__}.{n} must be a positive integer, got {v!r}")


def _require(d: dict, key: str, where: str):
    if key not in d:
        raise ValueError(f"{where}: missing required key {key!r}")
    return d[key]


def _build(cls, d: dict, where: str):
    """Instantiate a config dataclass from JSON keys: unknown keys ignored, missing required keys named,
    JSON types checked (an int where a float is expected is fine, a string where a number is expected is not)."""
    kwargs, missing = {}, []
    for f in dataclasses.fields(cls):
        if f.name not in d:
            if f.default is dataclasses.MISSING:
                missing.append(f.name)
            continue
        v = d[f.name]
        kind = str(f.type)
        if isinstance(v, KDAConfig):
            pass
        elif v is None:
            if "None" not in kind:
                raise ValueError(f"{where}: {f.name} must not be null")
        elif kind.startswith("int") or kind.startswith("tuple"):
            items = v if kind.startswith("tuple") else [v]
            if kind.startswith("tuple") and not isinstance(v, (list, tuple)):
                raise ValueError(f"{where}: {f.name} must be a list of integers, got {v!r}")
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in items):
                raise ValueError(f"{where}: {f.name} must be {'a list of integers' if kind.startswith('tuple') else 'an integer'}, got {v!r}")
            if kind.startswith("tuple"):
                v = tuple(v)
        elif kind.startswith("float"):
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ValueError(f"{where}: {f.name} must be a number, got {v!r}")
            v = float(v)
        elif kind == "bool" and not isinstance(v, bool):
            raise ValueError(f"{where}: {f.name} must be true or false, got {v!r}")
        elif kind == "str" and not isinstance(v, str):
            raise ValueError(f"{where}: {f.name} must be a string, got {v!r}")
        kwargs[f.name] = v
    if missing:
        raise ValueError(f"{where}: missing required key(s) {missing}")
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------- presets

_K3_KDA_LAYERS, _K3_FULL_LAYERS = _k3_layer_lists(93)

_K3 = dict(
    vocab_size=163840, hidden_size=7168, num_hidden_layers=93, num_attention_heads=96, num_key_value_heads=96,
    intermediate_size=33792, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, num_experts=896, num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
    routed_expert_hidden_size=3584, attn_res_block_size=12, bos_token_id=163584, eos_token_id=163586,
    pad_token_id=163839, max_position_embeddings=1048576,
    linear_attn_config=KDAConfig(num_heads=96, head_dim=128, kda_layers=_K3_KDA_LAYERS,
                                 full_attn_layers=_K3_FULL_LAYERS),
)

_TINY_KDA, _TINY_FULL = _k3_layer_lists(8)

PRESETS: dict[str, tuple[str, ModelConfig]] = {
    "k3_1_pro": ("Kimi K3.1 Pro release values (2.8T total, 104B active) with the DSA indexer (64 x 128, top 2048)",
                 ModelConfig(**_K3, index_n_heads=64, index_head_dim=128, index_topk=2048)),
    "k3": ("Kimi K3 release values: dense gated MLA, no indexer", ModelConfig(**_K3)),
    "tiny": ("K3.1 Pro structure at ~2M parameters for CPU tests and demos: 8 layers (2 x [3 KDA + 1 MLA]), "
             "attention-residual blocks of 3, dense first layer, 8 experts top-2 + shared, indexer top-16",
             ModelConfig(vocab_size=512, hidden_size=128, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=256, q_lora_rank=64, kv_lora_rank=32,
                         qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=8,
                         num_experts_per_token=2, num_shared_experts=2, moe_intermediate_size=64,
                         routed_expert_hidden_size=64, attn_res_block_size=3, bos_token_id=256, eos_token_id=258,
                         pad_token_id=511, index_n_heads=4, index_head_dim=32, index_topk=16, dtype="float32",
                         linear_attn_config=KDAConfig(num_heads=4, head_dim=32, kda_layers=_TINY_KDA,
                                                      full_attn_layers=_TINY_FULL))),
    "medium": ("Real K3 head and expert widths at ~1.2B parameters for benchmarks: hidden 2048, 8 layers "
               "(2 x [3 KDA + 1 MLA]), 16 KDA heads x 128, 16 MLA heads (128/64/128), 32 experts top-4, "
               "indexer 16 x 128 top-512",
               ModelConfig(vocab_size=32768, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16,
                           num_key_value_heads=16, intermediate_size=8192, q_lora_rank=768, kv_lora_rank=512,
                           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=32,
                           num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=1024,
                           routed_expert_hidden_size=1024, attn_res_block_size=4, bos_token_id=256, eos_token_id=258,
                           pad_token_id=511, index_n_heads=16, index_head_dim=128, index_topk=512,
                           linear_attn_config=KDAConfig(num_heads=16, head_dim=128, kda_layers=_TINY_KDA,
                                                        full_attn_layers=_TINY_FULL))),
}


def scaled(cfg: ModelConfig, *, num_layers: int | None = None, num_experts: int | None = None) -> ModelConfig:
    """`cfg` with its per-layer widths kept but fewer layers (K3's pattern: every 4th and the last are gated MLA;
    attention-residual blocks shrunk to at most half the depth so block boundaries still occur) and/or fewer routed
    experts (top-k kept, one routing group): real-width models that fit one GPU, for benchmarks."""
    changes: dict[str, Any] = {}
    if num_layers is not None:
        kda, full = _k3_layer_lists(num_layers)
        block = cfg.attn_res_block_size
        changes.update(num_hidden_layers=num_layers, first_k_dense_replace=min(cfg.first_k_dense_replace, num_layers),
                       attn_res_block_size=None if block is None else min(block, max(1, num_layers // 2)),
                       linear_attn_config=dataclasses.replace(cfg.linear_attn_config, kda_layers=kda,
                                                              full_attn_layers=full))
    if num_experts is not None:
        changes.update(num_experts=num_experts, num_experts_per_token=min(cfg.num_experts_per_token, num_experts),
                       num_expert_group=1, topk_group=1)
    return dataclasses.replace(cfg, **changes)


def preset(name: str) -> ModelConfig:
    """A named configuration (see `PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name][1]
