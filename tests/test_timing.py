"""The counters behind the book's FLOP and byte figures."""
import numpy as np
from conftest import perturbed_params

import lib.timing
from lib.cache.kv_cache import KVCache
from lib.config import TARGET
from lib.measure.counting import count_ops, numpy_calls_per_step, step_counts
from lib.model import forward_cached
from lib.timing import fastest_time, interleaved_speedups, median_time, paired


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


def test_fastest_time_keeps_the_fastest_repeat_and_median_time_the_median(monkeypatch):
    def clock(*ticks):  # three repeats of one call each, taking 3, 1 and 2 seconds
        monkeypatch.setattr(lib.timing.time, "perf_counter", iter(ticks).__next__)
    clock(0, 3, 10, 11, 20, 22)
    assert fastest_time(lambda: None, repeats=3, warmup=0) == 1
    clock(0, 3, 10, 11, 20, 22)
    assert median_time(lambda: None, repeats=3, warmup=0) == 2


def test_every_call_is_kept_as_an_op_with_what_a_cost_model_needs():
    params = {"w": np.ones((8, 3), np.float32), "k": np.ones((2, 6, 10), np.float32)}
    x = np.ones((5, 8), np.float32)

    def step(p):
        y = np.dot(x, p["w"])  # a weight product through np.dot: 5 rows share one read of w
        att = np.ones((2, 1, 6), np.float32) @ p["k"]  # attention: batched over 2 heads
        att = np.exp(att)
        att[att > 0] = 0.0  # a masked write
        return np.concatenate([y, y])
    counts = count_ops(step, params)
    kinds = [(op.kind, op.name) for op in counts.ops]
    assert kinds == [("matmul", "weights"), ("matmul", "attention"), ("ufunc", "exp.__call__"),
                     ("ufunc", "greater.__call__"), ("ufunc", "setitem"), ("function", "concatenate")]
    weights, attention = counts.ops[:2]
    assert (weights.rows, weights.streamed, weights.batch) == (5, 8 * 3 * 4, 1)
    assert (attention.rows, attention.streamed, attention.batch) == (1, 2 * 6 * 10 * 4, 2)
    keys_left = count_ops(lambda p: p["k"].transpose(0, 2, 1) @ np.ones((2, 6, 1), np.float32), params).ops[0]
    assert keys_left.streamed == 2 * 6 * 10 * 4  # K counted as streamed on either side of the product
    assert counts.ops[4].flops == 2 * 10  # every element of att was written
    assert counts.numpy_calls == 5  # the masked write is not a numpy call


def test_step_counts_are_the_step_alone_for_each_call_size():
    params, cfg = perturbed_params(TARGET), TARGET
    builder = lambda p: (lambda new, cache: forward_cached(p, cfg, new, cache))
    counts = step_counts(builder, params, cfg, 99, sizes=(1, 3))
    assert counts[1].flops == 2 * sum(v.size for k, v in params.items() if v.ndim == 2 and k not in
                                      ("wte.weight", "wpe.weight")) + 4 * cfg.n_embd * 100 * cfg.n_layer
    assert counts[3].matmuls == counts[1].matmuls and counts[3].flops > 3 * counts[1].flops - 1
    assert numpy_calls_per_step(builder, params, cfg, 99) == counts[1].numpy_calls


def test_interleaved_runs_sit_between_baselines_and_keep_the_first_results():
    log = []
    run = lambda name: (lambda: log.append(name) or f"{name}{len(log)}")
    groups = [{("a", 1): run("a1"), ("b", 1): run("b1")}, {("a", 2): run("a2")}]
    reference, results, ratios = interleaved_speedups(run("base"), groups, repeats=2)
    assert log == ["base", "a1", "b1", "base", "a2", "base", "a1", "b1", "base", "a2", "base"]  # repeat 2 follows the last baseline
    assert reference == "base1" and results == {("a", 1): "a12", ("b", 1): "b13", ("a", 2): "a25"}
    assert list(ratios) == list(results) and all(len(r) == 2 and min(r) > 0 for r in ratios.values())


def test_paired_returns_one_pair_so_times_and_ratio_agree():
    """`paired` gives the pair whose ratio is the median: its ratio is its own times' ratio, exactly."""
    work = np.ones(20000, np.float32)
    base, cand, ratio = paired(lambda: work.sum(), lambda: np.sort(work), repeats=5, min_seconds=0.0)
    assert base > 0 and cand > 0
    assert ratio == cand / base
