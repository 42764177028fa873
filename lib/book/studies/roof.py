"""A plain memory stream read beside the steps, for chapter 2's roofline (Williams, Waterman and
Patterson 2009, "Roofline: an insightful visual performance model for multicore architectures"),
and the one way the regimes page, chapter 2 and chapter 12 time a decode step, so that their numbers
for the same stand-in differ only by the machine's noise.

The machine card's bandwidth (`lib.measure.card`), the card's read rate, is one thread's one-row
products, probed once per machine and kept on disk: a reference, not a ceiling, since a step timed
at another moment, with the machine more or less busy, lands either side of it. The plain stream is
read now: one thread streams an array far larger than any cache through BLAS's dot product of the
array with itself (every byte read once, two FLOPs per four bytes, vectorized), the median of a few
repeats; it reads faster than the one-row products. numpy's `a.sum()` is no such stream: its
pairwise summation was measured at 12 to 23 GB/s on a machine whose decode step read at 17 to 20.
"""
import numpy as np

from lib.measure.counting import cached_call
from lib.timing import median_time, single_thread

STREAM_BYTES = 2**29  # 512 MiB: beyond the last-level caches of CPUs of this kind (32 to 480 MiB)


def streaming_read(nbytes: int = STREAM_BYTES, repeats: int = 5) -> float:
    """Bytes per second one thread reads from memory: a float32 array of `nbytes` dotted with itself
    (BLAS sdot on one BLAS thread), the median of `repeats` after one warm-up."""
    a = np.ones(nbytes // 4, np.float32)  # (nbytes / 4,): every page written before it is timed
    with single_thread():
        return a.nbytes / median_time(lambda: a.dot(a), repeats=repeats, warmup=1)


def decode_times(steps: dict, repeats: int = 7, loop_seconds: float = 0.05, warmup_seconds: float = 0.5) -> dict:
    """{name: seconds of one decode step} for steps {name: (step, cfg, position)}: each step (a function of
    (new_tokens, cache); its model's config `cfg`) after `position` cached tokens, the fastest of `repeats`
    timings, each looping the step for `loop_seconds` (a 0.1 ms step is too short to time alone). The
    timings are taken in rounds, one of every step per round, so a slow second of the machine lands on
    one round of each step rather than on every timing of one; the fastest is the least disturbed. Each
    step first runs for `warmup_seconds`: a fresh step's first fraction of a second runs slow."""
    calls = {name: cached_call(step, cfg, position) for name, (step, cfg, position) in steps.items()}
    for call in calls.values():
        median_time(call, repeats=1, warmup=0, min_seconds=warmup_seconds)
    rounds = [{name: median_time(call, repeats=1, warmup=0, min_seconds=loop_seconds) for name, call in calls.items()}
              for _ in range(repeats)]
    return {name: min(r[name] for r in rounds) for name in calls}


def decode_seconds(step, cfg, position: int = 64, repeats: int = 7) -> float:
    """Seconds of one decode step of `step` after `position` cached tokens, timed as `decode_times` times
    several."""
    return decode_times({"step": (step, cfg, position)}, repeats)["step"]
