"""Chapter 9's check 3: whole speculative generations held to the target's exact joint
distribution, with a threshold a correct decoder crosses with probability at most delta.

Speculative sampling emits every token from the target's p (Leviathan, Kalman & Matias 2023;
Chen et al. 2023), so the next n characters after a prefix follow the target's joint
distribution, which its forward passes give exactly. The statistic is the TVD between n
generations' frequencies and that distribution; the threshold adds to Jensen's bound on a correct
decoder's expected TVD the margin McDiarmid's inequality (1989) gives for delta, since one
generation moves the TVD by at most 1/n. No approximation is involved.
"""
from contextlib import contextmanager

import numpy as np

import lib
import lib.speculative
from lib.sampling import probs_from_logits


def next_probs(model, text, temperature=1.0):
    """The model's next-token distribution after `text`: (V,)."""
    params, cfg = model
    return probs_from_logits(lib.forward(params, cfg, lib.encode(text))[-1], temperature)


@contextmanager
def patched(owner, name, replacement):
    """owner.name replaced for the duration of a with-block."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def continuations(model, prefix, n_chars, min_prob):
    """{tokens: exact probability} of every n_chars-character continuation of prefix at least
    min_prob likely, from the model's forward passes (a continuation's prefixes are at least as
    likely, so a prefix below min_prob is not extended)."""
    return joint_from(lambda seq: next_probs(model, prefix + lib.decode(list(seq))), n_chars, min_prob)


def outcomes(joint):
    """The outcomes' exact probabilities (named continuations, then one pooling the rest) and
    each named continuation's index: ((outcomes + 1,), {tokens: index})."""
    exact = np.append(list(joint.values()), 1 - sum(joint.values()))
    return exact, {seq: i for i, seq in enumerate(joint)}


def threshold_for(exact, n, delta):
    """(Jensen's bound on a correct decoder's expected TVD over n generations, that bound plus
    McDiarmid's margin for delta): P(TVD > the second) <= delta."""
    expected = 0.5 * np.sqrt(exact * (1 - exact) / n).sum()  # >= E[TVD], bin by bin
    return expected, expected + np.sqrt(np.log(1 / delta) / (2 * n))


def generations(target, draft, prompt, n_chars, k, n, index, drafter=lib.speculative.ModelDrafter):
    """Outcome counts (outcomes + 1,) and round counts of n generations of n_chars tokens after
    prompt, seeds 0..n-1, drafting with the class `drafter` (any ModelDrafter)."""
    counts, stats = generations_with(target, draft, prompt, n_chars, k, n, index, drafter=drafter)
    return counts, np.bincount([s.rounds for s in stats], minlength=n_chars + 1)


def processed(temperature, top_k):
    """A request's logits processing: the softmax at `temperature`, then top-k (the top_k likeliest
    tokens kept, renormalized). Returns probs(logits, ignored=None) -> (..., V), called as
    lib.sampling.probs_from_logits is; the request's temperature replaces the one passed."""
    def probs(logits, _temperature=None):
        p = probs_from_logits(logits, temperature)  # (..., V)
        kth = np.sort(p, axis=-1)[..., -top_k, None]  # (..., 1): the top_k-th largest probability
        kept = np.where(p >= kth, p, 0.0)
        return kept / kept.sum(axis=-1, keepdims=True)
    return probs


def joint_from(p_next, n_chars, min_prob):
    """{tokens: exact probability} of every n_chars-token continuation at least min_prob likely,
    p_next(seq) being the next-token distribution (V,) after the emitted tuple seq: `continuations`
    for any distribution (processed logits, for one)."""
    out, todo = {}, [((), 1.0)]
    while todo:
        seq, prob = todo.pop()
        if len(seq) == n_chars:
            out[seq] = prob
            continue
        p = p_next(seq)  # (V,)
        todo += [(seq + (int(a),), prob * p[a]) for a in np.flatnonzero(prob * p >= min_prob)]
    return dict(sorted(out.items()))


def generations_with(target, draft, prompt, n_chars, k, n, index, temperature=1.0, dynamic=False, probs=None,
                     drafter=lib.speculative.ModelDrafter):
    """`generations` with the request's temperature, an adaptive k (`dynamic`) and, if given, `probs`
    in place of probs_from_logits for both models (a drafter class may process its own q apart).
    Returns outcome counts (outcomes + 1,) and each generation's SpecStats, seeds 0..n-1."""
    counts, stats = np.zeros(len(index) + 1), []
    with patched(lib.speculative, "ModelDrafter", drafter), \
            patched(lib.speculative, "probs_from_logits", probs or lib.speculative.probs_from_logits):
        for seed in range(n):
            out, s = lib.speculative.speculative_generate(target, draft, prompt, n_chars, k=k, temperature=temperature,
                                                          seed=seed, dynamic=dynamic)
            counts[index.get(tuple(int(t) for t in out), -1)] += 1
            stats.append(s)
    return counts, stats
