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
written by a step that succeeded (`commit`); a block about to be written loses its name first
(`reserve`).
"""
import hashlib
from collections import deque

import numpy as np

from lib.checks import check_count


def chain_hash(parent: str, tokens) -> str:
    """Hash of a full block given its parent block's hash: equal only for equal prefixes."""
    return hashlib.sha256(parent.encode() + np.asarray(tokens, np.int64).tobytes()).hexdigest()


class BlockManager:
    """Free list, reference counts, block tables and the prefix-hash index. Counts only, no tensors."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks = check_count(num_blocks, "num_blocks")
        self.block_size = check_count(block_size, "block_size")
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
    def _take_free(self) -> int:
        block = self.free.popleft()
        self._unregister(block)  # reused: never found again by its old contents
        self.ref[block] = 1
        return block

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
    def allocate(self, seq_id, tokens) -> int:
        """Give a new sequence blocks for its prompt, reusing registered full blocks of the same prefix.

        Returns how many leading tokens already have K/V. At least the last token is always left
        to compute (its logits are needed); if it sits in a shared block, that block is copied first.
        """
        tokens = np.asarray(tokens).tolist()
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

    def _copy_on_write(self, seq_id, index) -> bool:
        """Give the sequence a private copy of its block `index` if another sequence shares it."""
        table = self.tables[seq_id]
        src = table[index]
        if self.ref[src] > 1:
            table[index] = self._take_free()
            self.ref[src] -= 1
            self.copies.append((src, table[index]))
            return True
        return False

    def append_need(self, seq_id, n: int = 1) -> int:
        """Free blocks that n more tokens after the written ones take: new blocks past the table's
        end, and a private copy of a shared block they would write into."""
        start, table = self.computed[seq_id], self.tables[seq_id]
        shared = start % self.block_size and self.ref[table[start // self.block_size]] > 1
        return max(0, self._blocks_for(start + n) - len(table)) + bool(shared)

    def reserve(self, seq_id, new_tokens) -> None:
        """Slots for new tokens at positions computed..: where they differ from the planned tokens,
        the plan from there on is replaced, and planned blocks it no longer needs are released.
        Written blocks become private and unnamed first. `append_need` blocks must be free."""
        new = np.asarray(new_tokens).tolist()
        table, tokens, bs = self.tables[seq_id], self.tokens[seq_id], self.block_size
        start, end = self.computed[seq_id], self.computed[seq_id] + len(new)
        follows = tokens[start:end] == new  # keep a plan the new tokens follow, else the plan ends with them
        planned = self._blocks_for(len(tokens) if follows else end)
        for i in range(start // bs, min(self._blocks_for(end), len(table))):  # existing blocks written to
            if not self._copy_on_write(seq_id, i):
                self._unregister(table[i])  # its K/V are about to change
        for block in table[planned:]:
            self._release(block)
        del table[planned:]
        while len(table) < planned:
            table.append(self._take_free())
        if not follows:
            tokens[start:] = new  # in place: no copy of the sequence's tokens at every step

    def commit(self, seq_id, computed: int) -> None:
        """The step succeeded: K/V of positions ..computed are written. Register full blocks."""
        self.computed[seq_id] = computed
        self._register_computed(seq_id)

    def truncate(self, seq_id, n: int) -> None:
        """Keep the first n written positions (dropping the plan after them); blocks past them are
        released, shared ones stay shared (copied only when written)."""
        n, table = int(n), self.tables[seq_id]
        for block in reversed(table[self._blocks_for(n):]):
            self._release(block)
        del table[self._blocks_for(n):]
        del self.tokens[seq_id][n:], self.hashes[seq_id][n // self.block_size:]
        self.computed[seq_id] = n

    def fork(self, parent, child) -> None:
        """A child sequence sharing every written block of its parent (parallel sampling, beam search)."""
        n = self.computed[parent]
        self.tables[child] = self.tables[parent][:self._blocks_for(n)]
        self.tokens[child], self.computed[child] = self.tokens[parent][:n], n
        self.hashes[child] = list(self.hashes[parent])
        for block in self.tables[child]:
            self.ref[block] += 1

    def deallocate(self, seq_id) -> None:
        """Drop a sequence; blocks nobody uses return to the free list (keeping their hash until reused)."""
        for block in reversed(self.tables.pop(seq_id)):
            self._release(block)
        del self.tokens[seq_id], self.hashes[seq_id], self.computed[seq_id]
