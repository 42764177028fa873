"""A serving policy: the settings one rung of the ladder runs with, checked once.

Each rung adds one idea to the one before it (`LADDER`):

- static batching: a batch is formed when the previous one has finished and either `max_batch`
  requests wait or the oldest has waited `batch_wait` seconds; each request's blocks for its
  prompt and `max_tokens` of answer are set aside when it joins (a server does not know the length
  of an answer before it ends).
- Orca (Yu et al. 2022, "Orca: A Distributed Serving System for Transformer-Based Generative
  Models"): iteration-level scheduling. Requests join and leave between any two steps, a
  newcomer's prompt is computed in the same step as the others' next tokens; memory is still
  reserved for max_tokens, so nothing is ever preempted.
- paged blocks, as vLLM (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
  Serving with PagedAttention"): blocks are taken as the sequence grows. A request is admitted
  when blocks for its whole prompt are free beyond a watermark; when the pool runs dry mid-decode
  the newest running sequence is preempted, its blocks freed, and it is recomputed later from its
  prompt and the tokens it had produced (preemption by recompute; vLLM can also swap blocks to
  CPU memory). vLLM v0 without chunked prefill ran a step of prompts only whenever one was
  waiting (mixed=False here).
- the same with prefix caching: full blocks of a prompt seen before are shared (chapter 6).
- a token budget, as vLLM v1 (and v0 with chunked prefill; Agrawal et al. 2024, "Taming
  Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve"): one token budget per step
  that counts decode tokens; running sequences' next tokens first, then prompt chunks fill what
  is left.
"""
import math
from dataclasses import dataclass

from lib.checks import check_count, check_option, is_number

RUNGS = ("continuous/paged", "continuous/max", "static/max")  # batching/reserve pairs: static batching reserves the max


@dataclass(frozen=True)
class Policy:
    batching: str = "continuous"  # "continuous" (iteration-level) or "static"
    reserve: str = "paged"  # "paged": blocks as the sequence grows; "max": prompt + max_tokens on admission
    mixed: bool = True  # prompts computed in the same step as decode tokens (False: vLLM v0's prompt-only steps)
    prefix_caching: bool = False  # share full blocks of prompts seen before (paged only)
    token_budget: int = None  # tokens per step, decode tokens first, prompts chunked into the rest (None: no limit)
    max_batch: int = 32  # sequences running at once
    watermark: float = 0.01  # share of the pool a paged admission leaves free while others run (vLLM's)

    def __post_init__(self):
        check_option(f"{self.batching}/{self.reserve}", "batching/reserve", RUNGS)
        check_count(self.max_batch, "max_batch")
        if not (is_number(self.watermark) and 0 <= self.watermark < 1):
            raise ValueError(f"watermark must be a share of the pool in [0, 1), got {self.watermark!r}")
        if self.token_budget is not None:
            check_count(self.token_budget, "token_budget")
        for name in ("mixed", "prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def budget(self) -> float:
        return self.token_budget or math.inf

    def answer_length(self, req, max_tokens) -> int:
        """The answer length a request's blocks are sized for: max_tokens (if known) under a
        "max" reservation, which cannot know where an answer ends; its own n_new when paged."""
        return (max_tokens or req.n_new) if self.reserve == "max" else req.n_new


LADDER = {  # each rung adds one idea to the one before; prefix caching only where named
    "static": Policy("static", "max"),
    "Orca": Policy("continuous", "max"),
    "paged (vLLM)": Policy("continuous", "paged"),
    "+ prefix caching": Policy("continuous", "paged", prefix_caching=True),
    "+ token budget (v1)": Policy("continuous", "paged", prefix_caching=True, token_budget=64),
}
