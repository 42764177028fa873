"""Quantizing the KV cache: symmetric integer codes with scales, int8 and packed int4.

x ~ scale * q with q = round(x / scale) clipped to [-qmax, qmax], qmax = 127 (int8) or 7 (int4),
and scale = max|x| / qmax over a group of values. The group is the granularity: per position
(one scale per head and position, computed as each token is written, as in KIVI's per-token
value quantization, Liu et al. 2024), per head or per tensor (one scale per layer and head, or per
layer, fixed beforehand from a calibration run, like vLLM's `calculate_kv_scales` for its fp8
cache). int4 codes are packed two to a byte, so the bytes really halve.
"""
import numpy as np

QMAX = {"int8": 127, "int4": 7}
GRANULARITIES = ("position", "head", "tensor")


def quantize(x, scale, kind: str):
    """Codes of x (..., D) for the given scale (broadcastable to x): int8, or int4 packed to (..., D/2) uint8."""
    qmax = QMAX[kind]
    q = np.rint(x / scale)  # (..., D)
    np.clip(q, -qmax, qmax, out=q)
    if kind == "int8":
        return q.astype(np.int8)
    u = (q + 8).astype(np.uint8)  # 1..15
    return u[..., 0::2] | (u[..., 1::2] << 4)  # (..., D/2): two codes per byte


def dequantize(codes, scale, kind: str) -> np.ndarray:
    """float32 values from codes and scales (the inverse of quantize, up to rounding)."""
    if kind == "int8":
        return codes.astype(np.float32) * scale
    lo = (codes & 0x0F).astype(np.int8) - 8
    hi = (codes >> 4).astype(np.int8) - 8
    q = np.stack([lo, hi], axis=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)  # (..., D)
    return q.astype(np.float32) * scale


def position_scales(x, kind: str):
    """One scale per head and position: max |x| over the head dimension / qmax, as float16.

    Rounded up to the next float16 (so no code is clipped) and at least float16's smallest normal
    number (so the scale is never zero or subnormal)."""
    s = np.maximum(np.abs(x).max(axis=-1, keepdims=True) / QMAX[kind], np.finfo(np.float16).tiny)  # (Hkv, T, 1)
    s16 = s.astype(np.float16)
    return np.where(s16.astype(s.dtype) < s, np.nextafter(s16, np.float16(np.inf)), s16)


def calibrate(params, cfg, tokens):
    """Max |K| and |V| per layer and KV head over a calibration text: two (n_layer, Hkv) arrays."""
    from .kv_cache import KVCache
    from .model import forward_cached
    cache = KVCache(cfg, len(tokens))
    forward_cached(params, cfg, tokens, cache)
    k_max = np.array([np.abs(k[:, :len(tokens)]).max(axis=(1, 2)) for k in cache.k])  # (L, Hkv)
    v_max = np.array([np.abs(v[:, :len(tokens)]).max(axis=(1, 2)) for v in cache.v])  # (L, Hkv)
    return k_max, v_max


def static_scales(absmax, granularity: str, kind: str):
    """Per layer, the fixed scale for 'head' (Hkv, 1, 1) or 'tensor' (1, 1, 1) granularity, float32."""
    if granularity == "head":
        return [(m / QMAX[kind]).astype(np.float32)[:, None, None] for m in absmax]
    return [np.full((1, 1, 1), m.max() / QMAX[kind], np.float32) for m in absmax]
