"""KV quantization: codes and scales round-trip within half a step; caches store what they say."""
import numpy as np
import pytest
from conftest import perturbed_params
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lib.cache.kv_cache import KVCache
from lib.cache.quant import FORMS, fp8_decode, fp8_encode, position_scales
from lib.config import TARGET
from lib.kv_scales import kv_maxima
from lib.model import forward, forward_cached

values = arrays(np.float32, (2, 5, 8), elements=st.floats(-50, 50, width=32))


@settings(max_examples=100)
@given(values, st.sampled_from(["int8", "int4"]))
def test_round_trip_error_is_at_most_half_a_step(x, kind):
    """Also for a group too small for any nonzero code at float16's smallest scale: its codes are 0."""
    form = FORMS[kind]
    scale = position_scales(x, form.qmax).astype(np.float32)
    codes = form.encode(x, scale)
    assert codes.dtype == (np.int8 if kind == "int8" else np.uint8)
    assert codes.shape[-1] == (8 if kind == "int8" else 4)
    err = np.abs(form.decode(codes, scale) - x)
    assert (err <= scale * 0.5 * (1 + 1e-3) + 1e-6).all()


def test_an_all_zero_group_gets_the_smallest_scale_and_zero_codes():
    scales = position_scales(np.zeros((1, 2, 4)), FORMS["int8"].qmax)
    assert (scales == np.finfo(np.float16).tiny).all()
    assert not FORMS["int8"].encode(np.zeros((1, 2, 4)), scales.astype(np.float32)).any()


def test_int4_packing_keeps_every_code():
    q = np.arange(-7, 8, dtype=np.float32)[None, :].repeat(2, 0)[:, :14]  # (2, 14)
    assert (FORMS["int4"].decode(FORMS["int4"].encode(q, 1.0), 1.0) == q).all()


def test_static_scales_clip_outliers():
    codes = FORMS["int8"].encode(np.array([[[300.0, -300.0]]]), np.full((1, 1, 1), 1.0, np.float32))
    assert codes.tolist() == [[[127, -127]]]


@pytest.mark.parametrize("kind,granularity,tol", [("float16", None, 5e-3), ("int8", "position", 0.05),
                                                  ("int8", "head", 0.1), ("int8", "tensor", 0.1),
                                                  ("int4", "position", 1.0)])
def test_quantized_cache_stays_near_the_reference(kind, granularity, tol):
    params = perturbed_params(TARGET, seed=11)
    tokens = np.arange(120) * 5 % 96
    cal = kv_maxima(params, TARGET, tokens[:60])
    cache = KVCache(TARGET, 120, kind, granularity or "position", cal)
    out = np.concatenate([forward_cached(params, TARGET, tokens[:60], cache), forward_cached(params, TARGET, tokens[60:], cache)])
    assert np.abs(out - forward(params, TARGET, tokens)).max() < tol
    assert cache.k[0].dtype == {"float16": np.float16, "int8": np.int8, "int4": np.uint8}[kind]


def test_bytes_at_112_tokens():
    assert [KVCache(TARGET, 112, d).nbytes for d in ("float32", "float16", "int8")] == [344_064, 172_032, 93_184]
    assert KVCache(TARGET, 112, "int4").nbytes == 86_016 // 2 + 7_168


def test_copy_of_a_quantized_cache_is_independent():
    params = perturbed_params(TARGET, seed=12)
    cache = KVCache(TARGET, 64, "int8")
    forward_cached(params, TARGET, np.arange(30), cache)
    twin = cache.copy()
    forward_cached(params, TARGET, np.arange(30, 40), cache)  # grows the original only
    assert twin.n == 30 and not twin.k_scale[0][:, 30:40].any()
    fresh = KVCache(TARGET, 64, "int8")
    forward_cached(params, TARGET, np.arange(30), fresh)
    np.testing.assert_array_equal(forward_cached(params, TARGET, np.arange(30, 40), twin),
                                  forward_cached(params, TARGET, np.arange(30, 40), fresh))


@pytest.mark.parametrize("granularity", ["position", "head", "tensor"])
def test_fp8_cache_stores_exactly_the_e4m3_rounding_of_k_and_v(granularity):
    """What an fp8 cache returns is the float32 K/V rounded to e4m3 at its scale, nothing else
    (layer 0, whose K/V do not depend on what earlier layers read from the cache)."""
    params = perturbed_params(TARGET, seed=13)
    tokens = np.arange(40) * 7 % 96
    cal = kv_maxima(params, TARGET, tokens)
    cache, ref = KVCache(TARGET, 40, "fp8", granularity, cal), KVCache(TARGET, 40)
    forward_cached(params, TARGET, tokens, cache)
    forward_cached(params, TARGET, tokens, ref)
    assert cache.k[0].dtype == np.uint8 and cache.nbytes < ref.nbytes / 3
    for mine, theirs, scales in zip(cache.read(0, 40), ref.read(0, 40), (cache.k_scale[0], cache.v_scale[0])):
        scale = scales[:, :40].astype(np.float32) if granularity == "position" else scales
        np.testing.assert_array_equal(mine, fp8_decode(fp8_encode(theirs / scale)) * scale)
