"""lib.speculative.emitted_distribution: the exact joint a speculative decoder emits, the chain rule
over next_token_laws (each prefix's law mixes its places in the round). With Leviathan et al.'s
rule it is the target's joint (the lemma); with a broken rule it is still a distribution, and it
matches the decoder's own draws."""
import itertools

import numpy as np
import pytest

from lib.measure.stats import tvd, tvd_noise_floor
from lib.speculative import emitted_distribution, residual, step_parts

V, N = 4, 3
ALL = list(itertools.product(range(V), repeat=N))


def table(seed):
    """A next-token distribution for every prefix of up to N - 1 tokens: {prefix: (V,)}."""
    rng = np.random.default_rng(seed)
    return {seq: rng.dirichlet(np.ones(V)) for n in range(N) for seq in itertools.product(range(V), repeat=n)}


P, Q = table(1), table(2)


def greedy_parts(p, q):
    """A broken rule (chapter 9's bug 1): the draft proposes its argmax, the ratio uses q."""
    proposal = np.eye(len(q))[np.argmax(q)]
    accept = np.minimum(1.0, p / q)
    return proposal * accept, float(np.sum(proposal * (1 - accept))) * residual(p, q)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_the_correct_rule_emits_the_targets_joint(k):
    joint = emitted_distribution(P.get, Q.get, ALL, k)
    chain = [np.prod([P[seq[:i]][a] for i, a in enumerate(seq)]) for seq in ALL]
    np.testing.assert_allclose(joint, chain, atol=1e-15, rtol=0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_broken_rule_gives_a_distribution_away_from_the_target(k):
    joint = emitted_distribution(P.get, Q.get, ALL, k, greedy_parts)
    chain = np.array([np.prod([P[seq[:i]][a] for i, a in enumerate(seq)]) for seq in ALL])
    assert abs(joint.sum() - 1) < 1e-12 and tvd(joint, chain) > 0.05


def test_a_broken_rule_matches_a_simulation_of_its_decoder():
    """Simulate the decoder's rounds with the broken rule: drafted positions judged, a bonus from p."""
    k, draws, rng = 2, 20_000, np.random.default_rng(0)
    index = {seq: i for i, seq in enumerate(ALL)}
    counts = np.zeros(len(ALL))
    for _ in range(draws):
        seq = ()
        while len(seq) < N:
            drafted = min(k, N - len(seq))
            for place in range(drafted + 1):
                if len(seq) == N:
                    break
                p = P[seq]
                if place == drafted:  # the bonus token
                    seq += (int(rng.choice(V, p=p)),)
                    break
                accepted, replaced = greedy_parts(p, Q[seq])
                u = rng.random()
                if u < accepted.sum():
                    seq += (int(rng.choice(V, p=accepted / accepted.sum())),)
                else:
                    seq += (int(rng.choice(V, p=replaced / replaced.sum())),)
                    break
        counts[index[seq]] += 1
    joint = emitted_distribution(P.get, Q.get, ALL, k, greedy_parts)
    assert tvd(counts / draws, joint) < 3 * tvd_noise_floor(joint, draws)


def test_only_the_sequences_asked_for_are_followed():
    asked = ALL[:5]
    seen = set()

    def p_next(seq):
        seen.add(seq)
        return P[seq]
    joint = emitted_distribution(p_next, Q.get, asked, 2, step_parts)
    assert seen <= {seq[:i] for seq in asked for i in range(N)}
    np.testing.assert_allclose(joint, emitted_distribution(P.get, Q.get, ALL, 2)[:5], atol=1e-15)

