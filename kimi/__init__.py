"""kimi: the Kimi K3.1 Pro text model as pure functions over a parameter tree.

    import kimi
    cfg = kimi.preset("tiny")                              # or kimi.ModelConfig.from_hf("path/to/ckpt")
    params = kimi.init_params(cfg, seed=0)                 # or cfg, params = kimi.load_checkpoint("path")
    logits = kimi.forward(params, input_ids, cfg, kimi.Backend(attn="sdpa", kda="chunk"))
    cache = kimi.init_cache(cfg, batch=B, max_len=L)              # decoding: see kimi/cache.py
    logits, cache = kimi.forward(params, input_ids, cfg, cache=cache)

Dimension letters used in shapes everywhere: B batch, T tokens, S keys (= T without a cache), D hidden size,
H heads, K key head dim, V value head dim (or vocabulary for logits), R latent rank, E experts, k top-k,
W conv width, N flattened tokens (B·T), Z latent expert width.
"""

from .cache import CacheError, clone_cache, init_cache, left_pad, mark_static, reset_cache
from .checkpoint import load_checkpoint, save_checkpoint
from .config import PRESETS, Backend, KDAConfig, ModelConfig, preset
from .cp import ContextParallel, CPError
from .model import compile_layers, compile_options, forward
from .params import init_params, param_count, param_specs

__all__ = ["Backend", "CPError", "CacheError", "ContextParallel", "KDAConfig", "ModelConfig", "PRESETS",
           "clone_cache", "compile_layers", "compile_options", "forward", "init_cache", "init_params", "left_pad",
           "load_checkpoint", "mark_static", "param_count", "param_specs", "preset", "reset_cache",
           "save_checkpoint"]
