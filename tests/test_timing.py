"""The counters behind the book's FLOP and byte figures."""
import numpy as np

from lib.bench import count_ops, median_time
from lib.config import TARGET
from lib.kv_cache import KVCache
from lib.model import forward_cached

from conftest import perturbed_params


def test_matmul_flops_and_bytes_come_from_the_shapes():
    params = {"w": np.ones((8, 3), np.float32)}
    counts = count_ops(lambda p: np.ones((5, 8), np.float32) @ p["w"], params)
    assert (counts.matmuls, counts.flops) == (1, 2 * 5 * 8 * 3)
    assert counts.bytes == 4 * (5 * 8 + 8 * 3 + 5 * 3)


def test_batched_matmul_counts_every_batch():
    params = {"q": np.ones((4, 2, 6), np.float32)}
    counts = count_ops(lambda p: p["q"] @ np.ones((4, 6, 10), np.float32), params)
    assert counts.flops == 2 * 4 * 2 * 6 * 10


def test_decode_step_flops_equal_the_parameter_and_attention_terms():
    """2 FLOPs per weight of every matrix product, plus 4 * n_embd per cached position per layer."""
    params, cfg = perturbed_params(TARGET), TARGET
    cache = KVCache(cfg)
    forward_cached(params, cfg, np.arange(99) % 96, cache)
    counts = count_ops(lambda p: forward_cached(p, cfg, [1], cache), params)
    matrices = [v for k, v in params.items() if v.ndim == 2 and k not in ("wte.weight", "wpe.weight")]
    assert counts.flops == 2 * sum(m.size for m in matrices) + 4 * cfg.n_embd * 100 * cfg.n_layer
    assert counts.numpy_calls > counts.matmuls == 6 * cfg.n_layer + 1  # 6 products per block, then the head


def test_median_time_is_positive_and_loops_short_calls():
    calls = []
    t = median_time(lambda: calls.append(1), repeats=3, warmup=1, min_seconds=0.001)
    assert t > 0 and len(calls) > 4
