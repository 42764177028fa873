"""Batched decoding is exact: every sequence's logits equal decoding it alone, for any batch of
ragged positions and lengths, on contiguous and paged caches, on the plain and lean paths."""
import numpy as np
import pytest
from conftest import GQA, MQA, perturbed_params
from hypothesis import given, settings
from hypothesis import strategies as st

from lib.cache.kv_cache import KVCache
from lib.cache.paged import PagedKVCache
from lib.config import TARGET
from lib.fast.batch import BatchedModel
from lib.fast.lean import LeanModel
from lib.model import Model, forward

MODELS = {name: (perturbed_params(cfg, seed=41), cfg) for name, cfg in (("gqa", GQA), ("mqa", MQA), ("target", TARGET))}


def _engine(name, path):
    params, cfg = MODELS[name]
    return BatchedModel(LeanModel(params, cfg) if path == "lean" else Model(params, cfg)), params, cfg


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(MODELS)), path=st.sampled_from(["plain", "lean"]),
       kind=st.sampled_from(["contiguous", "paged"]), data=st.data())
def test_batch_equals_each_sequence_alone(name, path, kind, data):
    """B sequences with their own prompts; each step feeds every sequence 1..4 new tokens."""
    model, params, cfg = _engine(name, path)
    B = data.draw(st.integers(1, 6), label="B")
    prompts = [data.draw(st.lists(st.integers(0, cfg.vocab_size - 1), min_size=1, max_size=30), label="prompt")
               for _ in range(B)]
    steps = data.draw(st.integers(1, 3), label="steps")
    chunks = [[data.draw(st.lists(st.integers(0, cfg.vocab_size - 1), min_size=1, max_size=4), label="new")
               for _ in range(B)] for _ in range(steps)]
    if kind == "paged":
        block_size = data.draw(st.sampled_from([1, 4, 16]), label="block_size")
        pool = PagedKVCache(cfg, num_blocks=B * (-(-42 // block_size)), block_size=block_size)
        caches = [pool.add(b, p) for b, p in enumerate(prompts)]
        run = lambda tokens: model.feed(caches, tokens)
    else:  # contiguous caches: one batched step
        caches = [KVCache(cfg, 42) for _ in range(B)]
        run = lambda tokens: model.step(tokens, caches)
    outs = [run(prompts)] + [run(c) for c in chunks]
    for b in range(B):
        tokens = prompts[b] + [t for c in chunks for t in c[b]]
        got = np.concatenate([o[b] for o in outs])
        np.testing.assert_allclose(got, forward(params, cfg, tokens), atol=1e-5, rtol=0)
        assert caches[b].n == len(tokens)


def test_trained_model_batch_gives_the_same_greedy_tokens():
    """The shipped target: 8 sequences at different positions decode the tokens each gets alone."""
    from lib.generation import generate
    from lib.model import load
    params, cfg = load("target")
    lean = LeanModel(params, cfg)
    batched = BatchedModel(lean)
    prompts = [np.arange(3 + 7 * b) * (b + 5) % cfg.vocab_size for b in range(8)]
    pool = PagedKVCache(cfg, num_blocks=40, block_size=16)
    seqs = [pool.add(b, p) for b, p in enumerate(prompts)]
    last = [rows[-1] for rows in batched.feed(seqs, prompts)]
    out = [[] for _ in prompts]
    for _ in range(20):
        nxt = [[int(np.argmax(l))] for l in last]
        for o, t in zip(out, nxt):
            o.append(t[0])
        last = [rows[-1] for rows in batched.feed(seqs, nxt)]
    assert out == [generate(lean, p, 20).tokens.tolist() for p in prompts]


def test_bad_token_leaves_every_sequence_as_it_was():
    model, _, cfg = _engine("gqa", "lean")
    pool = PagedKVCache(cfg, num_blocks=8, block_size=4)
    seqs = [pool.add(b, [1, 2, 3]) for b in range(2)]
    model.feed(seqs, [[1, 2, 3], [1, 2, 3]])
    state = lambda: (pool.manager.num_free, [list(s.block_table) for s in seqs], [list(s.tokens) for s in seqs])
    before = state()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.feed(seqs, [[4], [cfg.vocab_size]])
    assert state() == before


def test_pool_too_small_for_the_batch_unwinds_every_sequence():
    """The second sequence's new block does not fit: the batch is refused before either reserves one."""
    model, params, cfg = _engine("gqa", "plain")
    pool = PagedKVCache(cfg, num_blocks=2, block_size=4)
    a, b = pool.add("a", [1, 2, 3, 4]), pool.add("b", [5, 6, 7, 8])
    model.feed([a, b], [[1, 2, 3, 4], [5, 6, 7, 8]])
    with pytest.raises(ValueError, match="out of blocks"):
        model.feed([a, b], [[9], [9]])
    assert (a.n, b.n, pool.manager.num_free) == (4, 4, 0)
    pool.free(b)
    logits = model.feed([a], [[9]])[0]
    np.testing.assert_allclose(logits, forward(params, cfg, [1, 2, 3, 4, 9])[-1:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("tokens, caches, message", [
    ([[1]], 2, "one token list per sequence"),
    ([[1], [2]], "same", "same sequence appears twice"),
    ([[]], 1, "non-empty"),
])
def test_malformed_batch_is_refused(tokens, caches, message):
    model, _, cfg = _engine("gqa", "plain")
    pool = PagedKVCache(cfg, num_blocks=8, block_size=4)
    seq = pool.add("a", [1])
    seqs = [seq, seq] if caches == "same" else [pool.add(b, [1]) for b in range(caches)]
    with pytest.raises(ValueError, match=message):
        model.feed(seqs, tokens)


def test_sequence_of_another_model_is_refused():
    model, _, _ = _engine("gqa", "plain")
    with pytest.raises(ValueError, match="made for"):
        model.feed([PagedKVCache(MQA, 4, 4).add("a", [1])], [[1]])
    with pytest.raises(TypeError, match="must be a paged sequence"):
        model.feed([np.zeros(3)], [[1]])
