"""Turning logits into a next token: temperature softmax and seeded sampling.

Temperature 0 is greedy decoding (argmax). Sampling draws one uniform number from a
`numpy.random.Generator` and inverts the cumulative distribution, so the same seed gives the
same tokens. These are the p and q of speculative sampling (Leviathan et al. 2023).
"""
import numpy as np

PROB_TOL = 1e-6  # how far a probability vector may sum from 1


def check_temperature(temperature: float) -> None:
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")


def probs_from_logits(logits, temperature: float = 1.0) -> np.ndarray:
    """Softmax of logits / temperature in float64 over the last axis; temperature 0 gives one-hot argmax."""
    check_temperature(temperature)
    z = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        return np.eye(z.shape[-1])[z.argmax(axis=-1)]  # (..., V) one-hot
    z = z / temperature
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)  # (..., V)


def check_probs(probs) -> np.ndarray:
    """A 1-D, non-negative vector summing to 1 (within PROB_TOL), else a ValueError saying which."""
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"probabilities must be a non-empty 1-D vector, got shape {p.shape}")
    if not np.isfinite(p).all() or (p < 0).any():
        raise ValueError("probabilities must be finite and non-negative")
    total = p.sum()
    if abs(total - 1.0) > PROB_TOL:
        raise ValueError(f"probabilities sum to {total:.9g}, not 1: normalise them (softmax) first")
    return p


def sample(probs, rng: np.random.Generator) -> int:
    """Draw one index from a probability vector with a seeded generator."""
    return draw(check_probs(probs), rng)


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """`sample` without the checks, for distributions this engine computed itself (inverse CDF)."""
    c = np.cumsum(p)  # (V,)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), p.size - 1))


def next_token(logits, temperature: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0 (no random number is drawn), else a sample from the softmax."""
    if temperature == 0:
        return int(np.argmax(logits))
    return draw(probs_from_logits(logits, temperature), rng)
