"""Calibrating a quantized KV cache's static scales: the largest |K| and |V| each layer and KV
head writes over a calibration text, as vLLM's fp8 cache takes calibrated scales (k_scale,
v_scale) from llm-compressor. It runs the model, so it sits above the caches, beside the model
(`lib.cache.kv_cache.fixed_scales` turns the maxima into scales).
"""
import numpy as np

from lib.cache.kv_cache import KVCache
from lib.checks import check_tokens
from lib.model import forward_cached


def kv_maxima(params, cfg, tokens):
    """Max |K| and |V| per layer and KV head over a calibration text: two (n_layer, Hkv) arrays."""
    cache = KVCache(cfg, len(check_tokens(tokens, cfg)))
    forward_cached(params, cfg, tokens, cache)
    k_max = np.array([np.abs(k[:, :len(tokens)]).max(axis=(1, 2)) for k in cache.k])  # (L, Hkv)
    v_max = np.array([np.abs(v[:, :len(tokens)]).max(axis=(1, 2)) for v in cache.v])  # (L, Hkv)
    return k_max, v_max
