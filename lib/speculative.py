"""Speculative sampling: a small draft model proposes k tokens, the target checks them in one call.

Leviathan, Kalman & Matias 2023 ("Fast Inference from Transformers via Speculative Decoding")
and Chen et al. 2023 ("Accelerating LLM Decoding with Speculative Sampling"). With target
distribution p and draft distribution q, a drafted token x is accepted with probability
min(1, p(x)/q(x)); on the first rejection the next token is drawn from norm(max(0, p - q)); if
all k are accepted a bonus token is drawn from p. Each emitted token is then distributed
exactly as p. Both caches are truncated to the tokens that were kept.

Notation follows Leviathan et al.: p is the target, q the draft (Chen et al. swap the letters).
"""
from dataclasses import dataclass, field

import numpy as np

from .config import ModelConfig
from .kv_cache import KVCache
from .model import check_tokens, forward_cached
from .sampling import probs_from_logits, sample


def residual(p, q) -> np.ndarray:
    """norm(max(0, p - q)): where to draw from after a rejection (p if p == q)."""
    r = np.maximum(p - q, 0.0)  # (V,)
    total = r.sum()
    return r / total if total > 0 else p


def step_distribution(p, q) -> np.ndarray:
    """The closed-form distribution of one accept/reject step: min(p, q) + (1 - sum min(p, q)) * residual.

    Equals p: accepted mass min(p, q), plus rejected mass sum(max(0, q - p)) = sum(max(0, p - q))
    times the residual max(0, p - q) / sum(max(0, p - q)).
    """
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    accepted = np.minimum(p, q)  # (V,)
    return accepted + (1.0 - accepted.sum()) * residual(p, q)


def accept_or_resample(p, q, x: int, rng: np.random.Generator):
    """Judge drafted token x ~ q against the target's p: (True, x) or (False, token from the residual)."""
    if rng.random() < min(1.0, p[x] / q[x]):
        return True, x
    return False, sample(residual(p, q), rng)


@dataclass
class SpecStats:
    k: int
    rounds: int = 0
    drafted: int = 0
    judged: int = 0  # drafted tokens that reached the accept/reject test
    accepted: int = 0
    emitted: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    judged_at: list = field(default_factory=list)  # per draft position i: times it was judged
    accepted_at: list = field(default_factory=list)  # per draft position i: times it was accepted

    def __post_init__(self):
        self.judged_at = [0] * self.k
        self.accepted_at = [0] * self.k

    @property
    def alpha(self) -> float:
        """Acceptance rate: accepted / judged."""
        return self.accepted / self.judged if self.judged else float("nan")

    @property
    def tokens_per_call(self) -> float:
        return self.emitted / self.target_calls if self.target_calls else float("nan")

    @property
    def acceptance_by_position(self) -> np.ndarray:
        """P(draft token i accepted | tokens before it accepted), per position i."""
        judged = np.maximum(np.array(self.judged_at), 1)
        return np.array(self.accepted_at) / judged


def check_pair(target_cfg: ModelConfig, draft_cfg: ModelConfig, k) -> None:
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        raise ValueError(f"draft and target must share a vocabulary: the target has {target_cfg.vocab_size} "
                         f"tokens, the draft {draft_cfg.vocab_size}")
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k (draft tokens per round) must be an integer >= 1, got {k!r}")


class _Stream:
    """One model's cache plus the tokens it has not read yet."""

    def __init__(self, params, cfg, tokens, max_len):
        self.params, self.cfg = params, cfg
        self.cache = KVCache(cfg, max_len)
        self.pending = list(tokens)

    def feed(self, extra=()):
        """Read the pending tokens (and extra ones) in one call; return the logits of every one fed."""
        tokens, self.pending = self.pending + list(extra), []
        return forward_cached(self.params, self.cfg, np.array(tokens), self.cache)  # (T, V)


def speculative_generate(target, draft, prompt, n_new: int, k: int = 4, temperature: float = 1.0,
                         seed: int = 0):
    """Generate n_new tokens after prompt with draft-then-verify decoding.

    target, draft: (params, cfg) pairs. Returns (tokens (n_new,), SpecStats).
    At temperature 0, p and q are one-hot argmaxes and the rule accepts exactly while the
    draft's token is the target's argmax, so the output equals greedy decoding of the target.
    """
    (tp, tcfg), (dp, dcfg) = target, draft
    check_pair(tcfg, dcfg, k)
    prompt = check_tokens(prompt, tcfg)
    if not isinstance(n_new, (int, np.integer)) or n_new < 1:
        raise ValueError(f"n_new must be a positive integer, got {n_new!r}")
    limit = min(tcfg.block_size, dcfg.block_size)
    if len(prompt) + n_new > limit:
        raise ValueError(f"prompt ({len(prompt)} tokens) plus generation ({n_new}) is longer than "
                         f"the context of {limit} positions")
    probs_from_logits(np.zeros(1), temperature)  # validates the temperature
    rng = np.random.default_rng(seed)
    max_len = len(prompt) + n_new
    tgt = _Stream(tp, tcfg, prompt[:-1], max_len)
    dft = _Stream(dp, dcfg, prompt[:-1], max_len)
    last = int(prompt[-1])  # emitted but not yet read by either model
    out, stats = [], SpecStats(k)
    while len(out) < n_new:
        k_round = min(k, n_new - len(out))  # never draft past the end
        drafted, qs = [], []
        q_logits = dft.feed([last])[-1]  # (V,)
        for i in range(k_round):
            q = probs_from_logits(q_logits, temperature)  # (V,)
            x = sample(q, rng) if temperature > 0 else int(np.argmax(q))
            drafted.append(x)
            qs.append(q)
            if i < k_round - 1:
                q_logits = dft.feed([x])[-1]
        stats.draft_calls += k_round
        base = tgt.cache.n + len(tgt.pending)  # position of `last`
        ps = probs_from_logits(tgt.feed([last] + drafted)[-(k_round + 1):], temperature)  # (k_round + 1, V)
        stats.target_calls += 1
        n_ok, nxt = 0, None
        for i, x in enumerate(drafted):
            stats.judged_at[i] += 1
            ok, tok = accept_or_resample(ps[i], qs[i], x, rng)
            if not ok:
                nxt = tok
                break
            stats.accepted_at[i] += 1
            n_ok += 1
        if nxt is None:  # every draft token accepted: a bonus token from the last target position
            nxt = sample(ps[k_round], rng) if temperature > 0 else int(np.argmax(ps[k_round]))
        stats.rounds += 1
        stats.drafted += k_round
        stats.judged += min(n_ok + 1, k_round)
        stats.accepted += n_ok
        kept = [last] + drafted[:n_ok]
        tgt.cache.truncate(base + len(kept))  # drop rejected positions
        dft.cache.truncate(min(dft.cache.n, base + len(kept)))
        dft.pending = kept[dft.cache.n - base:]  # the draft never read its last accepted token
        out.extend(drafted[:n_ok] + [nxt])
        stats.emitted += n_ok + 1
        last = nxt
    return np.array(out[:n_new], dtype=np.int64), stats


def expected_tokens_per_call(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): expected tokens per target call (Leviathan et al., eq. 1)."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Theorem 3.8: walltime improvement (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)), c = draft / target cost."""
    return expected_tokens_per_call(alpha, k) / (k * c + 1)
