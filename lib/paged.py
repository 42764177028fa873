"""Paged KV cache: fixed-size blocks from a shared pool, found through per-sequence block tables.

PagedAttention (Kwon et al. 2023, vLLM) stores each sequence's K/V in blocks of `block_size`
positions taken from one pool, so memory is allocated as a sequence grows instead of for its
longest possible length. Full blocks are named by a chained hash of (parent hash, block tokens),
checked token by token on a hit, so requests that share a prefix share its blocks (reference
counts > 1; nano-vllm's BlockManager). A block that must change while shared is copied first
(copy-on-write). `PagedSequence` offers the `KVCache` interface, so `model.forward_cached`
runs through the block table unchanged.
"""
import hashlib
from collections import deque

import numpy as np

from .config import ModelConfig
from .model import check_tokens


def chain_hash(parent: str, tokens) -> str:
    """Hash of a full block given its parent block's hash: equal only for equal prefixes."""
    return hashlib.sha256(parent.encode() + np.asarray(tokens, np.int64).tobytes()).hexdigest()


class BlockManager:
    """Free list, reference counts, block tables and the prefix-hash index. Counts only, no tensors."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching  # vLLM's enable_prefix_caching
        self.ref = [0] * num_blocks
        self.free = deque(range(num_blocks))
        self.block_hash = [None] * num_blocks  # hash of a registered full block
        self.block_tokens = [None] * num_blocks  # its tokens, for the exact check on a hit
        self.hash_to_block = {}
        self.tables, self.tokens = {}, {}  # seq_id -> block ids, seq_id -> token ids with a slot
        self.hashes = {}  # seq_id -> chained hash of each of its full blocks
        self.copies = []  # (src, dst) block copies the pool must apply (copy-on-write)

    # -- helpers
    def _take_free(self) -> int:
        block = self.free.popleft()
        old = self.block_hash[block]
        if old is not None and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]  # reused: never found again by its old contents
        self.block_hash[block] = self.block_tokens[block] = None
        self.ref[block] = 1
        return block

    def _register(self, seq_id, index):
        """Name the full block `index` of a sequence by its chained hash."""
        bs, hashes = self.block_size, self.hashes[seq_id]
        chunk = self.tokens[seq_id][index * bs:(index + 1) * bs]
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
        return self._blocks_for(n_tokens) <= self.num_free

    def allocate(self, seq_id, tokens) -> int:
        """Give a new sequence blocks for its prompt, reusing cached full blocks of the same prefix.

        Returns how many leading tokens already have K/V. At least the last token is always left
        to compute (its logits are needed); if it sits in a shared block, that block is copied first.
        """
        tokens = [int(t) for t in tokens]
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        if not tokens:
            raise ValueError("a sequence needs at least one token")
        bs, table, hits, parent = self.block_size, [], [], ""
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
            table.append(block)
        cached = len(hits) * bs
        self.tables[seq_id], self.tokens[seq_id] = table, tokens
        self.hashes[seq_id] = [self.block_hash[b] for b in hits]
        if cached == len(tokens):  # fully cached: recompute the last token in a private copy
            self._copy_on_write(seq_id)
            cached -= 1
        while len(table) < self._blocks_for(len(tokens)):
            table.append(self._take_free())
            if len(table) * bs <= len(tokens):
                self._register(seq_id, len(table) - 1)
        return cached

    def _copy_on_write(self, seq_id):
        table = self.tables[seq_id]
        src = table[-1]
        if self.ref[src] > 1:
            dst = self._take_free()
            self.ref[src] -= 1
            table[-1] = dst
            self.copies.append((src, dst))

    def can_append(self, seq_id, n: int = 1) -> bool:
        length = len(self.tokens[seq_id])
        return self._blocks_for(length + n) - len(self.tables[seq_id]) + 1 <= self.num_free

    def may_append(self, seq_id, new_tokens) -> None:
        """Slots for tokens appended to a sequence: new blocks as needed, a private copy of a shared
        partial last block, and hashes for blocks that become full."""
        new_tokens = [int(t) for t in new_tokens]
        table, tokens, bs = self.tables[seq_id], self.tokens[seq_id], self.block_size
        partial_shared = len(tokens) % bs and self.ref[table[-1]] > 1
        need = self._blocks_for(len(tokens) + len(new_tokens)) - len(table) + bool(partial_shared)
        if need > self.num_free:
            raise ValueError(f"KV pool is out of blocks: {len(new_tokens)} more tokens need {need} "
                             f"blocks, {self.num_free} are free")
        if partial_shared:
            self._copy_on_write(seq_id)
        for t in new_tokens:
            if len(tokens) % bs == 0:
                table.append(self._take_free())
            tokens.append(t)
            if len(tokens) % bs == 0:
                self._register(seq_id, len(table) - 1)

    def fork(self, parent, child) -> None:
        """A child sequence sharing every block of its parent (parallel sampling, beam search)."""
        if child in self.tables:
            raise ValueError(f"sequence {child!r} is already allocated")
        self.tables[child], self.tokens[child] = list(self.tables[parent]), list(self.tokens[parent])
        self.hashes[child] = list(self.hashes[parent])
        for block in self.tables[child]:
            self.ref[block] += 1

    def deallocate(self, seq_id) -> None:
        """Drop a sequence; blocks nobody uses return to the free list (keeping their hash until reused)."""
        for block in reversed(self.tables.pop(seq_id)):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free.append(block)
        del self.tokens[seq_id], self.hashes[seq_id]


class PagedKVCache:
    """The block pool: per layer K and V as (num_blocks, Hkv, block_size, D), and its manager."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16, prefix_caching: bool = True):
        self.cfg = cfg
        self.manager = BlockManager(num_blocks, block_size, prefix_caching)
        shape = (num_blocks, cfg.n_kv_head, block_size, cfg.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(cfg.n_layer)]
        self.v = [np.zeros(shape, np.float32) for _ in range(cfg.n_layer)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)

    def _apply_copies(self):
        for src, dst in self.manager.copies:
            for a in self.k + self.v:
                a[dst] = a[src]
        self.manager.copies.clear()

    def add(self, seq_id, prompt) -> "PagedSequence":
        """Allocate a sequence for a prompt; its `n` says how many prompt positions are already cached."""
        cached = self.manager.allocate(seq_id, prompt)
        self._apply_copies()
        return PagedSequence(self, seq_id, cached)

    def fork(self, parent: "PagedSequence", child_id) -> "PagedSequence":
        self.manager.fork(parent.seq_id, child_id)
        return PagedSequence(self, child_id, parent.n)


class PagedSequence:
    """One sequence's view of the pool with the KVCache interface (n, check_room, write, read, advance)."""

    def __init__(self, pool: PagedKVCache, seq_id, n: int):
        self.pool, self.seq_id, self.n, self.cfg = pool, seq_id, n, pool.cfg

    @property
    def tokens(self):
        return self.pool.manager.tokens[self.seq_id]

    @property
    def block_table(self):
        return self.pool.manager.tables[self.seq_id]

    def feed(self, new_tokens, step):
        """Compute new tokens with step(tokens, cache), e.g. forward_cached; slots are appended as needed.
        The tokens are checked first, so a bad call leaves the sequence as it was."""
        new_tokens = check_tokens(new_tokens, self.cfg, self.n)
        missing = self.n + len(new_tokens) - len(self.tokens)
        if missing > 0:
            self.pool.manager.may_append(self.seq_id, new_tokens[-missing:])
            self.pool._apply_copies()
        return step(new_tokens, self)

    def check_room(self, count: int) -> None:
        if self.n + count > len(self.tokens):
            raise ValueError(f"sequence {self.seq_id!r} has slots for {len(self.tokens)} positions, "
                             f"{self.n} are used and {count} more were asked: use feed()")

    def _slots(self, start, stop):
        pos = np.arange(start, stop)
        return np.asarray(self.block_table)[pos // self.pool.manager.block_size], pos % self.pool.manager.block_size

    def write(self, layer, k, v):
        """Scatter K, V (Hkv, T, D) of positions n..n+T-1 into their blocks."""
        blocks, offsets = self._slots(self.n, self.n + k.shape[1])
        self.pool.k[layer][blocks, :, offsets] = k.transpose(1, 0, 2)  # (T, Hkv, D)
        self.pool.v[layer][blocks, :, offsets] = v.transpose(1, 0, 2)

    def read(self, layer, end):
        """Gather K, V of positions 0..end-1 through the block table: (Hkv, end, D) each."""
        bs = self.pool.manager.block_size
        blocks = self.block_table[:-(-end // bs)]
        gather = lambda pool: pool[layer][blocks].transpose(1, 0, 2, 3).reshape(self.cfg.n_kv_head, -1, self.cfg.head_dim)[:, :end]
        return gather(self.pool.k), gather(self.pool.v)

    def advance(self, count):
        self.n += count
