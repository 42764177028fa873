"""What a serving run reports: each request's outcome, and the latency metrics computed from them.

Each request keeps the time each of its tokens came out (`times`). TTFT is the first minus the
arrival; TPOT a request's gaps between tokens, averaged ((last - first) / (tokens - 1)); ITL every
single gap between two tokens of a request, pooled over all requests (vLLM's benchmark reports
ITL beside TPOT; Sarathi-Serve, Agrawal et al. 2024, judges chunked prefill by its p99, "TBT"):
one long step stalls one gap, which a request's average dilutes. Goodput is the requests per
second that met both targets, as vLLM's `bench serve` reports it (`request_goodput`, with
`--goodput`); DistServe (Zhong et al. 2024) calls goodput the highest rate at which a set share of
the requests (`attainment`) meets them, `lib.book.studies.load_study.slo_capacity`.
"""
from dataclasses import dataclass, field

import numpy as np

from lib.cache.paged import PagedKVCache
from lib.serve.trace import Request


@dataclass
class Outcome:
    """What happened to one request; times in seconds on the trace's clock."""
    request: Request
    tokens: list = field(default_factory=list)  # the generated ids
    first: float = float("nan")  # when the first token was out
    finish: float = float("nan")
    rejected: str = ""  # why it was never run, if it was not
    preempted: int = 0  # times its blocks were taken back
    drafted: int = 0  # draft tokens proposed (k per round; those after a rejection are never judged)
    accepted: int = 0  # of those, accepted
    times: list = field(default_factory=list)  # when each token came out (the end of its step)

    @property
    def ttft(self) -> float:
        return self.first - self.request.arrival

    @property
    def tpot(self) -> float:
        n = len(self.tokens)
        return (self.finish - self.first) / (n - 1) if n > 1 else float("nan")

    @property
    def itl(self) -> np.ndarray:
        """(tokens - 1,) the gaps between consecutive tokens, seconds."""
        return np.diff(self.times)


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
        itl = list(np.concatenate([o.itl for o in done])) if done else []  # every gap of every request
        decoding = [o for o in done if len(o.tokens) > 1]  # token-weighted: all their gaps over all their tokens
        tpot_mean = (sum(o.finish - o.first for o in decoding) / sum(len(o.tokens) - 1 for o in decoding) * 1e3
                     if decoding else float("nan"))
        seconds = self.timeline[:, 3] if self.steps else np.zeros(0)
        pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else float("nan")
        drafted = sum(o.drafted for o in done)
        spec = {"accepted/drafted": sum(o.accepted for o in done) / drafted} if drafted else {}  # of drafted tokens
        return {"completed": len(done), "rejected": len(self.outcomes) - len(done),
                "tokens/s": sum(len(o.tokens) for o in done) / self.makespan if self.makespan else 0.0,
                "TTFT p50 ms": pct(ttft, 50), "TTFT p99 ms": pct(ttft, 99),
                "TPOT p50 ms": pct(tpot, 50), "TPOT p99 ms": pct(tpot, 99), "TPOT mean ms": tpot_mean,
                "ITL p50 ms": pct(itl, 50), "ITL p99 ms": pct(itl, 99),
                "mean batch": float(self.timeline[:, 1] @ seconds / seconds.sum()) if self.steps else 0.0,
                "preemptions": self.preemptions, "recomputed tokens": self.recomputed,
                "peak blocks": self.peak_blocks, **spec}

    def _met(self, ttft: float, tpot: float) -> int:
        return sum(1 for o in self.outcomes if not o.rejected and o.ttft <= ttft
                   and (len(o.tokens) < 2 or o.tpot <= tpot))

    def goodput(self, ttft: float, tpot: float) -> float:
        """Requests per second that met both targets (seconds): TTFT <= ttft and TPOT <= tpot (vLLM
        `bench serve`'s request goodput)."""
        return self._met(ttft, tpot) / self.makespan if self.makespan else 0.0

    def attainment(self, ttft: float, tpot: float) -> float:
        """The share of the trace's requests that met both targets (rejected ones did not)."""
        return self._met(ttft, tpot) / len(self.outcomes)
