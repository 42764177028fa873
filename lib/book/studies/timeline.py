"""Continuous batching drawn: each request's state at each step of a serving run, read from the
scheduler's own state as the run goes, and the picture of it (one row per request, a colour per
state), as Orca (Yu et al. 2022, "Orca: A Distributed Serving System for Transformer-Based
Generative Models", figures of iteration-level scheduling) and Hugging Face's continuous-batching
post draw it.

`traced` runs `lib.serve.serve`'s own server, unchanged, and before each step reads which requests
wait, which were preempted, and how many prompt tokens each running one still has to compute; after
the step, how many it computed. `agrees` checks those states against what the report keeps anyway:
each request's token times and the steps' end times. `TIMELINE_TRACE` is a handful of requests
chosen so that the rungs differ in a few dozen steps: a shared system prompt, a long prompt arriving
while others decode, answers of different lengths, a pool small enough that reservations bind and
a paged pool runs dry.
"""
from dataclasses import dataclass

import numpy as np
from matplotlib.patches import Patch

from lib.book.studies.long_ladder import CONTEXT
from lib.serve.lengths import PREFIX_SEED, LengthsReplay, ledger_config
from lib.serve.report import Report
from lib.serve.server import Server
from lib.serve.trace import Request

ABSENT, WAITING, PREFILL, DECODE, PREEMPTED = range(5)  # ABSENT: not arrived yet, or finished
NAMES = ("", "waiting", "prefill", "decode", "preempted, waiting")
COLOURS = ("white", "#d9d9d9", "#e6862e", "#3b75af", "#c0392b")

# (arrival s, own prompt tokens, answer tokens) after one shared prefix: a queue forms at once, one long
# prompt arrives while the first ones decode, and the last ones arrive as the first finish
TIMELINE_TRACE = ((0.0, 96, 40), (0.004, 48, 12), (0.008, 160, 28), (0.012, 64, 20), (0.05, 800, 16),
                  (0.09, 80, 36), (0.15, 112, 8), (0.2, 40, 24))
TIMELINE_PREFIX, TIMELINE_BLOCKS, TIMELINE_MAX_TOKENS = 128, 104, 128  # the system prompt; the pool, in blocks of 16
# positions, small enough that a paged pool runs dry once; what a "max" reservation sets aside per answer
# chunked prefill: six short requests decoding when a prompt of 4,096 tokens of its own arrives
STRIP_TRACE = ((0.0, 64, 60), (0.004, 32, 44), (0.008, 96, 52), (0.012, 48, 64), (0.016, 80, 36), (0.02, 40, 56),
               (0.1, 4096, 16))


def small_trace(rows=TIMELINE_TRACE, prefix_len: int = TIMELINE_PREFIX, vocab: int = 96, seed: int = 0) -> list:
    """Requests from (arrival, own prompt tokens, answer tokens) rows, each prompt opening with one
    shared prefix of placeholder ids (as `lib.serve.lengths.lengths_trace` draws them)."""
    rng = np.random.default_rng(seed)
    prefix = np.random.default_rng(PREFIX_SEED).integers(0, vocab, prefix_len)  # (prefix_len,)
    return [Request(i, float(at), np.concatenate([prefix, rng.integers(0, vocab, own)]), int(n_new))
            for i, (at, own, n_new) in enumerate(rows)]


@dataclass
class Trail:
    """A traced run: the server's report, and each request's state and computed tokens per step."""
    report: Report
    states: np.ndarray  # (requests, steps) ABSENT / WAITING / PREFILL / DECODE / PREEMPTED
    tokens: np.ndarray  # (requests, steps) tokens each request computed in each step (a prompt chunk, or 1)

    @property
    def ends(self) -> np.ndarray:
        """(steps,) the clock's time at the end of each step, seconds."""
        return self.report.timeline[:, 0]

    @property
    def seconds(self) -> np.ndarray:
        """(steps,) each step's duration, seconds."""
        return self.report.timeline[:, 3]


class _Traced(Server):
    """The server with a record of every step's rows; its steps and its scheduler are the server's own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows = []  # per step: {rid: (state, tokens computed)}

    def _step(self):
        s = self.scheduler
        pending = {live.rid: len(live.pending) for live in s.running}  # before the step
        rows = {r.rid: (PREEMPTED if s.outcomes[r.rid].preempted else WAITING, 0) for r in s.waiting}
        rows.update({rid: (WAITING, 0) for rid in pending})  # admitted; in the step only if planned
        seconds, batch, finished = super()._step()
        for live in batch:
            left = pending[live.rid]
            rows[live.rid] = (PREFILL, left - len(live.pending)) if left else (DECODE, 1)
        self.rows.append(rows)
        return seconds, batch, finished


def traced(model, trace, num_blocks: int, policy, clock, block_size: int = 16, batch_wait: float = 0.0,
           max_tokens=None) -> Trail:
    """`lib.serve.serve(model, trace, num_blocks, policy, ...)` at temperature 0, on `clock`, with
    each request's state at each step recorded."""
    server = _Traced(model=model, trace=trace, num_blocks=num_blocks, policy=policy, block_size=block_size,
                     temperature=0.0, batch_wait=batch_wait, max_tokens=max_tokens, clock=clock, draft=None, k=1,
                     draft_clock=None)
    report = server.run()
    rids = [r.rid for r in trace]
    states = np.zeros((len(rids), report.steps), np.int8)  # (requests, steps)
    tokens = np.zeros((len(rids), report.steps), np.int64)  # (requests, steps)
    for j, rows in enumerate(server.rows):
        for i, rid in enumerate(rids):
            states[i, j], tokens[i, j] = rows.get(rid, (ABSENT, 0))
    return Trail(report, states, tokens)


def timeline_runs(clock, policies: dict, rows=TIMELINE_TRACE, num_blocks: int = TIMELINE_BLOCKS) -> dict:
    """{name: Trail}: the small trace of `rows` through each policy as lengths only (`lib.serve.lengths`: no
    token decoded), every step priced by `clock` (a GPUClock); static batching waits four short steps."""
    engine = LengthsReplay(ledger_config(clock.spec, CONTEXT))
    requests = small_trace(rows)
    wait = 4 * clock.decode_step(1, TIMELINE_PREFIX)
    return {name: traced(engine, requests, num_blocks, policy, clock, batch_wait=wait, max_tokens=TIMELINE_MAX_TOKENS)
            for name, policy in policies.items()}


def agrees(trail: Trail) -> bool:
    """Whether the recorded states agree with each request's token times: a request gets a token at
    the end of every decode step and of the last step of every prefill (a recomputation after a
    preemption too) and at no other step; a decode row computes one token, a prefill row at least one;
    it is preempted as often as its outcome counts, each time after a step it was in; it is in no step that started before it arrived, in every step from its first to its last
    token, and in none after."""
    starts, ends = trail.ends - trail.seconds, trail.ends  # (steps,)
    for out, states, tokens in zip(trail.report.outcomes, trail.states, trail.tokens):
        if out.rejected:  # never run: in no step
            if np.any(states != ABSENT):
                return False
            continue
        steps = np.searchsorted(ends, out.times)  # (tokens,) the step each token came out of
        if len(steps) != len(out.tokens) or not len(steps) or not np.array_equal(ends[steps], out.times):
            return False
        prefill, decode = states == PREFILL, states == DECODE  # (steps,)
        gets = decode | (prefill & (np.append(states[1:], ABSENT) != PREFILL))  # a token at the step's end
        here = np.flatnonzero(states != ABSENT)
        preempted = np.diff((states == PREEMPTED).astype(int), prepend=0) == 1  # (steps,) entering PREEMPTED
        if preempted.sum() != out.preempted or np.any(preempted & (np.cumsum(decode | prefill) == 0)):
            return False
        if not (np.array_equal(np.flatnonzero(gets), steps) and np.all(tokens[decode] == 1)
                and np.all(tokens[prefill] >= 1) and np.all(tokens[~(prefill | decode)] == 0)):
            return False
        if starts[here[0]] < out.request.arrival or here[-1] != steps[-1] or len(here) != here[-1] - here[0] + 1:
            return False
    return True


def draw(ax, trail: Trail, by_time: bool = False) -> None:
    """One row per request (the first on top), one cell per step coloured by the request's state. x: the
    step, or (by_time) the clock's time in ms, each step as wide as it took and each prefill cell wide
    enough labelled with the prompt tokens it computed. Each row is labelled with its prompt's tokens."""
    n = len(trail.states)
    lefts, widths = ((trail.ends - trail.seconds) * 1e3, trail.seconds * 1e3) if by_time else \
        (np.arange(trail.states.shape[1]) - 0.5, np.ones(trail.states.shape[1]))
    for i, (states, tokens) in enumerate(zip(trail.states, trail.tokens)):
        for state in (WAITING, PREFILL, DECODE, PREEMPTED):
            js = np.flatnonzero(states == state)
            ax.broken_barh(list(zip(lefts[js], widths[js])), (i - 0.4, 0.8), facecolors=COLOURS[state],
                           edgecolor="white", linewidth=0.4)
        for j in np.flatnonzero((states == PREFILL) & (widths > 0.02 * widths.sum())) if by_time else ():
            ax.text(lefts[j] + widths[j] / 2, i, f"{tokens[j]:,}", ha="center", va="center", fontsize=6, color="white")
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks(range(n), [f"{out.request.rid}: {len(out.request.prompt):,}" for out in trail.report.outcomes],
                  fontsize=7)
    ax.set_ylabel("request: prompt tokens", fontsize=8)
    ax.set_xlabel("time on the clock (ms)" if by_time else "step")
    ax.grid(False)


def legend(fig, states=(WAITING, PREFILL, DECODE, PREEMPTED), **kwargs) -> None:
    """The colours of `states`, once for a figure."""
    fig.legend(handles=[Patch(facecolor=COLOURS[s], label=NAMES[s]) for s in states], ncol=len(states), fontsize=8,
               frameon=False, **kwargs)
