"""Paged KV cache: fixed-size blocks from a shared pool, found through per-sequence block tables.

PagedAttention (Kwon et al. 2023, vLLM) stores each sequence's K/V in blocks of `block_size`
positions taken from one pool, so memory is allocated as a sequence grows instead of for its
longest possible length. `PagedKVCache` is the pool, per layer (blocks, KV heads, block size,
head dim), stored in any of `lib.cache.kv_cache`'s forms; `lib.cache.blocks.BlockManager` decides which
block holds which positions (free list, reference counts, prefix hashes, copy-on-write) and
`PagedKVCache` applies the block copies it asks for. `PagedSequence` offers the `KVCache`
interface, and `feed(new_tokens, step)` runs `model.forward_cached` (or a `LeanModel`) through the
block table: it checks the tokens and that their blocks are free, reserves slots for exactly
those tokens (`reserve`), runs the step, and names the blocks it filled (`commit`).
"""
from collections.abc import Hashable
from contextlib import contextmanager

import numpy as np

from lib.cache import quant
from lib.cache.blocks import BlockManager
from lib.cache.kv_cache import check_step_function, fixed_scales, storage
from lib.checks import check_tokens
from lib.config import ModelConfig


def scatter(pool, blocks, offsets, x):
    """Write T positions' rows x (T, Hkv, ...) into a pool (num_blocks, Hkv, block_size, ...) at slots
    (blocks[t], offsets[t]): the block table has already turned each position into its slot."""
    pool[blocks, :, offsets] = x  # (T, Hkv, ...)


def gather(pool, blocks, end):
    """The first `end` positions held in `blocks`, in the table's order: (Hkv, end, ...), a copy."""
    rows = pool[blocks]  # (n_blocks, Hkv, block_size, ...)
    rows = rows.transpose(1, 0, 2, *range(3, pool.ndim))  # (Hkv, n_blocks, block_size, ...)
    return rows.reshape(pool.shape[1], -1, *pool.shape[3:])[:, :end]  # (Hkv, end, ...)


class PagedKVCache:
    """The block pool: per layer K and V as (num_blocks, Hkv, block_size, D), and its manager.

    dtype and granularity as for `lib.cache.kv_cache.KVCache`: quantized pools store codes (int4: D/2
    bytes) and, per layer, scales as (num_blocks, Hkv, block_size) float32 for 'position' (each
    slot's float16 scale, set when it is written) or (1, Hkv, 1) / (1, 1, 1) for 'head' / 'tensor'
    (fixed from K/V maxima); unquantized pools keep scales of one, (1, 1, 1)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16, prefix_caching: bool = True,
                 dtype="float32", granularity: str = "position", maxima=None):
        self.form, self.granularity = storage(cfg, dtype, granularity, maxima)
        self.cfg = cfg
        self.manager = BlockManager(num_blocks, block_size, prefix_caching)
        shape = (self.manager.num_blocks, cfg.n_kv_head, self.manager.block_size, self.form.width(cfg.head_dim))
        self.k = [np.zeros(shape, self.form.stored) for _ in range(cfg.n_layer)]
        self.v = [np.zeros(shape, self.form.stored) for _ in range(cfg.n_layer)]
        if self.granularity == "position":
            self.k_scale = [np.ones(shape[:3], np.float32) for _ in range(cfg.n_layer)]  # (blocks, Hkv, bs)
            self.v_scale = [np.ones(shape[:3], np.float32) for _ in range(cfg.n_layer)]
        elif self.granularity is not None:
            k_fixed, v_fixed = fixed_scales(self.form, self.granularity, maxima)
            self.k_scale = [s.reshape(1, -1, 1) for s in k_fixed]  # (1, Hkv or 1, 1)
            self.v_scale = [s.reshape(1, -1, 1) for s in v_fixed]
        else:
            self.k_scale = self.v_scale = [np.ones((1, 1, 1), np.float32)] * cfg.n_layer

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V codes and of their per-slot scales (fixed scales are a few bytes, not counted)."""
        scales = self.k_scale + self.v_scale if self.granularity == "position" else []
        return sum(a.nbytes for a in self.k + self.v + scales)

    def _apply_copies(self):
        per_slot = self.k + self.v + (self.k_scale + self.v_scale if self.granularity == "position" else [])
        for src, dst in self.manager.copies:
            for a in per_slot:
                a[dst] = a[src]
        self.manager.copies.clear()

    def store(self, layer, blocks, offsets, k, v):
        """Write K, V (T, Hkv, D) of T positions into slots (blocks[t], offsets[t]), quantized as the pool is."""
        for x, codes, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            s = None  # an unscaled form stores the values themselves
            if self.granularity == "position":
                s = quant.position_scales(x, self.form.qmax).astype(np.float32)  # (T, Hkv, 1)
                scatter(scales[layer], blocks, offsets, s[..., 0])
            elif self.granularity:
                s = scales[layer].reshape(-1, 1)  # (Hkv or 1, 1): broadcasts over (T, Hkv, D)
            scatter(codes[layer], blocks, offsets, self.form.encode(x, s))

    def load(self, layer, blocks, end):
        """K, V of the first `end` positions of the blocks listed, as float32 (Hkv, end, D) each."""
        out = []
        for codes, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            s = None  # an unscaled form reads the values themselves
            if self.granularity == "position":
                s = gather(scales[layer], blocks, end)[..., None]  # (Hkv, end, 1)
            elif self.granularity:
                s = scales[layer][0][:, :, None]  # (Hkv or 1, 1, 1)
            out.append(self.form.decode(gather(codes[layer], blocks, end), s))  # (Hkv, end, D)
        return out[0], out[1]

    def add(self, seq_id, prompt) -> "PagedSequence":
        """Allocate a sequence for a prompt; its `n` says how many prompt positions are already cached."""
        if not isinstance(seq_id, Hashable):
            raise TypeError(f"seq_id must be hashable (a str or an int names a sequence), got {type(seq_id).__name__}")
        if seq_id in self.manager.tables:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        self.manager.allocate(seq_id, check_tokens(prompt, self.cfg))
        self._apply_copies()
        return PagedSequence(self, seq_id)

    def fork(self, parent: "PagedSequence", child_id) -> "PagedSequence":
        """A child of a live sequence of this pool, under a new id, sharing its written blocks
        (parallel sampling, beam search). Like `free`, a verb of the code that manages the pool,
        behind the boundary: it trusts its arguments, as the block manager's verbs do."""
        self.manager.fork(parent.seq_id, child_id)
        return PagedSequence(self, child_id)

    def free(self, seq: "PagedSequence") -> None:
        """Drop a live sequence of this pool and release its blocks (the scheduler's verb)."""
        self.manager.deallocate(seq.seq_id)


def check_feed(seqs, new_tokens) -> list:
    """The checked tokens of a feed: one token list per distinct live sequence, and free blocks for
    all of them, so that nothing is reserved for a feed that would be refused."""
    for name, value in (("seqs", seqs), ("new_tokens", new_tokens)):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list, one entry per sequence, got {type(value).__name__}")
    if len(new_tokens) != len(seqs) or not seqs:
        raise ValueError(f"a batch needs one token list per sequence: got {len(new_tokens)} and {len(seqs)}")
    for seq in seqs:
        if not isinstance(seq, PagedSequence):
            raise TypeError(f"each of seqs must be a paged sequence from add or fork, got {type(seq).__name__}")
        if seq.seq_id not in seq.pool.manager.tables:
            raise ValueError(f"unknown sequence {seq.seq_id!r}: never allocated, or already freed")
    if len({(id(s.pool), s.seq_id) for s in seqs}) != len(seqs):
        raise ValueError("the same sequence appears twice in one batch")
    tokens = [check_tokens(t, s.cfg, s.n) for s, t in zip(seqs, new_tokens)]
    for pool in {id(s.pool): s.pool for s in seqs}.values():
        mine = [(s, t) for s, t in zip(seqs, tokens) if s.pool is pool]
        need = sum(pool.manager.append_need(s.seq_id, len(t)) for s, t in mine)
        if need > pool.manager.num_free:
            raise ValueError(f"KV pool is out of blocks: {sum(len(t) for _, t in mine)} more tokens need {need} blocks, {pool.manager.num_free} are free")
    return tokens


@contextmanager
def reserved(seqs, new_tokens):
    """Slots for each sequence's (checked) new tokens while a step writes them; after a step that
    succeeded, each sequence's filled blocks become findable by their hash (`commit`)."""
    for seq, tokens in zip(seqs, new_tokens):
        seq.pool.manager.reserve(seq.seq_id, tokens)
        seq.pool._apply_copies()
        seq._armed = len(tokens)
    try:
        yield
    finally:
        for seq in seqs:
            seq._armed = 0
    for seq in seqs:
        seq.pool.manager.commit(seq.seq_id, seq.n)


class PagedSequence:
    """One sequence's view of the pool with the KVCache interface (n, check_room, write, read,
    advance, truncate). Its K/V advance only through `feed`, which knows the tokens they belong to."""

    def __init__(self, pool: PagedKVCache, seq_id):
        self.pool, self.seq_id, self.cfg = pool, seq_id, pool.cfg
        self._armed = 0  # positions the running feed() reserved

    @property
    def n(self) -> int:
        """Positions whose K/V are written."""
        return self.pool.manager.computed[self.seq_id]

    @property
    def tokens(self):
        """Token ids with a slot: the written ones, then the rest of the prompt still to feed."""
        return self.pool.manager.tokens[self.seq_id]

    @property
    def block_table(self):
        return self.pool.manager.tables[self.seq_id]

    def feed(self, new_tokens, step):
        """Compute new tokens at positions n.. with step(tokens, cache), e.g. forward_cached, and
        return their logits. A feed that is refused changes nothing; its blocks become findable
        only once written."""
        check_step_function(step)
        (tokens,) = check_feed([self], [new_tokens])
        with reserved([self], [tokens]):
            return step(tokens, self)

    def check_room(self, count: int) -> None:
        """The room a step may write: exactly the positions `feed` reserved."""
        if count != self._armed:
            raise ValueError(f"sequence {self.seq_id!r} computes tokens only through feed(tokens, step): {count} asked outside it")

    def _slots(self, start, stop):
        pos = np.arange(start, stop)
        return np.asarray(self.block_table)[pos // self.pool.manager.block_size], pos % self.pool.manager.block_size

    def write(self, layer, k, v):
        """Scatter K, V (Hkv, T, D) of positions n..n+T-1 into their blocks (T: the tokens `feed` reserved)."""
        blocks, offsets = self._slots(self.n, self.n + k.shape[1])
        self.pool.store(layer, blocks, offsets, k.transpose(1, 0, 2), v.transpose(1, 0, 2))  # (T, Hkv, D)

    def read(self, layer, end):
        """Gather K, V of positions 0..end-1 through the block table: (Hkv, end, D) each, float32."""
        return self.pool.load(layer, self.block_table[:-(-end // self.pool.manager.block_size)], end)

    def advance(self, count):
        self.pool.manager.computed[self.seq_id] += count
        self._armed = 0

    def truncate(self, n: int) -> None:
        """Keep the first n positions (speculative decoding drops rejected draft tokens)."""
        self.pool.manager.truncate(self.seq_id, n)
