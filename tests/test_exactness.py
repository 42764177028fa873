"""lib.book.studies.exactness.PrefixTest: chapter 9's check 3, a Monte Carlo test (Hope 1968) of
every prefix's next-token law. Its false-alarm rate is its nominal level within noise (its largest
score or their sum), on the simulated runs and on runs drawn token by token; it flags a law shifted at one prefix. And
`processed`, the (H0) reference's logits processing: top-k of the tempered softmax. And check 4's
randomized PIT: uniform for tokens drawn from their laws, far from it for tokens drawn from another."""
import itertools
from collections import Counter

import numpy as np
import pytest
from scipy.stats import chi2

from lib.book.studies.exactness import PrefixTest, pit_values, prefix_tree, processed, uniformity
from lib.sampling import probs_from_logits

V, N = 4, 3
RNG = np.random.default_rng(1)
P = {seq: RNG.dirichlet(np.ones(V)) for n in range(N) for seq in itertools.product(range(V), repeat=n)}
TREE = prefix_tree(P.get, N, 0.05)


def test_the_tree_holds_every_prefix_likely_enough_and_its_law():
    assert () in TREE and all(len(seq) < N for seq in TREE)
    for seq, law in TREE.items():
        assert law is P[seq] and np.prod([P[seq[:i]][a] for i, a in enumerate(seq)]) >= 0.05


@pytest.mark.parametrize("summed", [False, True])  # the largest score, or their sum (Fisher's)
def test_false_alarms_on_simulated_runs_are_at_the_level(summed):
    test = PrefixTest(TREE, 300, sets=9_999, level=0.01, summed=summed)  # its threshold: the 100th largest of 9,999
    rate = np.mean(test.simulate(TREE, 20_000, np.random.default_rng(7)) > test.threshold)
    # the threshold's own exceedance ~ Beta(100, 9,900): sd 0.001; 20,000 runs: sd 0.0007
    assert abs(rate - 0.01) < 0.005


def test_false_alarms_on_runs_drawn_token_by_token_are_at_the_level():
    test, rng = PrefixTest(TREE, 100, sets=999, level=0.05), np.random.default_rng(3)
    flagged = []
    for _ in range(400):
        draws = Counter()
        for _ in range(100):
            seq = ()
            while len(seq) < N:
                seq += (int(rng.choice(V, p=P[seq])),)
            draws[seq] += 1
        flagged.append(test.score(draws)[0] > test.threshold)
    assert abs(np.mean(flagged) - 0.05) < 0.035  # 400 runs: sd 0.011; the threshold's own: 0.007


def test_a_law_shifted_at_one_prefix_is_flagged_there():
    test = PrefixTest(TREE, 2_000, sets=999, level=0.01)
    shifted = dict(TREE)
    shifted[()] = 0.8 * TREE[()] + 0.2 * np.eye(V)[int(np.argmin(TREE[()]))]  # TVD 0.2 at the first token
    assert test.power(shifted, sets=500) > 0.99 and test.power(TREE, sets=500) < 0.05
    rng, draws = np.random.default_rng(4), Counter()
    for _ in range(2_000):
        seq = (int(rng.choice(V, p=shifted[()])),)
        while len(seq) < N:
            seq += (int(rng.choice(V, p=P[seq])),)
        draws[seq] += 1
    stat, where = test.score(draws)
    assert stat > test.threshold and where == ()


@pytest.mark.parametrize("temperature,top_k", [(1.0, 4), (0.7, 2), (1.3, 1)])
def test_processed_keeps_top_k_at_the_temperature_and_prefix_tree_holds_every_prefix(temperature, top_k):
    """chapter 9's (H0) reference: top-k keeps the k likeliest tokens of the tempered softmax,
    renormalized; prefix_tree with no cut-off holds every prefix shorter than N."""
    logits = np.random.default_rng(0).normal(size=(3, V))
    probs = processed(temperature, top_k)(logits, 99.0)  # the passed temperature is ignored
    tempered = probs_from_logits(logits, temperature)
    assert np.allclose(probs.sum(axis=-1), 1.0) and ((probs > 0).sum(axis=-1) == top_k).all()
    kept = probs > 0
    assert np.allclose(probs[kept], (tempered * kept / (tempered * kept).sum(-1, keepdims=True))[kept])
    tree = prefix_tree(P.get, N, 0.0)
    assert len(tree) == sum(V**n for n in range(N)) and all(tree[seq] is P[seq] for seq in tree)


def test_pit_is_uniform_for_the_right_sampler_and_flags_a_sampler_that_draws_from_q():
    rng = np.random.default_rng(5)
    p, q = rng.dirichlet(np.ones(8), 4_000), rng.dirichlet(np.ones(8), 4_000)  # (T, V) each: a law per position
    draw = lambda laws: np.array([rng.choice(8, p=law) for law in laws])  # (T,)
    x = draw(p)
    u = pit_values(p, x, np.random.default_rng(6))
    below = np.cumsum(p, axis=1)[np.arange(len(x)), x] - p[np.arange(len(x)), x]
    assert np.all((u >= below) & (u <= below + p[np.arange(len(x)), x]))  # inside the token's slice of the CDF
    assert uniformity(u)[1] > 1e-3  # seeded: numpy's generators give these draws on any machine
    wrong = uniformity(pit_values(p, draw(q), np.random.default_rng(6)))[0]
    assert wrong > 5 * chi2.ppf(0.999, 19)  # a sampler that draws from q: far beyond the null
