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

from lib.cache.kv_cache import KVCache
from lib.checks import check_cache, check_count, check_step, check_tokens
from lib.config import ModelConfig
from lib.generation import check_request
from lib.sampling import probs_from_logits, sample


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
    accepted, replaced = step_parts(p, q)  # (V,) each
    return accepted + replaced


def step_parts(p, q) -> tuple:
    """One accept/reject step split by path: (accepted min(p, q), replaced after a rejection), each (V,).
    Their sum is step_distribution(p, q)."""
    accepted = np.minimum(p, q)  # (V,)
    return accepted, (1.0 - accepted.sum()) * residual(p, q)


def next_token_laws(p_next, q_next, prefixes, k: int, n: int, parts=step_parts) -> dict:
    """The law of the next token that speculative_generate (fixed k, temperature 1, n tokens) emits
    after each emitted prefix in `prefixes` (a set of tuples closed under taking prefixes, () in it),
    when each drafted position is judged by `parts`: {prefix: (V,)}, for the prefixes it can reach.

    p_next(seq), q_next(seq): the target's and the draft's next-token distribution after the
    emitted tuple seq, (V,). parts(p, q) -> (accepted, replaced), each (V,): a drafted position's
    output, split by path (step_parts is Leviathan et al.'s rule; a bug that breaks (H1) or (H2)
    passes its own). A token's law given the history then depends only on the emitted prefix and
    its place in the round (drafted, or the bonus token from p), so the prefix's law mixes those
    places by their probability; with step_parts every law is p_next (the lemma of chapter 9)."""
    laws, level = {}, {((), 0, min(k, n)): 1.0}  # (emitted, place in the round, drafts this round): probability
    for _ in range(n):
        after, mixed = {}, {}
        for (seq, place, drafted), mass in level.items():
            p = p_next(seq)  # (V,)
            if place < drafted:  # a drafted position: accepted, the round goes on; replaced, it ends
                accepted, replaced = parts(p, q_next(seq))
                moves = [(accepted, place + 1), (replaced, None)]
            else:  # the bonus token, drawn from p; the round ends
                moves = [(p, None)]
            mixed[seq] = mixed.get(seq, 0.0) + mass * sum(dist for dist, _ in moves)
            for dist, nxt in moves:
                for a in np.flatnonzero(dist > 0):
                    grown = seq + (int(a),)
                    if grown in prefixes:
                        state = (grown, nxt, drafted) if nxt is not None else (grown, 0, min(k, n - len(grown)))
                        after[state] = after.get(state, 0.0) + mass * dist[a]
        laws.update({seq: m / m.sum() for seq, m in mixed.items() if m.sum() > 0})
        level = after
    return laws


def emitted_distribution(p_next, q_next, sequences, k: int, parts=step_parts) -> np.ndarray:
    """The exact probability that speculative_generate (fixed k, temperature 1) emits each of
    `sequences` (tuples of n tokens), when each drafted position is judged by `parts`: the chain
    rule over next_token_laws. Only prefixes of `sequences` are followed. Returns (len(sequences),)."""
    n = len(sequences[0])
    laws = next_token_laws(p_next, q_next, {tuple(seq[:i]) for seq in sequences for i in range(n)}, k, n, parts)
    return np.array([np.prod([laws[tuple(seq[:i])][a] if tuple(seq[:i]) in laws else 0.0
                              for i, a in enumerate(seq)]) for seq in sequences])


def accept_or_resample(p, q, x: int, rng: np.random.Generator):
    """Judge drafted token x ~ q against the target's p: (True, x) or (False, token from the residual)."""
    if rng.random() < min(1.0, p[x] / q[x]):  # with probability min(1, p/q)
        return True, x
    return False, sample(residual(p, q), rng)


def verify(ps, qs, drafted, temperature: float, rng: np.random.Generator):
    """One round of Leviathan et al.'s rule on the engine's distributions:
    accept drafted tokens while the target agrees, then one token: from the
    residual at the first rejection, or, if all were accepted, from the
    target's next row. ps: (k + 1, V) the target's; qs: k draft rows (V,).
    Returns (tokens accepted, next token)."""
    for i, x in enumerate(drafted):
        ok, token = accept_or_resample(ps[i], qs[i], x, rng)
        if not ok:
            return i, token
    last = ps[len(drafted)]  # (V,)
    greedy = temperature == 0
    return len(drafted), int(np.argmax(last)) if greedy else sample(last, rng)


@dataclass
class SpecStats:
    """What a run did, per draft position i: times drafted, judged (reached the accept/reject
    test) and accepted. The totals are their sums; a round is one target call."""
    k: int
    rounds: int = 0
    draft_calls: int = 0
    drafted_at: list = field(default_factory=list)
    judged_at: list = field(default_factory=list)
    accepted_at: list = field(default_factory=list)

    def __post_init__(self):
        self.drafted_at, self.judged_at, self.accepted_at = [0] * self.k, [0] * self.k, [0] * self.k

    def record(self, k_round: int, n_ok: int) -> None:
        """One round: k_round tokens drafted, the first n_ok accepted, the one after them (if any) rejected."""
        self.rounds += 1
        for i in range(k_round):
            self.drafted_at[i] += 1
            self.judged_at[i] += i <= n_ok
            self.accepted_at[i] += i < n_ok

    drafted = property(lambda self: sum(self.drafted_at))
    judged = property(lambda self: sum(self.judged_at))
    accepted = property(lambda self: sum(self.accepted_at))
    emitted = property(lambda self: self.accepted + self.rounds, doc="accepted tokens plus one per round")
    target_calls = property(lambda self: self.rounds, doc="one per round")

    @property
    def alpha(self) -> float:
        """Acceptance rate: accepted / judged."""
        return self.accepted / self.judged if self.judged else float("nan")


def check_pair(target_cfg: ModelConfig, draft_cfg: ModelConfig, k, dynamic: bool = False, k_max=16) -> None:
    """Same vocabulary; k (and with `dynamic`, k_max >= k) an integer from 1 to the context length."""
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        raise ValueError(f"draft and target must share a vocabulary: {target_cfg.vocab_size} vs {draft_cfg.vocab_size} tokens")
    context = min(target_cfg.block_size, draft_cfg.block_size)
    for name, value in [("k (draft tokens per round)", k)] + [("k_max", k_max)] * dynamic:
        check_count(value, name, high=context)
    if dynamic and k > k_max:
        raise ValueError(f"dynamic k starts at k={k}, which is above k_max={k_max}")


def target_cache(cache, cfg: ModelConfig, prompt, max_len: int):
    """The target's cache: a new KVCache, or the one given if it holds a prefix of the prompt (a
    PagedSequence from `pool.add(seq_id, prompt)` may hold a shared prefix) and at least the last
    prompt token is still to read."""
    if cache is None:
        return KVCache(cfg, max_len)
    check_cache(cache, cfg)
    held = list(getattr(cache, "tokens", [])[:cache.n])  # a KVCache does not know its tokens: n must be 0
    if cache.n >= len(prompt) or held != [int(t) for t in prompt[:cache.n]]:
        raise ValueError(f"cache must be empty or hold a prefix of the prompt short of its last token, got {cache.n} positions")
    return cache


class ModelDrafter:
    """Drafts with a small model: its own KV cache, sampling each token from its q."""

    def __init__(self, model, prompt, max_len, temperature):
        self.model, self.temperature = model, temperature
        self.cache = KVCache(model.cfg, max_len)
        self.pending = list(prompt[:-1])  # tokens the draft has not read yet
        self.calls = 0

    def propose(self, last, k, rng):
        """k tokens after `last`, each drawn from q; returns (tokens, their q distributions)."""
        tokens, qs = [], []
        feed = self.pending + [last]
        for i in range(k):
            logits = self.model(np.array(feed), self.cache)[-1]  # (V,)
            self.calls += 1
            q = probs_from_logits(logits, self.temperature)  # (V,)
            x = sample(q, rng) if self.temperature > 0 else int(np.argmax(q))
            tokens.append(x)
            qs.append(q)
            feed = [x]
        self.pending = feed  # the last draft token is not read yet
        return tokens, qs

    def keep(self, base, kept):
        """After verification: the sequence from position `base` on is `kept` (last emitted excluded)."""
        read = self.cache.n
        self.cache.truncate(min(read, base + len(kept)))
        self.pending = list(kept[self.cache.n - base:])


class PromptLookup:
    """Drafting without a draft model: copy what followed the latest earlier occurrence of the
    last n tokens (prompt lookup decoding, Saxena 2023; `prompt_lookup_num_tokens` in
    transformers). The proposal is a point mass, so q is one-hot and the rule stays exact. The
    longest match is tried first, from max_ngram tokens down to min_ngram (vLLM's
    `prompt_lookup_max` and `prompt_lookup_min`); shorter tails draft nothing."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if check_count(min_ngram, "min_ngram") > check_count(max_ngram, "max_ngram"):
            raise ValueError(f"min_ngram must be an integer from 1 to max_ngram={max_ngram}, got {min_ngram!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, prompt, vocab_size) -> "PromptLookup":
        """A fresh drafter for one generation (this object stays reusable)."""
        state = PromptLookup(self.max_ngram, self.min_ngram)
        state.history, state.vocab_size, state.calls = [int(t) for t in prompt[:-1]], vocab_size, 0
        return state

    def propose(self, last, k, rng):
        seq = self.history + [last]
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):  # latest earlier match first
                if seq[start:start + n] == tail:
                    tokens = seq[start + n:start + n + k]
                    return tokens, [np.eye(self.vocab_size)[t] for t in tokens]
        return [], []

    def keep(self, base, kept):
        self.history = self.history[:base] + list(kept)


def speculative_generate(target, draft, prompt, n_new: int, k: int = 4, temperature: float = 1.0,
                         seed: int = 0, dynamic: bool = False, k_max: int = 16, cache=None):
    """Generate n_new tokens after prompt with draft-then-verify decoding.

    target: a Step (`lib.model.Model(params, cfg)`, a `LeanModel`, ...); draft: a Step, or a
    `PromptLookup`. dynamic: start at k, add 2 after a round that accepts every draft token, else
    subtract 1 (within 1..k_max). cache: the target's KV cache (default a new KVCache); a
    `PagedSequence` runs it on the paged cache. Returns (tokens (n_new,), SpecStats). At
    temperature 0, p and q are one-hot argmaxes and the rule accepts exactly while the draft's
    token is the target's argmax, so the output equals greedy decoding of the target.
    """
    tcfg = check_step(target, "target").cfg
    lookup = isinstance(draft, PromptLookup)
    dcfg = tcfg if lookup else check_step(draft, "draft").cfg
    check_pair(tcfg, dcfg, k, dynamic, k_max)
    prompt = check_tokens(prompt, tcfg)
    check_request(len(prompt), n_new, min(tcfg.block_size, dcfg.block_size), temperature)
    rng = np.random.default_rng(check_count(seed, "seed", 0))
    max_len = len(prompt) + n_new
    cache = target_cache(cache, tcfg, prompt, max_len)
    drafter = draft.start(prompt, tcfg.vocab_size) if lookup else ModelDrafter(draft, prompt, max_len, temperature)
    pending = list(prompt[cache.n:-1])  # tokens the target has not read yet
    last = int(prompt[-1])  # emitted but not yet read by either model
    out, stats = [], SpecStats(k_max if dynamic else k)
    while len(out) < n_new:
        drafted, qs = drafter.propose(last, min(k, n_new - len(out)), rng)  # never past the end
        base = cache.n + len(pending)  # position of `last`
        logits = cache.feed(np.array(pending + [last] + drafted), target)  # one call scores every draft
        ps = probs_from_logits(logits[-(len(drafted) + 1):], temperature)  # (k_round + 1, V)
        n_ok, nxt = verify(ps, qs, drafted, temperature, rng)
        stats.record(len(drafted), n_ok)
        kept = [last] + drafted[:n_ok]
        cache.truncate(base + len(kept))  # drop the rejected positions
        drafter.keep(base, kept)
        out.extend(drafted[:n_ok] + [nxt])
        pending, last = [], nxt
        if dynamic:
            k = min(k + 2, k_max) if drafted and n_ok == len(drafted) else max(k - 1, 1)
    stats.draft_calls = drafter.calls
    return np.array(out[:n_new], dtype=np.int64), stats


def expected_tokens_per_call(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): expected tokens per target call (Leviathan et al., eq. 1)."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, c: float, call_cost: float = 1.0) -> float:
    """Theorem 3.8: walltime improvement (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)), c = draft / target cost.

    `call_cost` replaces the theorem's assumption that a (k+1)-token target call costs as much as a
    one-token call: pass the measured ratio of the two, V(k+1), to get the same accounting with it."""
    return expected_tokens_per_call(alpha, k) / (k * c + call_cost)
