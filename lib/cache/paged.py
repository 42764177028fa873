"""Paged KV cache: fixed-size blocks from a shared pool, found through per-sequence block tables.

PagedAttention (Kwon et al. 2023, vLLM) stores each sequence's K/V in blocks of `block_size`
positions taken from one pool, so memory is allocated as a sequence grows instead of for its
longest possible length. `PagedKVCache` is the pool, per layer (blocks, KV heads, block size,
head dim), stored in any of `lib.cache.kv_cache`'s forms; `lib.cache.blocks.BlockManager` decides which
block holds which positions (free list, reference counts, prefix hashes, copy-on-write) and
`PagedKVCache` applies the block copies it asks for. Slots are reserved for the tokens
actually fed (`reserve`), and a step that fails is undone (`rollback`). `PagedSequence` offers
the `KVCache` interface, and `feed(new_tokens, step)` runs `model.forward_cached` (or a
`LeanModel`) through the block table.
"""
import numpy as np

from lib.cache import quant
from lib.cache.blocks import BlockManager
from lib.cache.kv_cache import check_step, fixed_scales, storage
from lib.checks import check_tokens
from lib.config import ModelConfig, is_int


class PagedKVCache:
    """The block pool: per layer K and V as (num_blocks, Hkv, block_size, D), and its manager.

    dtype and granularity as for `lib.cache.kv_cache.KVCache`: quantized pools store codes (int4: D/2
    bytes) and, per layer, scales as (num_blocks, Hkv, block_size) float32 for 'position' (each
    slot's float16 scale, set when it is written) or (1, Hkv, 1) / (1, 1, 1) for 'head' / 'tensor'
    (fixed from a calibration); unquantized pools keep scales of one, (1, 1, 1)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16, prefix_caching: bool = True,
                 dtype="float32", granularity: str = "position", calibration=None):
        self.form, self.granularity = storage(cfg, dtype, granularity, calibration)
        self.cfg = cfg
        self.manager = BlockManager(num_blocks, block_size, prefix_caching)
        shape = (self.manager.num_blocks, cfg.n_kv_head, self.manager.block_size, self.form.width(cfg.head_dim))
        self.k = [np.zeros(shape, self.form.stored) for _ in range(cfg.n_layer)]
        self.v = [np.zeros(shape, self.form.stored) for _ in range(cfg.n_layer)]
        if self.granularity == "position":
            self.k_scale = [np.ones(shape[:3], np.float32) for _ in range(cfg.n_layer)]  # (blocks, Hkv, bs)
            self.v_scale = [np.ones(shape[:3], np.float32) for _ in range(cfg.n_layer)]
        elif self.granularity is not None:
            k_fixed, v_fixed = fixed_scales(self.form.name, self.granularity, calibration)
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
                s = quant.position_scales(x, self.form.name).astype(np.float32)  # (T, Hkv, 1)
                scales[layer][blocks, :, offsets] = s[..., 0]
            elif self.granularity:
                s = scales[layer].reshape(-1, 1)  # (Hkv or 1, 1): broadcasts over (T, Hkv, D)
            codes[layer][blocks, :, offsets] = self.form.encode(x, s)

    def load(self, layer, blocks, end):
        """K, V of the first `end` positions of the blocks listed, as float32 (Hkv, end, D) each."""
        Hkv = self.cfg.n_kv_head
        def gather(pool):  # (blocks, Hkv, bs, ...) -> (Hkv, end, ...)
            return pool[blocks].transpose(1, 0, 2, *range(3, pool.ndim)).reshape(Hkv, -1, *pool.shape[3:])[:, :end]
        out = []
        for codes, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            s = None  # an unscaled form reads the values themselves
            if self.granularity == "position":
                s = gather(scales[layer])[..., None]  # (Hkv, end, 1)
            elif self.granularity:
                s = scales[layer][0][:, :, None]  # (Hkv or 1, 1, 1)
            out.append(self.form.decode(gather(codes[layer]), s))  # (Hkv, end, D)
        return out[0], out[1]

    def add(self, seq_id, prompt) -> "PagedSequence":
        """Allocate a sequence for a prompt; its `n` says how many prompt positions are already cached."""
        self.manager.allocate(seq_id, check_tokens(prompt, self.cfg))
        self._apply_copies()
        return PagedSequence(self, seq_id)

    def fork(self, parent: "PagedSequence", child_id) -> "PagedSequence":
        self.manager.fork(self._own(parent, "parent").seq_id, child_id)
        return PagedSequence(self, child_id)

    def free(self, seq: "PagedSequence") -> None:
        """Drop a sequence and release its blocks."""
        self.manager.deallocate(self._own(seq, "seq").seq_id)

    def _own(self, seq, name) -> "PagedSequence":
        if not isinstance(seq, PagedSequence) or seq.pool is not self:
            raise TypeError(f"{name} must be a sequence of this pool (from add or fork), got {type(seq).__name__}")
        return seq


class PagedSequence:
    """One sequence's view of the pool with the KVCache interface (n, check_room, write, read,
    advance, truncate). Its K/V advance only through `feed`, which knows the tokens they belong to."""

    def __init__(self, pool: PagedKVCache, seq_id):
        self.pool, self.seq_id, self.cfg = pool, seq_id, pool.cfg
        self._armed = 0  # positions the running feed() reserved

    @property
    def n(self) -> int:
        """Positions whose K/V are written."""
        self.pool.manager._check_seq(self.seq_id)
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
        return their logits. Slots are reserved for these tokens; if the step fails, the sequence
        and the pool are as they were, and its blocks become findable only once written."""
        manager, start = self.pool.manager, self.n
        check_step(step)
        new_tokens = check_tokens(new_tokens, self.cfg, start)
        reservation = manager.reserve(self.seq_id, new_tokens)
        self.pool._apply_copies()
        self._armed = len(new_tokens)
        try:
            logits = step(new_tokens, self)
            if self.n != start + len(new_tokens):
                raise RuntimeError(f"the step wrote {self.n - start} positions, not the {len(new_tokens)} fed")
        except BaseException:
            self._armed = 0
            manager.rollback(self.seq_id, reservation)
            raise
        manager.commit(self.seq_id, reservation, self.n)
        return logits

    def check_room(self, count: int) -> None:
        if not is_int(count) or count != self._armed:
            raise ValueError(f"sequence {self.seq_id!r} computes tokens only through feed(tokens, step), "
                             f"which reserves their slots: {count} positions were asked outside it")

    def _slots(self, start, stop):
        pos = np.arange(start, stop)
        return np.asarray(self.block_table)[pos // self.pool.manager.block_size], pos % self.pool.manager.block_size

    def _check_layer(self, layer) -> None:
        if not is_int(layer) or not 0 <= layer < self.cfg.n_layer:
            raise ValueError(f"layer must be an integer in 0..{self.cfg.n_layer - 1}, got {layer!r}")

    def write(self, layer, k, v):
        """Scatter K, V (Hkv, T, D) of positions n..n+T-1 into their blocks (T: the tokens `feed` reserved)."""
        self._check_layer(layer)
        expected = (self.cfg.n_kv_head, self._armed, self.cfg.head_dim)
        if not self._armed or getattr(k, "shape", ()) != expected or getattr(v, "shape", ()) != expected:
            raise ValueError(f"k and v must be (n_kv_head, T, head_dim) = {expected} for the {self._armed} positions "
                             f"that feed reserved, got shapes {np.shape(k)} and {np.shape(v)}")
        blocks, offsets = self._slots(self.n, self.n + k.shape[1])
        self.pool.store(layer, blocks, offsets, k.transpose(1, 0, 2), v.transpose(1, 0, 2))  # (T, Hkv, D)

    def read(self, layer, end):
        """Gather K, V of positions 0..end-1 through the block table: (Hkv, end, D) each, float32. Only
        written positions, and inside `feed` the ones it reserved."""
        self._check_layer(layer)
        written = self.n + self._armed
        if not is_int(end) or not 1 <= end <= written:
            raise ValueError(f"end must be an integer in 1..{written}: sequence {self.seq_id!r} holds {written} "
                             f"written or reserved positions, got {end!r}")
        return self.pool.load(layer, self.block_table[:-(-end // self.pool.manager.block_size)], end)

    def advance(self, count):
        if not is_int(count) or count != self._armed or not count:
            raise ValueError(f"sequence {self.seq_id!r} advances only inside feed(tokens, step), by the {self._armed} "
                             f"positions it reserved, got count {count!r}")
        self.pool.manager.computed[self.seq_id] += count
        self._armed = 0

    def truncate(self, n: int) -> None:
        """Keep the first n positions (speculative decoding drops rejected draft tokens)."""
        self.pool.manager.truncate(self.seq_id, n)
