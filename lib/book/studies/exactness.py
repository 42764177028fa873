"""Chapter 9's check 3: whole speculative generations held to the target's exact conditionals,
with a threshold a correct decoder crosses with probability at most 1e-4, by construction.

Speculative sampling emits every token from the target's p (Leviathan, Kalman & Matias 2023;
Chen et al. 2023), so after every prefix a decoder emits, its next character follows the target's
conditional p(. | prefix), which the target's forward pass gives exactly. The test takes each
prefix at least min_prob likely, compares the next characters the generations emitted after it
with that conditional (Pearson's chi-square, cells expected fewer than 5 times lumped), and keeps
the largest score over the prefixes. Its threshold comes from a Monte Carlo null (Hope 1968;
Besag & Clifford 1989): the same statistic on many simulated sets of exact draws from the target's
conditionals; a correct decoder's statistic is exchangeable with theirs, so it lands among the r
largest of sets + 1 with probability at most r / (sets + 1), whatever the statistic's law.

Check 4 (pit_values, pit_generations, uniformity): every emitted token of long generations, each mapped by
the randomized probability integral transform of the target's law given its past; under exactness the
values are iid U(0, 1), tested with a binned chi-square.
"""
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

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


def generations(target, draft, prompt, n_chars, k, n, drafter=lib.speculative.ModelDrafter):
    """The emitted sequences of n generations of n_chars tokens after prompt, seeds 0..n-1, as a
    Counter {tokens: count}, and the generations' counts by rounds, drafting with the class `drafter`."""
    seqs, stats_ = generations_with(target, draft, prompt, n_chars, k, n, drafter=drafter)
    return seqs, np.bincount([s.rounds for s in stats_], minlength=n_chars + 1)


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


def generations_with(target, draft, prompt, n_chars, k, n, temperature=1.0, dynamic=False, probs=None,
                     drafter=lib.speculative.ModelDrafter):
    """`generations` with the request's temperature, an adaptive k (`dynamic`) and, if given, `probs`
    in place of probs_from_logits for both models (a drafter class may process its own q apart).
    Returns the emitted sequences as a Counter and each generation's SpecStats, seeds 0..n-1."""
    seqs, stats_ = Counter(), []
    with patched(lib.speculative, "ModelDrafter", drafter), \
            patched(lib.speculative, "probs_from_logits", probs or lib.speculative.probs_from_logits):
        for seed in range(n):
            out, s = lib.speculative.speculative_generate(target, draft, prompt, n_chars, k=k, temperature=temperature,
                                                          seed=seed, dynamic=dynamic)
            seqs[tuple(int(t) for t in out)] += 1
            stats_.append(s)
    return seqs, stats_


def prefix_tree(p_next, n_chars, min_prob):
    """{prefix: its next-token law (V,)} for every prefix shorter than n_chars at least min_prob
    likely, () included, p_next(seq) being the next-token distribution after the emitted tuple seq
    (a prefix's own prefixes are at least as likely, so a prefix below min_prob is not extended)."""
    out, todo = {}, [((), 1.0)]
    while todo:
        seq, prob = todo.pop()
        out[seq] = p = p_next(seq)  # (V,)
        if len(seq) + 1 < n_chars:
            todo += [(seq + (int(a),), prob * p[a]) for a in np.flatnonzero(prob * p >= min_prob)]
    return dict(sorted(out.items()))


def prefix_cells(tree, n):
    """Each prefix's cells at n generations, fixed before any draw: the tokens expected at least 5
    times after it, then the rest pooled (joined to the likeliest cell if it is expected fewer
    than 5 times); tokens that are prefixes of the tree are drawn apart to follow them.
    Returns {prefix: (drawn tokens, which of them stand alone, whether the rest stands alone)}."""
    reach, cells = {(): 1.0}, {}
    for seq, p in tree.items():  # sorted: a prefix comes before its extensions
        big = p * reach[seq] * n >= 5  # (V,)
        drawn = np.array([a for a in range(len(p)) if big[a] or seq + (a,) in tree], dtype=int)
        reach.update({seq + (int(a),): reach[seq] * p[a] for a in drawn if seq + (int(a),) in tree})
        cells[seq] = (drawn, big[drawn], (1 - p[big].sum()) * reach[seq] * n >= 5)
    return cells


@dataclass
class PrefixTest:
    """Check 3 (module docstring): the reference's conditionals `tree` (prefix_tree), n generations,
    a Monte Carlo null of `sets` simulated sets, false alarms at most `level` (a multiple of
    1 / (sets + 1)); prefixes visited fewer than n_min times are not scored. `summed`: the statistic
    is the sum of the prefixes' scores, Fisher's combination (Fisher 1925), not the largest; the
    simulated null sets are the same for a given seed."""
    tree: dict
    n: int
    sets: int = 99_999
    level: float = 1e-4
    n_min: int = 20
    seed: int = 1
    summed: bool = False
    cells: dict = field(init=False, repr=False)
    threshold: float = field(init=False)

    def __post_init__(self):
        self.cells = prefix_cells(self.tree, self.n)
        null = np.sort(self.simulate(self.tree, self.sets, np.random.default_rng(self.seed)))
        self.rank = round(self.level * (self.sets + 1))  # a correct decoder lands above null[-rank] w.p. <= level
        self.threshold = float(null[-self.rank])

    def scores(self, counts):
        """{prefix: (runs,) -ln of its chi-square p-value}, counts {prefix: (runs, drawn + 1)}, the last the rest."""
        out = {}
        for seq, c in counts.items():
            drawn, alone, rest_alone = self.cells[seq]
            if not alone.any():  # no token expected 5 times: nothing to score
                continue
            p = self.tree[seq][drawn]
            obs = np.concatenate([c[:, :-1][:, alone], c[:, :-1][:, ~alone].sum(1, keepdims=True) + c[:, -1:]], 1)
            ref = np.append(p[alone], max(0.0, 1 - p[alone].sum()))
            if not rest_alone:  # too rare to stand alone: the rest joins the likeliest cell
                j = int(np.argmax(ref[:-1]))
                obs[:, j], ref[j] = obs[:, j] + obs[:, -1], ref[j] + ref[-1]
                obs, ref = obs[:, :-1], ref[:-1]
            visits = c.sum(1)  # (runs,)
            if len(ref) > 1:
                expected = np.maximum(visits, 1)[:, None] * ref
                chi = ((obs - expected) ** 2 / expected).sum(1)
                out[seq] = np.where(visits >= self.n_min, -stats.chi2.logsf(chi, len(ref) - 1), 0.0)
        return out

    def simulate(self, laws, sets, rng):
        """(sets,) statistics of simulated runs whose next token after each prefix follows laws[prefix]."""
        counts, visits = {}, {(): np.full(sets, self.n)}
        for seq, (drawn, _, _) in self.cells.items():
            law = laws.get(seq, self.tree[seq])  # a prefix the decoder never reaches: any law, 0 visits
            probs = np.append(law[drawn], max(0.0, 1 - law[drawn].sum()))
            counts[seq] = rng.multinomial(visits.pop(seq), probs / probs.sum())  # (sets, drawn + 1)
            visits.update({seq + (int(a),): counts[seq][:, j] for j, a in enumerate(drawn) if seq + (int(a),) in self.tree})
        scored = np.array(list(self.scores(counts).values()))  # (prefixes, sets)
        return scored.sum(axis=0) if self.summed else scored.max(axis=0)

    def counts_of(self, sequences):
        """{prefix: (1, drawn + 1)} next-token counts of emitted sequences (a Counter {tokens: count})."""
        counts = {seq: np.zeros((1, len(drawn) + 1)) for seq, (drawn, _, _) in self.cells.items()}
        for tokens, m in sequences.items():
            for i, a in enumerate(tokens):
                if tokens[:i] in counts:
                    drawn = self.cells[tokens[:i]][0]
                    j = np.flatnonzero(drawn == a)
                    counts[tokens[:i]][0, j[0] if len(j) else -1] += m
        return counts

    def score(self, sequences):
        """(statistic, the worst prefix): the largest score (or, summed, their sum) of emitted sequences."""
        scored = {seq: float(s[0]) for seq, s in self.scores(self.counts_of(sequences)).items()}
        worst = max(scored, key=scored.get)
        return (sum(scored.values()) if self.summed else scored[worst]), worst

    def power(self, laws, sets=2000, seed=2):
        """The share of simulated runs, each token after a prefix following laws[prefix], that the test flags."""
        return float(np.mean(self.simulate(laws, sets, np.random.default_rng(seed)) > self.threshold))


def pit_values(probs, tokens, rng):
    """The randomized probability integral transform of emitted tokens (Rosenblatt 1952; for discrete
    laws Brockwell 2007, Czado, Gneiting & Held 2009): u_t = F(x_t - 1) + V_t p(x_t), F the CDF of
    probs[t] in the vocabulary's order, V_t ~ U(0, 1) from rng. If each x_t was drawn from probs[t]
    given everything before it, the u_t are iid U(0, 1). probs: (T, V); tokens: (T,). Returns (T,)."""
    rows = np.arange(len(tokens))
    mass = probs[rows, tokens]  # (T,)
    return np.cumsum(probs, axis=1)[rows, tokens] - mass + rng.random(len(tokens)) * mass


def pit_generations(target, draft, reference, prompts, n_new, k, seed=0, temperature=1.0):
    """The PIT values (pit_values) of every token of one speculative generation per prompt (seeds
    0, 1, ...), against the reference's next-token laws: one lib.forward call over prompt + output
    gives every position's. reference: (params, cfg). V_t from its own generator, `seed`. Returns (n_new * prompts,)."""
    rng, out = np.random.default_rng(seed), []
    for i, prompt in enumerate(prompts):
        tokens, _ = lib.speculative.speculative_generate(target, draft, prompt, n_new, k=k, temperature=temperature, seed=i)
        logits = lib.forward(*reference, np.concatenate([prompt, tokens]))[len(prompt) - 1:-1]  # (n_new, V)
        out.append(pit_values(probs_from_logits(logits, temperature), tokens, rng))
    return np.concatenate(out)


def uniformity(u, bins=20):
    """Pearson's chi-square of u's counts in `bins` equal bins of [0, 1) against uniform counts, and its
    p-value on chi-square with bins - 1 degrees of freedom (the u_t iid U(0, 1): the counts are multinomial)."""
    counts = np.histogram(u, bins, range=(0.0, 1.0))[0]  # (bins,)
    expected = len(u) / bins
    chi = float(((counts - expected) ** 2 / expected).sum())
    return chi, float(stats.chi2.sf(chi, bins - 1))
