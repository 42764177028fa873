"""What a serving step costs: a clock for `lib.serve.serve`, fitted or measured on a stand-in.

A scheduler's schedule depends on how long its steps take. `serve` can time each step as it
runs (the measured clock); it can also ask a clock what a step costs, given its rows as
(sequence, new tokens, cached positions before the step). Two clocks are here:

- `FittedClock`, fitted to steps timed now: the step of one sequence fed n tokens, interpolated
  between measured n, plus a cost per further sequence. On it the same trace gives the same
  schedule in every run, so two policies compare the same way whatever else the machine does.
- `StandInClock`, measured: every step the served model runs is run again, with the same rows at the
  same cache lengths, on another model (a cost stand-in of realistic size, `lib.measure.standins`),
  and timed. The served model still makes every decision (its tokens), as in
  `lib.measure.standins.StandInStep`; the times are those of the larger model.
- `GPUClock`, a GPU's step from its data sheet (the arithmetic of
  `lib.measure.costmodel.predict_decode`, per row): the weights read once per step, each sequence's
  K/V read at its own context, both at an achieved share of the data-sheet bandwidth, against the
  step's FLOPs at the compute roof, plus a fixed cost per step. `gpu_clock` takes the share from one
  published measurement (torchao's Llama-3.1-8B decode at batch 1 on an H100).

Decode of B sequences costs t(B) = t1(B) + (B - 1) x per_seq: one weight read shared by all rows
(Pope et al. 2022, "Efficiently Scaling Transformer Inference"), B times the arithmetic, and each
sequence's own attention and bookkeeping.
"""
import math
import time
from dataclasses import dataclass

import numpy as np

from lib.cache.paged import PagedKVCache
from lib.checks import check_count, is_number
from lib.config import is_int
from lib.fast.batch import BatchedModel
from lib.gpu.memory import GPU, H100, KVSpec, dtype_bytes, kv_budget
from lib.gpu.models import LLAMA_3_8B
from lib.measure.counting import batched_call
from lib.timing import median_time


def check_rows(rows) -> list:
    """rows: a non-empty list of (sequence key, new tokens >= 1, cached positions >= 0)."""
    if not isinstance(rows, (list, tuple)) or not rows:
        raise ValueError(f"rows must be a non-empty list of (key, new tokens, cached positions), got {rows!r}")
    for row in rows:
        if (not isinstance(row, tuple) or len(row) != 3 or not is_int(row[1]) or row[1] < 1
                or not is_int(row[2]) or row[2] < 0):
            raise ValueError(f"each row is (key, new tokens >= 1, cached positions >= 0), got {row!r}")
    return list(rows)


@dataclass(frozen=True)
class FittedClock:
    """The stand-in device's clock fitted to steps timed on it (`fit_clock`): one sequence's step of all the step's tokens (linear between the measured
    token counts, and past the last two) plus per_seq for each further sequence."""
    tokens: tuple  # token counts measured for one sequence, increasing from 1
    seconds: tuple  # their step times
    per_seq: float
    decode_times: tuple = ()  # (B, seconds) of the decode steps measured for the fit

    def __post_init__(self):
        t = np.asarray(self.tokens)
        if len(t) < 2 or t[0] != 1 or np.any(np.diff(t) <= 0) or len(self.seconds) != len(t):
            raise ValueError(f"tokens must increase from 1 with one time each, got {self.tokens} and {self.seconds}")

    def one(self, n: float) -> float:
        """One sequence fed n tokens."""
        t, s = self.tokens, self.seconds
        if n <= t[-1]:
            return float(np.interp(n, t, s))
        return float(s[-1] + (n - t[-1]) * (s[-1] - s[-2]) / (t[-1] - t[-2]))

    def __call__(self, rows) -> float:
        rows = check_rows(rows)
        return self.one(sum(n for _, n, _ in rows)) + self.per_seq * (len(rows) - 1)

    def decode(self, batch: int) -> float:
        """A decode step of `batch` sequences, one token each."""
        return self.one(batch) + self.per_seq * (batch - 1)

    def free(self, key) -> None:
        """Nothing to release: a fitted cost keeps no state."""


def fit_clock(model, positions, sizes=(1, 2, 4, 8, 16, 32), chunks=(2, 4, 8, 16, 32, 64, 128, 256),
                  repeats: int = 5) -> FittedClock:
    """Fit `FittedClock` to median times measured now (one BLAS thread is the caller's choice): one
    sequence at positions[0] fed n tokens for n in (1,) + chunks, and decode steps of B sequences
    at positions[:B]; per_seq is the least-squares slope of t(B) - t1(B) against B - 1. A count
    measured faster than a smaller one (noise) takes the smaller one's time."""
    if len(positions) < max(sizes):
        raise ValueError(f"positions holds {len(positions)} sequences, sizes go up to {max(sizes)}")
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
        rows = check_rows(rows)
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


TORCHAO_STEP = 1 / 126.90  # seconds per token: torchao's quantization README (pytorch/ao, Oct 2024), Llama-3.1-8B
# "Base (bfloat16)", 126.90 tokens/s on one H100 with torch.compile, batch 1, a 200-token generation
STEP_OVERHEAD = 0.5e-3  # seconds per step beyond bytes and FLOPs (scheduling, sampling, launches): stated, not measured
KEEP_ASIDE = 0.1  # share of GPU memory kept out of the K/V pool (vLLM v0's gpu_memory_utilization, 0.9; 0.92 in recent releases)


class GPUClock:
    """A serving step on a GPU from its data sheet, for a full-attention `KVSpec` in `dtype`.

    seconds = overhead + max(bytes read / (efficiency x bandwidth),
                             2 x parameters x tokens / (compute_efficiency x flops)):
    the weights once per step (`KVSpec.weight_bytes` at the step's token count), every row's K/V at
    its own context (cached positions + new tokens), the products' FLOPs at a share
    `compute_efficiency` of the compute roof (1.0: the data sheet's peak; attention's FLOPs, a few
    percent at these contexts, are left out)."""

    def __init__(self, spec: KVSpec = LLAMA_3_8B, gpu: GPU = H100, efficiency: float = 1.0,
                 overhead: float = STEP_OVERHEAD, dtype: str = "bfloat16", compute_efficiency: float = 1.0):
        if not isinstance(spec, KVSpec) or any(w is not None for w in spec.windows) or spec.latent:
            raise ValueError(f"spec must be a full-attention lib.gpu.memory.KVSpec, got {spec!r:.80}")
        if not isinstance(gpu, GPU):
            raise TypeError(f"gpu must be a lib.gpu.memory.GPU, got {type(gpu).__name__}")
        if not (is_number(efficiency) and 0 < efficiency <= 1):
            raise ValueError(f"efficiency must be a share of the bandwidth in (0, 1], got {efficiency!r}")
        if not (is_number(compute_efficiency) and 0 < compute_efficiency <= 1):
            raise ValueError(f"compute_efficiency must be a share of the FLOP/s in (0, 1], got {compute_efficiency!r}")
        if not (is_number(overhead) and 0 <= overhead < math.inf):
            raise ValueError(f"overhead must be seconds >= 0, got {overhead!r}")
        self.spec, self.gpu, self.efficiency, self.overhead, self.dtype = spec, gpu, efficiency, overhead, dtype
        self.per_position = spec.kv_bytes(1, 1, dtype)  # K/V bytes of one cached position, all layers
        self.params_per_token = spec.weight_bytes(dtype, batch=1) / dtype_bytes(dtype)  # parameters a token's products use
        self.read_rate = gpu.bandwidth * efficiency  # bytes/s achieved
        self.compute_efficiency = compute_efficiency
        self.flop_rate = gpu.flops * compute_efficiency  # FLOP/s achieved by the products

    def step(self, tokens: int, positions: int) -> float:
        """A step of `tokens` new tokens whose sequences hold `positions` positions in all after it."""
        memory = (self.spec.weight_bytes(self.dtype, batch=tokens) + positions * self.per_position) / self.read_rate
        compute = 2 * self.params_per_token * tokens / self.flop_rate
        return self.overhead + max(memory, compute)

    def __call__(self, rows) -> float:
        rows = check_rows(rows)
        return self.step(sum(n for _, n, _ in rows), sum(n + start for _, n, start in rows))

    def decode(self, batch: int, context: int = 1024) -> float:
        """A decode step of `batch` sequences, one token each, at `context` positions each."""
        check_count(batch, "batch", 1)
        check_count(context, "context", 1)
        return self.step(batch, batch * context)

    def blocks(self, block_size: int = 16, keep: float = KEEP_ASIDE) -> int:
        """K/V blocks of `block_size` positions in the GPU's memory, less the share `keep` and the
        weights as stored."""
        check_count(block_size, "block_size", 1)
        if not (is_number(keep) and 0 <= keep < 1):
            raise ValueError(f"keep must be a share of memory in [0, 1), got {keep!r}")
        free = kv_budget(self.gpu, self.spec.weight_bytes(self.dtype), utilization=1 - keep)
        return max(int(free // (block_size * self.per_position)), 0)

    def free(self, key) -> None:
        """Nothing to release: the clock keeps no state."""


def gpu_clock(spec: KVSpec = LLAMA_3_8B, gpu: GPU = H100, measured: float = TORCHAO_STEP, context: int = 200,
              overhead: float = STEP_OVERHEAD) -> GPUClock:
    """A `GPUClock` whose achieved bandwidth share makes its batch-1 step at `context` take `measured`
    seconds (default: torchao's Llama-3.1-8B on an H100, `TORCHAO_STEP`)."""
    if not (is_number(measured) and overhead < measured < math.inf):
        raise ValueError(f"measured must be seconds longer than the overhead ({overhead}), got {measured!r}")
    ideal = GPUClock(spec, gpu, 1.0, 0.0).decode(1, context)  # the data sheet's step
    return GPUClock(spec, gpu, min(ideal / (measured - overhead), 1.0), overhead)


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
    up to `largest` does."""
    if rate <= 0 or mean_new <= 0 or mean_prompt < 0 or not 0 <= alpha < 1 or not is_int(k) or k < 0 \
            or (k and draft_cost is None):
        raise ValueError(f"need rate > 0, mean_new > 0, mean_prompt >= 0, alpha in [0, 1), k >= 0 (a draft_cost "
                         f"when k > 0), got {rate!r}, {mean_new!r}, {mean_prompt!r}, {alpha!r}, {k!r}")
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
