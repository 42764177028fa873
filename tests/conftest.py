import copy
import json
import os
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

from lib.config import DRAFT, TARGET, ModelConfig
from lib.model import init_params

# hypothesis: the README's `python -m pytest` draws a fixed set of examples on any machine, CI or not
# (derandomized, no example database), so a reader's run checks what CI checked. A wide random
# search is run by hand: HYPOTHESIS_PROFILE=thorough (ten times the examples, new ones each run).
settings.register_profile("fixed", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("thorough", max_examples=1000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

GQA = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=64)
MQA = ModelConfig(n_layer=2, n_head=4, n_kv_head=1, n_embd=32, block_size=64)
CONFIGS = {"target": TARGET, "draft": DRAFT, "gqa": GQA, "mqa": MQA}


def perturbed_params(cfg, seed=0):
    """Random parameters with non-trivial LayerNorm gains and biases (init leaves them 1 and 0)."""
    params = init_params(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    for name, value in params.items():
        value += (rng.standard_normal(value.shape) * 0.05).astype(value.dtype)
    return params


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def model(request):
    cfg = CONFIGS[request.param]
    return perturbed_params(cfg), cfg


def pool_state(pool):
    """Everything a paged pool holds: the manager's counts and tables, and the K blocks."""
    m = pool.manager
    return copy.deepcopy((m.ref, list(m.free), m.tables, m.tokens, m.computed, m.hash_to_block)), [k.copy() for k in pool.k]


BROWSER_TESTS = {"test_book_html.py", "test_live_kernel.py"}


def recorded_seconds(notebook: Path) -> float:
    """Wall time of a notebook's last stored run, from the cell timings nbclient records."""
    stamps = [datetime.fromisoformat(c["metadata"]["execution"][key].replace("Z", "+00:00"))
              for c in json.loads(notebook.read_text())["cells"]
              if "execution" in c.get("metadata", {})
              for key in ("iopub.execute_input", "shell.execute_reply")]
    if not stamps:
        raise ValueError(f"{notebook.name} stores no cell timings: re-execute it with nbclient")
    return (max(stamps) - min(stamps)).total_seconds()


def _longest_first(item) -> float:
    """Chapters by their stored run time, then the browser tests, then the rest: the two workers
    (`--dist loadfile` hands out files in this order) take the long files first and finish together."""
    if item.path.suffix == ".ipynb":
        try:
            return -1e6 - recorded_seconds(item.path)
        except (ValueError, KeyError):  # not yet run with nbclient: test_prose_numbers says so
            return -1e6
    return -1.0 if item.path.name in BROWSER_TESTS else 0.0


def pytest_collection_modifyitems(items):
    """Markers by where a test lives: `-m "not notebooks and not browser"` is the quick loop."""
    for item in items:
        name = item.path.name
        if name.endswith(".ipynb"):
            item.add_marker(pytest.mark.notebooks)
        elif name in BROWSER_TESTS:
            item.add_marker(pytest.mark.browser)


class LongestFirst:
    """The longest files first: the two workers take them first and finish together."""

    @pytest.hookimpl(trylast=True)  # after the markers' deselection and pytest's reordering by fixture scope
    def pytest_collection_modifyitems(self, items):
        times = {}
        items.sort(key=lambda item: times.setdefault(item.path, _longest_first(item)))  # stable within a file


def pytest_configure(config):
    config.pluginmanager.register(LongestFirst())
