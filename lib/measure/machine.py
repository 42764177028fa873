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
from pathlib import Path

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
    """One line: CPU, cores, numpy, and each loaded BLAS library (numpy's, and scipy's own once scipy
    is imported) with the package that ships it, its version, kernel set and threads."""
    blas = sorted(f"{_owner(i.get('filepath', ''))}{i.get('internal_api')} {i.get('version')} "
            f"({i.get('architecture') or 'generic'}), "
            f"{i.get('num_threads')} thread{'s' * (i.get('num_threads') != 1)}"
            for i in threadpool_info() if i.get("user_api") == "blas")  # one order on every run
    return (f"{cpu_model()}, {os.cpu_count()} cores; numpy {np.__version__}; "
            f"BLAS: {'; '.join(blas) or 'none found'}")


def _owner(filepath: str) -> str:
    """'numpy's ' for a library wheels ship in site-packages/numpy.libs, '' when no package is named."""
    folder = Path(filepath).parent.name
    return f"{folder.removesuffix('.libs')}'s " if folder.endswith(".libs") else ""


def setup() -> str:
    """Limit BLAS to one thread for the rest of the process and bring the core up to speed
    (`lib.timing.warm_up`); return the machine line."""
    threadpool_limits(1, user_api="blas")
    warm_up()
    return machine_line()
