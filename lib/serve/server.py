"""Serving a trace of requests on one engine: the step loop, and speculative decoding inside the batch.

Each step the scheduler plans (`lib.serve.scheduler`), the batched model runs every planned row
in one call (`lib.fast.batch.BatchedModel`), and each sequence gets its next token; the clock advances
by the step's time. With a draft model (Leviathan et al. 2023), each decoding sequence first
drafts up to k tokens (k batched draft steps over all of them), then the one batched target step
verifies every sequence's ragged k + 1 rows with `lib.speculative.verify`; both caches are
truncated per sequence. At temperature 0 the tokens are each request's greedy decoding. The
draft's cache lives in its own pool, not scheduled.

Time: with cost=None each iteration (scheduling, the batched steps, sampling) is timed and the
clock advances by it; a clock from `lib.measure.clocks` (a `FittedClock` fitted to a stand-in or a
measured `StandInClock`) gives each step's time from its rows instead.
"""
import math
import time

import numpy as np

from lib.cache.paged import PagedKVCache
from lib.checks import check_temperature, check_tokens
from lib.config import is_int
from lib.fast.batch import BatchedModel
from lib.sampling import draw, next_token, probs_from_logits
from lib.serve.policy import Policy
from lib.serve.replay import Replay
from lib.serve.report import Outcome, Report
from lib.serve.scheduler import Scheduler
from lib.serve.trace import rejection_reason
from lib.speculative import verify


def serve(model, trace, num_blocks: int, policy: Policy = Policy(), block_size: int = 16,
          temperature: float = 0.0, window: float = 0.0, max_tokens=None, cost=None, draft=None,
          k: int = 4, draft_cost=None) -> Report:
    """Run a trace of requests through one engine; returns every request's outcome and the pool.

    model: a LeanModel or a (params, cfg) pair, or a `lib.serve.replay.Replay` of recorded
    completions (the same schedule without running the model each step). policy: a `Policy` (a rung of `LADDER`).
    window: seconds static batching waits for a batch to fill. max_tokens: the answer length a
    "max" reservation assumes (None: each request's own n_new, an oracle). draft: a draft model
    for speculative decoding with up to k tokens per step. cost, draft_cost: None to time each
    iteration, or clocks from lib.measure.clocks."""
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a lib.serve.Policy (a rung of lib.serve.LADDER), got {policy!r}")
    check_temperature(temperature)
    if not (isinstance(window, (int, float)) and 0 <= window < math.inf):
        raise ValueError(f"window must be seconds >= 0, got {window!r}")
    if not is_int(k) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if isinstance(model, Replay) and (draft is not None or cost is None):
        raise ValueError("a Replay runs without a draft, on a clock (cost): it has no steps to time")
    if draft is not None and (cost is None) != (draft_cost is None):
        raise ValueError("cost and draft_cost go together: both clocks, or neither (the measured clock)")
    if max_tokens is not None:
        longest = max((r.n_new for r in trace), default=0)
        if not is_int(max_tokens) or max_tokens < max(longest, 1):
            raise ValueError(f"max_tokens must be an integer at least every request's n_new ({longest}), "
                             f"got {max_tokens!r}")
    return Server(model, trace, num_blocks, policy, block_size, temperature, window, max_tokens, cost, draft, k,
                  draft_cost).run()


class Server:
    """The state of one `serve` run; `run` is the step loop."""

    def __init__(self, model, trace, num_blocks, policy, block_size, temperature, window, max_tokens, cost,
                 draft, k, draft_cost):
        self.engine = model if isinstance(model, Replay) else BatchedModel(model)
        cfg = self.engine.cfg
        sharing = policy.prefix_caching and policy.reserve == "paged"
        self.pool = (model.new_pool(num_blocks, block_size, sharing) if isinstance(model, Replay)
                     else PagedKVCache(cfg, num_blocks, block_size, sharing))
        self.temperature, self.window, self.k, self.cost, self.draft_cost = temperature, window, k, cost, draft_cost
        outcomes = {r.rid: Outcome(r) for r in trace}
        if len(outcomes) != len(trace):
            raise ValueError("request ids in a trace must be unique")
        self.rngs = {r.rid: np.random.default_rng(r.rid) for r in trace}  # kept across preemptions
        for r in trace:
            check_tokens(r.prompt, cfg)
            if not is_int(r.n_new) or r.n_new < 1:
                raise ValueError(f"request {r.rid}: n_new must be a positive integer, got {r.n_new!r}")
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
                due = s.batch_due(self.now, self.window)
                if due is not None:
                    self.now = due
                    continue
            tick = time.perf_counter()
            for live in s.running:  # draft tokens this step (decoding only)
                drafting = self.draft and not live.pending
                live.k = min(self.k, live.remaining - 1) if drafting else 0
            s.schedule()
            seconds, batch, finished = self._step()
            if self.cost is None:  # measured: this iteration's time
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
        for clock in (self.cost, self.draft_cost):
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
        if self.cost is not None:
            seconds += self.cost([(l.rid, len(f), s) for l, f, s in zip(batch, feeds, starts)])
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
            if self.draft_cost is not None:
                seconds += self.draft_cost([(l.rid, len(f), s) for l, f, s in zip(group, feeds, starts)])
            for live, rows in zip(group, logits):
                q = probs_from_logits(rows[-1], self.temperature)  # (V,)
                x = int(np.argmax(q)) if self.temperature == 0 else draw(q, self.rngs[live.rid])
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
