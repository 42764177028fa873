"""Serving a trace of requests on one engine: the step loop, and speculative decoding inside the batch.

Each step the scheduler plans (`lib.serve.scheduler`), the batched model runs every planned row
in one call (`lib.fast.batch.BatchedModel`), and each sequence gets its next token; the clock advances
by the step's time. With a draft model (Leviathan et al. 2023), each decoding sequence first
drafts up to k tokens (k batched draft steps over all of them), then the one batched target step
verifies every sequence's ragged k + 1 rows with `lib.speculative.verify`; both caches are
truncated per sequence. At temperature 0 the tokens are each request's greedy decoding. The
draft's cache lives in its own pool, not scheduled.

Time: with clock=None each iteration (scheduling, the batched steps, sampling) is timed and the
clock advances by it; a clock from `lib.measure.clocks` (a `FittedClock` fitted to a stand-in or a
measured `StandInClock`) gives each step's time from its rows instead.
"""
import math
import time

import numpy as np

from lib.cache.paged import PagedKVCache
from lib.checks import check_count, check_step, check_temperature, check_tokens, is_number
from lib.fast.batch import BatchedModel
from lib.sampling import next_token, probs_from_logits, sample
from lib.serve.policy import Policy
from lib.serve.replay import Replay
from lib.serve.report import Outcome, Report
from lib.serve.scheduler import Scheduler
from lib.serve.trace import rejection_reason
from lib.speculative import verify


def serve(model, trace, num_blocks: int, policy: Policy = Policy(), block_size: int = 16,
          temperature: float = 0.0, batch_wait: float = 0.0, max_tokens=None, clock=None, draft=None,
          k: int = 4, draft_clock=None) -> Report:
    """Run a trace of requests through one engine; returns every request's outcome and the pool.

    model: a Step (`lib.model.Model(params, cfg)`, a LeanModel), or a `lib.serve.replay.Replay` of
    recorded completions (the same schedule without running the model each step). policy: a
    `Policy` (a rung of `LADDER`). batch_wait: seconds static batching waits for a batch to fill.
    max_tokens: the answer length a "max" reservation assumes (None: each request's own n_new, an
    oracle). draft: a draft Step for speculative decoding with up to k tokens per step. clock,
    draft_clock: None to time each iteration, or clocks from lib.measure.clocks."""
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a lib.serve.Policy (a rung of lib.serve.LADDER), got {policy!r}")
    check_temperature(temperature)
    if not (is_number(batch_wait) and 0 <= batch_wait < math.inf):
        raise ValueError(f"batch_wait must be seconds >= 0, got {batch_wait!r}")
    check_count(k, "k")
    if isinstance(model, Replay) and (draft is not None or clock is None):
        raise ValueError("a Replay runs without a draft, on a clock: it has no steps to time")
    if draft is not None:
        check_step(draft, "draft")
        if (clock is None) != (draft_clock is None):
            raise ValueError("clock and draft_clock go together: both clocks, or neither (the measured clock)")
    if max_tokens is not None:
        check_count(max_tokens, "max_tokens", max((r.n_new for r in trace), default=1))  # every request's n_new
    return Server(model, trace, num_blocks, policy, block_size, temperature, batch_wait, max_tokens, clock, draft, k,
                  draft_clock).run()


class Server:
    """The state of one `serve` run; `run` is the step loop."""

    def __init__(self, model, trace, num_blocks, policy, block_size, temperature, batch_wait, max_tokens, clock,
                 draft, k, draft_clock):
        sharing = policy.prefix_caching and policy.reserve == "paged"
        if isinstance(model, Replay):  # recorded logits on a pool of block tables
            self.engine, self.pool = model, model.new_pool(num_blocks, block_size, sharing)
        else:  # BatchedModel refuses a model it cannot step
            self.engine, self.pool = BatchedModel(model), PagedKVCache(model.cfg, num_blocks, block_size, sharing)
        cfg = model.cfg
        self.temperature, self.batch_wait, self.k = temperature, batch_wait, k
        self.clock, self.draft_clock = clock, draft_clock
        outcomes = {r.rid: Outcome(r) for r in trace}
        if len(outcomes) != len(trace):
            raise ValueError("request ids in a trace must be unique")
        self.rngs = {r.rid: np.random.default_rng(r.rid) for r in trace}  # kept across preemptions
        for r in trace:
            check_tokens(r.prompt, cfg)
            check_count(r.n_new, f"request {r.rid}: n_new")
            length = policy.answer_length(r, max_tokens)
            outcomes[r.rid].rejected = rejection_reason(r, cfg, num_blocks, block_size, length)
        self.draft = BatchedModel(draft) if draft is not None else None
        self.draft_pool = None
        if self.draft is not None:
            if self.draft.cfg.vocab_size != cfg.vocab_size or self.draft.cfg.block_size < cfg.block_size:
                raise ValueError("the draft must share the target's vocabulary and context")
            blocks_each = -(-cfg.block_size // block_size)
            self.draft_pool = PagedKVCache(self.draft.cfg, policy.max_batch * blocks_each, block_size,
                                           prefix_caching=False)
        self.scheduler = Scheduler(policy, self.pool, outcomes, max_tokens, self._forget)
        arrivals = self.scheduler.arrivals
        self.now = arrivals[0].arrival if arrivals else 0.0
        self.steps = self.prefilled = self.peak = 0
        self.timeline = []

    def run(self) -> Report:
        s, start = self.scheduler, self.now
        while s.arrivals or s.waiting or s.running:
            s.arrive(self.now)
            if not s.running and not s.waiting:
                self.now = s.arrivals[0].arrival  # idle till the next one
                continue
            if s.policy.batching == "static" and not s.running:
                due = s.batch_due(self.now, self.batch_wait)
                if due is not None:
                    self.now = due
                    continue
            tick = time.perf_counter()
            for live in s.running:  # draft tokens this step (decoding only)
                drafting = self.draft and not live.pending
                live.k = min(self.k, live.remaining - 1) if drafting else 0
            s.schedule()
            seconds, batch, finished = self._step()
            if self.clock is None:  # measured: this iteration's time
                seconds = time.perf_counter() - tick
            self.now += seconds
            self._record(seconds, batch, finished)
        timeline = np.array(self.timeline).reshape(-1, 4)
        makespan, outcomes = self.now - start, list(s.outcomes.values())
        return Report(outcomes, self.pool, makespan, self.steps, s.preemptions,
                      s.recomputed, self.prefilled, self.peak, timeline,
                      self.draft_pool)

    def _forget(self, live) -> None:
        """What the scheduler's release leaves to the server: the clocks' and the draft's state."""
        for clock in (self.clock, self.draft_clock):
            if clock is not None:
                clock.free(live.rid)
        if live.draft_seq is not None:
            self.draft_pool.free(live.draft_seq)
            live.draft_seq = None

    def _step(self):
        """Draft, run one batched target step, verify and sample; returns (the clock's seconds for
        it, the sequences in it, those that finished)."""
        batch, feeds = self.scheduler.plan()
        seconds, drafted, qs = self._draft([l for l, f in zip(batch, feeds) if f is None and l.k])
        feeds = [[l.outcome.tokens[-1]] + drafted.get(l, []) if f is None else f for l, f in zip(batch, feeds)]
        starts = [live.seq.n for live in batch]
        logits = self.engine.feed([live.seq for live in batch], feeds)
        if self.clock is not None:
            seconds += self.clock([(l.rid, len(f), s) for l, f, s in zip(batch, feeds, starts)])
        self.steps += 1
        self.prefilled += sum(len(f) for l, f in zip(batch, feeds) if l.pending)
        finished = []
        for live, f, rows in zip(batch, feeds, logits):
            if live.pending:
                live.pending = live.pending[len(f):]
                if live.pending:
                    continue  # more of its prompt to come: no token yet
                new = [next_token(rows[-1], self.temperature, self.rngs[live.rid])]
            else:
                new = self._verify(live, drafted.get(live, []), qs.get(live, []), rows)
            out = live.outcome
            out.tokens.extend(new)
            if len(out.tokens) == out.request.n_new:
                finished.append(live)
        return seconds, batch, finished

    def _draft(self, specs):
        """k_i draft tokens for each speculating sequence, in batched draft steps; returns
        (the draft clock's seconds, {live: tokens}, {live: their draft distributions})."""
        seconds, drafted, qs = 0.0, {live: [] for live in specs}, {live: [] for live in specs}
        for j in range(max((l.k for l in specs), default=0)):
            group = [l for l in specs if l.k > j]
            feeds = []
            for live in group:
                if live.draft_seq is None:
                    live.draft_seq = self.draft_pool.add(live.rid, live.seq.tokens[:1])
                if j == 0:  # catch up: every token of the sequence the draft has not read, up to the last
                    known = list(live.outcome.request.prompt) + live.outcome.tokens
                    feeds.append(known[live.draft_seq.n:])
                else:
                    feeds.append([drafted[live][-1]])
            starts = [live.draft_seq.n for live in group]
            logits = self.draft.feed([live.draft_seq for live in group], feeds)
            if self.draft_clock is not None:
                seconds += self.draft_clock([(l.rid, len(f), s) for l, f, s in zip(group, feeds, starts)])
            for live, rows in zip(group, logits):
                q = probs_from_logits(rows[-1], self.temperature)  # (V,)
                x = int(np.argmax(q)) if self.temperature == 0 else sample(q, self.rngs[live.rid])
                drafted[live].append(x)
                qs[live].append(q)
        return seconds, drafted, qs

    def _verify(self, live, drafted, qs, rows):
        """The target's verdict on one sequence's drafts; both caches keep
        only the kept tokens."""
        t, rng = self.temperature, self.rngs[live.rid]
        if not drafted:
            return [next_token(rows[0], t, rng)]
        base = live.seq.n - len(drafted) - 1  # the token before the drafts
        kept, nxt = verify(probs_from_logits(rows, t), qs, drafted, t, rng)
        live.outcome.drafted += len(drafted)
        live.outcome.accepted += kept
        live.seq.truncate(base + 1 + kept)
        live.draft_seq.truncate(min(live.draft_seq.n, base + 1 + kept))
        return drafted[:kept] + [nxt]

    def _record(self, seconds: float, batch, finished):
        used = self.scheduler.used()
        self.peak = max(self.peak, used)
        self.timeline.append((self.now, len(batch), used, seconds))
        for live in batch:
            out = live.outcome
            out.times.extend([self.now] * (len(out.tokens) - len(out.times)))  # this step's tokens
            if out.tokens and math.isnan(out.first):
                out.first = self.now
        for live in finished:
            live.outcome.finish = self.now
            self.scheduler.finish(live)
