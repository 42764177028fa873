"""Serving many requests: one scheduler, five policies from static batching to vLLM v1, and
speculative decoding inside the batch.

Each policy adds one idea to the one before it (`LADDER`):

- static batching: a batch is formed when the previous one has finished and either `max_batch`
  requests wait or the oldest has waited `window` seconds; each request's blocks for its prompt
  and `max_tokens` of answer are set aside when it joins (a server does not know the length of
  an answer before it ends).
- Orca (Yu et al. 2022, "Orca: A Distributed Serving System for Transformer-Based Generative
  Models"): iteration-level scheduling. Requests join and leave between any two steps, a
  newcomer's prompt is computed in the same step as the others' next tokens; memory is still
  reserved for max_tokens, so nothing is ever preempted.
- paged blocks, as vLLM (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
  Serving with PagedAttention"): blocks are taken as the sequence grows. A request is admitted when blocks for
  its whole prompt are free beyond a watermark; when the pool runs dry mid-decode the newest
  running sequence is preempted, its blocks freed, and it is recomputed later from its prompt and
  the tokens it had produced (preemption by recompute; vLLM can also swap blocks to CPU memory,
  which trades PCIe traffic for the recomputation). vLLM v0 without chunked prefill ran a step of
  prompts only whenever one was waiting (mixed=False here).
- the same with prefix caching: full blocks of a prompt seen before are shared (chapter 6).
- a token budget, as vLLM v1 (and v0 with chunked prefill; Agrawal et al. 2024, "Taming Throughput-Latency Tradeoff
  in LLM Inference with Sarathi-Serve"): one token budget per step that counts decode tokens;
  running sequences' next tokens first, then prompt chunks fill what is left.

`draft`: speculative decoding inside the batch (Leviathan et al. 2023). Each decoding sequence
drafts up to k tokens with the draft model (k batched draft steps over all of them), then one
batched target step verifies every sequence's ragged k + 1 rows; acceptance or resampling,
and the truncation of both caches, are per sequence. At temperature 0 the tokens are each
request's greedy decoding. The draft's cache lives in its own pool, not scheduled.

Time: with cost=None each iteration (scheduling, the batched steps, sampling) is timed and the
clock advances by it; a clock from `lib.clocks` (a `FittedClock` fitted to a stand-in or a measured `StandInClock`)
gives each step's time from its rows instead. Requests arrive at their trace times, with
gamma-distributed gaps (shape 1 is a Poisson process, below 1 burstier: vLLM's benchmark_serving).
"""
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .batch import BatchedModel, batch_stepper
from .config import is_int
from .corpus import held_out_spans
from .model import check_tokens
from .paged import PagedKVCache
from .sampling import check_temperature, draw, next_token, probs_from_logits
from .speculative import accept_or_resample
from .timing import paired, single_thread, stepper


@dataclass
class Request:
    rid: int
    arrival: float  # seconds after the start of the trace
    prompt: np.ndarray  # (P,) token ids
    n_new: int  # tokens the answer has (where it would end)


@dataclass
class Outcome:
    """What happened to one request; times in seconds on the trace's clock."""
    request: Request
    tokens: list = field(default_factory=list)  # the generated ids
    first: float = float("nan")  # when the first token was out
    finish: float = float("nan")
    rejected: str = ""  # why it was never run, if it was not
    preempted: int = 0  # times its blocks were taken back
    drafted: int = 0  # draft tokens judged by the target
    accepted: int = 0  # of those, accepted

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
    Prompts are spans of the held-out text from line starts, cut to a length drawn uniformly from prompt_len,
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
    texts = held_out_spans(n, prompt_len[1])
    system = np.asarray(system, np.int64)
    return [Request(i, float(arrivals[i]), np.concatenate([system, texts[i][:lengths[i]]]), int(outputs[i]))
            for i in range(n)]


def rejection(req: Request, cfg, num_blocks: int, block_size: int, length: int = None) -> str:
    """Why a request can never run here ('' if it can), for an answer of `length` tokens (default
    its own n_new; a server reserving max_tokens must fit that many): positions written are
    prompt + length - 1."""
    length = req.n_new if length is None else length
    written = len(req.prompt) + length - 1
    if len(req.prompt) + length > cfg.block_size:
        return (f"prompt ({len(req.prompt)} tokens) plus output ({length}) is longer than the "
                f"context of {cfg.block_size} positions")
    if -(-written // block_size) > num_blocks:
        return (f"needs {-(-written // block_size)} blocks of {block_size} positions, the whole pool "
                f"has {num_blocks}")
    return ""


LADDER = {  # each rung adds one idea to the one before; prefix caching only where named
    "static": dict(policy="static", reserve="max"),
    "Orca": dict(policy="continuous", reserve="max", mixed=True),
    "paged (vLLM)": dict(policy="continuous", reserve="paged", mixed=True),
    "+ prefix caching": dict(policy="continuous", reserve="paged", mixed=True, prefix_caching=True),
    "+ token budget (v1)": dict(policy="continuous", reserve="paged", mixed=True, prefix_caching=True,
                                token_budget=64),
}


class _Live:
    """A running sequence: its outcome, its slice of the pool, and the tokens to feed next."""

    def __init__(self, outcome, seq, reserved):
        self.outcome, self.seq, self.reserved = outcome, seq, reserved
        self.feed = list(seq.tokens[seq.n:])  # prompt (and, after a preemption, output) to compute
        self.draft_seq = None  # its sequence in the draft's pool, when speculating
        self.k = 0  # draft tokens this step

    @property
    def rid(self):
        return self.outcome.request.rid

    @property
    def remaining(self) -> int:
        return self.outcome.request.n_new - len(self.outcome.tokens)


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
    timeline: np.ndarray  # (steps, 4): time at the end of each step, sequences in it, blocks in use or set
    # aside, the step's seconds
    draft_pool: PagedKVCache = None

    def summary(self) -> dict:
        done = [o for o in self.outcomes if not o.rejected]
        ttft = [o.ttft for o in done]
        tpot = [o.tpot for o in done if len(o.tokens) > 1]
        decoding = [o for o in done if len(o.tokens) > 1]  # token-weighted: all their gaps over all their tokens
        tpot_mean = (sum(o.finish - o.first for o in decoding) / sum(len(o.tokens) - 1 for o in decoding) * 1e3
                     if decoding else float("nan"))
        seconds = self.timeline[:, 3] if self.steps else np.zeros(0)
        pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else float("nan")
        drafted = sum(o.drafted for o in done)
        spec = {"acceptance": sum(o.accepted for o in done) / drafted} if drafted else {}  # of judged draft tokens
        return {"completed": len(done), "rejected": len(self.outcomes) - len(done),
                "tokens/s": sum(len(o.tokens) for o in done) / self.makespan if self.makespan else 0.0,
                "TTFT p50 ms": pct(ttft, 50), "TTFT p99 ms": pct(ttft, 99),
                "TPOT p50 ms": pct(tpot, 50), "TPOT p99 ms": pct(tpot, 99), "TPOT mean ms": tpot_mean,
                "mean batch": float(self.timeline[:, 1] @ seconds / seconds.sum()) if self.steps else 0.0,
                "preemptions": self.preemptions, "recomputed tokens": self.recomputed,
                "peak blocks": self.peak_blocks, **spec}

    def _met(self, ttft: float, tpot: float) -> int:
        return sum(1 for o in self.outcomes if not o.rejected and o.ttft <= ttft
                   and (len(o.tokens) < 2 or o.tpot <= tpot))

    def goodput(self, ttft: float, tpot: float) -> float:
        """Requests per second that met both targets (seconds): TTFT <= ttft and TPOT <= tpot."""
        return self._met(ttft, tpot) / self.makespan if self.makespan else 0.0

    def attainment(self, ttft: float, tpot: float) -> float:
        """The share of the trace's requests that met both targets (rejected ones did not)."""
        return self._met(ttft, tpot) / len(self.outcomes)


def _check_settings(policy, reserve, max_batch, watermark, token_budget, window, max_tokens, k, trace, draft, cost,
                    draft_cost):
    if policy not in ("continuous", "static"):
        raise ValueError(f"policy must be 'continuous' or 'static', got {policy!r}")
    if reserve not in ("paged", "max") or (policy == "static" and reserve != "max"):
        raise ValueError(f"reserve must be 'paged' or 'max' ('max' for static batching), got {reserve!r}")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
    if not 0 <= watermark < 1:
        raise ValueError(f"watermark must be a share of the pool in [0, 1), got {watermark!r}")
    if token_budget is not None and (not isinstance(token_budget, int) or token_budget < 1):
        raise ValueError(f"token_budget must be a positive integer or None, got {token_budget!r}")
    if not (isinstance(window, (int, float)) and 0 <= window < math.inf):
        raise ValueError(f"window must be seconds >= 0, got {window!r}")
    if not is_int(k) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if draft is not None and (cost is None) != (draft_cost is None):
        raise ValueError("cost and draft_cost go together: both clocks, or neither (the measured clock)")
    if max_tokens is not None:
        longest = max((r.n_new for r in trace), default=0)
        if not is_int(max_tokens) or max_tokens < max(longest, 1):
            raise ValueError(f"max_tokens must be an integer at least every request's n_new ({longest}), "
                             f"got {max_tokens!r}")


def serve(model, trace, num_blocks: int, block_size: int = 16, policy: str = "continuous",
          max_batch: int = 32, prefix_caching: bool = False, temperature: float = 0.0,
          watermark: float = 0.01, token_budget=None, cost=None, reserve: str = "paged",
          mixed: bool = True, window: float = 0.0, max_tokens=None, draft=None, k: int = 4,
          draft_cost=None) -> Report:
    """Run a trace of requests through one engine; returns every request's outcome and the pool.

    model: a LeanModel or a (params, cfg) pair. policy: "continuous" or "static" (batches formed
    after `window` seconds or at max_batch requests). reserve: "paged" (blocks as the sequence
    grows; preemption by recompute) or "max" (prompt + max_tokens set aside on admission).
    max_tokens: the answer length a "max" reservation assumes (None: each request's own n_new,
    an oracle). mixed: prompts computed in the same step as decode tokens (False: steps of
    prompts only, vLLM v0). token_budget: tokens per step, decode tokens counted first, prompts
    chunked into the rest (None: no limit). watermark: share of the pool a paged admission leaves
    free while others run (vLLM keeps int(watermark x blocks)). draft: a draft model for
    speculative decoding with up to k tokens per step. cost, draft_cost: None to time each
    iteration, or clocks from lib.clocks."""
    _check_settings(policy, reserve, max_batch, watermark, token_budget, window, max_tokens, k, trace, draft, cost,
                    draft_cost)
    check_temperature(temperature)
    server = _Server(model, trace, num_blocks, block_size, policy, max_batch, prefix_caching, temperature,
                     watermark, token_budget, cost, reserve, mixed, window, max_tokens, draft, k, draft_cost)
    return server.run()


class _Server:
    """The state of one `serve` run; `run` is the scheduler's loop."""

    def __init__(self, model, trace, num_blocks, block_size, policy, max_batch, prefix_caching, temperature,
                 watermark, token_budget, cost, reserve, mixed, window, max_tokens, draft, k, draft_cost):
        self.engine = BatchedModel(model)
        cfg = self.engine.cfg
        self.pool = PagedKVCache(cfg, num_blocks, block_size, prefix_caching and reserve == "paged")
        self.manager, self.num_blocks, self.block_size = self.pool.manager, num_blocks, block_size
        self.policy, self.reserve, self.mixed, self.max_batch = policy, reserve, mixed, max_batch
        self.temperature, self.token_budget, self.window, self.k = temperature, token_budget, window, k
        self.cost, self.draft_cost = cost, draft_cost
        self.keep = int(watermark * num_blocks)  # blocks a paged admission leaves free, as vLLM rounds
        self.outcomes = {r.rid: Outcome(r) for r in trace}
        if len(self.outcomes) != len(trace):
            raise ValueError("request ids in a trace must be unique")
        self.rngs = {r.rid: np.random.default_rng(r.rid) for r in trace}  # kept across preemptions
        for r in trace:
            check_tokens(r.prompt, cfg)
            if not is_int(r.n_new) or r.n_new < 1:
                raise ValueError(f"request {r.rid}: n_new must be a positive integer, got {r.n_new!r}")
            length = (max_tokens or r.n_new) if reserve == "max" else r.n_new
            self.outcomes[r.rid].rejected = rejection(r, cfg, num_blocks, block_size, length)
        self.max_tokens = max_tokens
        self.draft = BatchedModel(draft) if draft is not None else None
        if self.draft is not None:
            if self.draft.cfg.vocab_size != cfg.vocab_size or self.draft.cfg.block_size < cfg.block_size:
                raise ValueError("the draft must share the target's vocabulary and context")
            blocks_each = -(-cfg.block_size // block_size)
            self.draft_pool = PagedKVCache(self.draft.cfg, max_batch * blocks_each, block_size, prefix_caching=False)
        else:
            self.draft_pool = None
        self.arrivals = deque(sorted((r for r in trace if not self.outcomes[r.rid].rejected),
                                     key=lambda r: r.arrival))
        self.waiting, self.running = deque(), []
        self.reserved = 0  # "max": blocks set aside for the running sequences
        self.now = self.arrivals[0].arrival if self.arrivals else 0.0
        self.steps = self.preemptions = self.recomputed = self.prefilled = self.peak = 0
        self.timeline = []

    def blocks(self, n: int) -> int:
        return -(-n // self.block_size)

    def set_aside(self, req) -> int:
        """Blocks a "max" reservation takes: prompt + max_tokens - 1 positions."""
        return self.blocks(len(req.prompt) + (self.max_tokens or req.n_new) - 1)

    # ------------------------------------------------------------------ the loop

    def run(self) -> Report:
        start = self.now
        while self.arrivals or self.waiting or self.running:
            while self.arrivals and self.arrivals[0].arrival <= self.now:
                self.waiting.append(self.arrivals.popleft())
            if not self.running and not self.waiting:
                self.now = self.arrivals[0].arrival  # idle until the next request
                continue
            if self.policy == "static" and not self.running and not self._batch_ready():
                continue
            tick = time.perf_counter()
            for live in self.running:
                live.k = min(self.k, live.remaining - 1) if self.draft and not live.feed else 0
            need, preempted = self._grow_running()
            if not preempted and (self.policy == "continuous" or not self.running):
                self._admit(need)
            if not self.running:
                raise RuntimeError(f"scheduler stalled: {len(self.waiting)} waiting, none admitted, "
                                   f"{self.manager.num_free} of {self.num_blocks} blocks free")
            seconds, batch, finished = self._step()
            seconds = time.perf_counter() - tick if self.cost is None else seconds
            self.now += seconds
            self._record(seconds, batch, finished)
        return Report([self.outcomes[r] for r in self.outcomes], self.pool, self.now - start, self.steps,
                      self.preemptions, self.recomputed, self.prefilled, self.peak,
                      np.array(self.timeline).reshape(-1, 4), self.draft_pool)

    def _batch_ready(self) -> bool:
        """Static batching: form a batch once max_batch wait, the oldest has waited `window`, or no
        more will come; otherwise move the clock to whichever comes first."""
        due = self.waiting[0].arrival + self.window
        if len(self.waiting) >= self.max_batch or self.now >= due or not self.arrivals:
            return True
        self.now = min(due, self.arrivals[0].arrival)
        return False

    def _grow_running(self):
        """Blocks for each running sequence's tokens this step, oldest first; if the pool is short
        the newest running sequence gives its blocks back and waits to be recomputed."""
        need, preempted = {}, False
        if self.reserve == "max":
            return need, preempted
        for live in list(self.running):
            if live not in self.running:
                break  # preempted itself, and every newer one before it
            need[live] = 0 if live.feed else self.manager.append_need(live.seq.seq_id, live.k + 1)
            while sum(need.values()) > self.manager.num_free:
                victim = self.running.pop()
                need.pop(victim, None)
                self._release(victim)
                victim.outcome.preempted += 1
                self.waiting.appendleft(victim.outcome.request)
                self.preemptions, preempted = self.preemptions + 1, True
        return need, preempted

    def _admit(self, need):
        """Waiting requests, oldest first, while blocks (and the batch size) allow."""
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            out = self.outcomes[req.rid]
            tokens = np.concatenate([req.prompt, np.asarray(out.tokens, np.int64)])
            if self.reserve == "max":
                fits = self.reserved + self.set_aside(req) <= self.num_blocks
            else:
                keep = self.keep if self.running else 0
                fits = self.blocks(len(tokens)) + sum(need.values()) + keep <= self.manager.num_free
            if not fits:
                break
            self.waiting.popleft()
            reserved = self.set_aside(req) if self.reserve == "max" else 0
            self.reserved += reserved
            live = _Live(out, self.pool.add(req.rid, tokens), reserved)
            self.running.append(live)
            self.running.sort(key=lambda l: l.outcome.request.arrival)  # the latest arrival is preempted first
            if out.tokens:  # back after a preemption: what it computes now, it had computed before
                self.recomputed += len(live.feed)

    def _release(self, live):
        self.pool.free(live.seq)
        self.reserved -= live.reserved
        for clock, key in ((self.cost, live.rid), (self.draft_cost, live.rid)):
            if clock is not None:
                clock.free(key)
        if live.draft_seq is not None:
            self.draft_pool.free(live.draft_seq)
            live.draft_seq = None

    def _plan(self):
        """(sequences, tokens to feed each) for this step: decode rows first, then prompts."""
        decoding = [l for l in self.running if not l.feed]
        prompts = [l for l in self.running if l.feed]
        if not self.mixed and prompts:
            decoding = []  # vLLM v0 without chunked prefill: a step of prompts only
        budget = self.token_budget or math.inf
        batch, feeds = [], []
        for live in decoding:
            if budget < live.k + 1:
                continue  # its next tokens wait for the next step's budget
            batch.append(live)
            feeds.append(None)  # filled in after drafting
            budget -= live.k + 1
        for live in prompts:
            if budget < 1:
                break
            chunk = live.feed[:int(min(budget, len(live.feed)))]
            batch.append(live)
            feeds.append(chunk)
            budget -= len(chunk)
        return batch, feeds

    def _step(self):
        """Draft, run one batched target step, judge and sample; returns (the clock's seconds for it,
        the sequences in it, those that finished)."""
        batch, feeds = self._plan()
        seconds, drafted, qs = self._draft([l for l, f in zip(batch, feeds) if f is None and l.k])
        for i, live in enumerate(batch):
            if feeds[i] is None:
                feeds[i] = [live.outcome.tokens[-1]] + drafted.get(live, [])
        starts = [live.seq.n for live in batch]
        logits = self.engine.feed([live.seq for live in batch], feeds)
        if self.cost is not None:
            seconds += self.cost([(l.rid, len(f), s) for l, f, s in zip(batch, feeds, starts)])
        self.steps += 1
        self.prefilled += sum(len(f) for l, f in zip(batch, feeds) if l.feed)
        finished = []
        for live, f, rows in zip(batch, feeds, logits):
            if live.feed:
                live.feed = live.feed[len(f):]
                if live.feed:
                    continue  # more of its prompt to come: no token yet
                new = [next_token(rows[-1], self.temperature, self.rngs[live.rid])]
            else:
                new = self._judge(live, drafted.get(live, []), qs.get(live, []), rows)
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

    def _judge(self, live, drafted, qs, rows):
        """Accept draft tokens while the target agrees (Leviathan et al.'s rule), then one token
        from the residual or, if all were accepted, from the target's last row; both caches keep
        only the positions of kept tokens."""
        rng, base = self.rngs[live.rid], live.seq.n - len(drafted) - 1  # position of the last token
        ps = probs_from_logits(rows, self.temperature)  # (k + 1, V)
        kept, nxt = 0, None
        for i, x in enumerate(drafted):
            ok, tok = accept_or_resample(ps[i], qs[i], x, rng)
            if not ok:
                nxt = tok
                break
            kept += 1
        if nxt is None:
            nxt = next_token(rows[len(drafted)], self.temperature, rng)
        live.outcome.drafted += len(drafted)
        live.outcome.accepted += kept
        if drafted:
            live.seq.truncate(base + 1 + kept)
            live.draft_seq.truncate(min(live.draft_seq.n, base + 1 + kept))
        return drafted[:kept] + [nxt]

    def _record(self, seconds: float, batch, finished):
        used = self.reserved if self.reserve == "max" else self.num_blocks - self.manager.num_free
        self.peak = max(self.peak, used)
        self.timeline.append((self.now, len(batch), used, seconds))
        for live in batch:
            if live.outcome.tokens and math.isnan(live.outcome.first):
                live.outcome.first = self.now
        for live in finished:
            live.outcome.finish = self.now
            self._release(live)  # its blocks return to the pool at once
            self.running.remove(live)


# ----------------------------------------------------------------------------- measurements

def decode_speedup(lean, positions, repeats: int = 9):
    """One batched decode step for sequences at `positions` against decoding each alone on the
    lean path, timed back to back: (seconds for all alone, seconds batched, speed-up), medians."""
    solos = [stepper(lean, lean.cfg, int(p)) for p in positions]
    alone, batched, ratio = paired(lambda: [s() for s in solos], batch_stepper(BatchedModel(lean), positions), repeats)
    return alone, batched, 1.0 / ratio


def sweep_rates(model, policies: dict, rates, trace: dict, num_blocks: int, **common) -> dict:
    """Each policy (name -> serve keywords) at each arrival rate, on the trace make_trace(**trace)
    draws at that rate: {name: {rate: Report}}. `common` goes to every run (a clock, max_tokens...)."""
    runs = {name: {} for name in policies}
    for rate in rates:
        requests = make_trace(**{**trace, "rate": float(rate)})
        for name, kwargs in policies.items():
            runs[name][rate] = serve(model, requests, num_blocks, **{**common, **kwargs})
    return runs


LOAD_TRACE = dict(n=64, seed=0, burstiness=1.0, prompt_len=(8, 48), n_new=(4, 128))  # Poisson arrivals
LOAD_BLOCKS, SPEC_BLOCKS = 96, 256  # the ladder's pool; speculation's, large enough that memory never binds
LOAD_FRACTIONS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)  # rates, as shares of what a batch of 32 serves
SLO_STEPS = dict(ttft=25, tpot=3)  # latency targets in one-sequence decode steps of the clock
SPEC_REQUESTS, SPEC_FRACTIONS = 64, (0.1, 0.15, 0.2, 0.3, 0.4, 0.6)  # below saturation: a steady state exists
SPEC_POLICY = LADDER["+ prefix caching"]  # no token budget: one would cap a batch at budget / (k + 1)


def load_rates(big_clock, mean_new: float, fractions) -> list:
    """Arrival rates (requests/s) as shares of what a decode batch of 32 serves on the clock."""
    return [round(32 / big_clock.decode(32) / mean_new * f, 2) for f in fractions]


def best_rate(runs: dict, slo: dict) -> float:
    """The rate, of {rate: Report}, at which a policy's goodput within slo (ttft, tpot) was highest."""
    return max(runs, key=lambda rate: runs[rate].goodput(**slo))


def slo_capacity(runs: dict, slo: dict, share: float = 0.9) -> float:
    """The highest rate, of {rate: Report}, at which `share` of the requests met both targets
    (DistServe's capacity, Zhong et al. 2024); 0 if none."""
    return max((rate for rate, rep in runs.items() if rep.attainment(**slo) >= share), default=0.0)


def load_study(target, draft, big_clock, small_clock, k: int = 4, out=print) -> dict:
    """The serving chapter's measurements at the stand-in's fitted cost: the ladder over the rates,
    and SPEC_POLICY with and without speculative decoding below saturation, with the crossover
    predicted by lib.clocks.crossover_rate. target, draft: (params, cfg) pairs; the clocks from
    lib.clocks.fit_clock. Returns the numbers the goals need."""
    from .clocks import crossing, crossover_rate
    from .corpus import load_corpus
    from .generate import generate
    from .lean import LeanModel
    from .sweep import acceptance_on_text
    lean = LeanModel(*target)
    held_out = load_corpus().held_out
    trace = dict(LOAD_TRACE, system=held_out[2000:2032])
    t1, max_tokens = big_clock.decode(1), trace["n_new"][1]
    slo = {name: steps * t1 for name, steps in SLO_STEPS.items()}
    sample = make_trace(2000, 1.0, prompt_len=trace["prompt_len"], n_new=trace["n_new"])
    mean_new = float(np.mean([r.n_new for r in sample]))
    mean_prompt = float(np.mean([len(r.prompt) for r in sample]))  # after the shared system prompt, cached
    rates = load_rates(big_clock, mean_new, LOAD_FRACTIONS)
    ladder = sweep_rates(lean, LADDER, rates, trace, LOAD_BLOCKS, cost=big_clock, max_tokens=max_tokens,
                         window=4 * t1)
    spec_rates = load_rates(big_clock, mean_new, SPEC_FRACTIONS)
    spec = {"plain": SPEC_POLICY, "speculative": dict(SPEC_POLICY, draft=LeanModel(*draft), k=k)}
    spec_trace = dict(trace, n=SPEC_REQUESTS)
    specs = sweep_rates(lean, spec, spec_rates, spec_trace, SPEC_BLOCKS, cost=big_clock, draft_cost=small_clock,
                        max_tokens=max_tokens)
    exact = True
    for t, policies, runs, rs in ((trace, LADDER, ladder, rates), (spec_trace, spec, specs, spec_rates)):
        for rate in rs:
            solo = {r.rid: generate(*target, r.prompt, r.n_new, step=lean).tokens.tolist()
                    for r in make_trace(**{**t, "rate": float(rate)})}
            for rep in (runs[n][rate] for n in policies):
                m = rep.pool.manager
                exact &= all(o.tokens == solo[o.request.rid] for o in rep.outcomes)
                exact &= m.num_free == m.num_blocks and not any(m.ref)
    goal_rate = best_rate(ladder["static"], slo)
    good = {n: ladder[n][goal_rate].goodput(**slo) for n in LADDER}
    ratio = lambda key: [specs["plain"][r].summary()[key] / specs["speculative"][r].summary()[key]
                         for r in spec_rates]
    gains, means = ratio("TPOT p50 ms"), ratio("TPOT mean ms")
    alpha = acceptance_on_text(target, draft, held_out[:4096], [0.0])[0.0]
    fine = list(np.geomspace(spec_rates[0] / 2, spec_rates[-1] * 2, 60))
    predicted = crossover_rate(big_clock, small_clock, alpha, k, mean_new, fine, mean_prompt)
    measured = crossing(spec_rates, means)  # the statistic steady_state predicts
    out(f"serving at the 12x768 stand-in's fitted cost, {trace['n']} Poisson requests per rate, rates {rates}")
    out(f"  goodput at {goal_rate} requests/s (static batching's best): "
        + ", ".join(f"{n} {g:.2f}" for n, g in good.items()))
    out(f"  speculative (k = {k}) TPOT gain at {spec_rates} requests/s, p50: " + ", ".join(f"{g:.2f}x" for g in gains)
        + "; mean: " + ", ".join(f"{g:.2f}x" for g in means))
    out(f"  crossover on the mean: measured {measured:.2f}, predicted {predicted:.2f} requests/s (alpha {alpha:.2f})")
    return dict(good=good, gains=gains, crossover=(measured, predicted), exact=exact)


def bench_rows(out=print):
    """The serving lines of `python -m lib.bench`: batched decode of the trained target and of the
    12x768 stand-in, then `load_study`; returns the goals as (text, value, met)."""
    from .clocks import fit_clock
    from .lean import LeanModel
    from .model import load
    from .standins import standin
    target, draft = load("target"), load("draft")
    lean = LeanModel(*target)
    positions = np.random.default_rng(0).integers(16, 129, 32)  # cached tokens of each sequence
    with single_thread():
        out("batched decode of the target, lean, B sequences at positions 16..128 (paired with each alone)")
        for B in (1, 4, 16, 32):
            alone, batched, gain = decode_speedup(lean, positions[:B])
            out(f"  B = {B:2d}: alone {alone * 1e3:6.2f} ms, batched {batched * 1e3:6.2f} ms per step, "
                f"{B / batched:7.0f} tokens/s, {gain:.2f}x")
        chunks = (4, 16, 64, 256)
        big_clock = fit_clock(standin("12x768"), positions, chunks=chunks, repeats=3)
        small_clock = fit_clock(standin("4x256"), positions, chunks=chunks, repeats=3)
        big = dict(big_clock.decode_times)
        out("12x768 stand-in, batched decode: " + ", ".join(f"B = {B}: {t * 1e3:.0f} ms" for B, t in big.items()))
        study = load_study(target, draft, big_clock, small_clock, out=out)
    big16 = 16 * big[1] / big[16]
    paged = study["good"]["paged (vLLM)"] / max(study["good"]["static"], 1e-9)
    measured, predicted = study["crossover"]
    gap = abs(measured / predicted - 1) if np.isfinite(measured / predicted) else float("inf")
    return [("12x768 stand-in: batched decode, B = 16 >= 5 x the tokens/s of B = 1", big16, big16 >= 5),
            ("stand-in cost: paged continuous goodput >= 2 x static's, at static's best rate", paged, paged >= 2),
            ("stand-in cost: speculative in the batch, TPOT p50 >= 1.3 x better at the lowest rate",
             study["gains"][0], study["gains"][0] >= 1.3),
            ("... measured crossover rate within 25% of the predicted one (|gap|; inf: none measured)", gap,
             gap <= 0.25),
            ("served tokens equal solo decoding, no block leaked, every run (1 = yes)", float(study["exact"]),
             study["exact"])]
