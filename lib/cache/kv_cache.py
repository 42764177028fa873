"""The key/value cache: K and V of every past position, so a decode step only computes the new one.

Under the causal mask a token's keys and values never change once computed, so they can be
stored and reused (Pope et al. 2022, "Efficiently Scaling Transformer Inference"). Storage is
preallocated per layer as (n_kv_head, max_len, head_dim), like llama2.c's key_cache; the
first `n` positions are valid. float16 halves the bytes; fp8 (e4m3), int8 and int4 store codes with
scales (`lib.cache.quant`): per position (float16, computed on write) or fixed per head or per
tensor (from `lib.kv_scales.kv_maxima`). Reads always return float32.
"""
import numpy as np

from lib.cache import quant
from lib.checks import check_config
from lib.config import ModelConfig, is_int

DTYPES = tuple(quant.FORMS)  # float32, float16, fp8, int8, int4


def storage(cfg: ModelConfig, dtype, granularity: str, calibration=None):
    """(form, granularity or None for an unscaled form) of a cache of `dtype` (a name of DTYPES or a
    numpy dtype), checked with its granularity and, when given, its calibration: the one rule for
    every K/V store (`KVCache`, `lib.cache.paged.PagedKVCache`)."""
    check_config(cfg)
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None) or getattr(dtype, "name", None)
    if name not in DTYPES:
        raise ValueError(f"KV cache dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    form = quant.FORMS[name]
    quant.check_granularity(granularity)  # also for float dtypes, where it has no effect
    if cfg.head_dim % form.pack:
        raise ValueError(f"{name} packs {form.pack} codes per byte: head_dim {cfg.head_dim} must be a multiple of {form.pack}")
    if calibration is not None:  # checked even where it goes unused (a float cache, position scales)
        check_calibration(cfg, name, calibration)
    return form, granularity if form.scaled else None


def check_calibration(cfg: ModelConfig, kind: str, calibration) -> None:
    """The pair (k_max, v_max) from lib.kv_scales.kv_maxima: finite maxima > 0 of shape (n_layer, n_kv_head)."""
    if not (isinstance(calibration, (tuple, list)) and len(calibration) == 2):
        raise ValueError(f"calibration must be the pair (k_max, v_max) from lib.kv_scales.kv_maxima, got {calibration!r:.80}")
    expected = (cfg.n_layer, cfg.n_kv_head)
    for name, m in zip(("k_max", "v_max"), calibration):
        if np.shape(m) != expected:
            raise ValueError(f"calibration {name} has shape {np.shape(m)}, expected {expected}")
        quant.static_scales(m, "head", kind if kind in quant.QUANTIZED else "int8")


def fixed_scales(kind: str, granularity: str, calibration):
    """Per layer, the fixed K and V scales of 'head' ((Hkv, 1, 1)) or 'tensor' ((1, 1, 1)) granularity,
    from a checked `calibration` = lib.kv_scales.kv_maxima(params, cfg, tokens)."""
    if calibration is None:
        raise ValueError(f"granularity {granularity!r} needs fixed scales: pass "
                         f"calibration=lib.kv_scales.kv_maxima(params, cfg, tokens)")
    k_max, v_max = calibration
    return quant.static_scales(k_max, granularity, kind), quant.static_scales(v_max, granularity, kind)


def check_step(step) -> None:
    if not callable(step):
        raise TypeError(f"step must be a function step(new_tokens, cache) -> logits, such as a LeanModel, got {step!r:.80}")


class KVCache:
    def __init__(self, cfg: ModelConfig, max_len: int | None = None, dtype="float32",
                 granularity: str = "position", calibration=None):
        max_len = cfg.block_size if isinstance(cfg, ModelConfig) and max_len is None else max_len
        self.form, self.granularity = storage(cfg, dtype, granularity, calibration)
        if not is_int(max_len) or not 1 <= max_len <= cfg.block_size:
            raise ValueError(f"max_len must be an integer in 1..{cfg.block_size} (block_size), got {max_len!r}")
        self.cfg, self.max_len, self.n = cfg, int(max_len), 0
        shape = (cfg.n_kv_head, self.max_len, self.form.width(cfg.head_dim))
        self.k_scale = self.v_scale = []  # quantized only: per layer, see _init_scales
        if self.granularity is not None:
            self._init_scales(calibration)
        self.k = [np.zeros(shape, self.form.stored) for _ in range(cfg.n_layer)]  # per layer (Hkv, max_len, D or D/2)
        self.v = [np.zeros(shape, self.form.stored) for _ in range(cfg.n_layer)]
        self.written = [0] * cfg.n_layer  # per layer: positions 0..written-1 hold K/V (n, or n + T mid-step)

    def _init_scales(self, calibration):
        if self.granularity == "position":  # (Hkv, max_len, 1) float16, filled on write
            shape = (self.cfg.n_kv_head, self.max_len, 1)
            self.k_scale = [np.zeros(shape, np.float16) for _ in range(self.cfg.n_layer)]
            self.v_scale = [np.zeros(shape, np.float16) for _ in range(self.cfg.n_layer)]
            return
        self.k_scale, self.v_scale = fixed_scales(self.form.name, self.granularity, calibration)

    def check_room(self, count: int) -> None:
        """Raise before anything is written if `count` more positions do not fit."""
        if not is_int(count) or count < 0:
            raise ValueError(f"count must be a non-negative integer, got {count!r}")
        if self.n + count > self.max_len:
            raise ValueError(
                f"KV cache is full: it holds {self.max_len} positions, {self.n} are used and "
                f"{count} more were asked")

    def _check_layer(self, layer) -> None:
        if not is_int(layer) or not 0 <= layer < self.cfg.n_layer:
            raise ValueError(f"layer must be an integer in 0..{self.cfg.n_layer - 1}, got {layer!r}")

    def _check_kv(self, layer, k, v) -> int:
        """The number T of new positions in K, V (Hkv, T, D), once they fit after n."""
        self._check_layer(layer)
        shape_k, shape_v = getattr(k, "shape", ()), getattr(v, "shape", ())  # attributes: no numpy call in the hot path
        T = shape_k[1] if len(shape_k) == 3 else 0
        expected = (self.cfg.n_kv_head, T, self.cfg.head_dim)
        if not T or shape_k != expected or shape_v != expected:
            raise ValueError(f"k and v must be (n_kv_head, T, head_dim) = (Hkv, T, {self.cfg.head_dim}) with "
                             f"T >= 1, got shapes {np.shape(k)} and {np.shape(v)}")
        self.check_room(T)
        return T

    def _check_end(self, layer, end) -> None:
        self._check_layer(layer)
        if not is_int(end) or not 1 <= end <= self.written[layer]:
            raise ValueError(f"end must be an integer in 1..{self.written[layer]}: layer {layer} of the KV cache "
                             f"holds {self.written[layer]} written positions, got {end!r}")

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store K, V (Hkv, T, D) of T new positions at n..n+T-1 (n advances in `advance`)."""
        T = self._check_kv(layer, k, v)
        new = slice(self.n, self.n + T)
        (kc, ks), (vc, vs) = self._codes(layer, k, self.k_scale), self._codes(layer, v, self.v_scale)
        self.k[layer][:, new], self.v[layer][:, new] = kc, vc  # stored only once both are encoded
        if self.granularity == "position":
            self.k_scale[layer][:, new], self.v_scale[layer][:, new] = ks, vs
        self.written[layer] = self.n + T

    def _codes(self, layer, x, scales):
        """x (Hkv, T, D) in the cache's form and, per position, its float16 scales (Hkv, T, 1)."""
        if self.granularity == "position":
            s16 = quant.position_scales(x, self.form.name)
            return self.form.encode(x, s16.astype(np.float32)), s16
        return self.form.encode(x, scales[layer] if scales else None), None  # fixed: (Hkv or 1, 1, 1)

    def read(self, layer: int, end: int):
        """K, V of positions 0..end-1 as float32, each (Hkv, end, D): only positions written."""
        self._check_end(layer, end)
        ks, vs = self._scales(layer, end)
        return self.form.decode(self.k[layer][:, :end], ks), self.form.decode(self.v[layer][:, :end], vs)

    def _scales(self, layer, end):
        """The K and V scales of positions 0..end-1 as float32, or (None, None) for an unscaled form."""
        if self.granularity == "position":
            return self.k_scale[layer][:, :end].astype(np.float32), self.v_scale[layer][:, :end].astype(np.float32)
        if self.granularity:
            return self.k_scale[layer], self.v_scale[layer]
        return None, None

    def _check_advance(self, count) -> None:
        """Raise unless every layer has written the `count` positions after n."""
        if not is_int(count) or count < 1:
            raise ValueError(f"count must be a positive integer, got {count!r}")
        if self.written.count(self.n + count) != len(self.written):
            raise ValueError(f"cannot advance the KV cache by {count}: every layer must have written positions "
                             f"{self.n}..{self.n + count - 1} first (written per layer: {self.written})")

    def advance(self, count: int) -> None:
        """Count the `count` positions just written in every layer as cached."""
        self._check_advance(count)
        self.n += int(count)

    def feed(self, new_tokens, step):
        """Compute new tokens at positions n.. with step(new_tokens, cache) and return their logits
        (T, V): the one way to advance a cache, shared with the paged `PagedSequence.feed`."""
        check_step(step)
        return step(new_tokens, self)

    def truncate(self, n: int) -> None:
        """Keep the first n positions (drop rejected draft tokens); stale entries are overwritten later."""
        if not is_int(n) or not 0 <= n <= self.n:
            raise ValueError(f"cannot truncate the KV cache to {n!r}: it holds {self.n} positions")
        self.n = int(n)
        self.written = [self.n] * self.cfg.n_layer

    def copy(self) -> "KVCache":
        """An independent cache with the same contents (for reusing a shared prefix)."""
        other = type(self).__new__(type(self))  # a subclass (KiviParts) stays itself
        other.__dict__.update(self.__dict__)
        other.k, other.v = [a.copy() for a in self.k], [a.copy() for a in self.v]
        other.written = list(self.written)
        other.k_scale, other.v_scale = [a.copy() for a in self.k_scale], [a.copy() for a in self.v_scale]
        return other

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated K and V arrays and their scales."""
        return sum(a.nbytes for a in self.k + self.v + self.k_scale + self.v_scale)

    def __repr__(self):
        kind = self.form.name + (f", {self.granularity} scales" if self.granularity else "")
        return f"KVCache(n={self.n}, max_len={self.max_len}, dtype={kind}, nbytes={self.nbytes:,})"
