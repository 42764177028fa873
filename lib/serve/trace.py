"""Requests and traces: who arrives when, with what prompt, wanting how many tokens.

Gaps between arrivals are gamma-distributed (shape 1 is a Poisson process, below 1 burstier), as
in vLLM's benchmark_serving; prompts are spans of the held-out text, answer lengths log-uniform
(many short answers and a few long ones, as in chat traces).
"""
from dataclasses import dataclass

import numpy as np

from lib.corpus import held_out_spans


@dataclass
class Request:
    rid: int
    arrival: float  # seconds after the start of the trace
    prompt: np.ndarray  # (P,) token ids
    n_new: int  # tokens the answer has (where it would end)


def make_trace(n: int, rate: float, seed: int = 0, burstiness: float = 1.0, prompt_len=(8, 48),
               n_new=(4, 128), system=()) -> list:
    """n requests at `rate` per second on average; gaps ~ Gamma(burstiness, 1 / (rate * burstiness)).
    Prompts are spans of the held-out text from line starts, cut to a length drawn uniformly from prompt_len,
    after an optional shared system prompt. Output lengths are log-uniform over n_new."""
    if n < 1 or rate <= 0 or burstiness <= 0 or not (1 <= prompt_len[0] <= prompt_len[1] and 1 <= n_new[0] <= n_new[1]):
        raise ValueError(f"need n >= 1, rate > 0, burstiness > 0, and prompt_len and n_new as (lowest, highest) ranges of "
                         f"positive lengths, got {n}, {rate}, {burstiness}, {prompt_len} and {n_new}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.gamma(burstiness, 1.0 / (rate * burstiness), n))  # (n,)
    lengths = rng.integers(prompt_len[0], prompt_len[1] + 1, n)
    outputs = np.exp(rng.uniform(np.log(n_new[0]), np.log(n_new[1] + 1), n)).astype(int)  # (n,) in n_new
    texts = held_out_spans(n, prompt_len[1])
    system = np.asarray(system, np.int64)
    return [Request(i, float(arrivals[i]), np.concatenate([system, texts[i][:lengths[i]]]), int(outputs[i]))
            for i in range(n)]


def rejection_reason(req: Request, cfg, num_blocks: int, block_size: int, length: int = None) -> str:
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
