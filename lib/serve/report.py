"""What a serving run reports: each request's outcome, and the latency metrics computed from them.

TTFT is first token minus arrival; TPOT a request's gaps between tokens, averaged
((finish - first) / (tokens - 1)); goodput the requests per second that met both targets
(DistServe, Zhong et al. 2024).
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
    drafted: int = 0  # draft tokens judged by the target
    accepted: int = 0  # of those, accepted

    @property
    def ttft(self) -> float:
        return self.first - self.request.arrival

    @property
    def tpot(self) -> float:
        n = len(self.tokens)
        return (self.finish - self.first) / (n - 1) if n > 1 else float("nan")


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
