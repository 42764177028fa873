"""Comparing distributions: total variation distance, its noise floor, and a chi-square test.

A sampled distribution is never exactly its source; the question is whether it is as close as
sampling noise allows. For n draws from p, the frequency of outcome i has standard deviation
sqrt(p_i (1 - p_i) / n), and E|N(0, s^2)| = s sqrt(2/pi), so the expected total variation
distance of the frequencies from p is about 0.5 * sum_i sqrt(2 p_i (1 - p_i) / (pi n)).
Pearson's chi-square test (Pearson 1900) pools outcomes expected fewer than 5 times.
"""
import numpy as np
from scipy import stats

from lib.checks import check_count, check_seed

SAMPLES = " (the number of samples)"  # how the counts are named in their errors

def check_distribution(p, name: str = "p", tol: float = 1e-6) -> np.ndarray:
    """A non-empty 1-D vector of finite non-negative numbers summing to 1 (within tol), as float64."""
    arr = np.asarray(p)
    if arr.dtype.kind not in "iuf" or arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D vector of numbers, got {arr.dtype} of shape {arr.shape}")
    arr = arr.astype(np.float64, copy=False)
    if not np.isfinite(arr).all() or (arr < 0).any() or abs(arr.sum() - 1.0) > tol:
        raise ValueError(f"{name} must be a distribution: finite, non-negative, summing to 1 (sums to {arr.sum():.9g})")
    return arr


def tvd(a, b) -> float:
    """Total variation distance: half the L1 distance between two distributions."""
    a, b = check_distribution(a, "a"), check_distribution(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"a and b must be distributions over the same outcomes: a has {a.size}, b {b.size}")
    return 0.5 * float(np.abs(a - b).sum())


def tvd_noise_floor(p, n: int) -> float:
    """Expected TVD between p and the frequencies of n samples drawn from p (normal approximation)."""
    p = check_distribution(p)
    check_count(n, "n", 1, SAMPLES)
    return 0.5 * float(np.sum(np.sqrt(2 * p * (1 - p) / (np.pi * n))))


def chi_square_pvalue(counts, p) -> float:
    """p-value of Pearson's test that counts were drawn from p; outcomes expected < 5 times are pooled."""
    p, counts = check_distribution(p), np.asarray(counts)
    if counts.dtype.kind not in "iuf" or counts.shape != p.shape or not np.isfinite(counts).all() or (counts < 0).any():
        raise ValueError(f"counts must be {p.size} finite non-negative numbers, one per outcome of p, got {counts!r:.80}")
    counts = counts.astype(np.float64)
    n = counts.sum()
    if n == 0:
        raise ValueError("counts are all zero: no samples to test")
    if (counts[p == 0] > 0).any():
        return 0.0  # an outcome that p says is impossible
    keep = p * n >= 5
    observed, expected = list(counts[keep]), list(p[keep] * n)
    if p[~keep].sum() > 0:
        observed.append(counts[~keep].sum())
        expected.append(p[~keep].sum() * n)
    if len(observed) < 2:
        return 1.0
    expected = np.array(expected) * (sum(observed) / sum(expected))  # guard float drift in the totals
    return float(stats.chisquare(observed, expected).pvalue)


def pool_rare(p, *freqs, min_prob: float):
    """Keep the outcomes with p >= min_prob and pool the rest into one last outcome, in p and in each
    frequency vector: fewer outcomes, so n samples resolve smaller differences."""
    p = check_distribution(p)
    if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float, np.integer, np.floating)) \
            or not 0 <= min_prob <= 1:
        raise ValueError(f"min_prob must be a probability in [0, 1], got {min_prob!r}")
    freqs = [np.asarray(f) for f in freqs]
    for i, f in enumerate(freqs):
        if f.dtype.kind not in "iuf" or f.shape != p.shape or not np.isfinite(f).all():
            raise ValueError(f"frequency vector {i} must be {p.size} finite numbers, one per outcome of p, "
                             f"got {f.dtype} of shape {f.shape}")
    keep = p >= min_prob
    pooled = [np.append(np.asarray(f, np.float64)[keep], np.asarray(f, np.float64)[~keep].sum()) for f in (p, *freqs)]
    return pooled[0] if not freqs else tuple(pooled)


def two_sample_tvd_null(p, n: int, trials: int = 1000, seed: int = 0) -> np.ndarray:
    """The empirical noise floor of a two-sample comparison: the TVDs between the frequencies of
    two independent sets of n draws from p, for `trials` pairs of sets (no normal approximation)."""
    p = check_distribution(p)
    check_count(n, "n", 1, SAMPLES)
    check_count(trials, "trials", 1, SAMPLES)
    rng = np.random.default_rng(check_seed(seed))
    a = rng.multinomial(n, p / p.sum(), size=trials) / n  # (trials, V)
    b = rng.multinomial(n, p / p.sum(), size=trials) / n  # (trials, V)
    return 0.5 * np.abs(a - b).sum(axis=1)
