"""A replay of lengths only: requests of thousands of positions through the real scheduler and block
manager, on a clock, with no model decoding their tokens.

A scheduler needs a request's lengths (its prompt, its answer) and, for prefix caching, which of its
prompt's blocks repeat an earlier prompt's; a clock needs each step's rows. Neither needs the tokens'
values. So `lengths_trace` draws requests as lengths, with prompts of placeholder ids that share a
prefix exactly where the trace says they do (as Mooncake's published traces give prompts as block
hashes, Qin et al. 2025, "Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving"),
and `LengthsReplay` stands in for the model in `lib.serve.serve`: it writes the blocks each step's
tokens take and answers every sequence with one placeholder token, until its drawn length ends it.
The timeline is the one `lib.serve.replay.Replay` gives for the same requests (tests/test_lengths.py):
it depends on lengths and shared prefixes, not on which tokens were decoded.
"""
import numpy as np

from lib.config import ModelConfig
from lib.serve.replay import NO, Replay, write
from lib.serve.trace import Request

ANSWER = 0  # the placeholder id of every answer token
PREFIX_SEED = 12345  # the shared prefixes' ids are one fixed draw, the same in every trace


def ledger_config(spec, context: int, vocab: int = 96) -> ModelConfig:
    """The configuration a lengths-only serve checks requests against: `spec`'s shape, `context` positions."""
    heads = spec.n_head or spec.n_kv_head
    return ModelConfig(spec.n_layer, heads, spec.n_kv_head, heads * spec.head_dim, context, vocab)


def lengths_trace(n: int, rate: float, seed: int = 0, prefixes: int = 8, prefix_len: int = 2048,
                  prompt_len=(256, 4096), n_new=(32, 1024), vocab: int = 96) -> list:
    """n Poisson requests at `rate` per second: each opens with one of `prefixes` shared prefixes of
    `prefix_len` placeholder ids (drawn uniformly), then a prompt of its own whose length is
    log-uniform over prompt_len, and asks for a log-uniform number of tokens over n_new. The lengths
    depend on the seed only: the traces of one seed at two rates differ only in their arrival times."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))  # (n,) Poisson arrivals
    log_uniform = lambda lo, hi: np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n)).astype(int)  # (n,) in lo..hi
    own, answers, which = log_uniform(*prompt_len), log_uniform(*n_new), rng.integers(0, prefixes, n)
    shared = np.random.default_rng(PREFIX_SEED).integers(0, vocab, (prefixes, prefix_len))  # (prefixes, prefix_len)
    return [Request(i, float(arrivals[i]), np.concatenate([shared[which[i]], rng.integers(0, vocab, own[i])]),
                    int(answers[i])) for i in range(n)]


class LengthsReplay(Replay):
    """A model for `lib.serve.serve` that decodes nothing: `feed` writes the new tokens' blocks and
    returns, for each sequence, one logits row with all the mass on ANSWER (the row after its last
    fed token: a prompt's first answer token, or a decoding sequence's next)."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.row = np.full((1, cfg.vocab_size), NO)  # (1, V): all the mass on ANSWER
        self.row[0, ANSWER] = 0.0

    def feed(self, seqs, new_tokens) -> list:
        for seq, new in zip(seqs, new_tokens):
            write(seq, new)
        return [self.row] * len(seqs)
