"""Serving many requests: continuous batching over the paged KV cache, against static batching.

Orca (Yu et al. 2022) schedules at the granularity of one model step: after every step,
finished sequences leave the batch and waiting requests join it, their prompts prefilled in the
same step as the others' next tokens. vLLM (Kwon et al. 2023) runs this over a pool of KV
blocks: a request is admitted when blocks for its prompt are free, its blocks grow as it
decodes and return to the pool the moment it ends; when the pool runs dry mid-decode, the
newest running sequence is preempted, its blocks freed, and it is recomputed later from its
prompt and the tokens it had produced (vLLM's default, preemption by recompute). A request that
could never fit, longer than the context or than the whole pool, is rejected with its reason.

Static batching, the baseline: a batch is formed only when the previous one has finished, and
each request's blocks for its whole length are set aside when it joins.

Time is measured: each iteration (scheduling, the batched step, sampling) is timed and the
clock advances by it; requests arrive at their trace times, with gamma-distributed gaps
(shape 1 is a Poisson process, below 1 burstier: vLLM's benchmark_serving). A `cost` function
can replace the measured time, which makes the schedule deterministic: `fit_step_cost` fits
one to this machine's steps (fixed + per sequence + per prompt token), a clock on which two
policies compare the same way in every run, while the measured clock shows what this run saw.
"""
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .batch import BatchedModel, batch_stepper
from .config import is_int
from .corpus import held_out_prompts
from .model import check_tokens
from .paged import PagedKVCache
from .sampling import check_temperature, next_token
from .timing import median_time, paired, single_thread, stepper


@dataclass
class Request:
    rid: int
    arrival: float  # seconds after the start of the trace
    prompt: np.ndarray  # (P,) token ids
    n_new: int  # tokens to generate


@dataclass
class Outcome:
    """What happened to one request; times in seconds on the trace's clock."""
    request: Request
    tokens: list = field(default_factory=list)  # the generated ids
    first: float = float("nan")  # when the first token was out
    finish: float = float("nan")
    rejected: str = ""  # why it was never run, if it was not
    preempted: int = 0  # times its blocks were taken back

    @property
    def ttft(self) -> float:
        return self.first - self.request.arrival

    @property
    def tpot(self) -> float:
        n = len(self.tokens)
        return (self.finish - self.first) / (n - 1) if n > 1 else float("nan")


def make_trace(n: int, rate: float, seed: int = 0, burstiness: float = 1.0, prompt_len=(8, 48),
               n_new=(4, 128), system=()) -> list:
    """n requests at `rate` per second on average; gaps ~ Gamma(burstiness, 1 / (rate * burstiness)).
    Prompts are line starts of the held-out text cut to a length drawn uniformly from prompt_len,
    after an optional shared system prompt. Output lengths are log-uniform over n_new: many short
    answers and a few long ones, as in chat traces."""
    if n < 1 or rate <= 0 or burstiness <= 0:
        raise ValueError(f"need n >= 1, rate > 0 and burstiness > 0, got {n}, {rate}, {burstiness}")
    if not (1 <= prompt_len[0] <= prompt_len[1] and 1 <= n_new[0] <= n_new[1]):
        raise ValueError(f"prompt_len and n_new are (lowest, highest) ranges of positive lengths, "
                         f"got {prompt_len} and {n_new}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.gamma(burstiness, 1.0 / (rate * burstiness), n))  # (n,)
    lengths = rng.integers(prompt_len[0], prompt_len[1] + 1, n)
    outputs = np.exp(rng.uniform(np.log(n_new[0]), np.log(n_new[1] + 1), n)).astype(int)  # (n,) in n_new
    texts = held_out_prompts(n, prompt_len[1])
    system = np.asarray(system, np.int64)
    return [Request(i, float(arrivals[i]), np.concatenate([system, texts[i][:lengths[i]]]), int(outputs[i]))
            for i in range(n)]


def rejection(req: Request, cfg, num_blocks: int, block_size: int) -> str:
    """Why a request can never run here ('' if it can): positions written are prompt + n_new - 1."""
    written = len(req.prompt) + req.n_new - 1
    if len(req.prompt) + req.n_new > cfg.block_size:
        return (f"prompt ({len(req.prompt)} tokens) plus output ({req.n_new}) is longer than the "
                f"context of {cfg.block_size} positions")
    if -(-written // block_size) > num_blocks:
        return (f"needs {-(-written // block_size)} blocks of {block_size} positions, the whole pool "
                f"has {num_blocks}")
    return ""


class _Live:
    """A running sequence: its outcome, its slice of the pool, and the tokens to feed next."""

    def __init__(self, outcome, seq):
        self.outcome, self.seq = outcome, seq
        self.feed = list(seq.tokens[seq.n:])  # prompt (and, after a preemption, output) to compute


@dataclass
class Report:
    outcomes: list
    pool: PagedKVCache
    makespan: float  # seconds from the first arrival to the last finish
    steps: int
    preemptions: int
    recomputed: int  # tokens computed again after preemptions
    prefilled: int  # prompt (and recomputed) tokens computed, after any shared prefix
    peak_blocks: int
    timeline: np.ndarray  # (steps, 3): time at the end of each step, sequences in it, blocks in use

    def summary(self) -> dict:
        done = [o for o in self.outcomes if not o.rejected]
        ttft = [o.ttft for o in done]
        tpot = [o.tpot for o in done if len(o.tokens) > 1]
        pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else float("nan")
        return {"completed": len(done), "rejected": len(self.outcomes) - len(done),
                "tokens/s": sum(len(o.tokens) for o in done) / self.makespan if self.makespan else 0.0,
                "TTFT p50 ms": pct(ttft, 50), "TTFT p99 ms": pct(ttft, 99),
                "TPOT p50 ms": pct(tpot, 50), "TPOT p99 ms": pct(tpot, 99),
                "mean batch": float(self.timeline[:, 1].mean()) if self.steps else 0.0,
                "preemptions": self.preemptions, "recomputed tokens": self.recomputed,
                "peak blocks": self.peak_blocks}


def serve(model, trace, num_blocks: int, block_size: int = 16, policy: str = "continuous",
          max_batch: int = 32, prefix_caching: bool = True, temperature: float = 0.0,
          watermark: float = 0.01, prefill_chunk=None, cost=None) -> Report:
    """Run a trace of requests through one engine; returns every request's outcome and the pool.

    model: a LeanModel or a (params, cfg) pair. policy: "continuous" or "static".
    watermark: share of the pool a new request must leave free while others run (vLLM's
    watermark), so that running sequences can grow without being preempted at once.
    prefill_chunk: at most this many prompt tokens per step (chunked prefill, Sarathi-Serve), so
    a long prompt does not stall the others' next tokens; None: whole prompts.
    cost: None to measure each iteration's time, or cost(prefill_tokens, batch) -> seconds."""
    if policy not in ("continuous", "static"):
        raise ValueError(f"policy must be 'continuous' or 'static', got {policy!r}")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
    check_temperature(temperature)
    if not 0 <= watermark < 1:
        raise ValueError(f"watermark must be a share of the pool in [0, 1), got {watermark!r}")
    if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be a positive integer or None, got {prefill_chunk!r}")
    engine = BatchedModel(model)
    cfg = engine.cfg
    pool = PagedKVCache(cfg, num_blocks, block_size, prefix_caching and policy == "continuous")
    manager = pool.manager
    outcomes = {r.rid: Outcome(r) for r in trace}
    rngs = {r.rid: np.random.default_rng(r.rid) for r in trace}  # kept across preemptions
    if len(outcomes) != len(trace):
        raise ValueError("request ids in a trace must be unique")
    for r in trace:
        check_tokens(r.prompt, cfg)
        if not is_int(r.n_new) or r.n_new < 1:
            raise ValueError(f"request {r.rid}: n_new must be a positive integer, got {r.n_new!r}")
        outcomes[r.rid].rejected = rejection(r, cfg, num_blocks, block_size)
    arrivals = deque(sorted((r for r in trace if not outcomes[r.rid].rejected), key=lambda r: r.arrival))
    blocks = lambda n: -(-n // block_size)
    waiting, running = deque(), []
    now = arrivals[0].arrival if arrivals else 0.0
    start, steps, preemptions, recomputed, prefilled, peak, timeline = now, 0, 0, 0, 0, 0, []
    reserved = 0  # static: blocks set aside for the running batch
    while arrivals or waiting or running:
        while arrivals and arrivals[0].arrival <= now:
            waiting.append(arrivals.popleft())
        if not running and not waiting:
            now = arrivals[0].arrival  # idle until the next request
            continue
        tick = time.perf_counter()
        # running sequences first, oldest first: blocks for their next token; if the pool is
        # short, the newest running sequence gives its blocks back and waits to be recomputed
        need, preempted_now = {}, False
        for live in list(running) if policy == "continuous" else []:
            if live not in running:
                break  # it was preempted itself, and every newer one before it
            need[live] = 0 if live.feed else manager.append_need(live.seq.seq_id)  # prompts have their blocks
            while sum(need.values()) > manager.num_free:
                victim = running.pop()
                need.pop(victim, None)
                pool.free(victim.seq)
                victim.outcome.preempted += 1
                waiting.appendleft(victim.outcome.request)
                preemptions, preempted_now = preemptions + 1, True
        # then waiting requests, oldest first, while blocks (and the batch size) allow
        admit = not preempted_now if policy == "continuous" else not running
        while admit and waiting and len(running) < max_batch:
            req = waiting[0]
            out = outcomes[req.rid]
            tokens = np.concatenate([req.prompt, np.asarray(out.tokens, np.int64)])
            if policy == "continuous":
                keep = int(watermark * num_blocks) if running else 0
                fits = blocks(len(tokens)) + sum(need.values()) + keep <= manager.num_free
            else:
                fits = reserved + blocks(len(req.prompt) + req.n_new - 1) <= num_blocks
            if not fits:
                break
            waiting.popleft()
            if policy == "static":
                reserved += blocks(len(req.prompt) + req.n_new - 1)
            running.append(_Live(out, pool.add(req.rid, tokens)))
            if out.tokens:  # back after a preemption: what it computes now, it had computed before
                recomputed += len(running[-1].feed)
        if not running:
            raise RuntimeError(f"scheduler stalled: {len(waiting)} waiting, none admitted, "
                               f"{manager.num_free} of {num_blocks} blocks free")
        # one step for the whole batch: prompts (or their next chunk) and one token for each of the rest
        budget, batch, feeds = prefill_chunk or sum(len(live.feed) for live in running), [], []
        for live in running:
            if live.feed and budget:
                feeds.append(live.feed[:budget])
                budget -= len(feeds[-1])
            elif not live.feed:
                feeds.append([live.outcome.tokens[-1]])
            else:
                continue  # its prompt waits for the next step's budget
            batch.append(live)
        logits = engine.feed([live.seq for live in batch], feeds)
        prefill = sum(len(f) for live, f in zip(batch, feeds) if live.feed)
        prefilled += prefill
        steps += 1
        used = num_blocks - manager.num_free
        peak = max(peak, used)
        finished, sampled = [], []
        for live, f, rows in zip(batch, feeds, logits):
            live.feed = live.feed[len(f):] if live.feed else []
            if live.feed:
                continue  # more of its prompt to come: no token yet
            live.outcome.tokens.append(next_token(rows[-1], temperature, rngs[live.outcome.request.rid]))
            sampled.append(live)
            if len(live.outcome.tokens) == live.outcome.request.n_new:
                finished.append(live)
        now += cost(prefill, len(batch)) if cost else time.perf_counter() - tick
        timeline.append((now, len(batch), used))
        for live in sampled:
            if math.isnan(live.outcome.first):
                live.outcome.first = now
        for live in finished:
            live.outcome.finish = now
            pool.free(live.seq)  # its blocks return to the pool at once
            running.remove(live)
        if policy == "static" and not running:
            reserved = 0
    return Report([outcomes[r.rid] for r in trace], pool, now - start, steps, preemptions, recomputed,
                  prefilled, peak, np.array(timeline).reshape(-1, 3))


# ----------------------------------------------------------------------------- measurements

@dataclass(frozen=True)
class StepCost:
    """A step's time in seconds, fitted: fixed + per_seq x sequences + per_prefill x prompt tokens."""
    fixed: float
    per_seq: float
    per_prefill: float

    def __call__(self, prefill_tokens: int, batch: int) -> float:
        return self.fixed + self.per_seq * batch + self.per_prefill * prefill_tokens

    def speedup_ceiling(self) -> float:
        """What batching decode steps can gain at most: B t(1) / t(B) as B grows, (fixed + per_seq) / per_seq."""
        return (self.fixed + self.per_seq) / self.per_seq


def fit_step_cost(lean, positions, sizes=(1, 2, 4, 8, 16, 32), chunks=(16, 48), repeats: int = 5) -> StepCost:
    """Fit `StepCost` by least squares to median step times measured now: decode steps of B
    sequences at `positions[:B]` for B in `sizes`, and one sequence fed a prompt chunk of each
    length in `chunks` (counted as that many prompt tokens, as `serve` counts a prefill)."""
    if len(positions) < max(sizes):
        raise ValueError(f"positions holds {len(positions)} sequences, sizes go up to {max(sizes)}")
    engine, rows, times = BatchedModel(lean), [], []
    for B in sizes:
        rows.append((1.0, B, 0.0))
        times.append(median_time(batch_stepper(engine, positions[:B]), repeats=repeats, warmup=1))
    for n in chunks:
        rows.append((1.0, 1, n))
        times.append(median_time(batch_stepper(engine, positions[:1], n_tokens=n), repeats=repeats, warmup=1))
    (fixed, per_seq, per_prefill), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    return StepCost(float(fixed), float(per_seq), float(per_prefill))


def decode_speedup(lean, positions, repeats: int = 9):
    """One batched decode step for sequences at `positions` against decoding each alone on the
    lean path, timed back to back: (seconds for all alone, seconds batched, speed-up), medians."""
    solos = [stepper(lean, lean.cfg, int(p)) for p in positions]
    alone, batched, ratio = paired(lambda: [s() for s in solos], batch_stepper(BatchedModel(lean), positions), repeats)
    return alone, batched, 1.0 / ratio


def compare(model, trace, num_blocks: int, repeats: int = 3, policies=("static", "continuous"), **kwargs):
    """Each policy on the same trace and pool, `repeats` times: {policy: the run of median
    throughput}. Tokens are the same in every run; only the timings vary."""
    runs = {}
    for policy in policies:
        reports = [serve(model, trace, num_blocks, policy=policy, **kwargs) for _ in range(repeats)]
        runs[policy] = sorted(reports, key=lambda r: r.summary()["tokens/s"])[len(reports) // 2]
    return runs


BENCH_TRACE = dict(n=48, rate=1000.0, seed=0, burstiness=0.25)  # a bursty trace (gamma shape 1/4)
BENCH_BLOCKS = 48  # blocks of 16 positions: 768 positions, the cache of 1.5 full-context sequences


def bench_rows(out=print):
    """The serving lines of `python -m lib.bench`: batched decode of the trained target against
    decoding alone, continuous against static batching; returns the goals as (text, value, met)."""
    from .generate import generate
    from .lean import LeanModel
    from .model import load
    params, cfg = load("target")
    lean = LeanModel(params, cfg)
    positions = np.random.default_rng(0).integers(16, 129, 32)  # cached tokens of each sequence
    with single_thread():
        out("batched decode of the target, lean, B sequences at positions 16..128 (paired with each alone)")
        speedup = {}
        for B in (1, 4, 16, 32):
            alone, batched, speedup[B] = decode_speedup(lean, positions[:B])
            out(f"  B = {B:2d}: alone {alone * 1e3:6.2f} ms, batched {batched * 1e3:6.2f} ms per step, "
                f"{B / batched:7.0f} tokens/s, {speedup[B]:.2f}x")
        trace = make_trace(**BENCH_TRACE)
        runs = compare(lean, trace, BENCH_BLOCKS)
    out(f"\n{BENCH_TRACE['n']} requests, bursty arrivals, {BENCH_BLOCKS} blocks of 16 for both (median of 3 runs)")
    for policy, report in runs.items():
        s = report.summary()
        out(f"  {policy:10s} {s['tokens/s']:7.0f} tokens/s, TTFT p50/p99 {s['TTFT p50 ms']:6.1f}/{s['TTFT p99 ms']:6.1f} ms, "
            f"TPOT p50/p99 {s['TPOT p50 ms']:5.2f}/{s['TPOT p99 ms']:5.2f} ms, {s['preemptions']} preemptions")
    solo = {r.rid: generate(params, cfg, r.prompt, r.n_new, step=lean).tokens.tolist() for r in trace}
    exact = all(o.tokens == solo[o.request.rid] for rep in runs.values() for o in rep.outcomes)
    clean = all(rep.pool.manager.num_free == BENCH_BLOCKS and not any(rep.pool.manager.ref) for rep in runs.values())
    cont, stat = runs["continuous"].summary(), runs["static"].summary()
    gain, tpot = cont["tokens/s"] / stat["tokens/s"], cont["TPOT p99 ms"] / stat["TPOT p99 ms"]
    return [("batched decode, B = 16 >= 8 x the tokens/s of decoding alone", speedup[16], speedup[16] >= 8),
            ("continuous >= 2 x static throughput, bursty trace, equal memory", gain, gain >= 2),
            ("... with p99 TPOT no worse (continuous / static)", tpot, tpot <= 1),
            ("served tokens equal solo decoding, no block leaked (1 = yes)", float(exact and clean), exact and clean)]
