"""Argument checks: the rules shared across the engine about what a caller may pass (llm.c's
`utils.h` idea: named checks, each message naming the argument and saying what to pass).
Rules that belong to one object (a Policy's settings, a cache's shapes) stay beside it.

A public entry point opens with its checks, then does its work; what it calls inside trusts
those values (an unchecked twin, such as `lib.sampling.draw` for `lib.sampling.sample`), so no
hot path checks twice. Each check raises ValueError or TypeError and returns the value normalised.
"""
import functools

import numpy as np

from lib.config import ModelConfig, is_int

PROB_TOL = 1e-6  # how far a probability vector may sum from 1


def is_number(value) -> bool:
    """A real number: a Python or numpy int or float, not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_config(cfg, name: str = "cfg", hint: str = "") -> ModelConfig:
    """A lib.config.ModelConfig, else a TypeError naming the argument."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"{name} must be a lib.config.ModelConfig, got {type(cfg).__name__}{hint}")
    return cfg


def check_count(value, name: str, low: int = 1, what: str = "") -> int:
    """An integer (not a bool) >= low, else a ValueError naming it."""
    if not is_int(value) or value < low:
        raise ValueError(f"{name}{what} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_tokens(tokens, cfg: ModelConfig, start: int = 0) -> np.ndarray:
    """Validate a 1-D sequence of token ids placed at positions start.. ; return it as int64."""
    check_config(cfg)
    if not is_int(start) or start < 0:
        raise ValueError(f"start (the position of the first token) must be an integer >= 0, got {start!r}")
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"tokens must be a non-empty 1-D sequence of ids, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integer ids, got dtype {arr.dtype}")
    ids = arr.astype(np.int64, copy=False)
    if ids.view(np.uint64).max() >= cfg.vocab_size:  # one test for both ends: negatives view as huge
        pos = int(np.argmax((arr < 0) | (arr >= cfg.vocab_size)))
        raise ValueError(f"token id {int(arr[pos])} at index {pos} is outside the vocabulary 0..{cfg.vocab_size - 1}")
    if start + arr.size > cfg.block_size:
        raise ValueError(
            f"tokens at positions {start}..{start + arr.size - 1} go past the context: the model has "
            f"{cfg.block_size} learned positions (block_size)")
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
    made = getattr(cache, "cfg", None)
    if made is cfg and isinstance(cfg, ModelConfig):
        return
    check_config(cfg)
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


def check_seed(seed) -> int:
    """A seed for numpy.random.default_rng: a non-negative integer."""
    if not is_int(seed) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def check_logits(logits) -> np.ndarray:
    """Logits as float64 (..., V), V >= 1, every row with a finite maximum: no NaN, no +inf, not all -inf."""
    z = np.asarray(logits)
    if z.dtype.kind not in "iuf" or z.ndim == 0 or z.shape[-1] == 0:
        raise ValueError(f"logits must be a non-empty array of numbers (..., V), got {z.dtype} of shape {z.shape}")
    z = z.astype(np.float64, copy=False)
    top = z.max(axis=-1, keepdims=True)  # NaN if any entry is NaN
    if not np.isfinite(top).all():
        raise ValueError("logits contain NaN or +inf, or a row is all -inf: no distribution to sample from")
    return z


def check_probs(probs, name: str = "probabilities") -> np.ndarray:
    """A 1-D, non-negative vector summing to 1 (within PROB_TOL), else a ValueError saying which.
    Two reductions when it is one (a NaN fails `min >= 0`, an inf the sum)."""
    p = np.asarray(probs)
    if p.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be numbers, got dtype {p.dtype}")
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D vector, got shape {p.shape}")
    p = p.astype(np.float64, copy=False)
    total = p.sum()
    if not (p.min() >= 0 and abs(total - 1.0) <= PROB_TOL):
        if not np.isfinite(p).all() or (p < 0).any():
            raise ValueError(f"{name} must be finite and non-negative")
        raise ValueError(f"{name} sum to {total:.9g}, not 1: normalise them (softmax) first")
    return p


def check_rng(rng) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, e.g. np.random.default_rng(seed), got {rng!r}")
    return rng
