"""Chapter 7's exercise: symmetric int8 quantization of K, one scale per head and position.

The reader writes `quantize_k` (codes round(k / scale), scale = max |k| over the head dimension /
127) and `dequantize_k` (codes x scale). The check takes the K of every layer of the target over
held-out text and holds the reader's answer to the engine's int8 per-position storage form
(`lib.cache.quant`, as `KVCache(dtype="int8")` stores it): the scales equal the engine's up to
its float16 rounding, the codes equal the engine's codes for those scales, every value comes back
within half a step, and decoding the engine's own codes gives the engine's values.
"""
import numpy as np

from lib.book.exercises import Wrong, call, run, verdict
from lib.cache.kv_cache import KVCache
from lib.cache.quant import FORMS, position_scales
from lib.model import forward_cached

INT8 = FORMS["int8"]
F16_STEP = 2.0 ** -10  # relative spacing of float16 numbers: the engine stores its scales as float16


def quantize_k(k):
    """int8 codes (Hkv, T, D) of k (Hkv, T, D) and their scales (Hkv, T, 1), one per head and position."""
    scale = np.abs(k).max(axis=-1, keepdims=True) / 127  # (Hkv, T, 1): the largest |k| gets code 127
    codes = np.rint(k / scale).astype(np.int8)  # (Hkv, T, D)
    return codes, scale


def dequantize_k(codes, scale):
    """float32 values (Hkv, T, D) of codes (Hkv, T, D) with their scales (Hkv, T, 1)."""
    return codes.astype(np.float32) * scale  # (Hkv, T, D)


def keys(params, cfg, tokens):
    """The K of every layer over tokens, float32 (Hkv, T, D) each."""
    cache = KVCache(cfg, len(tokens))
    forward_cached(params, cfg, tokens, cache)
    return [cache.read(layer, len(tokens))[0] for layer in range(cfg.n_layer)]


def _check_scale(case, k, scale):
    Hkv, T, _ = k.shape
    if np.shape(scale) != (Hkv, T, 1):
        hint = (": one per channel (the max over positions); the engine keeps one per head and position, the max "
                "over the head dimension (the last axis)" if np.shape(scale) == (Hkv, 1, k.shape[2]) else "")
        raise Wrong(f"{case}: the scales must be (Hkv, T, 1) = {(Hkv, T, 1)}, one per head and position, "
                    f"got shape {np.shape(scale)}{hint}")
    engine = position_scales(k, INT8.qmax).astype(np.float32)  # (Hkv, T, 1): max|k| / 127, float16 rounded up
    ratio = np.asarray(scale, np.float64) / engine
    h, t, _ = np.unravel_index(np.argmax(np.abs(np.log(np.abs(ratio) + 1e-30))), ratio.shape)
    if abs(ratio[h, t, 0] - 1) > 2 * F16_STEP:
        hint = " (divide max |k| by 127, the largest code)" if abs(ratio[h, t, 0] - 127) < 1 else ""
        raise Wrong(f"{case}: the scale of head {h} at position {t} should be max |k| / 127 = {engine[h, t, 0]:.6g}, "
                    f"got {float(scale[h, t, 0]):.6g}, {ratio[h, t, 0]:.4g} times it{hint}")


def _check_codes(case, k, codes, scale):
    if np.shape(codes) != k.shape or np.asarray(codes).dtype != np.int8:
        raise Wrong(f"{case}: the codes must be int8 of shape {k.shape}, one byte per value, "
                    f"got {np.asarray(codes).dtype} of shape {np.shape(codes)}")
    expected = INT8.encode(k, np.asarray(scale, np.float32))  # (Hkv, T, D): the engine's codes for these scales
    wrong = np.argwhere(codes != expected)
    if len(wrong):
        h, t, d = wrong[0]
        exact = k[h, t, d] / scale[h, t, 0]
        hint = ": round to the nearest code (astype alone truncates toward zero)" if abs(codes[h, t, d]) < abs(exact) else ""
        raise Wrong(f"{case}: head {h}, position {t}, channel {d}: the code should be round(k / scale) = "
                    f"round({exact:.3f}) = {expected[h, t, d]}, got {codes[h, t, d]}{hint}")


def _check_values(case, fn, k, codes, scale, what):
    got = call(fn, codes, scale, case=f"{case}, decoding {what}")
    expected = INT8.decode(codes, np.asarray(scale, np.float32))  # (Hkv, T, D)
    if np.shape(got) != k.shape:
        raise Wrong(f"{case}: dequantize_k must return {k.shape} values, got shape {np.shape(got)}")
    off = np.abs(got - expected)
    if (off > 1e-6 * np.abs(expected) + 1e-12).any():
        h, t, d = np.unravel_index(np.argmax(off), off.shape)
        hint = {codes[h, t, d]: ": multiply each code by its scale",
                codes[h, t, d] / scale[h, t, 0]: ": multiply by the scale, not divide"}.get(got[h, t, d], "")
        raise Wrong(f"{case}, decoding {what}: head {h}, position {t}, channel {d} should be code x scale = "
                    f"{expected[h, t, d]:.6g}, got {got[h, t, d]:.6g}{hint}")
    error = np.abs(got - k) / np.asarray(scale)  # in steps
    if (error > 0.5 + 1e-3).any():
        h, t, d = np.unravel_index(np.argmax(error), error.shape)
        raise Wrong(f"{case}, decoding {what}: head {h}, position {t}, channel {d} is {error[h, t, d]:.2f} steps "
                    f"from k, more than half a step")


@verdict
def check(quantize, dequantize, params, cfg, tokens):
    """Verdict on the reader's quantize_k and dequantize_k against the engine's int8 per-position form."""
    for layer, k in enumerate(keys(params, cfg, tokens)):
        case = f"layer {layer}'s K ({k.shape[0]} heads x {k.shape[1]} positions x {k.shape[2]} channels)"
        got = call(quantize, k.copy(), case=case)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Wrong(f"{case}: quantize_k must return (codes, scales), got {type(got).__name__}")
        codes, scale = got
        _check_scale(case, k, scale)
        _check_codes(case, k, codes, scale)
        engine_scale = position_scales(k, INT8.qmax).astype(np.float32)  # (Hkv, T, 1)
        _check_values(case, dequantize, k, INT8.encode(k, engine_scale), engine_scale, "the engine's codes")
        _check_values(case, dequantize, k, codes, scale, "your codes")


def attempt(quantize, dequantize, params, cfg, tokens) -> None:
    """Chapter 7's check cell."""
    run(check, (quantize, dequantize), (quantize_k, dequantize_k), params, cfg, tokens)
