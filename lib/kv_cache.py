"""The key/value cache: K and V of every past position, so a decode step only computes the new one.

Under the causal mask a token's keys and values never change once computed, so they can be
stored and reused (Pope et al. 2022, "Efficiently Scaling Transformer Inference"). Storage is
preallocated per layer as (n_kv_head, max_len, head_dim), like llama2.c's key_cache; the
first `n` positions are valid. float16 halves the bytes; fp8 (e4m3), int8 and int4 store codes with
scales (`lib.quant`): per position (float16, computed on write) or fixed per head or per
tensor (from `quant.calibrate`). Reads always return float32.
"""
import numpy as np

from . import quant
from .config import ModelConfig, is_int

DTYPES = ("float32", "float16", "fp8", "int8", "int4")
STORED = {"float32": np.float32, "float16": np.float16, "fp8": np.uint8, "int8": np.int8, "int4": np.uint8}  # int4: 2 per byte


def storage(cfg: ModelConfig, dtype, granularity: str):
    """(kind, granularity or None, stored numpy dtype, values per position and head as stored) of a
    cache of `dtype` (a name of DTYPES or a numpy dtype), checked: the one rule for every K/V store."""
    kind = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if kind not in DTYPES:
        raise ValueError(f"KV cache dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if kind in quant.QMAX and granularity not in quant.GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(quant.GRANULARITIES)}, got {granularity!r}")
    if kind == "int4" and cfg.head_dim % 2:
        raise ValueError(f"int4 packs two codes per byte: head_dim {cfg.head_dim} must be even")
    width = cfg.head_dim // 2 if kind == "int4" else cfg.head_dim
    return kind, granularity if kind in quant.QMAX else None, np.dtype(STORED[kind]), width


def fixed_scales(cfg: ModelConfig, kind: str, granularity: str, calibration):
    """Per layer, the fixed K and V scales of 'head' ((Hkv, 1, 1)) or 'tensor' ((1, 1, 1)) granularity,
    from `calibration` = lib.quant.calibrate(params, cfg, tokens)."""
    if calibration is None:
        raise ValueError(f"granularity {granularity!r} needs fixed scales: pass "
                         f"calibration=lib.quant.calibrate(params, cfg, tokens)")
    k_max, v_max = calibration
    if np.shape(k_max) != (cfg.n_layer, cfg.n_kv_head) or np.shape(v_max) != (cfg.n_layer, cfg.n_kv_head):
        raise ValueError(f"calibration has shapes {np.shape(k_max)} and {np.shape(v_max)}, "
                         f"expected {(cfg.n_layer, cfg.n_kv_head)} each")
    return quant.static_scales(k_max, granularity, kind), quant.static_scales(v_max, granularity, kind)


class KVCache:
    def __init__(self, cfg: ModelConfig, max_len: int | None = None, dtype="float32",
                 granularity: str = "position", calibration=None):
        max_len = cfg.block_size if max_len is None else max_len
        if not is_int(max_len) or not 1 <= max_len <= cfg.block_size:
            raise ValueError(f"max_len must be an integer in 1..{cfg.block_size} (block_size), got {max_len!r}")
        self.cfg, self.max_len, self.n = cfg, int(max_len), 0
        self.kind, self.granularity, self.dtype, width = storage(cfg, dtype, granularity)
        shape = (cfg.n_kv_head, self.max_len, width)
        self.k = [np.zeros(shape, self.dtype) for _ in range(cfg.n_layer)]  # per layer (Hkv, max_len, D or D/2)
        self.v = [np.zeros(shape, self.dtype) for _ in range(cfg.n_layer)]
        self.k_scale = self.v_scale = []  # quantized only: per layer, see _init_scales
        if self.granularity is not None:
            self._init_scales(calibration)

    def _init_scales(self, calibration):
        if self.granularity == "position":  # (Hkv, max_len, 1) float16, filled on write
            shape = (self.cfg.n_kv_head, self.max_len, 1)
            self.k_scale = [np.zeros(shape, np.float16) for _ in range(self.cfg.n_layer)]
            self.v_scale = [np.zeros(shape, np.float16) for _ in range(self.cfg.n_layer)]
            return
        self.k_scale, self.v_scale = fixed_scales(self.cfg, self.kind, self.granularity, calibration)

    def check_room(self, count: int) -> None:
        """Raise before anything is written if `count` more positions do not fit."""
        if self.n + count > self.max_len:
            raise ValueError(
                f"KV cache is full: it holds {self.max_len} positions, {self.n} are used and "
                f"{count} more were asked")

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store K, V (Hkv, T, D) of T new positions at n..n+T-1 (n advances in `advance`)."""
        new = slice(self.n, self.n + k.shape[1])
        if self.granularity is None:  # float32 or float16: a plain store (cast on assignment)
            self.k[layer][:, new] = k
            self.v[layer][:, new] = v
            return
        for x, store, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            if self.granularity == "position":
                scales[layer][:, new] = quant.position_scales(x, self.kind)
                scale = scales[layer][:, new].astype(np.float32)  # (Hkv, T, 1)
            else:
                scale = scales[layer]  # fixed: (Hkv or 1, 1, 1)
            store[layer][:, new] = quant.quantize(x, scale, self.kind)

    def read(self, layer: int, end: int):
        """K, V of positions 0..end-1 as float32, each (Hkv, end, D)."""
        k, v = self.k[layer][:, :end], self.v[layer][:, :end]
        if self.granularity is not None:
            ks, vs = self.k_scale[layer], self.v_scale[layer]
            if self.granularity == "position":
                ks, vs = ks[:, :end].astype(np.float32), vs[:, :end].astype(np.float32)
            return quant.dequantize(k, ks, self.kind), quant.dequantize(v, vs, self.kind)
        if self.kind == "float16":
            return k.astype(np.float32), v.astype(np.float32)
        return k, v

    def advance(self, count: int) -> None:
        self.n += count

    def feed(self, new_tokens, step):
        """Compute new tokens at positions n.. with step(new_tokens, cache) and return their logits
        (T, V): the one way to advance a cache, shared with the paged `PagedSequence.feed`."""
        return step(new_tokens, self)

    def truncate(self, n: int) -> None:
        """Keep the first n positions (drop rejected draft tokens); stale entries are overwritten later."""
        if not is_int(n) or not 0 <= n <= self.n:
            raise ValueError(f"cannot truncate the KV cache to {n!r}: it holds {self.n} positions")
        self.n = int(n)

    def copy(self) -> "KVCache":
        """An independent cache with the same contents (for reusing a shared prefix)."""
        other = KVCache.__new__(KVCache)
        other.__dict__.update(self.__dict__)
        other.k, other.v = [a.copy() for a in self.k], [a.copy() for a in self.v]
        other.k_scale, other.v_scale = [a.copy() for a in self.k_scale], [a.copy() for a in self.v_scale]
        return other

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated K and V arrays and their scales."""
        return sum(a.nbytes for a in self.k + self.v + self.k_scale + self.v_scale)

    def __repr__(self):
        kind = self.kind + (f", {self.granularity} scales" if self.granularity else "")
        return f"KVCache(n={self.n}, max_len={self.max_len}, dtype={kind}, nbytes={self.nbytes:,})"
