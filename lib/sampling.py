"""Turning logits into a next token: temperature softmax and seeded sampling.

Temperature 0 is greedy decoding (argmax). Sampling draws one uniform number from a
`numpy.random.Generator` and inverts the cumulative distribution, so the same seed gives the
same tokens. These are the p and q of speculative sampling (Leviathan et al. 2023).
"""
import numpy as np


def probs_from_logits(logits, temperature: float = 1.0) -> np.ndarray:
    """Softmax of logits / temperature in float64 over the last axis; temperature 0 gives one-hot argmax.

    The maximum is subtracted before dividing, so a tiny temperature gives the argmax's one-hot
    (ties shared) instead of inf / inf."""
    z = np.asarray(logits, dtype=np.float64)  # (..., V)
    if temperature == 0:
        return np.eye(z.shape[-1])[z.argmax(axis=-1)]  # (..., V) one-hot
    with np.errstate(over="ignore"):  # a tiny temperature sends the others to -inf: exp gives 0
        e = np.exp((z - z.max(axis=-1, keepdims=True)) / temperature)  # (..., V), largest entry 1
    return e / e.sum(axis=-1, keepdims=True)  # (..., V)


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from a probability vector with a seeded generator (inverse CDF)."""
    c = np.cumsum(p)  # (V,)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), p.size - 1))


def next_token(logits, temperature: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0 (no random number is drawn), else a sample from the softmax."""
    if temperature == 0:
        return int(np.argmax(logits))
    return sample(probs_from_logits(logits, temperature), rng)
