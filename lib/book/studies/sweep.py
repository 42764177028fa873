"""Measuring speculative decoding: what a call costs, and the speed-up for each k, against the
formulas of Leviathan et al. 2023 (tokens per call, their eq. 1; speed-up, their Theorem 3.8).

The target can be a LeanModel (the trained model at its own cost) or a `lib.measure.standins.StandInStep`
(the trained model's decisions at a large model's cost). Baseline and speculative runs are
timed interleaved (baseline, k1, baseline, k2, ..., baseline), each k against the mean of the
two baselines beside it, so a machine whose speed drifts affects both sides alike.
"""
import functools
import time

import numpy as np

from lib.generation import generate
from lib.measure.counting import cached_call
from lib.model import forward
from lib.sampling import probs_from_logits
from lib.speculative import expected_speedup, expected_tokens_per_call, speculative_generate
from lib.timing import interleaved_speedups, paired_times


def _median_ratio(baseline, candidate, repeats):
    """Candidate time over baseline time in `repeats` back-to-back pairs: (the median baseline
    seconds, the median of the pairs' ratios), taken the same way as the sweep's speed-ups, so a
    slow drift of the machine's speed cancels within each pair."""
    times = paired_times(baseline, candidate, repeats, min_seconds=0.01)  # (repeats, 2)
    return float(np.median(times[:, 0])), float(np.median(times[:, 1] / times[:, 0]))


def call_costs(model, sizes, position: int = 64, repeats: int = 9) -> dict:
    """V(T): the time of a T-token call after `position` cached tokens over a one-token call,
    each the median ratio of back-to-back pairs with a one-token call: {T: ratio}, and under key 0
    the one-token call's seconds (the median of its timings in the first pairs)."""
    cfg = model.cfg
    one = cached_call(model, cfg, position)
    costs = {1: 1.0}
    for T in sizes:
        if T > 1:
            seconds, costs[T] = _median_ratio(one, cached_call(model, cfg, position, T), repeats)
            costs.setdefault(0, seconds)
    return costs


def draft_cost_ratio(target, draft, position: int = 64, repeats: int = 9) -> float:
    """c: a one-token draft call over a one-token target call, the median ratio of back-to-back pairs."""
    return _median_ratio(cached_call(target, target.cfg, position),
                          cached_call(draft, draft.cfg, position), repeats)[1]


def acceptance_on_text(target, draft, tokens, temperatures, chunk: int = 512) -> dict:
    """alpha predicted without generating, {temperature: alpha}: the mean over the positions of
    `tokens` of beta = sum_x min(p(x), q(x)) = 1 - TVD(p, q) (Leviathan et al. 2023, Theorem 3.5
    and Corollary 3.6), p and q the target's and the draft's next-token distributions at each
    temperature (at 0, one-hot argmaxes: beta is 1 where they agree). target and draft are
    (params, cfg) pairs; the text is read in chunks of `chunk` tokens, each its own forward pass."""
    tokens = np.asarray(tokens)
    betas = {temperature: [] for temperature in temperatures}
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]  # (T,)
        z_p, z_q = forward(*target, piece), forward(*draft, piece)  # (T, V) each
        for temperature in temperatures:
            p, q = probs_from_logits(z_p, temperature), probs_from_logits(z_q, temperature)  # (T, V)
            betas[temperature].append(np.minimum(p, q).sum(axis=-1))  # (T,)
    return {temperature: float(np.concatenate(b).mean()) for temperature, b in betas.items()}


def tokens_per_call_distribution(stats) -> np.ndarray:
    """From the per-position acceptance counts of SpecStats (or their sums over runs): the share of
    rounds that emitted 1, 2, ..., k+1 tokens (a round emits its accepted tokens plus one)."""
    reached = np.append(stats["rounds"], stats["accepted_at"])  # rounds that accepted at least j, j = 0..k
    exactly = reached - np.append(reached[1:], 0)  # (k + 1,)
    return exactly / stats["rounds"]


def truncated_geometric(alpha: float, k: int) -> np.ndarray:
    """The formula's distribution of tokens per round (1..k+1) if each draft token is accepted
    independently with probability alpha: alpha^j (1 - alpha) for j < k accepted, alpha^k for k."""
    j = np.arange(k + 1)
    return np.where(j < k, alpha ** j * (1 - alpha), alpha ** k)


def merged(stats_list) -> dict:
    """SpecStats of several runs summed (counts and per-position counts)."""
    keys = ("rounds", "drafted", "judged", "accepted", "emitted", "target_calls", "draft_calls")
    total = {key: sum(getattr(s, key) for s in stats_list) for key in keys}
    for name in ("drafted_at", "accepted_at"):
        total[name] = np.sum([getattr(s, name) for s in stats_list], axis=0)
    return total


def k_sweep(target, drafts: dict, prompts, n_new: int, ks, temperature: float, repeats: int = 1) -> dict:
    """Speculative decoding with each draft in `drafts` ({name: model}) and each k, against
    target-only decoding of the same prompts and seeds: {(name, k): {alpha, tpc (tokens per target
    call), stats (merged SpecStats), formula (eq. 1), ratios (the measured speed-up of each repeat),
    identical (temperature 0: the target-only tokens), speedup (the ratios' median)}}, all but the
    ratios from the first repeat's runs. The runs are timed interleaved: baseline, every draft at
    k1, baseline, every draft at k2, ..., baseline (`lib.timing.interleaved_speedups`)."""

    def baseline():
        return [generate(target, p, n_new, temperature, seed=i).tokens for i, p in enumerate(prompts)]

    def speculative(draft, k):
        return [speculative_generate(target, draft, p, n_new, k=k, temperature=temperature, seed=i)
                for i, p in enumerate(prompts)]

    groups = [{(name, k): functools.partial(speculative, draft, k) for name, draft in drafts.items()} for k in ks]
    reference, first_runs, ratios = interleaved_speedups(baseline, groups, repeats)  # each k between two baselines
    rows = {}
    for (name, k), runs in first_runs.items():
        stats = merged([s for _, s in runs])
        alpha = stats["accepted"] / stats["judged"]
        identical = all((t == r).all() for (t, _), r in zip(runs, reference)) if temperature == 0 else None
        rows[name, k] = dict(alpha=alpha, tpc=stats["emitted"] / stats["target_calls"], stats=stats,
                             formula=expected_tokens_per_call(alpha, k), ratios=ratios[name, k], identical=identical,
                             speedup=float(np.median(ratios[name, k])))
    return rows


def predictions(rows: dict, c, costs: dict) -> None:
    """Add to each sweep row Theorem 3.8 (V = 1: a (k+1)-token call costs one token's) and the same
    with the measured c and V(k+1) (`with_call_cost`), from the row's measured alpha. c: one value,
    or {draft name: c}."""
    for (name, k), row in rows.items():
        c_draft = c[name] if isinstance(c, dict) else c
        row["theorem"] = expected_speedup(row["alpha"], k, c_draft)
        row["with_call_cost"] = expected_speedup(row["alpha"], k, c_draft, call_cost=costs[k + 1])


class Clocked:
    """A cached step that logs every call it passes on: (tokens read, seconds) in `log`, and their
    sum in `seconds` (chapter 10 clocks the target and the draft inside whole runs with it)."""

    def __init__(self, model):
        self.cfg, self.step = model.cfg, model
        self.seconds, self.log = 0.0, []

    def __call__(self, tokens, cache):
        start = time.perf_counter()
        logits = self.step(tokens, cache)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        self.log.append((len(tokens), seconds))
        return logits

    @property
    def calls(self) -> int:
        return len(self.log)


def split_mean_call(log, size: int, one: float) -> dict:
    """A model's call inside a run, in units of `one` seconds, split by the tokens each call read.

    log: (tokens, seconds) of its calls (`Clocked.log`, pooled over runs); size: the tokens of its usual
    call (1 for a draft, k + 1 for the target's verification); one: the baseline's one-token call. Each
    group of calls is priced at its median (robust to a host's stray call). Returns {"usual": the usual
    call, "catch-up": calls over size + 1 tokens (a draft reading, beside the newest token, the accepted
    one it had not read: `lib.speculative.ModelDrafter.propose`), "prefill": calls over more (the
    prompt), "short": calls over fewer (a last round cut short)}; each part but "usual" is its share of
    the calls times its median's excess over the usual call's, so the parts sum to the mean call."""
    groups = {}
    for n, seconds in log:
        groups.setdefault(n, []).append(seconds)
    usual = float(np.median(groups[size]))
    parts = {"usual": usual / one, "catch-up": 0.0, "prefill": 0.0, "short": 0.0}
    for n, times in groups.items():
        if n != size:
            name = "catch-up" if n == size + 1 else "prefill" if n > size else "short"
            parts[name] += len(times) / len(log) * (float(np.median(times)) - usual) / one
    return parts
