"""The lean path is the same model: exact against the plain reference on every config."""
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lib.cache.kv_cache import KVCache
from lib.cache.paged import PagedKVCache
from lib.config import TARGET
from lib.fast.lean import LeanModel
from lib.generation import generate
from lib.measure.counting import numpy_calls_per_step
from lib.model import Model, forward, forward_cached, load
from lib.speculative import speculative_generate
from lib.tokenizer import encode


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_lean_equals_reference_for_any_chunking(model, data):
    params, cfg = model
    lean = LeanModel(params, cfg)
    n = data.draw(st.integers(1, min(cfg.block_size, 80)), label="length")
    tokens = np.array(data.draw(st.lists(st.integers(0, cfg.vocab_size - 1), min_size=n, max_size=n)))
    cache, out, i = KVCache(cfg, n), [], 0
    while i < n:
        size = data.draw(st.integers(1, n - i), label="chunk")
        out.append(lean(tokens[i:i + size], cache))
        i += size
    np.testing.assert_allclose(np.concatenate(out), forward(params, cfg, tokens), atol=1e-5, rtol=0)


def _overflowing(params, cfg):
    """The model with queries and keys scaled 100-fold: scores grow 10,000-fold, past exp's range."""
    params = dict(params)
    for i in range(cfg.n_layer):
        w = params[f"h.{i}.attn.c_attn.weight"].copy()
        w[:, :cfg.n_embd + cfg.kv_dim] *= 100.0
        params[f"h.{i}.attn.c_attn.weight"] = w
    return params


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_overflowing_scores_rerun_with_the_stable_softmax(model, cache_kind):
    """The fast softmax overflows, the step is redone with the row maximum subtracted, and the
    result (and the cache) is still the reference's, on either kind of cache."""
    params, cfg = model
    params = _overflowing(params, cfg)
    tokens = np.arange(24) % cfg.vocab_size
    lean = LeanModel(params, cfg)
    stable_flags = []
    fast_forward = lean._forward
    lean._forward = lambda *args, stable: stable_flags.append(stable) or fast_forward(*args, stable=stable)
    if cache_kind == "paged":
        cache = PagedKVCache(cfg, num_blocks=4, block_size=8).add("s", tokens)
        run = lambda chunk: cache.feed(chunk, lean)
    else:
        cache = KVCache(cfg, 24)
        run = lambda chunk: lean(chunk, cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the overflow is handled, so the user sees no warning
        out = np.concatenate([run(tokens[:20]), run(tokens[20:])])
    assert True in stable_flags, "the scores were meant to overflow the fast softmax"
    ref = forward(params, cfg, tokens)
    np.testing.assert_allclose(out, ref, atol=1e-4 * np.abs(ref).max(), rtol=0)  # float32 with scores near 1e3
    assert cache.n == 24
    ref_cache = KVCache(cfg, 24)
    forward_cached(params, cfg, tokens, ref_cache)
    for i in range(cfg.n_layer):
        for mine, theirs in zip(cache.read(i, 24), ref_cache.read(i, 24)):
            np.testing.assert_allclose(mine, theirs, atol=1e-4 * np.abs(theirs).max(), rtol=0)


def _uniform_scores(params, cfg, score):
    """The model whose first layer gives every (query, key) pair the same attention score: ln_1's
    gain is 0, so every position's normalized input is ln_1's bias e_0 * beta, and the query and
    key columns read only that coordinate (q . k / sqrt(D) = beta^2 sqrt(D) = score)."""
    params = dict(params)
    C, KV, D = cfg.n_embd, cfg.kv_dim, cfg.head_dim
    beta = np.sqrt(abs(score) / np.sqrt(D))
    params["h.0.ln_1.weight"] = np.zeros(C, np.float32)
    params["h.0.ln_1.bias"] = np.eye(C, dtype=np.float32)[0] * beta
    w = params["h.0.attn.c_attn.weight"].copy()
    w[:, :C + KV] = 0.0
    w[0, :C], w[0, C:C + KV] = 1.0, np.sign(score)
    params["h.0.attn.c_attn.weight"] = w
    return params


@pytest.mark.parametrize("score, positions", [(86.0, 24), (-95.0, 24)])
def test_row_sums_out_of_range_rerun_with_the_stable_softmax(model, score, positions):
    """86: each exponential is finite (e^86 = 2.2e37) but 16 or more of them sum past float32's
    maximum (3.4e38), so the fast softmax would give weights 0 with finite logits. -95: every
    exponential is subnormal, so the fast weights would lose precision. Both must be exact."""
    params, cfg = model
    params = _uniform_scores(params, cfg, score)
    e = np.exp(np.float32(score))
    with np.errstate(over="ignore"):
        assert np.isfinite(e) and (not np.isfinite(e * np.float32(positions)) or e * positions < 2.0 ** -100)
    tokens = np.arange(positions) % cfg.vocab_size
    lean, cache = LeanModel(params, cfg), KVCache(cfg, positions)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = np.concatenate([lean(tokens[:positions - 2], cache)] + [lean(tokens[i:i + 1], cache)
                                                                     for i in range(positions - 2, positions)])
    ref = forward(params, cfg, tokens)
    assert np.isfinite(ref).all()
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)


def _held_out_texts(count=4, length=512):
    from lib.corpus import load_corpus
    held = load_corpus().held_out
    return [held[i * (len(held) - length) // count:][:length] for i in range(count)]


@pytest.mark.parametrize("name", ["target", "draft", "target-kv2", "target-kv1", "target-kv4"])
def test_lean_equals_reference_on_full_held_out_texts(name):
    """Every position of full-context held-out texts, one token at a time and in chunks: on such a
    text the shipped draft's fast softmax once overflowed in its row sums (logit error 3.9). The
    reference runs in float64; the tolerance is twice the float32 reference's own distance from it
    on the text (up to 9e-5 on Python 3.11's held-out texts, 1.1e-4 on 3.12's), at least 1e-4."""
    params, cfg = load(name)
    lean, rng = LeanModel(params, cfg), np.random.default_rng(0)
    params64 = {key: value.astype(np.float64) for key, value in params.items()}
    for text in _held_out_texts():
        ref = forward(params64, cfg, text)  # (512, V)
        atol = max(1e-4, 2 * float(np.abs(forward(params, cfg, text) - ref).max()))  # float32's rounding here
        cache = KVCache(cfg)
        one_by_one = np.concatenate([lean(text[i:i + 1], cache) for i in range(len(text))])
        np.testing.assert_allclose(one_by_one, ref, atol=atol, rtol=0)
        cache, out, i = KVCache(cfg), [], 0
        while i < len(text):
            size = int(rng.integers(1, 40))
            out.append(lean(text[i:i + size], cache))
            i += size
        np.testing.assert_allclose(np.concatenate(out), ref, atol=atol, rtol=0)


def test_feed_refuses_for_the_lean_path_what_the_plain_path_refuses(model):
    params, cfg = model
    lean, cache = LeanModel(params, cfg), KVCache(cfg, 4)
    cache.feed([1, 2, 3], lean)
    with pytest.raises(ValueError, match="KV cache is full"):
        cache.feed([1, 2], lean)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        cache.feed([cfg.vocab_size], lean)
    assert cache.n == 3


@pytest.mark.parametrize("name", ["target", "draft"])
def test_lean_greedy_text_equals_plain_on_shipped_weights(name):
    params, cfg = load(name)
    prompt = encode("    def __init__(self, ")
    plain = generate(Model(params, cfg), prompt, 96)
    lean = generate(LeanModel(params, cfg), prompt, 96)
    np.testing.assert_array_equal(lean.tokens, plain.tokens)
    assert np.abs(lean.logits - plain.logits).max() < 1e-4


def test_speculative_on_lean_models_equals_plain():
    target, draft = load("target"), load("draft")
    prompt = encode("import os\nimport ")
    plain = speculative_generate(Model(*target), Model(*draft), prompt, 60, k=3, temperature=0.7, seed=4)[0]
    lean = speculative_generate(LeanModel(*target), LeanModel(*draft), prompt, 60, k=3, temperature=0.7, seed=4)[0]
    np.testing.assert_array_equal(lean, plain)


def test_lean_step_makes_at_most_half_the_numpy_calls(model):
    params, cfg = model
    plain = numpy_calls_per_step(lambda p: Model(p, cfg), params, cfg, 40)
    lean = numpy_calls_per_step(lambda p: LeanModel(p, cfg), params, cfg, 40)
    assert lean <= plain / 2
    if cfg == TARGET:
        assert lean <= 150  # the engine's goal for the target's decode step


def test_work_buffers_are_sized_by_the_longest_call():
    """Calls of many lengths share one set of buffers, sized by the longest: memory stays bounded."""
    params, cfg = load("draft")
    lean = LeanModel(params, cfg)
    for n in range(1, 41):
        lean(np.arange(n) % cfg.vocab_size, KVCache(cfg, n))
    assert 40 <= lean.store.rows < 80
    assert all(np.shares_memory(view.ha, lean.store.ha) for view in lean.buffers.values())


@pytest.mark.parametrize("products", ["numpy", "kernel"])
def test_every_product_choice_equals_reference(model, products):
    """Both weight layouts and every product for 1..10 rows give the reference's logits."""
    params, cfg = model
    lean, rng = LeanModel(params, cfg, products), np.random.default_rng(1)
    n = min(cfg.block_size, 70)
    tokens = rng.integers(0, cfg.vocab_size, n)
    cache, out, i = KVCache(cfg, n), [], 0
    while i < n:
        size = int(rng.integers(1, 11))
        out.append(lean(tokens[i:i + size], cache))
        i += size
    np.testing.assert_allclose(np.concatenate(out), forward(params, cfg, tokens), atol=1e-5, rtol=0)


def test_unknown_products_choice_is_refused():
    with pytest.raises(ValueError, match="products must be one of auto, numpy, kernel"):
        LeanModel(*load("draft"), products="blas")
