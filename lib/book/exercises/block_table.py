"""Chapter 6's exercise: find a position's slot through a block table, and free a forked sequence.

The reader writes `slots` (positions to (block, offset) pairs through a sequence's block table, as
`PagedSequence.write` stores K and V) and `free_blocks` (one reference less on each of a
sequence's blocks; a block nobody uses returns to the free list, as `BlockManager.deallocate`).
The check asks `slots` for every position of two sequences of a real paged pool whose tables are
out of order (a freed sequence, a fork, a block copied on write) and compares with the engine's
slots, naming what the reader's slot holds instead; then it frees a fork and its parent, while a
third sequence shares their prefix, beside `BlockManager.deallocate`.
"""
import numpy as np

from lib.book.exercises import Wrong, call, run, verdict
from lib.cache.blocks import BlockManager
from lib.cache.paged import PagedKVCache
from lib.model import forward_cached


def slots(block_table, positions, block_size):
    """(blocks, offsets), each (T,): where positions (T,) of a sequence live in the pool."""
    positions = np.asarray(positions)  # (T,)
    return np.asarray(block_table)[positions // block_size], positions % block_size


def free_blocks(block_table, ref, free):
    """Drop a sequence: one reference less per block; blocks left unused join the free list."""
    for block in block_table:
        ref[block] -= 1
        if ref[block] == 0:
            free.append(block)


def forked_pool(params, cfg, tokens, block_size: int = 4):
    """A pool where X is freed after A took the next blocks, and B forks A and appends (A's
    partial last block is copied on write): {name: sequence} of A and B, tables out of order."""
    pool = PagedKVCache(cfg, num_blocks=16, block_size=block_size)
    step = lambda new, cache: forward_cached(params, cfg, new, cache)
    x = pool.add("X", tokens[100:108])
    x.feed(tokens[100:108], step)
    a = pool.add("A", tokens[:10])
    a.feed(tokens[:10], step)
    pool.free(x)
    b = pool.fork(a, "B")
    b.feed(tokens[10:13], step)
    a.feed(tokens[20:22], step)
    return pool, {"A": a, "B": b}


def _slot_hint(pool, seq, pos, block, offset) -> str:
    """Why the slot (block, offset) is wrong for position pos: a known slip, or what it holds."""
    bs, table = pool.manager.block_size, seq.block_table
    if (block, offset) == (pos // bs, pos % bs):
        return f"block {pos // bs} is the logical block: look it up in the table"
    if (block, offset) == (table[pos % bs] if pos % bs < len(table) else None, pos // bs):
        return "the block index and the offset are swapped"
    if not (0 <= block < pool.manager.num_blocks and 0 <= offset < bs):
        return f"that slot is outside the pool ({pool.manager.num_blocks} blocks of {bs})"
    blocks, offsets = seq._slots(0, seq.n)  # the engine's slots of the sequence
    held = [t for t in range(seq.n) if np.array_equal(pool.k[0][block, :, offset], pool.k[0][blocks[t], :, offsets[t]])]
    if not held:
        return f"that slot holds no position of {seq.seq_id}"
    return f"that slot holds the K of position {held[0]}" + (" (one position off)" if abs(held[0] - pos) == 1 else "")


def _check_slots(fn, pool, seqs):
    bs = pool.manager.block_size
    for name, seq in seqs.items():
        expected = seq._slots(0, seq.n)  # the engine's (blocks, offsets) of positions 0..n-1
        case = f"sequence {name} (block table {seq.block_table}, blocks of {bs})"
        got = call(fn, list(seq.block_table), np.arange(seq.n), bs, case=case)
        if not (isinstance(got, tuple) and len(got) == 2 and all(np.shape(g) == (seq.n,) for g in got)):
            raise Wrong(f"{case}: slots must return (blocks, offsets), each of shape ({seq.n},) for {seq.n} positions")
        for pos in range(seq.n):
            block, offset = int(got[0][pos]), int(got[1][pos])
            if (block, offset) != (expected[0][pos], expected[1][pos]):
                raise Wrong(f"{case}: position {pos} is in block {expected[0][pos]} at offset {expected[1][pos]} "
                            f"(the table's entry {pos // bs}), got block {block} at offset {offset}: "
                            f"{_slot_hint(pool, seq, pos, block, offset)}")


def shared_manager() -> BlockManager:
    """A forks into B, which appends; C starts with A's first two blocks: blocks with 1 to 3 users."""
    m = BlockManager(num_blocks=10, block_size=4)
    def write(seq_id, new):
        m.reserve(seq_id, new)
        m.commit(seq_id, m.computed[seq_id] + len(new))
    prompt = list(range(10))
    m.allocate("A", prompt)
    write("A", prompt)
    m.fork("A", "B")
    write("B", [50, 51, 52])
    cached = m.allocate("C", prompt[:8] + [60, 61])
    write("C", [60, 61][cached - 8:])
    return m


def _check_free(fn):
    m = shared_manager()
    for name in ("B", "A"):  # the fork first, then its parent; C still shares their first blocks
        table, ref, free = list(m.tables[name]), list(m.ref), list(m.free)
        users = {b: [s for s, t in m.tables.items() if b in t and s != name] for b in table}
        call(fn, table, ref, free, case=f"freeing {name}")
        m.deallocate(name)
        case = f"freeing {name} (block table {table}; reference counts before {[m.ref[b] + 1 for b in table]})"
        _compare_free(case, name, table, users, ref, free, m)


def _compare_free(case, name, table, users, ref, free, m):
    """The reader's counts and free list beside the manager's after deallocate; users: {block: the
    other sequences holding it}."""
    for block in table:
        if block in free and m.ref[block] > 0:
            raise Wrong(f"{case}: block {block} went to the free list, but {' and '.join(users[block])} still "
                        f"{'uses' if len(users[block]) == 1 else 'use'} it: a block is free only when its reference "
                        f"count reaches 0")
        if block not in free and m.ref[block] == 0:
            raise Wrong(f"{case}: block {block} was used by {name} alone: it should return to the free list")
    for block, (got, expected) in enumerate(zip(ref, m.ref)):
        if got != expected:
            raise Wrong(f"{case}: block {block}'s reference count should be {expected} after freeing, got {got}")
    if sorted(free) != sorted(m.free) or len(free) != len(set(free)):
        raise Wrong(f"{case}: the free list should hold blocks {sorted(m.free)}, got {sorted(free)}")


@verdict
def check(slots_fn, free_fn, params, cfg, tokens):
    """Verdict on the reader's slots and free_blocks, against the engine's pool and block manager."""
    pool, seqs = forked_pool(params, cfg, tokens)
    _check_slots(slots_fn, pool, seqs)
    _check_free(free_fn)


def attempt(slots_fn, free_fn, params, cfg, tokens) -> None:
    """Chapter 6's check cell."""
    run(check, (slots_fn, free_fn), (slots, free_blocks), params, cfg, tokens)
