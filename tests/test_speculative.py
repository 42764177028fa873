"""Speculative sampling leaves the target's distribution unchanged: exactly in closed form,
by sampling against the noise floor, and greedy-equal at temperature 0."""
import numpy as np
import pytest
from conftest import perturbed_params
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lib.config import DRAFT, TARGET, ModelConfig
from lib.generation import generate
from lib.measure.stats import chi_square_pvalue
from lib.model import Model, forward
from lib.sampling import probs_from_logits
from lib.speculative import PromptLookup, expected_speedup, expected_tokens_per_call, speculative_generate, step_distribution

logits = arrays(np.float64, 12, elements=st.floats(-8, 8))


@settings(max_examples=200)
@given(logits, logits, st.floats(0.2, 3.0))
def test_one_step_distribution_is_exactly_p(zp, zq, temperature):
    p, q = probs_from_logits(zp, temperature), probs_from_logits(zq, temperature)
    np.testing.assert_allclose(step_distribution(p, q), p, atol=1e-12, rtol=0)


def test_one_step_distribution_with_disjoint_supports_and_equal_inputs():
    p, q = np.array([0.5, 0.5, 0, 0]), np.array([0, 0, 0.25, 0.75])
    np.testing.assert_allclose(step_distribution(p, q), p, atol=1e-15)
    np.testing.assert_allclose(step_distribution(p, p), p, atol=1e-15)


TARGET_MODEL = Model(perturbed_params(TARGET, seed=21), TARGET)
DRAFT_MODEL = Model(perturbed_params(DRAFT, seed=22), DRAFT)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_temperature_zero_equals_greedy_target(k):
    prompt = np.arange(10) * 7 % 96
    greedy = generate(TARGET_MODEL, prompt, 50).tokens
    tokens, st_ = speculative_generate(TARGET_MODEL, DRAFT_MODEL, prompt, 50, k=k, temperature=0)
    np.testing.assert_array_equal(tokens, greedy)
    assert st_.target_calls == st_.rounds and st_.accepted <= st_.judged <= st_.drafted
    assert st_.emitted >= 50 and st_.draft_calls == st_.drafted


@pytest.mark.parametrize("draft,dynamic", [(DRAFT_MODEL, True), (PromptLookup(), False), (PromptLookup(1), True)],
                         ids=["dynamic-k", "prompt-lookup", "prompt-lookup-unigram-dynamic"])
def test_temperature_zero_equals_greedy_for_every_drafter(draft, dynamic):
    prompt = np.array([5, 6, 7, 5, 6, 7, 5, 6])
    greedy = generate(TARGET_MODEL, prompt, 60).tokens
    tokens, s = speculative_generate(TARGET_MODEL, draft, prompt, 60, k=2, temperature=0, dynamic=dynamic)
    np.testing.assert_array_equal(tokens, greedy)
    assert s.accepted <= s.judged <= s.drafted


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    lookup = PromptLookup(2).start(np.array([1, 2, 3, 4, 9, 1, 2]), 96)
    tokens, qs = lookup.propose(3, 3, None)  # context ... 1 2 3: "2 3" occurred before, followed by 4 9 1
    assert tokens == [4, 9, 1] and all(q[t] == 1 for q, t in zip(qs, tokens))
    assert PromptLookup(2).start(np.array([1, 2]), 96).propose(7, 3, None) == ([], [])


def test_prompt_lookup_drafts_nothing_below_its_shortest_ngram():
    """min_ngram: tails shorter than it are not matched (vLLM's prompt_lookup_min); a bad one is refused."""
    prompt = np.array([1, 2, 3, 4, 9, 5, 2])  # the tail (2,) occurred before; (5, 2) and (9, 5, 2) did not
    assert PromptLookup(3).start(prompt, 96).propose(2, 2, None)[0] == [3, 4]
    assert PromptLookup(3, min_ngram=2).start(prompt, 96).propose(2, 2, None) == ([], [])
    for bad in (0, 4, 1.5, None):
        with pytest.raises(ValueError, match="min_ngram"):
            PromptLookup(3, min_ngram=bad)


def test_identical_draft_accepts_everything():
    tokens, s = speculative_generate(TARGET_MODEL, TARGET_MODEL, np.arange(5), 40, k=4, temperature=1.0, seed=3)
    assert s.alpha == 1.0 and s.emitted / s.target_calls == pytest.approx(5.0) and len(tokens) == 40


# Tiny models over a 4-token vocabulary, so the joint distribution of the next two tokens has
# 16 outcomes that can be computed exactly from the target's forward pass.
TINY_T = ModelConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=8, block_size=16, vocab_size=4)
TINY_D = ModelConfig(n_layer=1, n_head=1, n_kv_head=1, n_embd=4, block_size=16, vocab_size=4)


def tiny(cfg, seed, scale):
    params = perturbed_params(cfg, seed)
    params["lm_head.weight"] *= scale  # sharper logits, so p and q really differ
    return Model(params, cfg)


def exact_joint(model, prompt, temperature):
    params, cfg = model.params, model.cfg
    p1 = probs_from_logits(forward(params, cfg, prompt)[-1], temperature)
    joint = np.zeros((4, 4))
    for a in range(4):
        p2 = probs_from_logits(forward(params, cfg, np.append(prompt, a))[-1], temperature)
        joint[a] = p1[a] * p2
    return joint.reshape(-1)


@pytest.mark.parametrize("use_lookup", [False, True], ids=["draft-model", "prompt-lookup"])
def test_two_token_joint_distribution_matches_target_sampling(use_lookup):
    target, draft = tiny(TINY_T, 1, 40.0), tiny(TINY_D, 2, 40.0)
    prompt, temperature, n = np.array([1, 3, 0]), 1.0, 6000
    expected = exact_joint(target, prompt, temperature)
    draft_only = exact_joint(draft, prompt, temperature)
    assert 0.5 * np.abs(expected - draft_only).sum() > 0.2  # the draft alone is clearly different
    drafter = PromptLookup(1) if use_lookup else draft
    spec = [4 * a + b for a, b in (speculative_generate(target, drafter, prompt, 2, k=2, temperature=temperature,
                                                        seed=s)[0] for s in range(n))]
    assert chi_square_pvalue(np.bincount(spec, minlength=16), expected) > 1e-3
    # The same statistic has the power to see the draft's distribution: it would fail there.
    draft_samples = np.random.default_rng(0).choice(16, size=n, p=draft_only)
    assert chi_square_pvalue(np.bincount(draft_samples, minlength=16), expected) < 1e-6


def test_formulas():
    assert expected_tokens_per_call(0.0, 5) == 1.0
    assert expected_tokens_per_call(1.0, 5) == 6.0
    assert expected_tokens_per_call(0.5, 2) == pytest.approx(1.75)
    assert expected_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)
    assert expected_speedup(0.5, 2, 0.25, call_cost=2.0) == pytest.approx(1.75 / 2.5)


@given(alpha=st.floats(0, 1), k=st.integers(1, 16))
def test_a_free_draft_cannot_beat_verification_that_costs_a_step_per_token(alpha, k):
    """If a (k+1)-token call costs k+1 one-token calls, speculation gains nothing even at c = 0."""
    assert expected_speedup(alpha, k, 0.0, call_cost=k + 1) <= 1.0 + 1e-12


@pytest.mark.parametrize("kwargs,message", [
    ({"k": 0}, r"k \(draft tokens per round\) must be an integer in 1..512, got 0"),
    ({"k": 2.5}, "must be an integer in 1..512"),
    ({"k": 10**9}, "must be an integer in 1..512, got 1000000000"),
    ({"k": 20, "dynamic": True}, "dynamic k starts at k=20, which is above k_max=16"),
    ({"k": 2, "dynamic": True, "k_max": 0}, "k_max must be an integer in 1"),
    ({"seed": "abc"}, "seed must be an integer >= 0"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"n_new": 600}, "n_new \\(the prompt holds"),
])
def test_bad_arguments(kwargs, message):
    args = {"k": 2, "temperature": 1.0, "n_new": 10} | kwargs
    with pytest.raises(ValueError, match=message):
        speculative_generate(TARGET_MODEL, DRAFT_MODEL, [1, 2, 3], **args)


def test_draft_with_another_vocabulary_is_refused():
    other = ModelConfig(n_layer=1, n_head=2, n_kv_head=2, n_embd=48, vocab_size=100)
    with pytest.raises(ValueError, match="share a vocabulary: 96 vs 100 tokens"):
        speculative_generate(TARGET_MODEL, Model(perturbed_params(other), other), [1, 2], 5)
