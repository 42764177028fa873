"""Quantizing the KV cache: symmetric integer codes with scales, int8 and packed int4.

x ~ scale * q with q = round(x / scale) clipped to [-qmax, qmax], qmax = 127 (int8) or 7 (int4),
and scale = max|x| / qmax over a group of values. The group is the granularity: per position
(one scale per head and position, computed as each token is written, as in KIVI's per-token
value quantization, Liu et al. 2024), per head or per tensor (one scale per layer and head, or per
layer, fixed beforehand from a calibration run, like vLLM's `calculate_kv_scales` for its fp8
cache). int4 codes are packed two to a byte, so the bytes really halve.

fp8 stores x / scale as an 8-bit float, e4m3 (4 exponent bits, 3 mantissa bits, largest value 448),
rounded exactly as vLLM's `kv_cache_dtype="fp8"` cache stores it (torch.float8_e4m3fn), with
scale = max|x| / 448 over the same groups; the codes are the format's bit patterns (uint8).
"""
import numpy as np

QMAX = {"int8": 127, "int4": 7, "fp8": 448.0}  # fp8: the largest finite e4m3 value
GRANULARITIES = ("position", "head", "tensor")


def check_kind(kind) -> None:
    if kind not in QMAX:
        raise ValueError(f"quantized kind must be one of {', '.join(QMAX)}, got {kind!r}")


def quantize(x, scale, kind: str):
    """Codes of x (..., D) for the given scale (broadcastable to x): int8, or int4 packed to (..., D/2) uint8."""
    check_kind(kind)
    x, scale = np.asarray(x), np.asarray(scale)
    if kind == "int4" and x.shape[-1] % 2:
        raise ValueError(f"int4 packs two codes per byte: the last dimension ({x.shape[-1]}) must be even")
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError("scales must be finite and > 0 (a group of all-zero values still needs a positive scale)")
    if kind == "fp8":
        return fp8_encode(x / scale)  # (..., D) uint8
    qmax = QMAX[kind]
    q = np.rint(x / scale)  # (..., D)
    np.clip(q, -qmax, qmax, out=q)
    if kind == "int8":
        return q.astype(np.int8)
    u = (q + 8).astype(np.uint8)  # 1..15
    return u[..., 0::2] | (u[..., 1::2] << 4)  # (..., D/2): two codes per byte


def dequantize(codes, scale, kind: str) -> np.ndarray:
    """float32 values from codes and scales (the inverse of quantize, up to rounding)."""
    check_kind(kind)
    if kind == "fp8":
        return fp8_decode(codes) * scale
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
    if not (s <= np.finfo(np.float16).max).all():  # also catches NaN
        raise ValueError(f"K/V values up to {float(np.nanmax(np.abs(x)))!r} (or NaN) have no float16 scale: "
                         f"the largest is {float(np.finfo(np.float16).max) * QMAX[kind]:.4g} for {kind}")
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
    absmax = np.asarray(absmax, np.float64)
    if not (np.isfinite(absmax).all() and (absmax > 0).all()):
        raise ValueError("calibration maxima must be finite and > 0 for every layer and KV head "
                         "(all-zero, NaN or inf calibration would give no usable scale)")
    if granularity == "head":
        return [(m / QMAX[kind]).astype(np.float32)[:, None, None] for m in absmax]
    return [np.full((1, 1, 1), m.max() / QMAX[kind], np.float32) for m in absmax]


def _e4m3_values() -> np.ndarray:
    """The 127 non-negative finite values of fp8 e4m3 ("e4m3fn": 4 exponent bits with bias 7, 3 mantissa
    bits, no infinities, 0x7F is NaN), indexed by their bit pattern 0x00..0x7E, so increasing."""
    e, m = np.divmod(np.arange(127), 8)  # exponent and mantissa fields of each code
    return np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))  # subnormals, then normals


E4M3 = _e4m3_values()  # (127,) float64, 0 .. 448


def fp8_encode(x) -> np.ndarray:
    """fp8 e4m3 codes (uint8 bit patterns) of x: round to the nearest e4m3 value, ties to an even
    mantissa, saturating at +-448 (like vLLM's fp8 KV cache, which stores torch.float8_e4m3fn values of
    x / scale, clamped to the format's range first)."""
    a = np.minimum(np.abs(np.asarray(x, np.float64)), E4M3[-1])  # (...,) saturate at 448
    hi = np.minimum(np.searchsorted(E4M3, a), len(E4M3) - 1)  # first value >= a
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - E4M3[lo], E4M3[hi] - a
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)  # nearest, ties to even
    return (code | np.signbit(x) << 7).astype(np.uint8)  # sign bit, also on a value rounded to -0


def fp8_decode(codes) -> np.ndarray:
    """float32 values of fp8 e4m3 codes from fp8_encode."""
    codes = np.asarray(codes, np.uint8)
    value = E4M3[codes & 0x7F].astype(np.float32)
    return np.where(codes & 0x80, -value, value)
