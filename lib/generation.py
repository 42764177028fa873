"""Autoregressive generation, with and without the KV cache.

Without a cache every step recomputes the whole sequence with the reference `forward`; with
the cache the prompt is prefilled in one call and each step feeds one token (Pope et al. 2022).
Both draw from the same seeded generator, so equal logits give equal tokens.
"""
from typing import NamedTuple

import numpy as np

from lib.cache.kv_cache import KVCache
from lib.checks import check_seed, check_temperature, check_tokens
from lib.config import ModelConfig, is_int
from lib.model import cached_step, forward
from lib.sampling import next_token
from lib.tokenizer import VOCAB_SIZE, decode, encode


def check_request(prompt_len: int, n_new, context: int, temperature: float) -> None:
    """Reject a generation request before any work: n_new >= 1, it fits the context, temperature >= 0."""
    for name, value in (("prompt_len", prompt_len), ("context", context)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not is_int(n_new) or n_new < 1:
        raise ValueError(f"n_new must be a positive integer, got {n_new!r}")
    if prompt_len + n_new > context:
        raise ValueError(f"prompt ({prompt_len} tokens) plus generation ({n_new}) is longer than "
                         f"the context of {context} positions")
    check_temperature(temperature)


class Generation(NamedTuple):
    tokens: np.ndarray  # (n_new,) the generated ids
    logits: np.ndarray  # (n_new, V) the logits each one was drawn from


def generate(params, cfg: ModelConfig, prompt, n_new: int, temperature: float = 0.0,
             seed: int = 0, use_cache: bool = True, step=None) -> Generation:
    """Generate n_new tokens after the prompt (token ids). Temperature 0 is greedy.

    step: the cached forward to use, step(new_tokens, cache) -> logits; default
    `forward_cached` with these params (a `lib.fast.lean.LeanModel` is the fast alternative).
    """
    prompt = check_tokens(prompt, cfg)
    check_request(len(prompt), n_new, cfg.block_size, temperature)
    rng = np.random.default_rng(check_seed(seed))
    out, logits = [], []
    step_fn = step or cached_step((params, cfg))[1]
    if use_cache:
        cache = KVCache(cfg, len(prompt) + n_new)
        last = step_fn(prompt, cache)[-1]  # (V,) prefill
    else:
        seq = list(prompt)
        last = forward(params, cfg, seq)[-1]  # (V,)
    for i in range(n_new):
        token = next_token(last, temperature, rng)
        out.append(token)
        logits.append(last)
        if i == n_new - 1:
            break
        if use_cache:
            last = step_fn([token], cache)[-1]  # (V,) one decode step
        else:
            seq.append(token)
            last = forward(params, cfg, seq)[-1]  # (V,) full recompute
    return Generation(np.array(out, dtype=np.int64), np.array(logits))


def complete(params, cfg: ModelConfig, prompt: str, n_new: int, temperature: float = 0.0,
             seed: int = 0, use_cache: bool = True) -> str:
    """Text in, text out: the n_new characters the model writes after `prompt`."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a lib.config.ModelConfig, got {type(cfg).__name__}")
    if cfg.vocab_size != VOCAB_SIZE:
        raise ValueError(f"complete() needs a model over the {VOCAB_SIZE}-character vocabulary of lib.tokenizer, "
                         f"this one has vocab_size {cfg.vocab_size}")
    return decode(generate(params, cfg, encode(prompt), n_new, temperature, seed, use_cache).tokens)
