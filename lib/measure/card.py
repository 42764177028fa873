"""This machine's card: its constants, measured once by single-threaded probes and kept on disk.

`measure()` runs the probes (about ten seconds): the fixed cost of a numpy call (alone, and
inside each engine path), read bandwidth by working-set size (32 KiB to 1 GiB, probed with the
product a decode step runs: one row through (K, N) weights in the engine's layout), the FLOP/s of
a weight product by row count and weight size with each product the engine can choose, and the
cost per element of each elementwise function, and a decoding loop's own time (run over a step that
does no model work, `FreeStep`). `calibrate()` returns the card: loaded from disk
when its key (the CPU, its cores, numpy, numpy's BLAS and the probes' code) matches, measured
again otherwise, so every chapter quotes one machine. `lib.measure.costmodel` predicts from it.
"""
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from lib.config import ModelConfig
from lib.fast.kernels import MAX_ROWS, candidates
from lib.generation import generate
from lib.measure.costmodel import (
    ELEMENTWISE,
    LARGE_ROWS,
    LOOP_COUNTS,
    PROBE_SIZES,
    RATE_LEVELS,
    RATE_ROWS,
    Machine,
    card_constants,
    lean_builder,
    plain_builder,
)
from lib.measure.counting import cached_call, step_counts
from lib.measure.machine import cpu_model
from lib.model import init_params
from lib.speculative import speculative_generate
from lib.timing import fastest_time, median_time, single_thread, warm_up
from lib.tokenizer import VOCAB_SIZE


def cache_sizes() -> dict:
    """The data caches this system reports for CPU 0: {"L1d": bytes, "L2": bytes, "L3": bytes}."""
    sizes = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            kind, level, size = ((index / f).read_text().strip() for f in ("type", "level", "size"))
        except OSError:
            continue
        if kind != "Instruction":
            unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1], 1)
            sizes["L1d" if level == "1" else f"L{level}"] = int(size.rstrip("KMG")) * unit
    return sizes


def _call_cost() -> float:
    """Seconds per call of the small calls a cached step is made of: an add into a buffer, a tiny
    product, an exp, a reduction, a slice copy (the median over them, each the fastest of its repeats:
    a busy moment of a shared host only lengthens a call, and the steps are timed by their fastest too)."""
    a, b = np.ones((1, 96), np.float32), np.ones((96, 8), np.float32)
    att, out, e = np.ones((4, 1, 17), np.float32), np.empty((1, 96), np.float32), np.empty((4, 1, 17), np.float32)
    calls = [lambda: np.add(a, a, out=out), lambda: np.matmul(a, b), lambda: np.exp(att, out=e),
             lambda: att.sum(axis=-1, keepdims=True), lambda: np.concatenate([a, a])]
    return float(np.median([fastest_time(lambda: [c() for _ in range(200)], repeats=5, warmup=1) / 200 for c in calls]))


def _engine_call_costs() -> dict:
    """Seconds per numpy call of a decode step of a model too small for its arithmetic or bytes to
    matter (2 layers of width 8): what a call costs with the engine's own Python around it, the fastest
    of its repeats (a card measured beside a memory stream once priced the plain path's call 1.8 us
    by the median, against 1.2 quiet, while the steps it predicts ran at their quiet speed)."""
    cfg = ModelConfig(n_layer=2, n_head=2, n_kv_head=2, n_embd=8, block_size=32)
    params = init_params(cfg)
    steps = {"plain": plain_builder(cfg), "lean": lean_builder(cfg)}
    return {path: fastest_time(cached_call(build(params), cfg, 16), repeats=7, min_seconds=0.005)
            / len(step_counts(build, params, cfg, 16)[1].ops) for path, build in steps.items()}


PROBE_K, PROBE_N = 768, 3072  # one weight matrix of the probe: GPT-2 small's MLP, 9 MiB of float32


def _probe_weights(nbytes: int) -> list:
    """Weight matrices of `nbytes` in all, laid out as the engine stores them ((K, N), column-major,
    as `lib.measure.standins` draws them): matrices of at most PROBE_K x PROBE_N, every page written."""
    count = max(1, round(nbytes / (PROBE_K * PROBE_N * 4)))
    N = max(1, nbytes // count // (4 * PROBE_K))
    return [np.asfortranarray(np.ones((PROBE_K, N), np.float32)) for _ in range(count)]  # (K, N) each


def _read_seconds(weights: list) -> float:
    """Seconds to run one row through every matrix in turn, x @ W, the product a decode step runs."""
    x = np.ones((1, PROBE_K), np.float32)  # (1, K)
    small = sum(w.nbytes for w in weights) < 2**26
    return median_time(lambda: [x @ w for w in weights], repeats=7, warmup=1, min_seconds=0.01 if small else 0.0)


def _read_rates(sizes) -> tuple:
    """((bytes, read bytes/s), ...) for working sets of each size: one-row products x @ W over weights
    of that size in the engine's layout, less the time of the same calls over one column each (their
    fixed cost). A probe of another shape misleads: a gemv over (rows, 256) matrices read 8-9 GB/s on
    a machine whose stand-in step streamed its 340 MB of weights at 12.8."""
    rates = []
    for size in sizes:
        weights = _probe_weights(size)
        fixed = _read_seconds([w[:, :1] for w in weights])  # (K, 1) views: the calls without the bytes
        nbytes = sum(w.nbytes for w in weights)  # within a column's bytes of `size`, which labels the probe
        rates.append((size, nbytes / max(_read_seconds(weights) - fixed, 1e-12)))
    return tuple(rates)


def _product_rates(call: float) -> dict:
    """FLOP/s of (rows, K) @ (K, N) with each product of `lib.fast.kernels`, on weights of each size of
    RATE_LEVELS in the engine's layout (`_probe_weights`: the read probe's matrices, read in turn, as
    a step reads its layers). A probe of another shape reads another way: (256, N) matrices read 10
    GB/s for one row over 256 MiB on a machine whose stand-in step streamed 16."""
    rng = np.random.default_rng(0)
    rates = {}
    for level in RATE_LEVELS:
        ws = _probe_weights(level)  # (K, N) each
        count, (K, N) = len(ws), ws[0].shape
        for rows in RATE_ROWS if level == RATE_LEVELS[0] else RATE_ROWS[:RATE_ROWS.index(LARGE_ROWS)]:
            a = rng.standard_normal((rows, K), np.float32)
            names = candidates(rows) if rows <= MAX_ROWS else {"numpy": np.matmul}
            for name, product in names.items():
                t = median_time(lambda: [product(a, w) for w in ws], repeats=3 if level > 2**26 else 7,
                                warmup=1, min_seconds=0.0 if level > 2**26 else 0.01)  # as `_read_seconds` times
                rates[name, rows, level] = 2 * rows * K * N * count / max(t - count * call, 1e-12)
    return rates


def _element_costs(call: float, n: int = 65536) -> dict:
    """Seconds per element of each elementwise call in ELEMENTWISE, on float32 values in cache."""
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    out = np.empty(n, np.float32)
    return {name: max(median_time(lambda: fn(x, out), repeats=5, min_seconds=0.003) - call, 0.0) / n
            for name, fn in ELEMENTWISE.items()}


class FreeStep:
    """A Step that does no model work: the logits of position i are row i of a fixed table. A decoding
    loop run over it takes only the loop's own time (drawing tokens, judging drafts, bookkeeping)."""

    def __init__(self, cfg, table):
        self.cfg, self.table = cfg, table  # table (block_size, V)

    def __call__(self, new_tokens, cache) -> np.ndarray:
        start = cache.n
        cache.advance(len(new_tokens))
        return self.table[start:cache.n]  # (T, V)


LOOP_KS, LOOP_NOISE, LOOP_TOKENS = (1, 2, 4, 8), (0.5, 1.5, 3.0, 6.0), 96  # drafts per round; draft logit noise (alpha high to low)


def _loop_costs() -> dict:
    """{"greedy" | "sampled": {LOOP_COUNTS name: seconds}}: `generate` over a FreeStep gives the loop's time
    per token; `speculative_generate` over a FreeStep target and a FreeStep draft (the target's logits plus
    noise, from a high acceptance rate to a low one) at several k gives runs whose times are fitted, by least
    squares, as a cost per round, per draft call, per judged and per rejected draft token."""
    cfg = ModelConfig(n_layer=1, n_head=1, n_kv_head=1, n_embd=8, block_size=2 * LOOP_TOKENS, vocab_size=VOCAB_SIZE)
    rng = np.random.default_rng(0)
    table = rng.standard_normal((cfg.block_size, VOCAB_SIZE)).astype(np.float32) * 3  # (positions, V)
    target, prompt = FreeStep(cfg, table), np.arange(8) % VOCAB_SIZE
    costs = {}
    for kind, temperature in (("greedy", 0.0), ("sampled", 0.7)):
        per_token = median_time(lambda: generate(target, prompt, LOOP_TOKENS, temperature), repeats=5, warmup=1) / LOOP_TOKENS
        rows, times = [], []
        for noise in LOOP_NOISE:
            draft = FreeStep(cfg, table + noise * rng.standard_normal(table.shape).astype(np.float32))
            for k in LOOP_KS:
                run = lambda: speculative_generate(target, draft, prompt, LOOP_TOKENS, k, temperature)
                s = run()[1]  # SpecStats
                rows.append([s.rounds, s.draft_calls, s.judged, s.judged - s.accepted])
                times.append(median_time(run, repeats=3, warmup=1))
        fit = np.clip(np.linalg.lstsq(np.array(rows, float), np.array(times), rcond=None)[0], 0.0, None)
        costs[kind] = dict(zip(LOOP_COUNTS, [per_token, *map(float, fit)]))
    return costs


def measure() -> Machine:
    """Measure this machine's constants now (one BLAS thread, about ten seconds)."""
    with single_thread():
        warm_up()  # the first second of a process can run at half speed
        call = _call_cost()
        return Machine(call, _engine_call_costs(), _read_rates(PROBE_SIZES), _product_rates(call),
                       _element_costs(call), cache_sizes(), _loop_costs())


# ----------------------------------------------------------------------------- the machine card

CARD_DIR = Path(os.environ.get("LIB_CARD_DIR", Path.home() / ".cache" / "fast-inference-book"))
PROBES = ("measure/card.py", "measure/costmodel.py", "fast/kernels.py", "timing.py")  # the modules whose code the constants come from


def card_key() -> dict:
    """What the constants depend on: the CPU, its cores, numpy and its BLAS, and lib's probes."""
    probes = hashlib.sha256(b"".join((Path(__file__).parents[1] / name).read_bytes() for name in PROBES))
    built = np.show_config(mode="dicts")["Build Dependencies"]["blas"]  # numpy's own BLAS, whatever else is loaded
    blas = [f"{built.get('name')} {built.get('version')}"]
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "numpy": np.__version__, "blas": blas,
            "lib": probes.hexdigest()[:16]}


def card_path(key: dict = None) -> Path:
    """Where the card for `key` (this machine's, by default) is kept."""
    digest = hashlib.sha256(json.dumps(key or card_key(), sort_keys=True).encode()).hexdigest()[:16]
    return CARD_DIR / f"machine-{digest}.json"


def _to_json(m: Machine, key: dict) -> dict:
    return {"key": key, "call": m.call, "engine_call": m.engine_call, "read_rates": [list(p) for p in m.read_rates],
            "rates": [[p, r, s, v] for (p, r, s), v in m.rates.items()], "per_element": m.per_element,
            "caches": m.caches, "loop": m.loop, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}


def _from_json(d: dict) -> Machine:
    return Machine(d["call"], d["engine_call"], tuple(tuple(p) for p in d["read_rates"]),
                   {(p, r, s): v for p, r, s, v in d["rates"]}, d["per_element"], d["caches"], d["loop"])


def load_card() -> Machine | None:
    """This machine's card as kept on disk, or None when there is none for its key or it is unreadable."""
    key = card_key()
    try:
        card = json.loads(card_path(key).read_text())
        return _from_json(card) if card["key"] == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def calibrate(out=print, refresh: bool = False) -> Machine:
    """This machine's card: its constants, measured once and kept on disk under CARD_DIR, keyed by
    `card_key()`, so every chapter of a build quotes the same machine. Measured again when the key
    changes (another CPU, numpy, BLAS or probe), when the card is unreadable, or with refresh=True
    (`python -m lib.bench --recalibrate`). `out` receives the card's description."""
    machine = None if refresh else load_card()
    if machine is None:
        machine, key = measure(), card_key()
        path = card_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_to_json(machine, key), indent=1))
        tmp.replace(path)  # atomic: two processes calibrating at once leave one whole card
    if out:
        out(card_constants(machine))
    return machine
