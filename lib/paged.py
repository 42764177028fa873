"""Paged KV cache: fixed-size blocks from a shared pool, found through per-sequence block tables.

PagedAttention (Kwon et al. 2023, vLLM) stores each sequence's K/V in blocks of `block_size`
positions taken from one pool, so memory is allocated as a sequence grows instead of for its
longest possible length. Full blocks are named by a chained hash of (parent hash, block tokens),
checked token by token on a hit, so requests that share a prefix share its blocks (reference
counts > 1; nano-vllm's BlockManager). A block that must change while shared is copied first
(copy-on-write).

The rule that keeps prefix sharing exact: a block becomes findable by its hash only after the
K/V of exactly its tokens have been written by a step that succeeded (`commit`), and a call that
fails is undone (`rollback`). Slots are reserved for the tokens actually fed (`reserve`), which
replace whatever the prompt had planned there. `PagedSequence` offers the `KVCache` interface,
and `feed(new_tokens, step)` runs `model.forward_cached` (or a `LeanModel`) through the block table.
"""
import hashlib
from collections import deque
from collections.abc import Hashable
from typing import NamedTuple

import numpy as np

from . import quant
from .config import ModelConfig, is_int
from .kv_cache import check_step, fixed_scales, storage
from .model import check_tokens


def chain_hash(parent: str, tokens) -> str:
    """Hash of a full block given its parent block's hash: equal only for equal prefixes."""
    return hashlib.sha256(parent.encode() + np.asarray(tokens, np.int64).tobytes()).hexdigest()


def _positive_int(name, value) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_id(name, seq_id) -> None:
    if not isinstance(seq_id, Hashable):
        raise TypeError(f"{name} must be hashable (a str or an int names a sequence), got {type(seq_id).__name__}")


def _token_list(tokens) -> list:
    """Token ids as a list of Python ints: a non-empty 1-D sequence of non-negative integers."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu" or (arr < 0).any():
        raise ValueError(f"tokens must be a non-empty 1-D sequence of non-negative integer ids, got {tokens!r:.80}")
    return arr.tolist()


class Reservation(NamedTuple):
    """What `reserve` changed, so that `rollback` can undo it and `commit` can finish it."""
    start: int  # position of the first new token
    old_plan: list  # the planned tokens from `start` on that the new tokens replaced
    old_table: list  # the block table before
    taken: list  # (block, its old hash, its old tokens) taken from the free list, in order
    copied: list  # shared blocks replaced by a private copy
    spare: list  # planned blocks no longer needed: released by commit


class BlockManager:
    """Free list, reference counts, block tables and the prefix-hash index. Counts only, no tensors."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_size = _positive_int("block_size", block_size)
        self.prefix_caching = bool(prefix_caching)  # vLLM's enable_prefix_caching
        self.ref = [0] * self.num_blocks
        self.free = deque(range(self.num_blocks))
        self.block_hash = [None] * self.num_blocks  # hash of a registered (full, written) block
        self.block_tokens = [None] * self.num_blocks  # its tokens, for the exact check on a hit
        self.hash_to_block = {}
        self.tables, self.tokens = {}, {}  # seq_id -> block ids, seq_id -> token ids with a slot
        self.computed = {}  # seq_id -> positions whose K/V are written
        self.hashes = {}  # seq_id -> chained hash of each of its registered full blocks
        self.copies = []  # (src, dst) block copies the pool must apply (copy-on-write)

    # -- helpers
    def _check_seq(self, seq_id):
        _check_id("seq_id", seq_id)
        if seq_id not in self.tables:
            raise ValueError(f"unknown sequence {seq_id!r}: never allocated, or already freed")

    def _take_free(self, log=None) -> int:
        block = self.free.popleft()
        if log is not None:
            log.append((block, self.block_hash[block], self.block_tokens[block]))
        self._unregister(block)  # reused: never found again by its old contents
        self.ref[block] = 1
        return block

    def _untake(self, taken):
        """Return blocks taken by `_take_free` to the front of the free list, as they were."""
        for block, old_hash, old_tokens in reversed(taken):
            self.ref[block] = 0
            self.free.appendleft(block)
            if old_hash is not None and old_hash not in self.hash_to_block:
                self.block_hash[block], self.block_tokens[block] = old_hash, old_tokens
                self.hash_to_block[old_hash] = block

    def _unregister(self, block):
        old = self.block_hash[block]
        if old is not None and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]
        self.block_hash[block] = self.block_tokens[block] = None

    def _release(self, block):
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free.append(block)  # keeps its hash: a later prompt may revive it until reused

    def _register_computed(self, seq_id):
        """Name every full block whose K/V are all written by its chained hash."""
        bs, hashes, tokens = self.block_size, self.hashes[seq_id], self.tokens[seq_id]
        for index in range(len(hashes), self.computed[seq_id] // bs):
            chunk = tokens[index * bs:(index + 1) * bs]
            h = chain_hash(hashes[index - 1] if index else "", chunk)
            hashes.append(h)
            block = self.tables[seq_id][index]
            if self.prefix_caching and self.block_hash[block] is None:
                self.block_hash[block], self.block_tokens[block] = h, list(chunk)
                self.hash_to_block.setdefault(h, block)

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free)

    # -- the allocator's verbs
    def can_allocate(self, n_tokens: int) -> bool:
        return self._blocks_for(_positive_int("n_tokens", n_tokens)) <= self.num_free

    def allocate(self, seq_id, tokens) -> int:
        """Give a new sequence blocks for its prompt, reusing registered full blocks of the same prefix.

        Returns how many leading tokens already have K/V. At least the last token is always left
        to compute (its logits are needed); if it sits in a shared block, that block is copied first.
        """
        tokens = _token_list(tokens)
        _check_id("seq_id", seq_id)
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        bs, hits, parent = self.block_size, [], ""
        for i in range(0, len(tokens) - len(tokens) % bs, bs):  # full blocks, while they hit
            h = chain_hash(parent, tokens[i:i + bs])
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tokens[i:i + bs]:
                break
            hits.append(block)
            parent = h
        need = self._blocks_for(len(tokens)) - len(hits) + (len(hits) * bs == len(tokens))
        revived = sum(self.ref[b] == 0 for b in hits)
        if need > self.num_free - revived:
            raise ValueError(f"KV pool is out of blocks: the prompt needs {need} new blocks of "
                             f"{bs} positions, {self.num_free - revived} are free")
        for block in hits:
            if self.ref[block] == 0:
                self.free.remove(block)  # a freed block whose contents are still valid
            self.ref[block] += 1
        cached = len(hits) * bs
        self.tables[seq_id], self.tokens[seq_id] = list(hits), tokens
        self.hashes[seq_id] = [self.block_hash[b] for b in hits]
        if cached == len(tokens):  # fully cached: recompute the last token in a private copy
            self._copy_on_write(seq_id, len(hits) - 1)
            cached -= 1
        self.computed[seq_id] = cached
        while len(self.tables[seq_id]) < self._blocks_for(len(tokens)):
            self.tables[seq_id].append(self._take_free())
        return cached

    def _copy_on_write(self, seq_id, index, log=None):
        """Give the sequence a private copy of its block `index` if another sequence shares it."""
        table = self.tables[seq_id]
        src = table[index]
        if self.ref[src] > 1:
            table[index] = self._take_free(log)
            self.ref[src] -= 1
            self.copies.append((src, table[index]))
            return src
        return None

    def append_need(self, seq_id, n: int = 1) -> int:
        """Free blocks that n more tokens after the written ones take: new blocks past the table's
        end, and a private copy of a shared block they would write into."""
        self._check_seq(seq_id)
        n = _positive_int("n", n)
        start, table = self.computed[seq_id], self.tables[seq_id]
        shared = start % self.block_size and self.ref[table[start // self.block_size]] > 1
        return max(0, self._blocks_for(start + n) - len(table)) + bool(shared)

    def can_append(self, seq_id, n: int = 1) -> bool:
        return self.append_need(seq_id, n) <= self.num_free

    def reserve(self, seq_id, new_tokens) -> Reservation:
        """Slots for new tokens at positions computed..: where they differ from the planned tokens,
        the plan from there on is replaced. Written blocks become private and unnamed first.
        Nothing changes if the pool is out of blocks."""
        self._check_seq(seq_id)
        new = _token_list(new_tokens)
        table, tokens, bs = self.tables[seq_id], self.tokens[seq_id], self.block_size
        start, end = self.computed[seq_id], self.computed[seq_id] + len(new)
        plan = tokens if tokens[start:end] == new else tokens[:start] + new  # keep a plan the new tokens follow
        written = range(start // bs, min(self._blocks_for(end), len(table)))  # existing blocks written to
        shared = [i for i in written if self.ref[table[i]] > 1]
        need = max(0, self._blocks_for(len(plan)) - len(table)) + len(shared)
        if need > self.num_free:
            raise ValueError(f"KV pool is out of blocks: {len(new)} more tokens need {need} "
                             f"blocks, {self.num_free} are free")
        old_table, taken, copied = list(table), [], []
        for i in written:
            if i in shared:
                copied.append(self._copy_on_write(seq_id, i, taken))
            else:
                self._unregister(table[i])  # its K/V are about to change
        spare = table[self._blocks_for(len(plan)):]
        del table[self._blocks_for(len(plan)):]
        while len(table) < self._blocks_for(len(plan)):
            table.append(self._take_free(taken))
        old_plan = tokens[start:]
        tokens[start:] = plan[start:]
        return Reservation(start, old_plan, old_table, taken, copied, spare)

    def commit(self, seq_id, reservation: Reservation, computed: int) -> None:
        """The step succeeded: K/V of positions ..computed are written. Register full blocks."""
        for block in reservation.spare:
            self._release(block)
        self.computed[seq_id] = computed
        self._register_computed(seq_id)

    def rollback(self, seq_id, reservation: Reservation) -> None:
        """The step failed: the sequence's tokens, table and computed count are as before `reserve`."""
        for src in reservation.copied:  # shared again
            self.ref[src] += 1
        taken = {block for block, _, _ in reservation.taken}
        self.copies = [c for c in self.copies if c[1] not in taken]
        self._untake(reservation.taken)
        self.tables[seq_id][:] = reservation.old_table
        self.tokens[seq_id][reservation.start:] = reservation.old_plan
        self.computed[seq_id] = reservation.start

    def truncate(self, seq_id, n: int) -> None:
        """Keep the first n written positions (dropping the plan after them); blocks past them are
        released, shared ones stay shared (copied only when written)."""
        self._check_seq(seq_id)
        if not is_int(n) or not 0 <= n <= self.computed[seq_id]:
            raise ValueError(f"cannot truncate sequence {seq_id!r} to {n!r}: it holds {self.computed[seq_id]} positions")
        n, table = int(n), self.tables[seq_id]
        for block in reversed(table[self._blocks_for(n):]):
            self._release(block)
        del table[self._blocks_for(n):]
        del self.tokens[seq_id][n:], self.hashes[seq_id][n // self.block_size:]
        self.computed[seq_id] = n

    def fork(self, parent, child) -> None:
        """A child sequence sharing every written block of its parent (parallel sampling, beam search)."""
        self._check_seq(parent)
        _check_id("child", child)
        if child in self.tables:
            raise ValueError(f"sequence {child!r} is already allocated")
        n = self.computed[parent]
        self.tables[child] = self.tables[parent][:self._blocks_for(n)]
        self.tokens[child], self.computed[child] = self.tokens[parent][:n], n
        self.hashes[child] = list(self.hashes[parent])
        for block in self.tables[child]:
            self.ref[block] += 1

    def deallocate(self, seq_id) -> None:
        """Drop a sequence; blocks nobody uses return to the free list (keeping their hash until reused)."""
        self._check_seq(seq_id)
        for block in reversed(self.tables.pop(seq_id)):
            self._release(block)
        del self.tokens[seq_id], self.hashes[seq_id], self.computed[seq_id]


class PagedKVCache:
    """The block pool: per layer K and V as (num_blocks, Hkv, block_size, D), and its manager.

    dtype and granularity as for `lib.kv_cache.KVCache`: quantized pools store codes (int4: D/2
    bytes) and, per layer, scales as (num_blocks, Hkv, block_size) float32 for 'position' (each
    slot's float16 scale, set when it is written) or (1, Hkv, 1) / (1, 1, 1) for 'head' / 'tensor'
    (fixed from a calibration); unquantized pools keep scales of one, (1, 1, 1)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16, prefix_caching: bool = True,
                 dtype="float32", granularity: str = "position", calibration=None):
        self.kind, self.granularity, stored, width = storage(cfg, dtype, granularity, calibration)
        self.cfg = cfg
        self.manager = BlockManager(num_blocks, block_size, prefix_caching)
        shape = (self.manager.num_blocks, cfg.n_kv_head, self.manager.block_size, width)
        self.k = [np.zeros(shape, stored) for _ in range(cfg.n_layer)]
        self.v = [np.zeros(shape, stored) for _ in range(cfg.n_layer)]
        if self.granularity == "position":
            self.k_scale = [np.ones(shape[:3], np.float32) for _ in range(cfg.n_layer)]  # (blocks, Hkv, bs)
            self.v_scale = [np.ones(shape[:3], np.float32) for _ in range(cfg.n_layer)]
        elif self.granularity is not None:
            k_fixed, v_fixed = fixed_scales(self.kind, self.granularity, calibration)
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
            if self.granularity is None:
                codes[layer][blocks, :, offsets] = x  # float16: cast on assignment
                continue
            if self.granularity == "position":
                s = quant.position_scales(x, self.kind).astype(np.float32)  # (T, Hkv, 1)
                scales[layer][blocks, :, offsets] = s[..., 0]
            else:
                s = scales[layer].reshape(-1, 1)  # (Hkv or 1, 1): broadcasts over (T, Hkv, D)
            codes[layer][blocks, :, offsets] = quant.quantize(x, s, self.kind)

    def load(self, layer, blocks, end):
        """K, V of the first `end` positions of the blocks listed, as float32 (Hkv, end, D) each."""
        Hkv, D = self.cfg.n_kv_head, self.cfg.head_dim
        def gather(pool):  # (blocks, Hkv, bs, ...) -> (Hkv, end, ...)
            return pool[blocks].transpose(1, 0, 2, *range(3, pool.ndim)).reshape(Hkv, -1, *pool.shape[3:])[:, :end]
        out = []
        for codes, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            c = gather(codes[layer])  # (Hkv, end, D or D/2)
            if self.granularity is None:
                out.append(c if self.kind == "float32" else c.astype(np.float32))
                continue
            s = gather(scales[layer])[..., None] if self.granularity == "position" else scales[layer][0][:, :, None]
            out.append(quant.dequantize(c, s, self.kind))  # (Hkv, end, D)
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
