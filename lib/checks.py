"""Argument checks at the engine's boundary: the entry points a reader calls (BOUNDARY) check
their arguments once, with the rules here (llm.c's `utils.h` idea: named checks, each message
naming the argument and saying what to pass), before they change anything. Everything behind
them trusts those values and is written as the algorithm, without checks: so the code a chapter
prints is the idea, and no hot path checks twice. Each rule raises ValueError or TypeError and
returns the value normalised.
"""
import functools

import numpy as np

from lib.config import ModelConfig, is_int

BOUNDARY = (  # the public entry points: each checks its arguments; tests/test_fuzz_api.py fuzzes every one
    "lib.config.ModelConfig",
    "lib.tokenizer.encode", "lib.tokenizer.decode",
    "lib.model.Model", "lib.model.forward", "lib.model.forward_cached", "lib.model.init_params",
    "lib.model.load", "lib.model.load_metadata",
    "lib.generation.generate", "lib.generation.complete",
    "lib.speculative.speculative_generate",
    "lib.kv_scales.kv_maxima",
    "lib.cache.kv_cache.KVCache", "lib.cache.kv_cache.KVCache.feed",
    "lib.cache.kivi.KiviCache", "lib.cache.kivi.KiviCache.feed", "lib.cache.kivi_parts.KiviParts",
    "lib.cache.blocks.BlockManager",
    "lib.cache.paged.PagedKVCache", "lib.cache.paged.PagedKVCache.add", "lib.cache.paged.PagedSequence.feed",
    "lib.fast.lean.LeanModel", "lib.fast.batch.BatchedModel", "lib.fast.batch.BatchedModel.feed",
    "lib.gpu.memory.read_config",
    "lib.gpu.memory.from_hf_config", "lib.gpu.memory.from_model_config",
    "lib.serve.policy.Policy", "lib.serve.server.serve",
)  # behind it, trusted: the records readers fill in (lib.gpu.memory.KVSpec, GPU), the trainer's
# lib.model.save, and the pool's fork and free, which the scheduler drives


def entry_point(rule):
    """Mark a boundary entry point whose body a chapter prints: `rule` takes the entry's arguments,
    checks them and returns them normalised, and the body runs on what it returns. The listing
    then shows the rule's name on one line above the algorithm."""
    def mark(fn):
        @functools.wraps(fn)
        def entry(*args, **kwargs):
            return fn(*rule(*args, **kwargs))
        return entry
    return mark


def is_number(value) -> bool:
    """A real number: a Python or numpy int or float, not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_config(cfg, name: str = "cfg", hint: str = "") -> ModelConfig:
    """A lib.config.ModelConfig, else a TypeError naming the argument."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"{name} must be a lib.config.ModelConfig, got {type(cfg).__name__}{hint}")
    return cfg


def check_step(model, name: str = "model"):
    """A Step (lib.model.Step): a callable with a ModelConfig `cfg`, else a TypeError naming the argument."""
    if not (callable(model) and isinstance(getattr(model, "cfg", None), ModelConfig)):
        hint = " (for a (params, cfg) pair pass lib.model.Model(params, cfg))" if isinstance(model, tuple) else ""
        raise TypeError(f"{name} must be a Step (lib.model.Model(params, cfg), a lib.fast.lean.LeanModel, "
                        f"a lib.measure.standins.StandInStep), got {type(model).__name__}{hint}")
    return model


def check_count(value, name: str, low: int = 1, what: str = "", high: int | None = None) -> int:
    """An integer (not a bool) >= low, and <= high if given (a seed, a size, a position), else a
    ValueError naming it."""
    if not is_int(value) or value < low or (high is not None and value > high):
        wanted = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"
        raise ValueError(f"{name}{what} must be {wanted}, got {value!r}")
    return int(value)


def check_option(value, name: str, options) -> None:
    """One of `options`, the names (or integers) a setting may take, else a ValueError listing them."""
    if not (isinstance(value, str) or is_int(value)) or value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(str, options))}, got {value!r}")


def check_tokens(tokens, cfg: ModelConfig, start: int = 0) -> np.ndarray:
    """Validate a 1-D sequence of token ids placed at positions start.. ; return it as int64."""
    check_config(cfg)
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be a non-empty 1-D sequence of integer ids, got {arr.dtype} of shape {arr.shape}")
    ids = arr.astype(np.int64, copy=False)
    if ids.view(np.uint64).max() >= cfg.vocab_size:  # one test for both ends: negatives view as huge
        pos = int(np.argmax((arr < 0) | (arr >= cfg.vocab_size)))
        raise ValueError(f"token id {int(arr[pos])} at index {pos} is outside the vocabulary 0..{cfg.vocab_size - 1}")
    if start + arr.size > cfg.block_size:
        raise ValueError(f"tokens at positions {start}..{start + arr.size - 1} go past the context of {cfg.block_size} (block_size)")
    return ids


@functools.lru_cache(maxsize=64)
def _shapes(cfg: ModelConfig) -> tuple:
    return tuple(cfg.parameter_shapes().items())


def check_params(params, cfg: ModelConfig) -> None:
    """params hold every tensor of cfg's shape (the GPT-2 checkpoint keys), as float arrays."""
    check_config(cfg, hint=" (a (params, cfg) pair reversed?)")
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict of arrays keyed like the GPT-2 checkpoint, got {type(params).__name__}")
    for key, shape in _shapes(cfg):
        value = params.get(key)
        if getattr(value, "shape", None) != shape or value.dtype.kind != "f":
            found = "missing" if value is None else f"{getattr(value, 'dtype', type(value).__name__)} {getattr(value, 'shape', '')}"
            raise ValueError(f"params[{key!r}] is {found}, but the config {cfg} needs float {shape}")


def check_cache(cache, cfg: ModelConfig) -> None:
    """A cache (KVCache or PagedSequence) holds K/V of this config's shape: layers, K/V heads, head size."""
    check_config(cfg)
    made = getattr(cache, "cfg", None)
    if not isinstance(made, ModelConfig):
        raise TypeError(f"expected a KV cache (lib.cache.kv_cache.KVCache or a paged sequence), got {type(cache).__name__}")
    if (made.n_layer, made.n_kv_head, made.head_dim) != (cfg.n_layer, cfg.n_kv_head, cfg.head_dim):
        raise ValueError(f"this KV cache was made for {made}, not for {cfg}")


def check_temperature(temperature) -> None:
    """A real number >= 0 (0 means greedy); any positive one works, however small (see probs_from_logits)."""
    if not is_number(temperature):
        raise TypeError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
