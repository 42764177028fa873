"""Sampling and generation: greedy at temperature 0, seeded, distributed as the softmax says."""
import numpy as np
import pytest
from conftest import perturbed_params

from lib.config import DRAFT, TARGET
from lib.generation import complete, generate
from lib.measure.stats import chi_square_pvalue, tvd, tvd_noise_floor
from lib.model import Model, forward
from lib.sampling import probs_from_logits, sample


def test_temperature_zero_is_one_hot_argmax():
    logits = np.array([0.1, 2.0, -1.0, 1.9])
    np.testing.assert_array_equal(probs_from_logits(logits, 0), [0, 1, 0, 0])


def test_temperature_scales_logits():
    logits = np.array([0.0, 1.0, 3.0])
    p = probs_from_logits(logits, 0.5)
    np.testing.assert_allclose(p, np.exp(2 * logits) / np.exp(2 * logits).sum())


def test_samples_follow_the_distribution():
    p = probs_from_logits(np.random.default_rng(1).standard_normal(96) * 2, 1.0)
    n = 200_000
    rng = np.random.default_rng(0)
    counts = np.bincount([sample(p, rng) for _ in range(n)], minlength=96)
    assert tvd(counts / n, p) < 2 * tvd_noise_floor(p, n)
    assert chi_square_pvalue(counts, p) > 1e-3


@pytest.mark.parametrize("cfg", [TARGET, DRAFT], ids=["target", "draft"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_same_tokens_with_and_without_cache(cfg, temperature):
    params = perturbed_params(cfg, seed=5)
    prompt = np.arange(24) * 5 % 96
    cached = generate(Model(params, cfg), prompt, 40, temperature, seed=7)
    plain = generate(Model(params, cfg), prompt, 40, temperature, seed=7, use_cache=False)
    np.testing.assert_array_equal(cached.tokens, plain.tokens)
    assert np.abs(cached.logits - plain.logits).max() < 1e-5


def test_same_seed_same_tokens_other_seed_other_tokens():
    params = perturbed_params(TARGET, seed=2)
    a = complete(Model(params, TARGET), "def f(x):", 60, 1.0, seed=11)
    assert a == complete(Model(params, TARGET), "def f(x):", 60, 1.0, seed=11)
    assert a != complete(Model(params, TARGET), "def f(x):", 60, 1.0, seed=12)


def test_without_cache_each_step_is_the_reference_forward():
    params = perturbed_params(DRAFT, seed=3)
    prompt = np.arange(12) * 7 % 96
    gen = generate(Model(params, DRAFT), prompt, 8, 0.8, seed=1, use_cache=False)
    seq = np.concatenate([prompt, gen.tokens])
    for i in range(8):
        np.testing.assert_array_equal(gen.logits[i], forward(params, DRAFT, seq[:len(prompt) + i])[-1])


def test_a_model_that_is_not_a_step_is_refused():
    params = perturbed_params(DRAFT, seed=3)
    with pytest.raises(TypeError, match=r"model must be a Step.*lib.model.Model\(params, cfg\)"):
        generate((params, DRAFT), [1, 2], 3)
    with pytest.raises(ValueError, match="needs float"):
        Model(params, TARGET)
