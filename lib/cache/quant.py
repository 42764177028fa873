"""How K/V values are stored: one `Form` per storage type, float32, float16, fp8 (e4m3), int8, int4.

A form knows its stored element type, how many values share an element (int4: two codes per byte,
so the bytes really halve), and how to encode values into codes and decode them back. The
quantized forms store codes with scales: x ~ scale * q with q = round(x / scale) clipped to
[-qmax, qmax], qmax = 127 (int8) or 7 (int4), and scale = max|x| / qmax over a group of values.
The group is the granularity: per position (one scale per head and position, computed as each
token is written, as in KIVI's per-token value quantization, Liu et al. 2024), per head or per
tensor (one scale per layer and head, or per layer, fixed beforehand from a calibration run, like
the calibrated scales vLLM's fp8 cache can load; its default scale is 1).

fp8 stores x / scale as an 8-bit float, e4m3 (4 exponent bits, 3 mantissa bits, largest value 448),
rounded exactly as vLLM's `kv_cache_dtype="fp8"` cache stores it (torch.float8_e4m3fn), with
scale = max|x| / 448 over the same groups; the codes are the format's bit patterns (uint8).
"""
from dataclasses import dataclass
from typing import Callable

import numpy as np

GRANULARITIES = ("position", "head", "tensor")


@dataclass(frozen=True)
class Form:
    """A storage form: `stored` elements, `pack` values per element, codes up to `qmax` (0: the
    values themselves, unscaled). `encode`/`decode` are the unchecked twins of quantize/dequantize."""
    name: str
    stored: np.dtype
    pack: int
    qmax: float
    to_codes: Callable  # values (already divided by their scale) -> codes
    to_values: Callable  # codes -> float32 values (before their scale)

    @property
    def scaled(self) -> bool:
        return self.qmax > 0

    @property
    def value_bytes(self) -> float:
        return self.stored.itemsize / self.pack

    def width(self, head_dim: int) -> int:
        """Stored elements per position and head."""
        return head_dim // self.pack

    def encode(self, x, scale=None) -> np.ndarray:
        return self.to_codes(x if scale is None else x / scale)

    def decode(self, codes, scale=None) -> np.ndarray:
        values = self.to_values(codes)
        return values if scale is None else values * scale


def _int_codes(qmax, dtype):
    def codes(y):
        q = np.rint(y)  # (..., D)
        np.clip(q, -qmax, qmax, out=q)
        return q.astype(dtype)
    return codes


def _int4_codes(y):
    u = (_int4_signed(y) + 8).astype(np.uint8)  # (..., D): 1..15
    return u[..., 0::2] | (u[..., 1::2] << 4)  # (..., D/2): two codes per byte


_int4_signed = _int_codes(7, np.int8)


def _int4_values(codes):
    q = np.stack([(codes & 0x0F).astype(np.int8) - 8, (codes >> 4).astype(np.int8) - 8], axis=-1)  # (..., D/2, 2)
    return q.reshape(*codes.shape[:-1], codes.shape[-1] * 2).astype(np.float32)  # (..., D)


def _as(dtype):
    return lambda a: a.astype(dtype, copy=False)


def _fp8_values(codes):
    value = E4M3[codes & 0x7F].astype(np.float32)
    return np.where(codes & 0x80, -value, value)


FORMS = {f.name: f for f in (
    Form("float32", np.dtype(np.float32), 1, 0, _as(np.float32), _as(np.float32)),
    Form("float16", np.dtype(np.float16), 1, 0, _as(np.float16), _as(np.float32)),
    Form("fp8", np.dtype(np.uint8), 1, 448.0, lambda y: fp8_encode(y), _fp8_values),  # 448: e4m3's largest value
    Form("int8", np.dtype(np.int8), 1, 127, _int_codes(127, np.int8), _as(np.float32)),
    Form("int4", np.dtype(np.uint8), 2, 7, _int4_codes, _int4_values),
)}
QUANTIZED = tuple(name for name, f in FORMS.items() if f.scaled)  # fp8, int8, int4


def check_kind(kind) -> Form:
    """The quantized form named `kind`."""
    if not isinstance(kind, str) or kind not in QUANTIZED:
        raise ValueError(f"quantized kind must be one of {', '.join(QUANTIZED)}, got {kind!r}")
    return FORMS[kind]


def check_granularity(granularity) -> None:
    if not isinstance(granularity, str) or granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")


def check_values(x, name: str = "x") -> np.ndarray:
    """Values to quantize: a float array (..., D) with D >= 1, every value finite."""
    x = np.asarray(x)
    if x.dtype.kind not in "iuf" or x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must be a non-empty array of numbers (..., D), got {x.dtype} of shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must be finite: NaN or inf has no code")
    return x


def check_scales(scale, shape) -> np.ndarray:
    """Scales that broadcast to `shape` (the values' or the codes' shape), finite and > 0."""
    scale = np.asarray(scale)
    fits = scale.ndim <= len(shape) and all(s in (1, n) for s, n in zip(scale.shape[::-1], shape[::-1]))
    if scale.dtype.kind not in "iuf" or not fits:
        raise ValueError(f"scales must be numbers broadcastable to {tuple(shape)}, got {scale.dtype} of shape {scale.shape}")
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError("scales must be finite and > 0 (a group of all-zero values still needs a positive scale)")
    return scale


def quantize(x, scale, kind: str):
    """Codes of x (..., D) for the given scale (broadcastable to x): int8, or int4 packed to (..., D/2) uint8."""
    form = check_kind(kind)
    x = check_values(x)
    if x.shape[-1] % form.pack:
        raise ValueError(f"{kind} packs {form.pack} codes per byte: the last dimension ({x.shape[-1]}) must be a "
                         f"multiple of {form.pack}")
    return form.encode(x, check_scales(scale, x.shape))


def dequantize(codes, scale, kind: str) -> np.ndarray:
    """float32 values from codes and scales (the inverse of quantize, up to rounding)."""
    form = check_kind(kind)
    codes = np.asarray(codes)
    if codes.dtype != form.stored or codes.ndim == 0:
        raise ValueError(f"{kind} codes must be an array of {form.stored.name} (from quantize), "
                         f"got {codes.dtype} of shape {codes.shape}")
    if kind == "fp8":
        _check_fp8(codes)
    return form.decode(codes, check_scales(scale, codes.shape[:-1] + (codes.shape[-1] * form.pack,)))


def position_scales(x, kind: str):
    """One scale per head and position: max |x| over the head dimension / qmax, as float16.

    Rounded up to the next float16 (so no code is clipped) and at least float16's smallest normal
    number (so the scale is never zero or subnormal). A group of all zeros gets that smallest
    scale and zero codes; a group whose largest |value| is not zero but so small that even that
    scale would give it only zero codes is refused, rather than silently stored as zeros."""
    qmax = check_kind(kind).qmax
    x = np.asarray(x)
    if x.dtype.kind not in "iuf" or x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"K/V values must be a non-empty array of numbers (..., D), got {x.dtype} of shape {x.shape}")
    amax = np.abs(x).max(axis=-1, keepdims=True)  # (Hkv, T, 1)
    s = np.maximum(amax / qmax, np.finfo(np.float16).tiny)
    if not (s <= np.finfo(np.float16).max).all():  # also catches NaN
        raise ValueError(f"K/V values up to {float(np.nanmax(np.abs(x)))!r} (or NaN) have no float16 scale: "
                         f"the largest is {float(np.finfo(np.float16).max) * qmax:.4g} for {kind}")
    lost = (amax > 0) & (amax < smallest_coded(kind))
    if lost.any():
        raise ValueError(f"K/V values as small as {float(amax[lost].max())!r} (a group's largest |value|) have no "
                         f"float16 scale: every code would be 0; a nonzero group needs a largest |value| of at least "
                         f"{smallest_coded(kind):.3g} for {kind} (a group of all zeros is fine)")
    s16 = s.astype(np.float16)
    return np.where(s16.astype(s.dtype) < s, np.nextafter(s16, np.float16(np.inf)), s16)


def smallest_coded(kind: str) -> float:
    """The smallest largest-|value| of a group that still gets a nonzero code with the smallest
    float16 scale: half a step for int8 and int4 (rint rounds half to even, so just above it),
    half of fp8's smallest subnormal for fp8."""
    check_kind(kind)
    step = float(E4M3[1]) if kind == "fp8" else 1.0
    return float(np.nextafter(np.float32(step / 2 * np.finfo(np.float16).tiny), np.float32(1)))


def static_scales(absmax, granularity: str, kind: str):
    """Per layer, the fixed scale for 'head' (Hkv, 1, 1) or 'tensor' (1, 1, 1) granularity, float32."""
    if granularity not in ("head", "tensor"):
        raise ValueError(f"granularity of fixed scales must be head or tensor, got {granularity!r}")
    qmax = check_kind(kind).qmax
    absmax = np.asarray(absmax)
    if absmax.dtype.kind not in "iuf" or absmax.ndim != 2 or absmax.size == 0:
        raise ValueError(f"calibration maxima must be a (n_layer, n_kv_head) array of numbers, got {absmax.dtype} "
                         f"of shape {absmax.shape}")
    absmax = absmax.astype(np.float64)
    if not (np.isfinite(absmax).all() and (absmax / qmax >= np.finfo(np.float32).tiny).all()):
        raise ValueError("calibration maxima must be finite and > 0 for every layer and KV head "
                         "(all-zero, NaN or inf calibration would give no usable scale; values below "
                         f"{np.finfo(np.float32).tiny * qmax:.3g} give a float32 scale that underflows)")
    if granularity == "head":
        return [(m / qmax).astype(np.float32)[:, None, None] for m in absmax]
    return [np.full((1, 1, 1), m.max() / qmax, np.float32) for m in absmax]


def _e4m3_values() -> np.ndarray:
    """The 127 non-negative finite values of fp8 e4m3 ("e4m3fn": 4 exponent bits with bias 7, 3 mantissa
    bits, no infinities, 0x7F is NaN), indexed by their bit pattern 0x00..0x7E, so increasing."""
    e, m = np.divmod(np.arange(127), 8)  # exponent and mantissa fields of each code
    return np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))  # subnormals, then normals


E4M3 = _e4m3_values()  # (127,) float64, 0 .. 448


def fp8_encode(x) -> np.ndarray:
    """fp8 e4m3 codes (uint8 bit patterns) of x: round to the nearest e4m3 value, ties to an even
    mantissa, saturating at +-448 (like vLLM's fp8 KV cache, which stores torch.float8_e4m3fn values of
    x / scale, clamped to the format's range first).

    With bit operations, as a conversion instruction does: in float64 (exact for float32 input),
    a normal value keeps 3 of its 52 mantissa bits, rounded to nearest even by adding just under
    half a step plus the lowest kept bit; a carry moves it to the next binade. Below 2^-6 the codes
    are subnormal, multiples of 2^-9."""
    x = check_values(x)
    a = np.minimum(np.abs(x.astype(np.float64)), E4M3[-1])  # (...,) saturate at 448
    bits = a.view(np.uint64)
    kept = (bits + np.uint64(2**48 - 1) + ((bits >> np.uint64(49)) & np.uint64(1))) >> np.uint64(49)  # exponent, 3 bits
    normal = kept.astype(np.int64) - (1023 - 7) * 8  # e4m3's exponent bias is 7
    code = np.where(a < 2.0 ** -6, np.rint(a * 2.0 ** 9).astype(np.int64), normal)  # subnormals: ties to even too
    return (code | np.signbit(x).astype(np.int64) << 7).astype(np.uint8)  # sign bit, also on a value rounded to -0


def _check_fp8(codes) -> None:
    if ((codes & 0x7F) == 0x7F).any():
        raise ValueError("fp8 codes 0x7F and 0xFF are NaN in e4m3fn, which fp8_encode never writes")


def fp8_decode(codes) -> np.ndarray:
    """float32 values of fp8 e4m3 codes from fp8_encode."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise ValueError(f"fp8 codes must be a uint8 array of bit patterns (from fp8_encode), got {codes.dtype}")
    _check_fp8(codes)
    return _fp8_values(codes)
