"""Autoregressive generation, with and without the KV cache.

With the cache the prompt is prefilled in one call and each step feeds one token (Pope et al.
2022); without it every step recomputes the whole sequence on a fresh cache, which is what the
cache saves. Both draw from the same seeded generator, so equal logits give equal tokens. The
model is any `lib.model.Step`: `lib.model.Model(params, cfg)`, a `LeanModel`, a `StandInStep`.
"""
from typing import NamedTuple

import numpy as np

from lib.cache.kv_cache import KVCache
from lib.checks import check_count, check_step, check_temperature, check_tokens
from lib.sampling import next_token
from lib.tokenizer import VOCAB_SIZE, decode, encode


def check_request(prompt_len: int, n_new, context: int, temperature) -> None:
    """Reject a generation request before any work: n_new >= 1, it fits the context, temperature >= 0."""
    check_count(n_new, "n_new", what=f" (the prompt holds {prompt_len} of {context} positions)", high=context - prompt_len)
    check_temperature(temperature)


class Generation(NamedTuple):
    tokens: np.ndarray  # (n_new,) the generated ids
    logits: np.ndarray  # (n_new, V) the logits each one was drawn from


def generate(model, prompt, n_new: int, temperature: float = 0.0, seed: int = 0,
             use_cache: bool = True) -> Generation:
    """Generate n_new tokens after the prompt (token ids) with a Step. Temperature 0 is greedy.
    use_cache=False feeds the whole sequence to a fresh cache at every step."""
    cfg = check_step(model).cfg
    prompt = check_tokens(prompt, cfg)
    check_request(len(prompt), n_new, cfg.block_size, temperature)
    rng = np.random.default_rng(check_count(seed, "seed", 0))
    seq, out, logits = list(prompt), [], []
    cache = KVCache(cfg, len(prompt) + n_new)
    last = model(prompt, cache)[-1]  # (V,) prefill
    for i in range(n_new):
        token = next_token(last, temperature, rng)
        out.append(token)
        logits.append(last)
        if i == n_new - 1:
            break
        seq.append(token)
        if use_cache:
            last = model([token], cache)[-1]  # (V,) one decode step
        else:
            last = model(seq, KVCache(cfg, len(seq)))[-1]  # (V,) every position again
    return Generation(np.array(out, dtype=np.int64), np.array(logits))


def complete(model, prompt: str, n_new: int, temperature: float = 0.0, seed: int = 0,
             use_cache: bool = True) -> str:
    """Text in, text out: the n_new characters the model (a Step) writes after `prompt`."""
    cfg = check_step(model).cfg
    if cfg.vocab_size != VOCAB_SIZE:
        raise ValueError(f"model must read the tokenizer's {VOCAB_SIZE}-character vocabulary, got vocab_size {cfg.vocab_size}")
    return decode(generate(model, encode(prompt), n_new, temperature, seed, use_cache).tokens)
