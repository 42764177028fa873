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
    values themselves, unscaled). `encode` turns values (divided by their scale) into codes,
    `decode` turns codes back into float32 values (times their scale)."""
    name: str
    stored: np.dtype
    pack: int
    qmax: float
    to_codes: Callable  # values (already divided by their scale) -> codes
    to_values: Callable  # codes -> float32 values (before their scale)

    @property
    def scaled(self) -> bool:
        return self.qmax > 0

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


FORMS = {f.name: f for f in (
    Form("float32", np.dtype(np.float32), 1, 0, _as(np.float32), _as(np.float32)),
    Form("float16", np.dtype(np.float16), 1, 0, _as(np.float16), _as(np.float32)),
    Form("fp8", np.dtype(np.uint8), 1, 448.0, lambda y: fp8_encode(y), lambda c: fp8_decode(c)),  # 448: e4m3's largest value
    Form("int8", np.dtype(np.int8), 1, 127, _int_codes(127, np.int8), _as(np.float32)),
    Form("int4", np.dtype(np.uint8), 2, 7, _int4_codes, _int4_values),
)}
QUANTIZED = tuple(name for name, f in FORMS.items() if f.scaled)  # fp8, int8, int4


def position_scales(x, qmax: float):
    """One scale per head and position: max |x| over the head dimension / qmax, as float16.

    Rounded up to the next float16 (so no code is clipped) and at least float16's smallest normal
    number (so the scale is never zero or subnormal: a group of all zeros gets zero codes)."""
    amax = np.abs(x).max(axis=-1, keepdims=True)  # (Hkv, T, 1)
    s = np.maximum(amax / qmax, np.finfo(np.float16).tiny)
    s16 = s.astype(np.float16)
    return np.where(s16.astype(s.dtype) < s, np.nextafter(s16, np.float16(np.inf)), s16)


def static_scales(maxima, granularity: str, qmax: float):
    """Per layer, the fixed scale for 'head' (Hkv, 1, 1) or 'tensor' (1, 1, 1) granularity, float32,
    from the largest |value| of each layer and KV head (n_layer, n_kv_head)."""
    maxima = np.asarray(maxima, np.float64)
    if granularity == "head":
        return [(m / qmax).astype(np.float32)[:, None, None] for m in maxima]
    return [np.full((1, 1, 1), m.max() / qmax, np.float32) for m in maxima]


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
    x = np.asarray(x)
    a = np.minimum(np.abs(x.astype(np.float64)), E4M3[-1])  # (...,) saturate at 448
    bits = a.view(np.uint64)
    kept = (bits + np.uint64(2**48 - 1) + ((bits >> np.uint64(49)) & np.uint64(1))) >> np.uint64(49)  # exponent, 3 bits
    normal = kept.astype(np.int64) - (1023 - 7) * 8  # e4m3's exponent bias is 7
    code = np.where(a < 2.0 ** -6, np.rint(a * 2.0 ** 9).astype(np.int64), normal)  # subnormals: ties to even too
    return (code | np.signbit(x).astype(np.int64) << 7).astype(np.uint8)  # sign bit, also on a value rounded to -0


def fp8_decode(codes) -> np.ndarray:
    """float32 values of fp8 e4m3 codes from fp8_encode (which never writes the NaN codes 0x7F, 0xFF)."""
    value = E4M3[codes & 0x7F].astype(np.float32)
    return np.where(codes & 0x80, -value, value)
