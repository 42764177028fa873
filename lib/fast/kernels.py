"""A small-rows weight product: a (T, K) @ w (K, N) for 2 <= T <= 9 that reads each weight once.

Verifying k draft tokens multiplies k+1 rows by every weight matrix. A general matrix product
(BLAS gemm) is built for many rows: it copies ("packs") blocks of the weight matrix into a
buffer laid out for its inner kernel and streams them back, work that pays for itself only when
each packed block is reused by many rows (Goto & van de Geijn 2008). With 2-9 rows it is not,
and OpenBLAS's gemm costs 2-3x its one-row path (gemv) even when the weights stream from
memory, where the extra rows should be nearly free.

The kernel below keeps the weights transposed, as CPU engines such as llama.cpp store them
(each output column's K weights contiguous, a row `wt[n]`), and accumulates a block of 3 output
columns x 4 input rows in 12 registers over K: every weight loaded is used by 4 rows, every
input value by 3 columns (2 or 1 rows for what is left of T).
numba compiles it with `fastmath` (which lets LLVM reorder the sums into SIMD lanes) and caches
the machine code in `__pycache__` beside this file (`cache=True`), so each process after the
first loads it instead of compiling it again.

Whether it beats numpy depends on the shape and the machine, so `LeanModel` times it against
numpy's products when it is built (`fastest_products`) and uses whichever is faster for each T.
"""
import numpy as np
from numba import njit

from lib.timing import median_time

MAX_ROWS = 9  # the kernel is considered for 1..MAX_ROWS rows (k = 8 verifies 9)


@njit(cache=True, fastmath=True, nogil=True, inline="always")
def _four_rows(a, wt, out, t, j0, j1, j2):
    """out[t:t+4, (j0, j1, j2)] in 12 accumulators: a weight loaded serves 4 rows."""
    s00 = s01 = s02 = s10 = s11 = s12 = np.float32(0.0)
    s20 = s21 = s22 = s30 = s31 = s32 = np.float32(0.0)
    for k in range(a.shape[1]):  # 7 loads, 12 multiply-adds
        w0, w1, w2 = wt[j0, k], wt[j1, k], wt[j2, k]
        x0, x1, x2, x3 = a[t, k], a[t + 1, k], a[t + 2, k], a[t + 3, k]
        s00 += x0 * w0
        s01 += x0 * w1
        s02 += x0 * w2
        s10 += x1 * w0
        s11 += x1 * w1
        s12 += x1 * w2
        s20 += x2 * w0
        s21 += x2 * w1
        s22 += x2 * w2
        s30 += x3 * w0
        s31 += x3 * w1
        s32 += x3 * w2
    out[t, j0], out[t, j1], out[t, j2] = s00, s01, s02
    out[t + 1, j0], out[t + 1, j1], out[t + 1, j2] = s10, s11, s12
    out[t + 2, j0], out[t + 2, j1], out[t + 2, j2] = s20, s21, s22
    out[t + 3, j0], out[t + 3, j1], out[t + 3, j2] = s30, s31, s32


@njit(cache=True, fastmath=True, nogil=True, inline="always")
def _two_rows(a, wt, out, t, j0, j1, j2):
    s00 = s01 = s02 = s10 = s11 = s12 = np.float32(0.0)
    for k in range(a.shape[1]):
        w0, w1, w2 = wt[j0, k], wt[j1, k], wt[j2, k]
        x0, x1 = a[t, k], a[t + 1, k]
        s00 += x0 * w0
        s01 += x0 * w1
        s02 += x0 * w2
        s10 += x1 * w0
        s11 += x1 * w1
        s12 += x1 * w2
    out[t, j0], out[t, j1], out[t, j2] = s00, s01, s02
    out[t + 1, j0], out[t + 1, j1], out[t + 1, j2] = s10, s11, s12


@njit(cache=True, fastmath=True, nogil=True, inline="always")
def _one_row(a, wt, out, t, j0, j1, j2):
    s0 = s1 = s2 = np.float32(0.0)
    for k in range(a.shape[1]):
        x = a[t, k]
        s0 += x * wt[j0, k]
        s1 += x * wt[j1, k]
        s2 += x * wt[j2, k]
    out[t, j0], out[t, j1], out[t, j2] = s0, s1, s2


@njit(cache=True, fastmath=True, nogil=True)
def _rows_times_transposed(a, wt, out):
    """out[t, n] = sum_k a[t, k] * wt[n, k]: a (T, K), wt (N, K), out (T, N), float32. Three
    output columns at a time (their 3K weights stay in L1 while every row passes over them)."""
    T, N = a.shape[0], wt.shape[0]
    for n in range(0, N, 3):
        j0, j1, j2 = n, min(n + 1, N - 1), min(n + 2, N - 1)  # past the end: the last column again
        t = 0
        while T - t >= 4:
            _four_rows(a, wt, out, t, j0, j1, j2)
            t += 4
        if T - t >= 2:
            _two_rows(a, wt, out, t, j0, j1, j2)
            t += 2
        if T - t == 1:
            _one_row(a, wt, out, t, j0, j1, j2)


def rows_product(a, w, out=None):
    """a @ w with the kernel: a (T, K) C-contiguous float32; w (K, N) float32 stored transposed,
    i.e. column-major (np.asfortranarray), so that w.T is C-contiguous; out (T, N) optional."""
    if out is None:
        out = np.empty((a.shape[0], w.shape[1]), np.float32)  # (T, N)
    _rows_times_transposed(a, w.T, out)
    return out


def rows_as_batch(a, w, out=None):
    """a @ w as a batch of one-row products (T, 1, K) @ (K, N), with an optional out= (T, N)."""
    return np.matmul(a[:, None, :], w, out=None if out is None else out[:, None, :])[:, 0]  # (T, 1, N) -> (T, N)


CANDIDATES = {"numpy": np.matmul, "one-row batch": rows_as_batch, "kernel": rows_product}


CLEAR_WIN = 0.8  # another product replaces numpy's only if it takes at most 80% of its time


def candidates(T: int) -> dict:
    """The products to try for T rows: for one row, numpy's (np.dot: BLAS's matrix-vector
    product, the cheapest numpy call for it) against the kernel; for more, all of CANDIDATES."""
    return {"numpy": np.dot, "kernel": rows_product} if T == 1 else CANDIDATES


def fastest_products(matrices, rows=range(1, MAX_ROWS + 1), repeats: int = 3):
    """For each T in rows, the fastest of `candidates(T)` over a pass through `matrices` (each
    (K, N), column-major), timed back to back: {T: name}, and the times {T: {name: seconds}}.
    numpy's product stays unless another is faster by a clear margin (CLEAR_WIN): where they are
    close, a noisy timing would otherwise flip the choice from one build to the next (and with it
    the float32 rounding), and an isolated product's small lead need not survive inside a step."""
    rng = np.random.default_rng(0)
    choice, times = {}, {}
    for T in rows:
        inputs = {w.shape[0]: rng.standard_normal((T, w.shape[0]), dtype=np.float32) for w in matrices}
        outs = [np.empty((T, w.shape[1]), np.float32) for w in matrices]

        def one_pass(product):
            for w, out in zip(matrices, outs):
                product(inputs[w.shape[0]], w, out=out)
        for product in candidates(T).values():  # warm-up (and the kernel's compilation or cache load)
            median_time(lambda: one_pass(product), repeats=1, warmup=1, min_seconds=0.005)
        rounds = [{name: median_time(lambda: one_pass(p), repeats=1, warmup=0) for name, p in candidates(T).items()}
                  for _ in range(repeats)]
        times[T] = {name: float(np.min([r[name] for r in rounds])) for name in candidates(T)}  # least disturbed
        best = min(times[T], key=times[T].get)
        choice[T] = best if times[T][best] < CLEAR_WIN * times[T]["numpy"] else "numpy"
    return choice, times
