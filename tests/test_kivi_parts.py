"""KIVI's parts one at a time (lib.cache.kivi_parts): with KIVI's settings and a float32 window the
rounded-in-place cache reads what KiviCache's real codes read and counts the same bytes; with
per-token symmetric 4-bit codes and no window it reads what the int4 per-position KVCache reads;
the window keeps the last tokens unrounded; bad settings are refused."""
import numpy as np
import pytest
from conftest import GQA, perturbed_params
from hypothesis import given, settings
from hypothesis import strategies as st

from lib.cache import kivi
from lib.cache.kivi_parts import KiviParts, _round_trip
from lib.cache.kv_cache import KVCache
from lib.model import forward_cached

PARAMS = perturbed_params(GQA, seed=11)


def fed(cache, chunks, seed=0):
    tokens = np.random.default_rng(seed).integers(0, GQA.vocab_size, sum(chunks))
    start, logits = 0, []
    for T in chunks:
        logits.append(forward_cached(PARAMS, GQA, tokens[start:start + T], cache))
        start += T
    return np.concatenate(logits)


@given(st.sampled_from(kivi.BITS), st.integers(1, 9),
       st.lists(st.integers(1, GQA.block_size // 6), min_size=1, max_size=6),  # never more positions than the model holds
       st.integers(0, 2**32 - 1))
@settings(max_examples=30, deadline=None)
def test_kivis_settings_read_what_kivis_codes_read(bits, R, chunks, seed):
    N = sum(chunks)
    parts, real = KiviParts(GQA, N, bits, "channel", True, R, "float32"), kivi.KiviCache(GQA, N, bits, R)
    assert np.array_equal(fed(parts, chunks, seed), fed(real, chunks, seed))
    for layer in range(GQA.n_layer):
        for a, b in zip(parts.read(layer, N), real.read(layer, N)):
            assert np.array_equal(a, b)
    assert parts.nbytes == real.nbytes


def test_per_token_symmetric_4_bit_without_a_window_stores_int4_per_position():
    """The same stored values (layer 0, which depends only on the tokens); the logits differ, as a
    KVCache quantizes on write, so a step attends to its own tokens' codes, and KIVI's stores after."""
    parts, int4 = KiviParts(GQA, 15, 4, "token", False, 0), KVCache(GQA, 15, "int4", "position")
    fed(parts, [15]), fed(int4, [15])
    for a, b in zip(parts.read(0, 15), int4.read(0, 15)):
        assert np.array_equal(a, b)
    assert parts.nbytes == int4.nbytes


@pytest.mark.parametrize("keys", ["channel", "token"])
def test_the_window_holds_the_last_tokens_in_its_dtype_only(keys):
    R, N = 4, 11
    cache = KiviParts(GQA, N, 2, keys, True, R, "float16")
    exact = KVCache(GQA, N)
    fed(exact, [N]), fed(cache, [N])
    _, v = cache.read(0, N)
    _, v32 = exact.read(0, N)
    assert np.array_equal(v[:, N - R:], v32[:, N - R:].astype(np.float16).astype(np.float32))  # the window: float16
    assert not np.array_equal(v[:, :N - R], v32[:, :N - R].astype(np.float16).astype(np.float32))  # older: codes


@pytest.mark.parametrize("zero_point", [True, False])
def test_round_trip_keeps_every_value_within_half_a_step(zero_point):
    x = np.random.default_rng(3).standard_normal((2, 5, 8)).astype(np.float32)
    y = _round_trip(x, 2, 4, zero_point)
    span = (x.max(2, keepdims=True) - x.min(2, keepdims=True)) / 15 if zero_point else np.abs(x).max(2, keepdims=True) / 7
    assert (np.abs(y - x) <= span * 0.5 * (1 + 1e-3) + 1e-6).all()


def test_bytes_add_up():
    L, D, cells = 64, GQA.head_dim, GQA.n_layer * GQA.n_kv_head
    assert KiviParts(GQA, L, 4, "token", True, 8, "float16").nbytes == \
        cells * (2 * L * D // 2 + 2 * L * 2 * 2 + 2 * 8 * D * 2)  # codes; lo and step per token, K and V; window


@pytest.mark.parametrize("kwargs,match", [
    (dict(bits=3), "bits"), (dict(keys="head"), "keys"), (dict(zero_point=1), "zero_point"),
    (dict(recent=0), "recent"), (dict(recent=-1, keys="token"), "recent"), (dict(recent_dtype="int8"), "recent_dtype"),
    (dict(max_len=0), "max_len")])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        KiviParts(GQA, **kwargs)
