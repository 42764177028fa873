"""KIVI's cache (lib.cache.kivi): keys per channel in groups, values per token, the last tokens in full
precision. Reads equal a direct computation of the scheme; with everything inside the
full-precision window the model's logits equal the float32 cache's; truncation never changes what
a read returns; a rerun of a step's write is the same as one write."""
import numpy as np
import pytest
from conftest import GQA, perturbed_params
from hypothesis import given, settings
from hypothesis import strategies as st

from lib.cache import kivi
from lib.cache.kv_cache import KVCache
from lib.fast.lean import LeanModel
from lib.model import forward_cached

PARAMS = perturbed_params(GQA, seed=11)
Hkv, D = GQA.n_kv_head, GQA.head_dim


def scheme(x_k, x_v, n, bits, R):
    """What a KIVI cache holding positions 0..n-1 of x_k, x_v (Hkv, N, D) must read back."""
    k, v = x_k[:, :n].copy(), x_v[:, :n].copy()
    for g0 in range(0, n // R * R, R):  # finished key groups: per channel over the group's tokens
        codes, lo, step = kivi._quantize(x_k[:, g0:g0 + R], 1, bits)
        k[:, g0:g0 + R] = kivi._dequantize(codes, lo, step)
    old = max(n - R, 0)  # values outside the window: per token
    codes, lo, step = kivi._quantize(x_v[:, :old], 2, bits)
    v[:, :old] = kivi._dequantize(codes, lo, step)
    return k, v


@given(st.sampled_from(kivi.BITS), st.integers(1, 9), st.lists(st.integers(1, 13), min_size=1, max_size=8),
       st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_reads_equal_the_scheme_for_any_chunking(bits, R, chunks, seed):
    rng = np.random.default_rng(seed)
    N = min(sum(chunks), GQA.block_size)
    x_k, x_v = rng.standard_normal((2, Hkv, N, D)).astype(np.float32) * rng.uniform(0.1, 5.0, (2, 1, 1, D)).astype(np.float32)
    cache, n = kivi.KiviCache(GQA, N, bits, R), 0
    for T in chunks:
        T = min(T, N - n)
        if not T:
            break
        for layer in range(GQA.n_layer):
            cache.write(layer, x_k[:, n:n + T], x_v[:, n:n + T])
        cache.advance(T)
        n += T
        k, v = cache.read(0, n)
        k_ref, v_ref = scheme(x_k, x_v, n, bits, R)
        np.testing.assert_array_equal(k, k_ref)
        np.testing.assert_array_equal(v, v_ref)


def test_codes_are_packed_and_stay_in_range():
    x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)
    for bits in kivi.BITS:
        codes, lo, step = kivi._quantize(x, 1, bits)
        assert codes.max() <= 2 ** bits - 1 and codes.min() == 0
        assert np.array_equal(kivi._unpack(kivi._pack(codes, bits), bits), codes)
        assert kivi._pack(codes, bits).shape == (2, 8, 16 * bits // 8)
        error = np.abs(kivi._dequantize(codes, lo, step) - x)
        assert (error <= step.astype(np.float32) / 2 * 1.001 + 1e-6).all()  # half a step, float16-rounded


@pytest.mark.parametrize("bits", kivi.BITS)
def test_inside_the_window_the_logits_equal_the_float32_caches(bits):
    """With fewer positions than the window, nothing is quantized: exact against the reference."""
    tokens = np.arange(20) % GQA.vocab_size
    ours = forward_cached(PARAMS, GQA, tokens, kivi.KiviCache(GQA, 64, bits, recent=32))
    reference = forward_cached(PARAMS, GQA, tokens, KVCache(GQA, 64))
    np.testing.assert_array_equal(ours, reference)


@pytest.mark.parametrize("bits", kivi.BITS)
def test_a_step_attends_to_its_own_tokens_in_full_precision(bits):
    """KIVI's order: a step's attention sees its new K and V as computed, and only then are they
    quantized. So a prefill of any length is exact, and the next step reads the codes."""
    tokens = np.arange(50) % GQA.vocab_size
    cache = kivi.KiviCache(GQA, 64, bits, recent=8)
    np.testing.assert_array_equal(forward_cached(PARAMS, GQA, tokens[:49], cache),
                                  forward_cached(PARAMS, GQA, tokens[:49], KVCache(GQA, 64)))
    exact = KVCache(GQA, 64)
    forward_cached(PARAMS, GQA, tokens[:49], exact)
    assert not np.array_equal(forward_cached(PARAMS, GQA, tokens[49:], cache),
                              forward_cached(PARAMS, GQA, tokens[49:], exact))  # positions 0..39 are codes now


def test_the_lean_path_and_the_plain_path_agree_on_a_kivi_cache():
    tokens = np.arange(50) % GQA.vocab_size
    plain, lean = kivi.KiviCache(GQA, 64, 4, 8), kivi.KiviCache(GQA, 64, 4, 8)
    a = forward_cached(PARAMS, GQA, tokens[:41], plain)
    b = LeanModel(PARAMS, GQA)(tokens[:41], lean)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    for t in tokens[41:]:
        np.testing.assert_allclose(forward_cached(PARAMS, GQA, [t], plain), LeanModel(PARAMS, GQA)([t], lean),
                                   rtol=1e-4, atol=1e-4)


@given(st.sampled_from(kivi.BITS), st.integers(1, 9), st.integers(1, 40), st.data())
@settings(max_examples=40, deadline=None)
def test_truncation_never_changes_what_a_read_returns(bits, R, n, data):
    rng = np.random.default_rng(n)
    cache = kivi.KiviCache(GQA, 64, bits, R)
    x = rng.standard_normal((2, Hkv, n, D)).astype(np.float32)
    for layer in range(GQA.n_layer):
        cache.write(layer, x[0], x[1])
    cache.advance(n)
    before = [cache.read(layer, n) for layer in range(GQA.n_layer)]
    m = data.draw(st.integers(0, n))
    cache.truncate(m)
    for layer in range(GQA.n_layer):
        if m:
            k, v = cache.read(layer, m)
            np.testing.assert_array_equal(k, before[layer][0][:, :m])
            np.testing.assert_array_equal(v, before[layer][1][:, :m])
    extra = rng.standard_normal((2, Hkv, 5, D)).astype(np.float32)  # and it goes on from there
    for layer in range(GQA.n_layer):
        cache.write(layer, extra[0], extra[1])
    cache.advance(5)
    k, v = cache.read(0, m + 5)
    step = 2 * np.abs(np.concatenate([before[0][0][:, :m], extra[0]], 1)).max() / (2 ** bits - 1)
    np.testing.assert_allclose(k[:, :m], before[0][0][:, :m], atol=step)  # requantized: within a step
    np.testing.assert_allclose(v[:, :m], before[0][1][:, :m], atol=step)


def test_a_rerun_write_equals_one_write():
    rng = np.random.default_rng(1)
    once, twice = kivi.KiviCache(GQA, 64, 2, 4), kivi.KiviCache(GQA, 64, 2, 4)
    first = rng.standard_normal((GQA.n_layer, 2, Hkv, 6, D)).astype(np.float32)
    for cache in (once, twice):
        for layer in range(GQA.n_layer):
            cache.write(layer, *first[layer])
        cache.advance(6)
    new = rng.standard_normal((2, Hkv, 3, D)).astype(np.float32)
    junk = rng.standard_normal((2, Hkv, 3, D)).astype(np.float32)
    for layer in range(GQA.n_layer):
        once.write(layer, *new)
        twice.write(layer, *junk)
        twice.write(layer, *new)  # the same positions again, as a rerun step writes them
    once.advance(3)
    twice.advance(3)
    for layer in range(GQA.n_layer):
        for a, b in zip(once.read(layer, 9), twice.read(layer, 9)):
            np.testing.assert_array_equal(a, b)


def test_bytes_per_position_fall_with_the_bits():
    sizes = {bits: kivi.KiviCache(GQA, 64, bits, 8).nbytes for bits in kivi.BITS}
    float32 = KVCache(GQA, 64).nbytes
    assert sizes[2] < sizes[4] < float32 / 2  # head_dim 16: the scales weigh as much as 4-bit codes


@pytest.mark.parametrize("kwargs,match", [
    (dict(bits=3), "bits"), (dict(bits=True), "bits"), (dict(recent=0), "recent"), (dict(recent=1.5), "recent"),
    (dict(max_len=0), "max_len")])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kivi.KiviCache(GQA, **{"max_len": 16, **kwargs})


def test_refused_feeds_change_nothing():
    cache = kivi.KiviCache(GQA, 8, 2, 4)
    step = lambda tokens, c: forward_cached(PARAMS, GQA, tokens, c)
    cache.feed([1, 2, 3, 4, 5], step)
    before = cache.copy()
    for tokens, match in (([GQA.vocab_size], "outside the vocabulary"), (np.arange(4), "full"), ([1.5], "integer")):
        with pytest.raises(ValueError, match=match):
            cache.feed(tokens, step)
        assert cache.n == 5 and cache.written == before.written
        assert all(np.array_equal(a, b) for a, b in zip(before.k_recent + before.v_recent + before.k_codes,
                                                        cache.k_recent + cache.v_recent + cache.k_codes))
