"""The scheduler: the queues, admission, preemption, and the plan of each step (after nano-vllm's
`engine/scheduler.py`). It knows blocks and tokens; it runs no model and keeps no clock.

A paged admission takes blocks for the whole prompt beyond a watermark; a "max" reservation sets
aside prompt + max_tokens - 1 positions. When a paged pool runs dry mid-decode the newest running
sequence gives its blocks back and waits to be recomputed from its prompt and the tokens it had
produced (preemption by recompute, as vLLM). A step's plan is decode rows first, then prompt
chunks within the token budget.
"""
from collections import deque

import numpy as np


class Running:
    """A running sequence: its outcome, its slice of the pool, and the tokens still to compute."""

    def __init__(self, outcome, seq, reserved):
        self.outcome, self.seq, self.reserved = outcome, seq, reserved
        self.pending = list(seq.tokens[seq.n:])  # prompt (and, after a preemption, output) to compute
        self.draft_seq = None  # its sequence in the draft's pool, when speculating
        self.k = 0  # draft tokens this step

    @property
    def rid(self):
        return self.outcome.request.rid

    @property
    def remaining(self) -> int:
        return self.outcome.request.n_new - len(self.outcome.tokens)


class Scheduler:
    def __init__(self, policy, pool, outcomes: dict, max_tokens, on_release=lambda live: None):
        self.policy, self.pool, self.manager, self.outcomes = policy, pool, pool.manager, outcomes
        self.max_tokens, self.on_release = max_tokens, on_release
        self.keep = int(policy.watermark * self.manager.num_blocks)  # blocks a paged admission leaves free
        self.arrivals = deque(sorted((o.request for o in outcomes.values() if not o.rejected),
                                     key=lambda r: r.arrival))
        self.waiting, self.running = deque(), []
        self.reserved = 0  # "max": blocks set aside for the running sequences
        self.preemptions = self.recomputed = 0

    def blocks(self, n: int) -> int:
        return -(-n // self.manager.block_size)

    def set_aside(self, req) -> int:
        """Blocks a "max" reservation takes: prompt + max_tokens - 1 positions."""
        return self.blocks(len(req.prompt) + self.policy.answer_length(req, self.max_tokens) - 1)

    def used(self) -> int:
        """Blocks in use, or set aside by "max" reservations."""
        return self.reserved if self.policy.reserve == "max" else self.manager.num_blocks - self.manager.num_free

    def arrive(self, now: float) -> None:
        while self.arrivals and self.arrivals[0].arrival <= now:
            self.waiting.append(self.arrivals.popleft())

    def batch_due(self, now: float, batch_wait: float):
        """Static batching: None once max_batch wait, the oldest has waited `batch_wait`, or no more
        will come; else the time to wait until (whichever comes first)."""
        due = self.waiting[0].arrival + batch_wait
        if len(self.waiting) >= self.policy.max_batch or now >= due or not self.arrivals:
            return None
        return min(due, self.arrivals[0].arrival)

    def schedule(self) -> None:
        """Blocks for the running sequences' next tokens, then, if none was preempted, newcomers."""
        need, preempted = self._grow_running()
        if not preempted and (self.policy.batching == "continuous" or not self.running):
            self._admit(need)
        if not self.running:
            raise RuntimeError(f"scheduler stalled: {len(self.waiting)} waiting, none admitted, "
                               f"{self.manager.num_free} of {self.manager.num_blocks} blocks free")

    def _grow_running(self):
        """Blocks for each running sequence's tokens this step, oldest first; if the pool is short
        the newest running sequence gives its blocks back and waits to be recomputed."""
        need, preempted = {}, False
        if self.policy.reserve == "max":
            return need, preempted
        for live in list(self.running):
            if live not in self.running:
                break  # preempted itself, and every newer one before it
            need[live] = 0 if live.pending else self.manager.append_need(live.seq.seq_id, live.k + 1)
            while sum(need.values()) > self.manager.num_free:
                victim = self.running.pop()
                need.pop(victim, None)
                self.release(victim)
                victim.outcome.preempted += 1
                self.waiting.appendleft(victim.outcome.request)
                self.preemptions, preempted = self.preemptions + 1, True
        return need, preempted

    def _admit(self, need):
        """Waiting requests, oldest first, while blocks (and the batch size) allow."""
        while self.waiting and len(self.running) < self.policy.max_batch:
            req = self.waiting[0]
            out = self.outcomes[req.rid]
            tokens = np.concatenate([req.prompt, np.asarray(out.tokens, np.int64)])
            if self.policy.reserve == "max":
                fits = self.reserved + self.set_aside(req) <= self.manager.num_blocks
            else:
                keep = self.keep if self.running else 0
                fits = self.blocks(len(tokens)) + sum(need.values()) + keep <= self.manager.num_free
            if not fits:
                break
            self.waiting.popleft()
            reserved = self.set_aside(req) if self.policy.reserve == "max" else 0
            self.reserved += reserved
            live = Running(out, self.pool.add(req.rid, tokens), reserved)
            self.running.append(live)
            self.running.sort(key=lambda l: l.outcome.request.arrival)  # the latest arrival is preempted first
            if out.tokens:  # back after a preemption: what it computes now, it had computed before
                self.recomputed += len(live.pending)

    def release(self, live) -> None:
        self.pool.free(live.seq)
        self.reserved -= live.reserved
        self.on_release(live)

    def finish(self, live) -> None:
        self.release(live)  # its blocks return to the pool at once
        self.running.remove(live)

    def plan(self):
        """(sequences, tokens to feed each) for this step: decode rows first
        (None: their last token and drafts, filled in later), then prompt
        chunks, within the token budget."""
        decoding = [l for l in self.running if not l.pending]
        prompts = [l for l in self.running if l.pending]
        if not self.policy.mixed and prompts:
            decoding = []  # vLLM v0 without chunked prefill: prompts only
        budget, batch, feeds = self.policy.budget, [], []
        for live in decoding:
            if budget < live.k + 1:
                continue  # its next tokens wait for the next step's budget
            batch.append(live)
            feeds.append(None)
            budget -= live.k + 1
        for live in prompts:
            if budget < 1:
                break
            chunk = live.pending[:int(min(budget, len(live.pending)))]
            batch.append(live)
            feeds.append(chunk)
            budget -= len(chunk)
        return batch, feeds
