"""The block manager of a paged KV cache: free list, reference counts, block tables, prefix hashes.

PagedAttention (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention", the paper behind vLLM) keeps each sequence's K/V in fixed-size blocks taken
from one pool and finds them through a per-sequence block table, as an operating system finds
pages through a page table. This module is that bookkeeping alone, counts and ids without
tensors, split from the pool as nano-vllm splits its `block_manager` (and in its verbs:
`can_allocate`, `allocate`, `deallocate`); `lib.cache.paged` holds the tensors.

Full blocks are named by a chained hash of (parent hash, block tokens), checked token by token on
a hit, so requests that share a prefix share its blocks (reference counts > 1, vLLM's automatic
prefix caching). A block that must change while shared is copied first (copy-on-write), which
is also how `fork` serves parallel sampling and beam search. The rule that keeps prefix sharing
exact: a block becomes findable by its hash only after the K/V of exactly its tokens have been
written by a step that succeeded (`commit`), and a call that fails is undone (`rollback`).
"""
import hashlib
from collections import deque
from collections.abc import Hashable
from typing import NamedTuple

import numpy as np

from lib.config import is_int


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
        bs, hits = self.block_size, self._prefix_hits(tokens)
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

    def _prefix_hits(self, tokens: list) -> list:
        """The registered blocks that hold the prompt's leading full blocks, found by chained hash
        and checked token by token; the search stops at the first miss."""
        bs, hits, parent = self.block_size, [], ""
        for i in range(0, len(tokens) - len(tokens) % bs, bs):  # full blocks, while they hit
            h = chain_hash(parent, tokens[i:i + bs])
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tokens[i:i + bs]:
                break
            hits.append(block)
            parent = h
        return hits

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
