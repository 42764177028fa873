"""The paged cache: same logits as the contiguous cache, shared prefixes, and the allocator bugs
that such systems have had (each test is named after the bug it pins)."""
import numpy as np
import pytest
from conftest import GQA, perturbed_params
from hypothesis import given, settings
from hypothesis import strategies as st

from lib.cache.kv_cache import KVCache
from lib.cache.paged import BlockManager, PagedKVCache
from lib.config import TARGET
from lib.model import forward, forward_cached

PARAMS = perturbed_params(GQA, seed=31)
step = lambda tokens, cache: forward_cached(PARAMS, GQA, tokens, cache)


def test_paged_generation_equals_contiguous():
    params = perturbed_params(TARGET, seed=32)
    tokens = np.arange(70) * 11 % 96
    pool = PagedKVCache(TARGET, num_blocks=8, block_size=16)
    seq = pool.add("a", tokens[:40])
    paged = [seq.feed(tokens[:40], lambda t, c: forward_cached(params, TARGET, t, c))]
    paged += [seq.feed(tokens[i:i + 1], lambda t, c: forward_cached(params, TARGET, t, c)) for i in range(40, 70)]
    contiguous = KVCache(TARGET)
    plain = [forward_cached(params, TARGET, tokens[:40], contiguous)]
    plain += [forward_cached(params, TARGET, tokens[i:i + 1], contiguous) for i in range(40, 70)]
    np.testing.assert_allclose(np.concatenate(paged), np.concatenate(plain), atol=1e-6, rtol=0)
    assert len(seq.block_table) == 5 and pool.manager.num_free == 3


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 44), st.sampled_from([1, 4, 16]), st.integers(0, 20))
def test_any_length_and_block_size_match_the_reference(n, block_size, decode):
    tokens = (np.arange(n + decode) * 7) % 96
    pool = PagedKVCache(GQA, num_blocks=-(-(n + decode) // block_size), block_size=block_size)
    seq = pool.add(0, tokens[:n])
    out = [seq.feed(tokens[:n], step)] + [seq.feed(tokens[i:i + 1], step) for i in range(n, n + decode)]
    np.testing.assert_allclose(np.concatenate(out), forward(PARAMS, GQA, tokens), atol=1e-5, rtol=0)


def test_shared_system_prompt_uses_its_blocks_once():
    system = np.arange(48) * 5 % 96  # 3 full blocks of 16
    pool = PagedKVCache(GQA, num_blocks=12, block_size=16)
    a = pool.add("a", np.concatenate([system, [1, 2]]))
    a.feed(a.tokens[a.n:], step)
    b = pool.add("b", np.concatenate([system, [3, 4, 5]]))
    assert b.n == 48 and b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert [pool.manager.ref[blk] for blk in b.block_table[:3]] == [2, 2, 2]
    logits = b.feed(b.tokens[b.n:], step)
    np.testing.assert_allclose(logits, forward(PARAMS, GQA, np.concatenate([system, [3, 4, 5]]))[48:], atol=1e-5)


def test_fully_cached_prompt_still_computes_its_last_token():
    prompt = np.arange(32) % 96  # exactly 2 blocks
    pool = PagedKVCache(GQA, num_blocks=6, block_size=16)
    a = pool.add("a", prompt)
    a.feed(prompt, step)
    before = [k[a.block_table].copy() for k in pool.k]
    b = pool.add("b", prompt)
    assert b.n == 31  # the last token is recomputed, for its logits
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]  # copied, not shared
    logits = b.feed(prompt[31:], step)
    np.testing.assert_allclose(logits, forward(PARAMS, GQA, prompt)[31:], atol=1e-5)
    assert all((k[a.block_table] == old).all() for k, old in zip(pool.k, before))  # a's cache untouched


def written(manager, seq_id, tokens):
    """Allocate a prompt and mark its K/V written, as a successful step would."""
    manager.allocate(seq_id, tokens)
    manager.reserve(seq_id, tokens)
    manager.commit(seq_id, len(tokens))


def test_freed_and_reused_block_is_never_found_by_its_old_hash():
    manager = BlockManager(num_blocks=4, block_size=4)
    old = [1, 2, 3, 4, 5, 6, 7, 8]
    written(manager, "a", old)
    manager.deallocate("a")
    written(manager, "b", [9] * 16)  # takes every block, overwriting the old contents
    manager.deallocate("b")
    assert manager.allocate("c", old) == 0  # no stale hit


def test_freed_block_with_valid_contents_is_revived():
    manager = BlockManager(num_blocks=4, block_size=4)
    written(manager, "a", [1, 2, 3, 4, 5])
    first = manager.tables["a"][0]
    manager.deallocate("a")
    assert manager.allocate("b", [1, 2, 3, 4, 6]) == 4 and manager.tables["b"][0] == first
    assert first not in manager.free


def test_allocated_but_unwritten_blocks_are_never_found():
    """Bugs (a) and (b): a prompt added twice before it is fed, or added, freed and added again,
    must not find blocks whose K/V were never written."""
    manager = BlockManager(num_blocks=8, block_size=4)
    manager.allocate("a", [1, 2, 3, 4, 5])
    assert manager.allocate("b", [1, 2, 3, 4, 5]) == 0
    manager.deallocate("a")
    manager.deallocate("b")
    assert manager.allocate("c", [1, 2, 3, 4, 5]) == 0


def test_hash_collision_in_block_tokens_needs_the_same_prefix():
    manager = BlockManager(num_blocks=8, block_size=2)
    written(manager, "a", [1, 2, 3, 4, 0])
    assert manager.allocate("b", [9, 9, 3, 4, 0]) == 0  # same second block, different parent


def test_fork_then_diverge_inside_a_shared_block_copies_it():
    pool = PagedKVCache(GQA, num_blocks=6, block_size=16)
    prompt = np.arange(20) % 96  # one full block and 4 positions of the second
    a = pool.add("a", prompt)
    a.feed(prompt, step)
    b = pool.fork(a, "b")
    assert pool.manager.ref[a.block_table[1]] == 2
    la = a.feed([7], step)
    lb = b.feed([8], step)
    assert a.block_table[1] != b.block_table[1] and a.block_table[0] == b.block_table[0]
    np.testing.assert_allclose(la, forward(PARAMS, GQA, np.append(prompt, 7))[-1:], atol=1e-5)
    np.testing.assert_allclose(lb, forward(PARAMS, GQA, np.append(prompt, 8))[-1:], atol=1e-5)


def test_out_of_blocks_is_a_clear_error_and_changes_nothing():
    manager = BlockManager(num_blocks=2, block_size=4)
    manager.allocate("a", [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="out of blocks: the prompt needs 1 new blocks of 4 positions, 0 are free"):
        manager.allocate("b", [7, 7])
    assert "b" not in manager.tables and manager.num_free == 0
    pool = PagedKVCache(GQA, num_blocks=2, block_size=4)
    a = pool.add("a", [1, 2, 3, 4, 5])
    a.feed([1, 2, 3, 4, 5, 6, 7, 8], step)
    assert pool.manager.append_need("a", 1) == 1
    with pytest.raises(ValueError, match="out of blocks: 1 more tokens need 1 blocks, 0 are free"):
        a.feed([9], step)
    assert a.tokens == [1, 2, 3, 4, 5, 6, 7, 8] and a.n == 8 and pool.manager.num_free == 0


def test_bad_tokens_leave_the_sequence_as_it_was():
    pool = PagedKVCache(GQA, num_blocks=6, block_size=16)
    seq = pool.add("a", np.arange(10))
    seq.feed(np.arange(10), step)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        seq.feed([96], step)
    with pytest.raises(ValueError, match="go past the context"):
        seq.feed(np.zeros(60, dtype=int), step)
    assert seq.n == 10 and len(seq.tokens) == 10 and pool.manager.num_free == 5


def test_without_prefix_caching_nothing_is_shared():
    manager = BlockManager(num_blocks=8, block_size=4, prefix_caching=False)
    written(manager, "a", list(range(9)))
    assert manager.allocate("b", list(range(9))) == 0 and manager.num_free == 2


def test_deallocate_returns_every_block():
    manager = BlockManager(num_blocks=10, block_size=4)
    written(manager, "a", list(range(13)))
    manager.fork("a", "b")
    manager.reserve("b", [1, 2, 3])
    manager.commit("b", 16)
    manager.deallocate("a")
    manager.deallocate("b")
    assert manager.num_free == 10 and all(r == 0 for r in manager.ref)


def test_truncated_block_rewritten_with_other_tokens_is_not_found_by_its_old_hash():
    """Truncate into a full block, write other tokens there: the block's old name must go, or a
    later prompt with the old prefix would read the new tokens' K/V."""
    pool = PagedKVCache(GQA, num_blocks=8, block_size=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    a = pool.add("a", prompt)
    a.feed(prompt, step)
    a.truncate(2)
    a.feed([50, 51, 52], step)
    b = pool.add("b", prompt)
    cached = b.n
    logits = b.feed(prompt[cached:], step)
    np.testing.assert_allclose(logits, forward(PARAMS, GQA, prompt)[cached:], atol=1e-5, rtol=0)
