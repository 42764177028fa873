"""KIVI's three ideas, one at a time: per-channel keys, zero points, and a full-precision window.

KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache") combines
three ideas: keys quantized per channel over a group of tokens (a key's outliers sit in a few
channels, as KVQuant, Hooper et al. 2024, also shows), ranges with a zero point (a minimum and a
step, not a symmetric scale), and the most recent tokens kept in full precision. `KiviParts`
switches each one on or off, so that their shares of KIVI's quality can be measured apart.

It is a float32 `KVCache` whose positions are rounded in place, at the end of the step that
would store them, to exactly the values their codes would read back as: the quality of a stored
cache, without its packing. `lib.cache.kivi.KiviCache` stores the codes themselves; with KIVI's
settings and a float32 window the two read the same numbers (tests/test_kivi_parts.py). `nbytes`
counts what the stored form would take: the codes, their float16 ranges and the window.

- keys="channel": a key group of `recent` tokens is rounded per channel once it is complete
  (KIVI's streaming groups; the group is also the window); keys="token": each key is rounded
  per head and token as it leaves the window, as values always are.
- zero_point=True: x ~ lo + step * code, codes 0..2^bits - 1 (KIVI); False: x ~ scale * q,
  q in [-(2^(bits-1) - 1), 2^(bits-1) - 1] with scale = max|x| / that (as lib.cache.quant's int4).
- recent: the window of full-precision tokens (KIVI's residual; 0: none, only with per-token keys),
  kept in `recent_dtype` = "float16" (KIVI's, the model's dtype there) or "float32".
"""
import numpy as np

from lib.cache.kivi import _dequantize, _quantize, check_kivi
from lib.cache.kv_cache import KVCache
from lib.checks import check_option
from lib.config import ModelConfig

KEYS = ("channel", "token")
RECENT_DTYPES = {"float32": 4, "float16": 2}  # the window's dtype: bytes per value


def _up16(s):
    """s as float16, rounded up (so no code is clipped)."""
    s16 = s.astype(np.float16)
    return np.where(s16.astype(np.float32) < s, np.nextafter(s16, np.float16(np.inf)), s16)


def _round_trip(x, axis: int, bits: int, zero_point: bool) -> np.ndarray:
    """x (float32) as its `bits`-bit codes read back, one range per slice along `axis` (float16 ranges)."""
    if zero_point:
        return _dequantize(*_quantize(x, axis, bits))
    qmax = 2 ** (bits - 1) - 1
    scale = _up16(np.maximum(np.abs(x).max(axis=axis, keepdims=True) / qmax,
                             np.finfo(np.float16).tiny)).astype(np.float32)
    return np.clip(np.rint(x / scale), -qmax, qmax) * scale


class KiviParts(KVCache):
    def __init__(self, cfg: ModelConfig, max_len: int | None = None, bits: int = 4, keys: str = "channel",
                 zero_point: bool = True, recent: int = 32, recent_dtype: str = "float16"):
        super().__init__(cfg, max_len)
        check_option(keys, "keys (quantized per channel or per token)", KEYS)
        if not isinstance(zero_point, (bool, np.bool_)):
            raise TypeError(f"zero_point must be True or False, got {zero_point!r}")
        recent = check_kivi(cfg, bits, recent, int(keys == "channel"),
                            " (full-precision tokens; per-channel keys need a group)" if keys == "channel" else "")
        check_option(recent_dtype, "recent_dtype", RECENT_DTYPES)
        self.bits, self.keys, self.zero_point = int(bits), keys, bool(zero_point)
        self.recent, self.recent_dtype = recent, recent_dtype

    def advance(self, count: int) -> None:
        """End the step: round what KIVI would store now (finished key groups, positions leaving the
        window) to their codes' values, and this step's positions in the window to its dtype."""
        n = self.n
        super().advance(count)
        R, end = self.recent, self.n
        for arrays, per_channel in ((self.k, self.keys == "channel"), (self.v, False)):
            for x in arrays:  # (Hkv, max_len, D) per layer
                if self.recent_dtype == "float16" and R:  # the window's dtype (and the values it passes on)
                    x[:, n:end] = x[:, n:end].astype(np.float16)
                if per_channel:
                    for g0 in range(n // R * R, end // R * R, R):  # key groups this step completed
                        x[:, g0:g0 + R] = _round_trip(x[:, g0:g0 + R], 1, self.bits, self.zero_point)
                else:
                    leaving = slice(max(n - R, 0), max(end - R, 0))  # (Hkv, tokens, D): per head and token
                    x[:, leaving] = _round_trip(x[:, leaving], 2, self.bits, self.zero_point)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored form: codes, float16 ranges (one or two numbers each) and the window."""
        Hkv, D, L, R = self.cfg.n_kv_head, self.cfg.head_dim, self.max_len, self.recent
        key_len = -(-L // R) * R if self.keys == "channel" else L  # key codes: whole groups
        ranges = (-(-L // R) * D if self.keys == "channel" else L) + L  # keys' ranges, then the values'
        per_layer = (key_len + L) * D * self.bits // 8 + ranges * 2 * (1 + self.zero_point) \
            + 2 * R * D * RECENT_DTYPES[self.recent_dtype]
        return self.cfg.n_layer * Hkv * per_layer

    def __repr__(self):
        return (f"KiviParts(n={self.n}, {self.bits}-bit, keys per {self.keys}, "
                f"{'zero points' if self.zero_point else 'symmetric'}, window {self.recent} in {self.recent_dtype}, "
                f"nbytes={self.nbytes:,})")
