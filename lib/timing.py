"""Timing, at the ground floor: median timers with single-threaded BLAS, paired and interleaved timings, and the
machine's copy bandwidth and product rates. It imports nothing of lib, so the fast paths can
time their candidates with it (`lib.fast.kernels`); counting a step's calls is `lib.measure.counting`.

Timing follows the usual benchmarking rules (warm-up, repeats, the median, or the fastest for a fixed
cost that noise can only lengthen; one BLAS thread so runs compare).
"""
import time
from contextlib import contextmanager

import numpy as np
from threadpoolctl import threadpool_limits


@contextmanager
def single_thread():
    """One BLAS thread, so timings compare across calls and machines."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def _repeat_times(fn, repeats: int = 7, warmup: int = 2, min_seconds: float = 0.0) -> list:
    """Wall times of fn() in seconds, one per repeat, after warm-up calls. With min_seconds, each
    repeat loops fn until that much time has passed and reports the time per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        times.append(elapsed / n)
    return times


def median_time(fn, repeats: int = 7, warmup: int = 2, min_seconds: float = 0.0) -> float:
    """Median wall time of fn() in seconds over `repeats` (`_repeat_times`)."""
    return float(np.median(_repeat_times(fn, repeats, warmup, min_seconds)))


def fastest_time(fn, repeats: int = 7, warmup: int = 2, min_seconds: float = 0.0) -> float:
    """Fastest wall time of fn() in seconds over `repeats` (`_repeat_times`): for a fixed cost such as a
    call's, which a busy moment of a shared host can only lengthen."""
    return float(min(_repeat_times(fn, repeats, warmup, min_seconds)))


def warm_up(seconds: float = 1.0) -> None:
    """Keep the core busy with small products for `seconds` before anything is timed. A process's first
    second can run at half speed on a virtual machine (on the book's host a decode step took 0.24 ms in
    its first half second of looping, 0.14 ms after): the host brings a busy core up to speed."""
    a = np.ones((128, 128), np.float32)
    median_time(lambda: a @ a, repeats=1, warmup=0, min_seconds=seconds)


def paired_times(baseline, candidate, repeats: int = 3, min_seconds: float = 0.0) -> np.ndarray:
    """Times of baseline and candidate run back to back, `repeats` times: (repeats, 2) seconds.
    Ratios taken row by row are immune to slow drifts of the machine's speed."""
    timed = lambda fn: median_time(fn, repeats=1, warmup=0, min_seconds=min_seconds)
    return np.array([(timed(baseline), timed(candidate)) for _ in range(repeats)])


def paired(baseline, candidate, repeats: int = 9, min_seconds: float = 0.01):
    """(baseline seconds, candidate seconds, candidate / baseline) of the back-to-back pair whose
    ratio is the median of `repeats` pairs, for timing single calls: the times, their ratio and
    their difference are one pair's, so they agree with each other."""
    times = paired_times(baseline, candidate, repeats, min_seconds)  # (repeats, 2) seconds
    base, cand = times[np.argsort(times[:, 1] / times[:, 0])[repeats // 2]]
    return float(base), float(cand), float(cand / base)


def _run_timed(fn):
    """(fn(), its wall time in seconds): one run, no warm-up."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def interleaved_speedups(baseline, groups, repeats: int = 1):
    """Runs timed in one interleaved sequence: baseline, every run of groups[0], baseline, every run
    of groups[1], ..., baseline, then the next repeat (its first group against the last baseline).
    groups: [{key: fn}, ...]. Returns (the first baseline's result, {key: the first repeat's result},
    {key: [baseline seconds / run seconds, one per repeat]}), each baseline the mean of the two
    beside the group, so a machine whose speed drifts slows both sides alike."""
    reference, before = _run_timed(baseline)
    results, ratios = {}, {}
    for _ in range(repeats):
        for group in groups:
            seconds = {}
            for key, fn in group.items():
                result, seconds[key] = _run_timed(fn)
                results.setdefault(key, result)
            after = _run_timed(baseline)[1]
            for key, s in seconds.items():
                ratios.setdefault(key, []).append((before + after) / 2 / s)
            before = after
    return reference, results, ratios


def matmul_gflops(m: int, k: int = 96, n: int = 384, seconds: float = 0.05) -> float:
    """Measured GFLOP/s of an (m, k) @ (k, n) float32 product on one thread."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    out = np.empty((m, n), np.float32)
    with single_thread():
        t = median_time(lambda: np.matmul(a, b, out=out), repeats=5, min_seconds=seconds)
    return 2 * m * k * n / t / 1e9


def memory_gbps(mbytes: int = 256) -> float:
    """Measured copy bandwidth in GB/s (bytes read + bytes written) over a buffer far larger than cache."""
    src = np.ones(mbytes * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    t = median_time(lambda: np.copyto(dst, src), repeats=5, warmup=1)
    return 2 * src.nbytes / t / 1e9
