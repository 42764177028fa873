"""A plain memory stream read beside the steps, the textbook memory roof (Williams, Waterman and Patterson
2009, "Roofline: an insightful visual performance model for multicore architectures", whose roof is STREAM's
bandwidth: a property of the memory, not of any kernel) that chapter 2 sets beside the card's read rate, its
roof; one row through the same weights in either layout beside that stream (`layout_rates`);
and the one way the regimes page, chapter 2 and chapter 12 time a decode step, so that their numbers
for the same stand-in differ only by their runs (a run on a busy host can take twice as long; the fastest
round is the least disturbed).

The machine card's bandwidth (`lib.measure.card`), the card's read rate, is one thread's one-row
products, probed once per machine and kept on disk: a reference, not a ceiling, since a step timed
at another moment, with the machine more or less busy, lands either side of it; it is what the cost
model prices reads with. The plain stream is read now: one thread streams an array far larger than any
cache through BLAS's dot product of the array with itself (every byte read once, two FLOPs per four bytes,
vectorized), the fastest of a few repeats (a roof is the least disturbed rate, as a step's time is its
fastest round); it reads faster than the one-row products, whose share of it is the one-row kernel's
efficiency. numpy's `a.sum()` is no such stream: its
pairwise summation was measured at 12 to 23 GB/s on a machine whose decode step read at 17 to 20.
"""
import numpy as np

from lib.book.prose import compared
from lib.measure.counting import cached_call
from lib.measure.standins import weight_bytes
from lib.timing import fastest_time, median_time, single_thread

STREAM_BYTES = 2**29  # 512 MiB: beyond the last-level caches of CPUs of this kind (32 to 480 MiB)


def streaming_read(nbytes: int = STREAM_BYTES, repeats: int = 5) -> float:
    """Bytes per second one thread reads from memory: a float32 array of `nbytes` dotted with itself
    (BLAS sdot on one BLAS thread), the fastest of `repeats` after one warm-up."""
    a = np.ones(nbytes // 4, np.float32)  # (nbytes / 4,): every page written before it is timed
    with single_thread():
        return a.nbytes / fastest_time(lambda: a.dot(a), repeats=repeats, warmup=1)


def decode_rounds(steps: dict, repeats: int = 7, loop_seconds: float = 0.05, warmup_seconds: float = 0.5) -> dict:
    """{name: [seconds of one decode step, one per round]} for steps {name: (step, cfg, position)}: each step
    (a function of (new_tokens, cache); its model's config `cfg`) after `position` cached tokens, timed in
    `repeats` rounds, each timing looping the step for `loop_seconds` (a 0.1 ms step is too short to time
    alone). One of every step per round, so a slow second of the machine lands on one round of each step
    rather than on every timing of one. Each step first runs for `warmup_seconds`: a fresh step's first
    fraction of a second runs slow."""
    calls = {name: cached_call(step, cfg, position) for name, (step, cfg, position) in steps.items()}
    return interleaved_rounds(calls, repeats, loop_seconds, warmup_seconds)


def interleaved_rounds(calls: dict, repeats: int = 7, loop_seconds: float = 0.05, warmup_seconds: float = 0.5) -> dict:
    """{name: [seconds of one call, one per round]} for calls {name: a function of no arguments}: each first run
    for `warmup_seconds`, then `repeats` rounds of one timing of every call, each timing looping the call for
    `loop_seconds`."""
    for call in calls.values():
        median_time(call, repeats=1, warmup=0, min_seconds=warmup_seconds)
    rounds = [{name: median_time(call, repeats=1, warmup=0, min_seconds=loop_seconds) for name, call in calls.items()}
              for _ in range(repeats)]
    return {name: [r[name] for r in rounds] for name in calls}


def decode_times(steps: dict, repeats: int = 7, loop_seconds: float = 0.05, warmup_seconds: float = 0.5) -> dict:
    """{name: seconds of one decode step} for steps {name: (step, cfg, position)}, timed as `decode_rounds`
    times them: the fastest round, the least disturbed."""
    return {name: min(r) for name, r in decode_rounds(steps, repeats, loop_seconds, warmup_seconds).items()}


def read_rates(models: dict, position: int = 64, repeats: int = 9) -> dict:
    """How fast each model's decode step reads its weights, with its spread: {name: {"bytes": weight bytes,
    "seconds": the fastest round's step (as `decode_times`), "rate": bytes/s of that fastest round (bytes /
    seconds), "median", "low", "high": bytes/s of the median round and of the rounds at the first and third
    quartiles}} for models {name: LeanModel}, all timed together in `repeats` interleaved rounds
    (`decode_rounds`) after `position` cached tokens. The regimes page and chapter 2 report the stand-ins'
    rates through it, so their numbers differ only by their runs: a step's time and its rate from the fastest
    round (the book's step rule), the median and quartiles for comparing rates (`slowest`)."""
    rounds = decode_rounds({name: (m, m.cfg, position) for name, m in models.items()}, repeats)
    out = {}
    for name, seconds in rounds.items():
        nbytes = weight_bytes(models[name])
        rates = nbytes / np.array(seconds)
        out[name] = {"bytes": nbytes, "seconds": min(seconds), "rate": nbytes / min(seconds), "median": float(np.median(rates)),
                     "low": float(np.percentile(rates, 25)), "high": float(np.percentile(rates, 75))}
    return out


RATE_HEADER = "GB/s: fastest round | median (middle half)"  # the columns of `rate_cells`


def rate_cells(r: dict) -> str:
    """One step's read rates (an entry of `read_rates`), in GB/s, as the regimes page and chapter 2 print them
    under `RATE_HEADER`: its fastest round's, the round that gives the step its time, then the median round's
    with the first and third quartiles around it (the median always inside its bracket)."""
    return f"{r['rate'] / 1e9:5.1f} | {r['median'] / 1e9:.1f} ({r['low'] / 1e9:.1f} to {r['high'] / 1e9:.1f})"


def slowest(rates: dict) -> str | None:
    """The name in `rates` (from `read_rates`) whose median read rate is the lowest, if `compared` puts the next
    lowest median above it by more than the wider of the two spreads (each its quartiles' gap over its median);
    else None: they read at about the same rate."""
    low, next_low = sorted(rates, key=lambda n: rates[n]["median"])[:2]
    margin = max((rates[n]["high"] - rates[n]["low"]) / rates[n]["median"] for n in (low, next_low))
    apart = compared(rates[next_low]["median"], rates[low]["median"], margin, ("apart", "within", "within"))
    return low if apart == "apart" else None


def against(r: dict, rate: float, words: tuple) -> str:
    """How a step's read rate (an entry of `read_rates`) compares with `rate` (bytes/s), in words: words[0] if
    even its first quartile is above it, words[2] if even its third quartile is below it, words[1] if the middle
    half of its rounds straddles it. A rate claim must hold for the median round, not only the fastest."""
    return words[0] if r["low"] > rate else words[2] if r["high"] < rate else words[1]


def layout_rates(weights: list, repeats: int = 5) -> dict:
    """{product: bytes/s} of one row through every matrix of `weights` in turn ((K, N) each, column-major as the
    engine stores them; together far larger than the caches), one BLAS thread: "x @ W"
    on that layout (the card's probe, `lib.measure.card`), "x @ W, row-major" on a row-major copy, "W.T @ x" (a
    column vector), and "dot" (the same bytes as one flat vector dotted with ones, BLAS sdot, the plain stream's
    kernel), each its fastest of `repeats` interleaved rounds (`interleaved_rounds`). Which of them reads near the
    stream says whether the one-row product's gap is its layout."""
    xs = [np.ones(w.shape[0], np.float32) for w in weights]  # (K,) each: the row, or the column of W.T @ x
    rows = [np.ascontiguousarray(w) for w in weights]  # (K, N) each, row-major copies
    flat = [w.T.reshape(-1) for w in weights]  # (K * N,) views: a column-major (K, N) is a row-major (N, K)
    ones = np.ones(max(f.size for f in flat), np.float32)
    calls = {"x @ W": lambda: [x @ w for x, w in zip(xs, weights)],
             "x @ W, row-major": lambda: [x @ w for x, w in zip(xs, rows)],
             "W.T @ x": lambda: [w.T @ x for x, w in zip(xs, weights)], "dot": lambda: [f.dot(ones[:f.size]) for f in flat]}
    nbytes = sum(w.nbytes for w in weights)
    with single_thread():  # one timing of each per round, as `decode_rounds`: a busy second lands on one round of each
        rounds = interleaved_rounds(calls, repeats, warmup_seconds=0.1)
    return {name: nbytes / min(seconds) for name, seconds in rounds.items()}


def decode_seconds(step, cfg, position: int = 64, repeats: int = 7) -> float:
    """Seconds of one decode step of `step` after `position` cached tokens, timed as `decode_times` times
    several."""
    return decode_times({"step": (step, cfg, position)}, repeats)["step"]


def row_times(step, cfg, rows, position: int = 64, repeats: int = 3, warmup_seconds: float = 0.1) -> dict:
    """{B: seconds of one call of `step` over B new tokens after `position` cached ones} for B in `rows`: a CPU's
    batching, B rows sharing each read of the weights (one sequence's B tokens, as a verify call or a prompt
    chunk; B sequences would add their own K/V reads, a small share at short context). Each B's fastest round
    of `interleaved_rounds`, as `decode_times` times a step; a short warm-up for a step already running."""
    calls = {B: cached_call(step, cfg, position, B) for B in rows}
    return {B: min(r) for B, r in interleaved_rounds(calls, repeats, warmup_seconds=warmup_seconds).items()}
