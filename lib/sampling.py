"""Turning logits into a next token: temperature softmax and seeded sampling.

Temperature 0 is greedy decoding (argmax). Sampling draws one uniform number from a
`numpy.random.Generator` and inverts the cumulative distribution, so the same seed gives the
same tokens. These are the p and q of speculative sampling (Leviathan et al. 2023).
"""
import numpy as np

from lib.checks import check_logits, check_probs, check_rng, check_temperature


def probs_from_logits(logits, temperature: float = 1.0) -> np.ndarray:
    """Softmax of logits / temperature in float64 over the last axis; temperature 0 gives one-hot argmax.

    The maximum is subtracted before dividing, so a tiny temperature gives the argmax's one-hot
    (ties shared) instead of inf / inf."""
    check_temperature(temperature)
    z = check_logits(logits)
    if temperature == 0:
        return np.eye(z.shape[-1])[z.argmax(axis=-1)]  # (..., V) one-hot
    with np.errstate(over="ignore"):  # a tiny temperature sends the others to -inf: exp gives 0
        e = np.exp((z - z.max(axis=-1, keepdims=True)) / temperature)  # (..., V), largest entry 1
    return e / e.sum(axis=-1, keepdims=True)  # (..., V)


def sample(probs, rng: np.random.Generator) -> int:
    """Draw one index from a probability vector with a seeded generator."""
    return draw(check_probs(probs), check_rng(rng))


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """`sample` without the checks, for distributions this engine computed itself (inverse CDF)."""
    c = np.cumsum(p)  # (V,)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), p.size - 1))


def next_token(logits, temperature: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0 (no random number is drawn), else a sample from the softmax."""
    check_rng(rng)
    if temperature == 0:
        return int(np.argmax(check_logits(logits)))
    return draw(probs_from_logits(logits, temperature), rng)
