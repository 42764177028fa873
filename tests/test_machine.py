"""The machine line that timing chapters print, and the one-BLAS-thread setup."""
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from lib.measure.machine import machine_line, setup


def test_setup_leaves_one_blas_thread_and_says_so():
    with threadpool_limits(None):  # restore whatever was set before, after the test
        line = setup()
        assert all(i["num_threads"] == 1 for i in threadpool_info() if i["user_api"] == "blas")
        assert "1 thread" in line and f"numpy {np.__version__}" in line and "cores" in line


def test_machine_line_names_the_blas_library():
    assert any(i["internal_api"] in machine_line() for i in threadpool_info() if i["user_api"] == "blas")
