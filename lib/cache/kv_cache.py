"""The key/value cache: K and V of every past position, so a decode step only computes the new one.

Under the causal mask a token's keys and values never change once computed, so they can be
stored and reused (Pope et al. 2022, "Efficiently Scaling Transformer Inference"). Storage is
preallocated per layer as (n_kv_head, max_len, head_dim), like llama2.c's key_cache; the
first `n` positions are valid. float16 halves the bytes; fp8 (e4m3), int8 and int4 store codes with
scales (`lib.cache.quant`): per position (float16, computed on write) or fixed per head or per
tensor (from the K/V maxima of `lib.kv_scales.kv_maxima`). Reads always return float32.

The constructor and `feed` are the boundary: they check their arguments before anything changes.
`write`, `read`, `advance` and `truncate` are the steps a model drives and trust what they get.
"""
import numpy as np

from lib.cache import quant
from lib.checks import check_config, check_count, check_option, check_tokens
from lib.config import ModelConfig

DTYPES = tuple(quant.FORMS)  # float32, float16, fp8, int8, int4


def storage(cfg: ModelConfig, dtype, granularity: str, maxima=None):
    """(form, granularity or None for an unscaled form) of a cache of `dtype` (a name of DTYPES or a
    numpy dtype), checked with its granularity and, when given, its maxima: the one rule for every
    K/V store (`KVCache`, `lib.cache.paged.PagedKVCache`)."""
    check_config(cfg)
    name = getattr(dtype, "__name__", None) or getattr(dtype, "name", dtype)  # np.float16, np.dtype("int8"), "fp8"
    check_option(name, "KV cache dtype", DTYPES)
    check_option(granularity, "granularity", quant.GRANULARITIES)  # also for float dtypes
    form = quant.FORMS[name]
    if cfg.head_dim % form.pack:
        raise ValueError(f"{name} packs {form.pack} codes per byte: head_dim {cfg.head_dim} must be a multiple of {form.pack}")
    if maxima is not None:  # checked even where it goes unused (a float cache, position scales)
        check_maxima(cfg, form.qmax or quant.FORMS["int8"].qmax, maxima)
    if form.scaled and granularity != "position" and maxima is None:
        raise ValueError(f"granularity {granularity!r} needs fixed scales: pass maxima=lib.kv_scales.kv_maxima(params, cfg, tokens)")
    return form, granularity if form.scaled else None


def check_maxima(cfg: ModelConfig, qmax: float, maxima) -> None:
    """The pair (k_max, v_max) from lib.kv_scales.kv_maxima: finite maxima > 0 of shape (n_layer, n_kv_head),
    large enough that maximum / qmax is a normal float32."""
    if not (isinstance(maxima, (tuple, list)) and len(maxima) == 2):
        raise ValueError(f"maxima must be the pair (k_max, v_max) from lib.kv_scales.kv_maxima, got {maxima!r:.80}")
    low = np.finfo(np.float32).tiny * qmax  # a smaller maximum gives a float32 scale that underflows
    for name, m in zip(("k_max", "v_max"), map(np.asarray, maxima)):
        if m.shape != (cfg.n_layer, cfg.n_kv_head) or m.dtype.kind not in "iuf" or not (np.isfinite(m) & (m >= low)).all():
            raise ValueError(f"maxima {name} must be finite numbers >= {low:.3g} of shape (n_layer, n_kv_head), got {m.dtype} {m.shape}")


def fixed_scales(form: quant.Form, granularity: str, maxima):
    """Per layer, the fixed K and V scales of 'head' ((Hkv, 1, 1)) or 'tensor' ((1, 1, 1)) granularity,
    from maxima = lib.kv_scales.kv_maxima(params, cfg, tokens)."""
    k_max, v_max = maxima
    return quant.static_scales(k_max, granularity, form.qmax), quant.static_scales(v_max, granularity, form.qmax)


def check_max_len(cfg: ModelConfig, max_len) -> int:
    """Positions a cache holds: 1..block_size, or None for block_size."""
    return cfg.block_size if max_len is None else check_count(max_len, "max_len", high=cfg.block_size)


def check_step_function(step) -> None:
    """A cache's feed takes any function step(new_tokens, cache) -> logits (lib.checks.check_step asks more of a model)."""
    if not callable(step):
        raise TypeError(f"step must be a function step(new_tokens, cache) -> logits, such as a LeanModel, got {step!r:.80}")


class KVCache:
    def __init__(self, cfg: ModelConfig, max_len: int | None = None, dtype="float32",
                 granularity: str = "position", maxima=None):
        self.form, self.granularity = storage(cfg, dtype, granularity, maxima)
        self.cfg, self.max_len, self.n = cfg, check_max_len(cfg, max_len), 0
        shape = (cfg.n_kv_head, self.max_len, self.form.width(cfg.head_dim))
        self.k = [np.zeros(shape, self.form.stored) for _ in range(cfg.n_layer)]  # per layer (Hkv, max_len, D or D/2)
        self.v = [np.zeros(shape, self.form.stored) for _ in range(cfg.n_layer)]
        self.k_scale = self.v_scale = [None] * cfg.n_layer  # per layer: an unscaled form has none
        if self.granularity == "position":  # (Hkv, max_len, 1) float16, filled on write
            self.k_scale = [np.zeros(shape[:2] + (1,), np.float16) for _ in range(cfg.n_layer)]
            self.v_scale = [np.zeros(shape[:2] + (1,), np.float16) for _ in range(cfg.n_layer)]
        elif self.granularity:  # fixed: (Hkv or 1, 1, 1) float32
            self.k_scale, self.v_scale = fixed_scales(self.form, self.granularity, maxima)
        self.written = [0] * cfg.n_layer  # per layer: positions 0..written-1 hold K/V (n, or n + T mid-step)

    def check_room(self, count: int) -> None:
        """Raise before anything is written if `count` more positions do not fit."""
        if self.n + count > self.max_len:
            raise ValueError(f"KV cache is full: it holds {self.max_len} positions, {self.n} are used and {count} more were asked")

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store K, V (Hkv, T, D) of T new positions at n..n+T-1 (n advances in `advance`)."""
        new = slice(self.n, self.n + k.shape[1])
        self.k[layer][:, new] = self._encode(k, self.k_scale[layer], new)
        self.v[layer][:, new] = self._encode(v, self.v_scale[layer], new)
        self.written[layer] = new.stop

    def read(self, layer: int, end: int):
        """K, V of positions 0..end-1 as float32, each (Hkv, end, D)."""
        return self._decode(self.k[layer], self.k_scale[layer], end), self._decode(self.v[layer], self.v_scale[layer], end)

    def _encode(self, x, scales, new):
        """x (Hkv, T, D) in the cache's form; per position, its float16 scales go into scales[:, new]."""
        if self.granularity != "position":  # fixed scales (Hkv or 1, 1, 1), or none
            return self.form.encode(x, scales)
        s16 = quant.position_scales(x, self.form.qmax)  # (Hkv, T, 1)
        scales[:, new] = s16
        return self.form.encode(x, s16.astype(np.float32))

    def _decode(self, codes, scales, end):
        """float32 values of positions 0..end-1 of one layer's codes (Hkv, max_len, D or D/2)."""
        if self.granularity == "position":
            scales = scales[:, :end].astype(np.float32)  # (Hkv, end, 1)
        return self.form.decode(codes[:, :end], scales)

    def advance(self, count: int) -> None:
        """Count the `count` positions just written in every layer as cached."""
        self.n += int(count)

    def feed(self, new_tokens, step):
        """Compute new tokens at positions n.. with step(new_tokens, cache) and return their logits
        (T, V): the one way to advance a cache, shared with the paged `PagedSequence.feed`."""
        check_step_function(step)
        tokens = check_tokens(new_tokens, self.cfg, self.n)
        self.check_room(len(tokens))
        return step(tokens, self)

    def truncate(self, n: int) -> None:
        """Keep the first n positions (drop rejected draft tokens); stale entries are overwritten later."""
        self.n = int(n)
        self.written = [self.n] * self.cfg.n_layer

    def copy(self) -> "KVCache":
        """An independent cache with the same contents (for reusing a shared prefix)."""
        other = type(self).__new__(type(self))  # a subclass (KiviParts) stays itself
        other.__dict__.update(self.__dict__)
        other.k, other.v = [a.copy() for a in self.k], [a.copy() for a in self.v]
        other.written = list(self.written)
        other.k_scale = [None if a is None else a.copy() for a in self.k_scale]
        other.v_scale = [None if a is None else a.copy() for a in self.v_scale]
        return other

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated K and V arrays and their scales."""
        return sum(a.nbytes for a in self.k + self.v + self.k_scale + self.v_scale if a is not None)

    def __repr__(self):
        kind = self.form.name + (f", {self.granularity} scales" if self.granularity else "")
        return f"KVCache(n={self.n}, max_len={self.max_len}, dtype={kind}, nbytes={self.nbytes:,})"
