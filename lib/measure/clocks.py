"""What a serving step costs: a clock for `lib.serve.serve`, fitted or measured on a stand-in.

A scheduler's schedule depends on how long its steps take. `serve` can time each step as it
runs (the measured clock); it can also ask a clock what a step costs, given its rows as
(sequence, new tokens, cached positions before the step; `serve` checks them). Two clocks are here:

- `FittedClock`, fitted to steps timed now: the step of one sequence fed n tokens, interpolated
  between measured n, plus a cost per further sequence. On it the same trace gives the same
  schedule in every run, so two policies compare the same way whatever else the machine does.
- `StandInClock`, measured: every step the served model runs is run again, with the same rows at the
  same cache lengths, on another model (a cost stand-in of realistic size, `lib.measure.standins`),
  and timed. The served model still makes every decision (its tokens), as in
  `lib.measure.standins.StandInStep`; the times are those of the larger model.
(A GPU's clock, from its data sheet and published measurements, is `lib.gpu.step.GPUClock`.)

Decode of B sequences costs t(B) = t1(B) + (B - 1) x per_seq: one weight read shared by all rows
(Pope et al. 2022, "Efficiently Scaling Transformer Inference"), B times the arithmetic, and each
sequence's own attention and bookkeeping.
"""
import math
import time
from dataclasses import dataclass

import numpy as np

from lib.cache.paged import PagedKVCache
from lib.fast.batch import BatchedModel
from lib.measure.counting import batched_call
from lib.timing import median_time


@dataclass(frozen=True)
class FittedClock:
    """The stand-in device's clock fitted to steps timed on it (`fit_clock`): one sequence's step of all the step's tokens (linear between the measured
    token counts, and past the last two) plus per_seq for each further sequence."""
    tokens: tuple  # token counts measured for one sequence, increasing from 1
    seconds: tuple  # their step times
    per_seq: float
    decode_times: tuple = ()  # (B, seconds) of the decode steps measured for the fit

    def one(self, n: float) -> float:
        """One sequence fed n tokens."""
        t, s = self.tokens, self.seconds
        if n <= t[-1]:
            return float(np.interp(n, t, s))
        return float(s[-1] + (n - t[-1]) * (s[-1] - s[-2]) / (t[-1] - t[-2]))

    def __call__(self, rows) -> float:
        return self.one(sum(n for _, n, _ in rows)) + self.per_seq * (len(rows) - 1)

    def decode_step(self, batch: int) -> float:
        """A decode step of `batch` sequences, one token each."""
        return self.one(batch) + self.per_seq * (batch - 1)

    def free(self, key) -> None:
        """Nothing to release: a fitted cost keeps no state."""


def fit_clock(model, positions, sizes=(1, 2, 4, 8, 16, 32), chunks=(2, 4, 8, 16, 32, 64, 128, 256),
                  repeats: int = 5) -> FittedClock:
    """Fit `FittedClock` to median times measured now (one BLAS thread is the caller's choice): one
    sequence at positions[0] fed n tokens for n in (1,) + chunks, and decode steps of B sequences
    at positions[:B]; per_seq is the least-squares slope of t(B) - t1(B) against B - 1. A count
    measured faster than a smaller one (noise) takes the smaller one's time. `positions` holds one
    cache length per sequence, at least max(sizes) of them."""
    engine = BatchedModel(model)
    time_of = lambda step: median_time(step, repeats=repeats, warmup=1)
    counts = sorted({1, *chunks, *sizes})
    one = {n: time_of(batched_call(engine, positions[:1], n_tokens=n)) for n in counts}
    many = {B: time_of(batched_call(engine, positions[:B])) for B in sizes if B > 1}
    extra = np.array([many[B] - one[B] for B in many])  # (sizes,)
    others = np.array([B - 1 for B in many], float)
    per_seq = float(extra @ others / (others @ others)) if len(many) else 0.0
    measured = tuple((B, one[1] if B == 1 else many[B]) for B in sizes)
    seconds = np.maximum.accumulate([one[n] for n in counts])  # more rows never cost less (noise aside)
    return FittedClock(tuple(counts), tuple(float(t) for t in seconds), max(per_seq, 0.0), measured)


class StandInClock:
    """The stand-in device for a batch, as a measured clock: each step is run on `model` (a stand-in)
    with the same rows at the same cache lengths, and timed (`lib.measure.standins.StandInStep` is the same
    device for one sequence; `FittedClock` is its clock fitted to a few measured steps). Its own pool holds num_blocks blocks of block_size positions; the
    K/V values it attends over are placeholders, which costs the same as real ones."""

    def __init__(self, model, num_blocks: int = 256, block_size: int = 16):
        self.engine = BatchedModel(model)
        self.pool = PagedKVCache(self.engine.cfg, num_blocks, block_size, prefix_caching=False)
        self.seqs = {}

    def _at(self, key, start: int):
        """The shadow sequence of `key`, holding exactly `start` positions."""
        seq = self.seqs.get(key)
        if seq is not None and seq.n > start:
            seq.truncate(start)
        if seq is None or seq.n < start:  # new, or the served one skipped positions (a shared prefix)
            self.free(key)
            seq = self.seqs[key] = self.pool.add(key, np.ones(max(start, 1), np.int64))
            self.pool.manager.computed[key] = start  # placeholders: their values do not change the cost
        return seq

    def __call__(self, rows) -> float:
        seqs = [self._at(key, start) for key, _, start in rows]
        feeds = [[1] * n for _, n, _ in rows]
        tick = time.perf_counter()
        self.engine.feed(seqs, feeds)
        return time.perf_counter() - tick

    def free(self, key) -> None:
        """The served sequence ended or was preempted: its shadow's blocks return to the pool."""
        seq = self.seqs.pop(key, None)
        if seq is not None:
            self.pool.free(seq)


def _poisson(n: np.ndarray, mean: float) -> np.ndarray:
    """P(N = n) for N ~ Poisson(mean)."""
    return np.exp(n * math.log(mean) - mean - np.array([math.lgamma(x + 1) for x in n]))


def steady_state(cost, rate: float, mean_new: float, draft_cost=None, alpha: float = 0.0, k: int = 0,
                 mean_prompt: float = 0.0, largest: int = 256):
    """(mean batch while busy, seconds per output token) of a server whose requests arrive as a
    Poisson process at `rate` per second, each computing mean_prompt prompt tokens and emitting
    mean_new tokens, with k draft tokens per step at acceptance rate alpha (E = (1 - alpha^(k+1)) /
    (1 - alpha) tokens per sequence per step, Leviathan et al. 2023, eq. 1; k = 0: no draft).

    The sequences in the system are taken as Poisson with mean m, as in an M/G/infinity queue. With n
    of them a decode step takes t_d(n), the target's step of n (k + 1) rows plus k draft steps of n
    rows; each arriving request's prompt is computed whole in one step with the others' rows,
    t_p(n), and such steps come at `rate`, so the mean step is t(n) = t_d / (1 - rate (t_p - t_d)).
    Per token, the time is t(n) / E, averaged over the steps' n (weighted by their tokens) while the
    server is busy, and m solves Little's law, m = rate x mean_new x TPOT(m). (inf, inf) if no m
    up to `largest` does. rate > 0, mean_new > 0, alpha in [0, 1); a draft_cost when k > 0."""
    per_seq = (1 - alpha ** (k + 1)) / (1 - alpha)  # tokens per sequence per step

    steps = {}

    def step(n: int) -> float:  # mean seconds per step with n sequences decoding, memoized
        if n not in steps:
            draft = k * (draft_cost.one(n) + draft_cost.per_seq * (n - 1)) if k else 0.0
            decode = cost.one(n * (k + 1)) + cost.per_seq * (n - 1) + draft
            with_prompt = cost.one(n * (k + 1) + mean_prompt) + cost.per_seq * n + draft
            # one step in rate x (mean step) also computes an arriving prompt: solve for the mean step
            spare = 1 - rate * (with_prompt - decode)
            steps[n] = decode / spare if spare > 0 else math.inf
        return steps[n]

    def busy(m):  # (TPOT, mean batch) with m sequences in the system on average
        n = np.arange(1, int(m + 8 * math.sqrt(m) + 12))  # (N,) batch sizes while busy
        w = _poisson(n, m)  # (N,)
        t = np.array([step(int(x)) for x in n])  # (N,)
        if not np.all(np.isfinite(t)):
            return math.inf, float((w * n).sum() / w.sum())
        return float((w * n * t).sum() / (w * n).sum() / per_seq), float((w * n).sum() / w.sum())
    excess = lambda m: rate * mean_new * busy(m)[0] - m  # > 0 while m is below its fixed point
    grid = np.geomspace(1e-3, largest, 80)
    hit = next((i for i, m in enumerate(grid) if excess(m) <= 0), None)
    if hit is None:
        return math.inf, math.inf
    lo, hi = (grid[hit - 1] if hit else 0.0), grid[hit]
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    tpot, batch = busy(hi)
    return batch, tpot


def crossover_rate(cost, draft_cost, alpha: float, k: int, mean_new: float, rates, mean_prompt: float = 0.0) -> float:
    """The request rate at which speculative decoding stops lowering the time per output token,
    by `steady_state` with and without the draft: interpolated in log rate between the first rate
    in `rates` (increasing) where it no longer helps and the one before (the first crossing only);
    nan if it helps at every rate."""
    gains = [steady_state(cost, r, mean_new, mean_prompt=mean_prompt)[1]
             / steady_state(cost, r, mean_new, draft_cost, alpha, k, mean_prompt)[1] for r in rates]
    return crossing(rates, gains)


def crossing(rates, gains) -> float:
    """Where gains (a speed-up per rate) first fall to 1, interpolated in log rate; nan if never."""
    for (r0, g0), (r1, g1) in zip(zip(rates, gains), zip(rates[1:], gains[1:])):
        if g0 > 1 >= g1 and np.isfinite(g1):
            f = (g0 - 1) / (g0 - g1)
            return float(np.exp(np.log(r0) + f * (np.log(r1) - np.log(r0))))
    return math.nan
