"""Replaying a trace through the real scheduler without running the model at every step.

Each request samples with its own random generator, seeded by its id, and a batched step gives
every sequence the logits it gets alone (tests/test_batch.py), so a request's tokens do not
depend on the schedule: which step it ran in, beside whom, or whether it was preempted. They are
therefore computed once (`completions`, the trained model decoding in batches), and a `Replay`
stands in for the model in `lib.serve.serve`: it keeps the block tables (no K/V) and returns for
each row logits that put all the mass on the recorded next token. The scheduler, the clock and
the report are the real ones, so a trace of 1,000 requests at many rates, seeds and rungs costs
a model run per request once (tests/test_replay.py checks that the replay and the server with the
model in the loop give the same schedule).
"""
import numpy as np

from lib.cache.blocks import BlockManager
from lib.cache.paged import PagedKVCache
from lib.fast.batch import BatchedModel
from lib.sampling import next_token

NO = -1e9  # the logit of every token but the recorded one: probability 0 at any temperature


def completions(model, trace, temperature: float = 0.0, batch: int = 256) -> dict:
    """{rid: the request's n_new tokens}, decoded by `model` (a Step) in batches of up to `batch`
    requests, each sampling with default_rng(rid) as `serve` does."""
    engine = BatchedModel(model)
    out = {}
    ordered = sorted(trace, key=lambda r: r.n_new)  # a batch's members end at about the same step
    for i in range(0, len(ordered), batch):
        group = ordered[i:i + batch]
        blocks = sum(-(-(len(r.prompt) + r.n_new) // 16) for r in group)
        pool = PagedKVCache(engine.cfg, blocks, 16, prefix_caching=False)
        seqs = [pool.add(r.rid, r.prompt) for r in group]
        rngs = [np.random.default_rng(r.rid) for r in group]
        last = [rows[-1] for rows in engine.feed(seqs, [list(r.prompt) for r in group])]  # (V,) each
        tokens = [[] for _ in group]
        live = list(range(len(group)))
        while live:
            for j, row in zip(live, last):
                tokens[j].append(next_token(row, temperature, rngs[j]))
            live = [j for j in live if len(tokens[j]) < group[j].n_new]
            if live:
                last = [rows[-1] for rows in engine.feed([seqs[j] for j in live], [[tokens[j][-1]] for j in live])]
        out.update({r.rid: t for r, t in zip(group, tokens)})
    return out


def write(seq, new) -> None:
    """The block manager's side of feeding `new` tokens to a ledger sequence: their slots, then their
    blocks marked written (no K/V to compute or copy)."""
    manager, end = seq.pool.manager, seq.n + len(new)
    manager.reserve(seq.seq_id, new)
    manager.copies.clear()
    manager.commit(seq.seq_id, end)


class LedgerPool:
    """What the scheduler needs of a `PagedKVCache`: its block manager, without K/V arrays."""

    def __init__(self, cfg, num_blocks: int, block_size: int = 16, prefix_caching: bool = True):
        self.cfg, self.manager = cfg, BlockManager(num_blocks, block_size, prefix_caching)

    def add(self, seq_id, prompt) -> "LedgerSequence":
        self.manager.allocate(seq_id, prompt)
        self.manager.copies.clear()  # no K/V to copy
        return LedgerSequence(self, seq_id)

    def free(self, seq) -> None:
        self.manager.deallocate(seq.seq_id)


class LedgerSequence:
    """A sequence's view of a `LedgerPool`: positions written, token ids, truncation."""

    def __init__(self, pool: LedgerPool, seq_id):
        self.pool, self.seq_id = pool, seq_id

    @property
    def n(self) -> int:
        return self.pool.manager.computed[self.seq_id]

    @property
    def tokens(self):
        return self.pool.manager.tokens[self.seq_id]

    def truncate(self, n: int) -> None:
        self.pool.manager.truncate(self.seq_id, n)


class Replay:
    """A model for `lib.serve.serve` that replays recorded completions: `feed` takes the blocks the
    new tokens need and returns (T, V) logits per sequence whose row i puts all the mass on the
    recorded token at position n + i + 1. A fed token that differs from the record is an error."""

    def __init__(self, cfg, trace, tokens: dict):
        self.cfg = cfg
        self.known = {r.rid: np.concatenate([r.prompt, np.asarray(tokens[r.rid][:r.n_new], np.int64)])
                      for r in trace}  # (prompt + n_new,) per request
        V = cfg.vocab_size
        self.after = {rid: np.append(k[1:], V) for rid, k in self.known.items()}  # (len,) next token; V past the end
        self.rows = np.full((V + 1, V), NO)  # (V + 1, V): row x puts all the mass on x; row V on nothing
        self.rows[np.arange(V), np.arange(V)] = 0.0

    def new_pool(self, num_blocks: int, block_size: int, prefix_caching: bool) -> LedgerPool:
        return LedgerPool(self.cfg, num_blocks, block_size, prefix_caching)

    def feed(self, seqs, new_tokens) -> list:
        out = []
        for seq, new in zip(seqs, new_tokens):
            start, known = seq.n, self.known[seq.seq_id]
            end = start + len(new)
            if known[start:end].tolist() != [int(x) for x in new]:
                raise ValueError(f"sequence {seq.seq_id}: fed tokens differ from the record at position {start}")
            write(seq, new)
            out.append(self.rows[self.after[seq.seq_id][start:end]])  # (T, V): row i predicts position start + i + 1
        return out
