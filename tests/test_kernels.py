"""The small-rows kernel is numpy's product, for every shape and row count it is used for."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lib.fast.kernels import CANDIDATES, CLEAR_WIN, MAX_ROWS, candidates, fastest_products, rows_as_batch, rows_product


@settings(max_examples=150, deadline=None)
@given(T=st.integers(1, MAX_ROWS + 3), K=st.integers(1, 300), N=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_rows_product_equals_numpy(T, K, N, seed):
    """Every row count (the 4-, 2- and 1-row blocks and their mixtures), every column count
    (column blocks of 3 with a shorter last one): float32 rounding of the same sum."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((T, K), dtype=np.float32)
    w = np.asfortranarray(rng.standard_normal((K, N), dtype=np.float32))
    ref = a.astype(np.float64) @ w.astype(np.float64)  # (T, N)
    bound = 1e-5 * np.abs(a).astype(np.float64) @ np.abs(w).astype(np.float64) + 1e-6  # (T, N) float32 summation error
    out = rows_product(a, w)
    assert out.shape == (T, N) and out.dtype == np.float32
    assert (np.abs(out - ref) <= bound).all()
    into = np.full((T, N + 1), np.nan, np.float32)
    rows_product(a, w, out=into[:, :N])  # a column view, as the lean path's buffers are
    assert (np.abs(into[:, :N] - ref) <= bound).all() and np.isnan(into[:, N]).all()


def test_rows_as_batch_equals_numpy():
    rng = np.random.default_rng(0)
    a, w = rng.standard_normal((5, 33), dtype=np.float32), rng.standard_normal((33, 7), dtype=np.float32)
    np.testing.assert_allclose(rows_as_batch(a, w), a @ w, rtol=1e-5, atol=1e-5)


def test_fastest_products_times_every_candidate_for_every_row_count():
    w = [np.asfortranarray(np.ones((16, 8), np.float32))]
    choice, times = fastest_products(w, rows=(1, 2, 5), repeats=1)
    assert set(choice) == {1, 2, 5} and all(choice[T] in candidates(T) for T in choice)
    for T in times:  # numpy's unless another takes at most CLEAR_WIN of its time, then the fastest
        fastest = min(times[T], key=times[T].get)
        clear = times[T][fastest] < CLEAR_WIN * times[T]["numpy"]
        assert set(times[T]) == set(candidates(T)) and choice[T] == (fastest if clear else "numpy")
    assert set(candidates(1)) == {"numpy", "kernel"} and candidates(5) == CANDIDATES
