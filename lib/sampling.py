"""Turning logits into a next token: temperature softmax and seeded sampling.

Temperature 0 is greedy decoding (argmax). Sampling draws one uniform number from a
`numpy.random.Generator` and inverts the cumulative distribution, so the same seed gives the
same tokens. These are the p and q of speculative sampling (Leviathan et al. 2023).
"""
import numpy as np

from .config import is_int

PROB_TOL = 1e-6  # how far a probability vector may sum from 1


def check_temperature(temperature) -> None:
    """A real number >= 0 (0 means greedy); any positive one works, however small (see probs_from_logits)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.integer, np.floating)):
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
