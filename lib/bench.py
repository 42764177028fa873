"""Measuring: median timers with single-threaded BLAS, and FLOPs and bytes counted from the
shapes of the matrix products a function actually runs.

Timing follows the usual benchmarking rules (warm-up, repeats, median; one BLAS thread so
runs compare). Counting runs the function on parameters viewed as an ndarray subclass whose
`__array_ufunc__` / `__array_function__` hooks see every numpy call: each `matmul` adds
2*m*k*n (times its batch) FLOPs and the bytes of its operands and result, the roofline
model's "bytes moved" (Williams et al. 2009).

    python -m lib.bench      # the benchmark table: ratios measured in one run
"""
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits


@contextmanager
def single_thread():
    """One BLAS thread, so timings compare across calls and machines."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def median_time(fn, repeats: int = 7, warmup: int = 2, min_seconds: float = 0.0) -> float:
    """Median wall time of fn() in seconds, after warm-up calls. With min_seconds, each repeat
    loops fn until that much time has passed and reports the time per call."""
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
    return float(np.median(times))


@dataclass
class OpCounts:
    flops: int = 0  # 2*m*k*n per matmul
    bytes: int = 0  # operands read + result written, per matmul
    matmuls: int = 0
    numpy_calls: int = 0  # every ufunc and array-function call that touched a counted array

    @property
    def intensity(self) -> float:
        """Arithmetic intensity of the products, FLOP per byte."""
        return self.flops / self.bytes if self.bytes else 0.0


def count_ops(fn, params: dict) -> OpCounts:
    """Run fn(counted_params) and count its numpy calls, and the FLOPs and bytes of its matmuls."""
    counts = OpCounts()

    def plain(x):
        return x.view(np.ndarray) if isinstance(x, Counted) else x

    def wrap(result):
        if isinstance(result, np.ndarray) and not isinstance(result, Counted):
            return result.view(Counted)
        if isinstance(result, tuple):
            return tuple(wrap(r) for r in result)
        return result

    class Counted(np.ndarray):
        def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
            counts.numpy_calls += 1
            inputs = [plain(x) for x in inputs]
            if "out" in kwargs:
                kwargs["out"] = tuple(plain(x) for x in kwargs["out"])
            result = getattr(ufunc, method)(*inputs, **kwargs)
            if ufunc is np.matmul and method == "__call__":
                a, b = np.asarray(inputs[0]), np.asarray(inputs[1])
                m, k, n = a.shape[-2] if a.ndim > 1 else 1, a.shape[-1], b.shape[-1]
                batch = int(np.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), dtype=np.int64))
                counts.matmuls += 1
                counts.flops += 2 * batch * m * k * n
                counts.bytes += a.nbytes + b.nbytes + np.asarray(result).nbytes
            return wrap(result)

        def __array_function__(self, func, types, args, kwargs):
            counts.numpy_calls += 1
            args = tuple(plain(a) if not isinstance(a, (list, tuple)) else type(a)(plain(x) for x in a) for a in args)
            return wrap(func(*args, **{k: plain(v) for k, v in kwargs.items()}))

    fn({k: v.view(Counted) for k, v in params.items()})
    return counts


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
