"""Chapter 3's exercise: write and read one layer of a preallocated K/V cache.

The reader writes `cache_write` (store T new positions at n..n+T-1 of arrays allocated once, as
`lib.KVCache.write`) and `cache_read` (the first `end` positions, as `KVCache.read`). The check
first writes a prompt and one more token by hand and says where each position landed, then runs
`forward_cached` over a cache built on the reader's two functions and demands the logits of
`lib.KVCache` bit for bit: the cache changes where K and V live, never a value.
"""
import numpy as np

from lib.book.exercises import Wrong, call, run, verdict
from lib.cache.kv_cache import KVCache
from lib.model import forward_cached


def cache_write(k_cache, v_cache, n, k, v):
    """Store K, V (Hkv, T, D) at positions n..n+T-1 of one layer's cache (Hkv, max_len, D)."""
    T = k.shape[1]
    k_cache[:, n:n + T] = k  # (Hkv, T, D)
    v_cache[:, n:n + T] = v


def cache_read(k_cache, v_cache, end):
    """K, V of positions 0..end-1, (Hkv, end, D) each."""
    return k_cache[:, :end], v_cache[:, :end]  # (Hkv, end, D): views, no copy


class ReaderCache:
    """The KVStore interface of `forward_cached` on the reader's write and read, one array pair per layer."""

    def __init__(self, cfg, max_len, write, read):
        self.cfg, self.n, self.write_fn, self.read_fn = cfg, 0, write, read
        shape = (cfg.n_kv_head, max_len, cfg.head_dim)  # (Hkv, max_len, D)
        self.k = [np.zeros(shape, np.float32) for _ in range(cfg.n_layer)]
        self.v = [np.zeros(shape, np.float32) for _ in range(cfg.n_layer)]

    def check_room(self, count):
        pass

    def write(self, layer, k, v):
        call(self.write_fn, self.k[layer], self.v[layer], self.n, k, v, case=f"layer {layer}, writing at n = {self.n}")

    def read(self, layer, end):
        got = call(self.read_fn, self.k[layer], self.v[layer], end, case=f"layer {layer}, reading end = {end}")
        expected = (self.cfg.n_kv_head, end, self.cfg.head_dim)
        if not (isinstance(got, tuple) and len(got) == 2 and all(np.shape(a) == expected for a in got)):
            shapes = [np.shape(a) for a in got] if isinstance(got, tuple) else type(got).__name__
            raise Wrong(f"cache_read(end={end}) must return (K, V), each (Hkv, end, D) = {expected}, got {shapes}")
        return got

    def advance(self, count):
        self.n += count


def _placement(write, cfg, prompt_len):
    """Write positions 0..prompt_len-1, then position prompt_len, with values that name their
    position and head (K: position + 1 + 1000 head, V: its negative); say where the first misplaced one went."""
    Hkv, D, max_len = cfg.n_kv_head, cfg.head_dim, prompt_len + 4
    k_cache, v_cache = np.zeros((Hkv, max_len, D), np.float32), np.zeros((Hkv, max_len, D), np.float32)
    tag = (np.arange(1, prompt_len + 2)[None, :, None] + 1000 * np.arange(Hkv)[:, None, None]
           + np.zeros((1, 1, D))).astype(np.float32)  # (Hkv, T+1, D)
    for n, stop in ((0, prompt_len), (prompt_len, prompt_len + 1)):
        call(write, k_cache, v_cache, n, tag[:, n:stop], -tag[:, n:stop], case=f"writing positions {n}..{stop - 1}")
    for name, cache, sign in (("K", k_cache, 1), ("V", v_cache, -1)):
        for pos in range(prompt_len + 1):
            if np.array_equal(cache[:, pos], sign * tag[:, pos]):  # (Hkv, D)
                continue
            raise Wrong(f"after writing {prompt_len} positions and then 1 more, {_misplaced(name, cache, sign * tag, pos)}")


def _misplaced(name, cache, tag, pos) -> str:
    """Where the K (or V) of position `pos` went, or what its slot holds instead. tag (Hkv, T, D)."""
    holds = lambda j, i: np.array_equal(cache[:, j], tag[:, i])  # slot j holds position i's values
    found = [j for j in range(cache.shape[1]) if holds(j, pos)]
    if found:
        hint = ": one late, at n + 1?" if found[0] == pos + 1 else ""
        return f"the {name} of position {pos} is at position {found[0]}, expected at position {pos}{hint}"
    other = [i for i in range(tag.shape[1]) if holds(pos, i)]
    if other:
        return (f"position {pos} of the {name} cache holds the {name} of position {other[0]}: "
                f"a later write landed on it (written at 0, not at n?)")
    if not cache[:, pos].any():
        return f"position {pos} of the {name} cache was never written (still zeros)"
    return f"position {pos} of the {name} cache holds values of no position (check the axes: (Hkv, max_len, D))"


@verdict
def check(write, read, params, cfg, tokens, prompt_len: int = 48, steps: int = 8):
    """Verdict on the reader's cache_write and cache_read: placement by hand, then forward_cached
    through them against lib.KVCache, bit for bit, over a prompt and `steps` decode steps."""
    _placement(write, cfg, prompt_len)
    theirs, ours = ReaderCache(cfg, prompt_len + steps, write, read), KVCache(cfg, prompt_len + steps)
    feeds = [tokens[:prompt_len]] + [tokens[i:i + 1] for i in range(prompt_len, prompt_len + steps)]
    for i, feed in enumerate(feeds):
        expected, got = forward_cached(params, cfg, feed, ours), forward_cached(params, cfg, feed, theirs)
        if not np.array_equal(got, expected):
            what = "the prompt" if i == 0 else f"decode step {i} (position {prompt_len + i - 1})"
            raise Wrong(f"logits of {what} differ from lib.KVCache's by up to {np.abs(got - expected).max():.3g}: "
                        f"they must be bit-identical (check which positions cache_read returns)")


def attempt(write, read, params, cfg, tokens) -> None:
    """Chapter 3's check cell."""
    run(check, (write, read), (cache_write, cache_read), params, cfg, tokens)
