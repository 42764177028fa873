"""Comparing distributions: total variation distance, its noise floor, and a chi-square test.

A sampled distribution is never exactly its source; the question is whether it is as close as
sampling noise allows. For n draws from p, the frequency of outcome i has standard deviation
sqrt(p_i (1 - p_i) / n), and E|N(0, s^2)| = s sqrt(2/pi), so the expected total variation
distance of the frequencies from p is about 0.5 * sum_i sqrt(2 p_i (1 - p_i) / (pi n)).
Pearson's chi-square test (Pearson 1900) lumps the outcomes expected fewer than 5 times into one.
"""
import numpy as np
from scipy import stats


def tvd(a, b) -> float:
    """Total variation distance: half the L1 distance between two distributions."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)  # (V,) each
    return 0.5 * float(np.abs(a - b).sum())


def tvd_noise_floor(p, n: int) -> float:
    """Expected TVD between p and the frequencies of n samples drawn from p (normal approximation)."""
    p = np.asarray(p, np.float64)  # (V,)
    return 0.5 * float(np.sum(np.sqrt(2 * p * (1 - p) / (np.pi * n))))


def chi_square_pvalue(counts, p) -> float:
    """p-value of Pearson's test that counts were drawn from p; outcomes expected < 5 times are lumped into one."""
    p, counts = np.asarray(p, np.float64), np.asarray(counts, np.float64)  # (V,) each
    n = counts.sum()
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
