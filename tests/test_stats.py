import numpy as np

from lib.measure.stats import chi_square_pvalue, tvd, tvd_noise_floor
from lib.sampling import probs_from_logits


def test_noise_floor_predicts_the_tvd_of_samples():
    p = probs_from_logits(np.random.default_rng(3).standard_normal(40) * 2)
    rng = np.random.default_rng(4)
    n = 5000
    observed = [tvd(np.bincount(rng.choice(40, n, p=p), minlength=40) / n, p) for _ in range(200)]
    assert abs(np.mean(observed) / tvd_noise_floor(p, n) - 1) < 0.1


def test_chi_square_accepts_samples_of_p_and_rejects_samples_of_q():
    rng = np.random.default_rng(5)
    p = probs_from_logits(rng.standard_normal(30) * 2)
    q = probs_from_logits(np.log(p) + rng.standard_normal(30) * 0.3)
    assert chi_square_pvalue(np.bincount(rng.choice(30, 20000, p=p), minlength=30), p) > 1e-3
    assert chi_square_pvalue(np.bincount(rng.choice(30, 20000, p=q), minlength=30), p) < 1e-6


def test_chi_square_on_a_point_mass_and_impossible_outcomes():
    assert chi_square_pvalue([100, 0, 0], [1.0, 0, 0]) == 1.0
    assert chi_square_pvalue([99, 1, 0], [1.0, 0, 0]) == 0.0

