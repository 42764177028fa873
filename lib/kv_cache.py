"""The key/value cache: K and V of every past position, so a decode step only computes the new one.

Under the causal mask a token's keys and values never change once computed, so they can be
stored and reused (Pope et al. 2022, "Efficiently Scaling Transformer Inference"). Storage is
preallocated per layer as (n_kv_head, max_len, head_dim), like llama2.c's key_cache; the
first `n` positions are valid. Float16 storage halves the bytes; reads return float32.
"""
import numpy as np

from .config import ModelConfig

DTYPES = (np.float32, np.float16)


class KVCache:
    def __init__(self, cfg: ModelConfig, max_len: int | None = None, dtype=np.float32):
        max_len = cfg.block_size if max_len is None else max_len
        if not isinstance(max_len, (int, np.integer)) or not 1 <= max_len <= cfg.block_size:
            raise ValueError(f"max_len must be an integer in 1..{cfg.block_size} (block_size), got {max_len!r}")
        dtype = np.dtype(dtype)
        if dtype not in [np.dtype(d) for d in DTYPES]:
            raise ValueError(f"KV cache dtype must be float32 or float16, got {dtype}")
        self.cfg = cfg
        self.max_len = int(max_len)
        self.dtype = dtype
        shape = (cfg.n_kv_head, self.max_len, cfg.head_dim)
        self.k = [np.zeros(shape, dtype) for _ in range(cfg.n_layer)]  # per layer (Hkv, max_len, D)
        self.v = [np.zeros(shape, dtype) for _ in range(cfg.n_layer)]  # per layer (Hkv, max_len, D)
        self.n = 0  # valid positions

    def check_room(self, count: int) -> None:
        """Raise before anything is written if `count` more positions do not fit."""
        if self.n + count > self.max_len:
            raise ValueError(
                f"KV cache is full: it holds {self.max_len} positions, {self.n} are used and "
                f"{count} more were asked")

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store K, V (Hkv, T, D) of T new positions at n..n+T-1 (n advances in `advance`)."""
        T = k.shape[1]
        self.k[layer][:, self.n:self.n + T] = k
        self.v[layer][:, self.n:self.n + T] = v

    def read(self, layer: int, end: int):
        """K, V of positions 0..end-1 as float32, each (Hkv, end, D)."""
        k, v = self.k[layer][:, :end], self.v[layer][:, :end]
        if self.dtype != np.float32:
            return k.astype(np.float32), v.astype(np.float32)
        return k, v

    def advance(self, count: int) -> None:
        self.n += count

    def truncate(self, n: int) -> None:
        """Keep the first n positions (drop rejected draft tokens); stale entries are overwritten later."""
        if not isinstance(n, (int, np.integer)) or not 0 <= n <= self.n:
            raise ValueError(f"cannot truncate the KV cache to {n!r}: it holds {self.n} positions")
        self.n = int(n)

    def copy(self) -> "KVCache":
        """An independent cache with the same contents (for reusing a shared prefix)."""
        other = KVCache(self.cfg, self.max_len, self.dtype)
        for src, dst in ((self.k, other.k), (self.v, other.v)):
            for a, b in zip(src, dst):
                b[:, :self.n] = a[:, :self.n]
        other.n = self.n
        return other

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated K and V arrays."""
        return sum(a.nbytes for a in self.k + self.v)

    def __repr__(self):
        return f"KVCache(n={self.n}, max_len={self.max_len}, dtype={self.dtype.name}, nbytes={self.nbytes:,})"
