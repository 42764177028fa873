"""The machine a chapter ran on, and one BLAS thread for everything it runs.

Every timing in the book is this machine's, so each timing chapter says what the machine was:
CPU model, cores, numpy and its BLAS (threadpoolctl reads the library, its version, the kernel
set it chose and its thread count). The chapters run with one BLAS thread: the small products
of this book gain little from a second thread on a quiet 2-core machine, and on a busy one two
BLAS threads spin against the other work (chapter 1's training ran 1.4x slower with 2 threads
than with 1 beside other jobs; a whole build went 11-14x slower).
"""
import os
import platform

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from lib.timing import warm_up


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux, else what the platform reports)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """One line: CPU, cores, numpy, BLAS library with version, kernel set and threads."""
    blas = [f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture') or 'generic'}), "
            f"{i.get('num_threads')} thread{'s' * (i.get('num_threads') != 1)}"
            for i in threadpool_info() if i.get("user_api") == "blas"]
    return (f"{cpu_model()}, {os.cpu_count()} cores; numpy {np.__version__}; "
            f"BLAS: {'; '.join(blas) or 'none found'}")


def setup() -> str:
    """Limit BLAS to one thread for the rest of the process and bring the core up to speed
    (`lib.timing.warm_up`); return the machine line."""
    threadpool_limits(1, user_api="blas")
    warm_up()
    return machine_line()
