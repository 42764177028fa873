import numpy as np

from lib.measure.stats import chi_square_pvalue, pool_rare, tvd, tvd_noise_floor, two_sample_tvd_null
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


def test_pool_rare_keeps_common_outcomes_and_sums_the_rest():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    f = np.array([0.4, 0.4, 0.1, 0.1])
    pp, pf = pool_rare(p, f, min_prob=0.2)
    assert np.allclose(pp, [0.5, 0.3, 0.2]) and np.allclose(pf, [0.4, 0.4, 0.2])
    assert np.allclose(pool_rare(p, min_prob=0.2), [0.5, 0.3, 0.2])


def test_two_sample_null_matches_simulated_pairs_and_flags_another_distribution():
    rng = np.random.default_rng(6)
    p = probs_from_logits(rng.standard_normal(20) * 2)
    q = probs_from_logits(np.log(p) + rng.standard_normal(20) * 0.5)
    n = 4000
    null = two_sample_tvd_null(p, n, trials=500, seed=1)
    pairs = [tvd(np.bincount(rng.choice(20, n, p=p), minlength=20) / n,
                 np.bincount(rng.choice(20, n, p=p), minlength=20) / n) for _ in range(200)]
    assert abs(np.mean(pairs) / null.mean() - 1) < 0.1  # same spread as drawing the pairs by hand
    other = tvd(np.bincount(rng.choice(20, n, p=q), minlength=20) / n, np.bincount(rng.choice(20, n, p=p), minlength=20) / n)
    assert other > np.quantile(null, 0.99)  # a different distribution lies above the floor
