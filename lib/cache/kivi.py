"""KIVI: keys quantized per channel, values per token, the most recent tokens kept in full precision.

KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache") starts
from where the two caches' large values lie: a key's outliers sit in a few channels, the same
channels at every position, while a value's magnitude varies from token to token. So keys are
quantized per channel, each channel's range taken over a group of tokens, and values per token,
each token's range taken over its channels. Both are asymmetric (a minimum and a step, not a
symmetric scale), which matters most at 2 bits, and neither needs calibration.

A channel's range needs a group of tokens, so keys are kept in full precision until `recent`
of them have arrived; then the group is quantized at once (KIVI's streaming scheme). Values are
quantized one by one as they leave a window of the last `recent` tokens (KIVI's "residual"). So the
full-precision part is at most `recent` keys and exactly the last `recent` values; everything older is codes
(`bits` = 2 or 4, packed 8 / bits to a byte) with float16 minima and steps: per group and channel
for keys, per token for values.

As in KIVI, a step attends to its own new tokens in full precision and quantizes afterwards: a
prefill's attention is exact, and a decoding token sees its own key before its group is
quantized. So a step's `write` only holds its new K and V (the step's own arrays), its reads
return them as they are, and `advance` (the end of the step) stores them: finished key groups
and values that leave the window become codes.

`KiviCache` offers `KVCache`'s interface (write, read, advance, truncate, feed, copy), so
`lib.model.forward_cached` and `lib.fast.lean.LeanModel` run on it unchanged; reads return float32.
Truncating into quantized positions (a rejected draft) puts their dequantized values back into
the full-precision part, so what a read returns never changes.
"""
import numpy as np

from lib.cache.kv_cache import KVCache, check_max_len
from lib.checks import check_config, check_count, check_option
from lib.config import ModelConfig

BITS = (2, 4)


def check_kivi(cfg: ModelConfig, bits, recent, low: int = 1, what: str = " (full-precision tokens, also the key group)") -> int:
    """KIVI's settings, the one rule for `KiviCache` and `lib.cache.kivi_parts.KiviParts`: 2 or 4 bits,
    whole bytes of codes along head_dim, and a window of `recent` >= low tokens (returned)."""
    check_option(bits, "KIVI bits", BITS)
    if cfg.head_dim * bits % 8:
        raise ValueError(f"{bits}-bit codes pack {8 // bits} to a byte: head_dim {cfg.head_dim} must be a multiple")
    return check_count(recent, "recent", low, what)


def _pack(codes, bits: int) -> np.ndarray:
    """Codes (..., D) in 0..2^bits - 1 as bytes (..., D * bits / 8): code i of a byte in bits i*bits.."""
    per = 8 // bits
    c = codes.reshape(*codes.shape[:-1], -1, per).astype(np.uint8)  # (..., D/per, per)
    return np.bitwise_or.reduce(c << (bits * np.arange(per, dtype=np.uint8)), axis=-1)  # (..., D/per)


def _unpack(packed, bits: int) -> np.ndarray:
    """The inverse of _pack: (..., D * bits / 8) bytes -> (..., D) codes."""
    per = 8 // bits
    c = (packed[..., None] >> (bits * np.arange(per, dtype=np.uint8))) & np.uint8(2 ** bits - 1)  # (..., D/per, per)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _quantize(x, axis: int, bits: int):
    """Codes of x over `axis` with a minimum and a step per group (float16, as KIVI keeps them):
    (codes uint8, lo, step), x ~ lo + step * code. The step is rounded up to a float16, so no
    code exceeds 2^bits - 1; a constant group gets the smallest normal step and all-zero codes."""
    lo = x.min(axis=axis, keepdims=True).astype(np.float16)
    lo32 = lo.astype(np.float32)
    span = np.maximum(x.max(axis=axis, keepdims=True) - lo32, 0)
    step = np.maximum(span / (2 ** bits - 1), np.finfo(np.float16).tiny).astype(np.float32)
    s16 = step.astype(np.float16)
    s16 = np.where(s16.astype(np.float32) < step, np.nextafter(s16, np.float16(np.inf)), s16)
    codes = np.clip(np.rint((x - lo32) / s16.astype(np.float32)), 0, 2 ** bits - 1).astype(np.uint8)
    return codes, lo, s16


def _dequantize(codes, lo, step) -> np.ndarray:
    return lo.astype(np.float32) + step.astype(np.float32) * codes


class KiviCache:
    def __init__(self, cfg: ModelConfig, max_len: int | None = None, bits: int = 2, recent: int = 32):
        max_len = check_max_len(check_config(cfg), max_len)
        recent = check_kivi(cfg, bits, recent)
        self.cfg, self.max_len, self.bits, self.recent, self.n = cfg, max_len, int(bits), recent, 0
        Hkv, D, L, R = cfg.n_kv_head, cfg.head_dim, self.max_len, self.recent
        groups = -(-L // R)
        self.k_codes = [np.zeros((Hkv, groups * R, D * bits // 8), np.uint8) for _ in range(cfg.n_layer)]
        self.k_lo = [np.zeros((Hkv, groups, 1, D), np.float16) for _ in range(cfg.n_layer)]  # per group and channel
        self.k_step = [np.zeros((Hkv, groups, 1, D), np.float16) for _ in range(cfg.n_layer)]
        self.v_codes = [np.zeros((Hkv, L, D * bits // 8), np.uint8) for _ in range(cfg.n_layer)]
        self.v_lo = [np.zeros((Hkv, L, 1), np.float16) for _ in range(cfg.n_layer)]  # per token
        self.v_step = [np.zeros((Hkv, L, 1), np.float16) for _ in range(cfg.n_layer)]
        self.k_recent = [np.zeros((Hkv, R, D), np.float32) for _ in range(cfg.n_layer)]  # slot p % R: position p
        self.v_recent = [np.zeros((Hkv, R, D), np.float32) for _ in range(cfg.n_layer)]
        self.new_k = [None] * cfg.n_layer  # per layer: this step's K and V (Hkv, T, D), stored at `advance`
        self.new_v = [None] * cfg.n_layer
        self.written = [0] * cfg.n_layer

    # where each position lives: keys of complete groups of R, and values outside the last R, are codes
    def _key_codes_end(self, n: int) -> int:
        return n // self.recent * self.recent

    def _value_codes_end(self, n: int) -> int:
        return max(n - self.recent, 0)

    # the same room rule and the same `feed` as KVCache's: they read only cfg, n and max_len
    check_room, feed = KVCache.check_room, KVCache.feed

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Hold K, V (Hkv, T, D) of T new positions at n..n+T-1 for this step: reads return them
        as they are, and `advance` stores them."""
        self.new_k[layer], self.new_v[layer] = np.array(k, np.float32), np.array(v, np.float32)
        self.written[layer] = self.n + k.shape[1]

    def _store(self, layer: int) -> None:
        """Store this step's K and V of one layer: finished key groups and values that leave the
        window become codes, the rest goes into the full-precision part."""
        k, v = self.new_k[layer], self.new_v[layer]
        n, R = self.n, self.recent
        end = n + k.shape[1]
        k_all = np.concatenate([self._exact_keys(layer, n), k], axis=1)  # (Hkv, end - key codes' end, D)
        first = self._key_codes_end(n)
        for g0 in range(first, self._key_codes_end(end), R):  # key groups finished by this step
            codes, lo, step = _quantize(k_all[:, g0 - first:g0 - first + R], 1, self.bits)  # per channel
            self.k_codes[layer][:, g0:g0 + R] = _pack(codes, self.bits)
            self.k_lo[layer][:, g0 // R], self.k_step[layer][:, g0 // R] = lo, step
        rest = np.arange(self._key_codes_end(end), end)
        self.k_recent[layer][:, rest % R] = k_all[:, rest - first]
        v_first = self._value_codes_end(n)
        v_all = np.concatenate([self.v_recent[layer][:, np.arange(v_first, n) % R], v], axis=1)
        leaving = np.arange(v_first, self._value_codes_end(end))  # values that leave the window
        if len(leaving):
            codes, lo, step = _quantize(v_all[:, leaving - v_first], 2, self.bits)  # per token
            self.v_codes[layer][:, leaving] = _pack(codes, self.bits)
            self.v_lo[layer][:, leaving], self.v_step[layer][:, leaving] = lo, step
        window = np.arange(self._value_codes_end(end), end)
        self.v_recent[layer][:, window % R] = v_all[:, window - v_first]
        self.new_k[layer] = self.new_v[layer] = None

    def _exact_keys(self, layer, n):
        """The full-precision keys of positions key codes' end..n-1, (Hkv, n - that, D)."""
        return self.k_recent[layer][:, np.arange(self._key_codes_end(n), n) % self.recent]

    def read(self, layer: int, end: int):
        """K, V of positions 0..end-1 as float32, each (Hkv, end, D): codes dequantized, the rest as stored."""
        n, R, Hkv, D = self.n, self.recent, self.cfg.n_kv_head, self.cfg.head_dim
        kq = self._key_codes_end(n)
        groups = _unpack(self.k_codes[layer][:, :kq], self.bits).reshape(Hkv, kq // R, R, D)
        keys = np.concatenate([_dequantize(groups, self.k_lo[layer][:, :kq // R],
                                           self.k_step[layer][:, :kq // R]).reshape(Hkv, kq, D),
                               self._exact_keys(layer, n)], axis=1)
        vq = self._value_codes_end(n)
        values = np.concatenate([_dequantize(_unpack(self.v_codes[layer][:, :vq], self.bits),
                                             self.v_lo[layer][:, :vq], self.v_step[layer][:, :vq]),
                                 self.v_recent[layer][:, np.arange(vq, n) % R]], axis=1)
        if self.written[layer] > n:  # this step's own positions, as they came
            keys = np.concatenate([keys, self.new_k[layer]], axis=1)
            values = np.concatenate([values, self.new_v[layer]], axis=1)
        return keys[:, :end], values[:, :end]

    def advance(self, count: int) -> None:
        """End the step: store every layer's new K and V, and count them as cached."""
        for layer in range(self.cfg.n_layer):
            self._store(layer)
        self.n += int(count)

    def truncate(self, n: int) -> None:
        """Keep the first n positions. Positions that were codes and are full precision again at n
        (a key group left unfinished, values back inside the window) get their dequantized values."""
        R, held = self.recent, self.n
        self.written = [held] * self.cfg.n_layer  # a step's unstored positions are dropped
        self.new_k, self.new_v = [None] * self.cfg.n_layer, [None] * self.cfg.n_layer
        for layer in range(self.cfg.n_layer):
            k_back = np.arange(self._key_codes_end(n), min(n, self._key_codes_end(held)))
            v_back = np.arange(self._value_codes_end(n), min(n, self._value_codes_end(held)))
            if held and (len(k_back) or len(v_back)):
                keys, values = self.read(layer, held)
                self.k_recent[layer][:, k_back % R] = keys[:, k_back]
                self.v_recent[layer][:, v_back % R] = values[:, v_back]
        self.n = int(n)
        self.written = [self.n] * self.cfg.n_layer

    def copy(self) -> "KiviCache":
        other = KiviCache.__new__(KiviCache)
        other.__dict__.update(self.__dict__)
        for name, value in self.__dict__.items():
            if isinstance(value, list):  # per layer: arrays (or None), or `written`'s counts
                other.__dict__[name] = [a.copy() if isinstance(a, np.ndarray) else a for a in value]
        return other

    @property
    def nbytes(self) -> int:
        """Bytes of the codes, their float16 minima and steps, and the full-precision part."""
        arrays = (self.k_codes, self.k_lo, self.k_step, self.v_codes, self.v_lo, self.v_step, self.k_recent, self.v_recent)  # not
        # new_k and new_v: a step's own K and V, held while it runs
        return sum(a.nbytes for group in arrays for a in group)

    def __repr__(self):
        return (f"KiviCache(n={self.n}, max_len={self.max_len}, {self.bits}-bit, recent={self.recent}, "
                f"nbytes={self.nbytes:,})")
