"""Predict, then measure: a step's time from its counted work and this machine's constants.

A step is a sequence of numpy calls (`lib.measure.counting.count_ops` records each one as an `Op`). The
model charges every call a fixed cost (Python, numpy's dispatch and the allocation of its
result), and on top of it the time of its work, where a roofline (Williams et al. 2009) sets it
by the larger of reading and computing:

- a weight product: its FLOPs at the rate measured on this machine for that product (numpy's,
  a batch of one-row products, the small-rows kernel), row count and weight size, a rate that
  includes streaming the weights from the level that holds the step's working set, and never
  faster than reading its weights at the read bandwidth of that working set (probed more densely
  in size than the products, so a working set just past the last cache reads at memory's rate);
- an attention product: the bytes of the cached K or V at the read bandwidth of that level,
  against its FLOPs at numpy's rate;
- an elementwise call or reduction: its elements at this machine's cost per element (a
  transcendental such as exp or tanh costs more than an add), against its bytes at the bandwidth
  of the level that holds them;
- any other call (a copy, a concatenation): its bytes at that bandwidth.

A decoding loop adds its own time around the model's calls: drawing each token (a softmax and an
inverse CDF when sampling), and for speculative decoding (Leviathan et al. 2023) each round's
accept/reject tests, residual draws and cache truncation. The card measures these loop costs once,
by running the engine's own loops over a step that does no model work (`loop` below), per emitted
token, per round, per draft call, per judged and per rejected draft token; `predict_decoding` adds
them to the predicted calls.

The constants are this machine's card (`lib.measure.card.calibrate()`: measured once and kept on
disk). One set of constants serves every prediction of a run: nothing is tuned per point. (A GPU's
step, from its data sheet, is `lib.gpu.step`.)
"""
from dataclasses import dataclass, field

import numpy as np

from lib.fast.lean import LeanModel
from lib.measure.counting import OpCounts, step_counts
from lib.measure.machine import cpu_model
from lib.model import forward_cached

MIB = 2**20
PROBE_SIZES = (MIB // 4, MIB, 3 * MIB // 2, 2 * MIB, 3 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 24 * MIB, 32 * MIB, 48 * MIB,
               64 * MIB, 96 * MIB, 128 * MIB, 192 * MIB, 256 * MIB, 384 * MIB, 512 * MIB, 1024 * MIB)
# working sets probed: dense around the common L2 sizes, and every half-octave over the L3 sizes machines of this
# kind report (32 to 480 MiB), where the rate falls to memory's: interpolating over a cliff between far probes
# priced a 45 MB stand-in at twice the rate it streamed on a 32 MiB L3.
# None below 256 KiB: there one-row products' bytes take less time than their calls, and the difference of
# two call times resolves no rate (a 32 KiB probe once gave 3e16 B/s); smaller working sets take 256 KiB's rate.
MEMORY_PROBES = 3  # the largest read probes (384 MiB to 1 GiB) measure memory's rate together
RATE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 64, 512)
RATE_LEVELS = (256 * 2**10, 16 * 2**20, 256 * 2**20)  # weight sizes the products are timed on: in L2, L3, memory
LARGE_ROWS = 64  # from this many rows on, products are timed in L2 only (compute-bound wherever the weight is;
# 16 rows are not: a batch of 16 over weights streamed from memory ran at about two thirds of its L2 rate)
ELEMENTWISE = {  # ufunc (and method) -> a call that computes 65,536 float32 elements of it into a buffer
    "add": lambda x, o: np.add(x, x, out=o), "subtract": lambda x, o: np.subtract(x, x, out=o),
    "multiply": lambda x, o: np.multiply(x, x, out=o), "divide": lambda x, o: np.divide(x, 3.0, out=o),
    "square": lambda x, o: np.square(x, out=o), "power": lambda x, o: np.power(x, 3, out=o),
    "sqrt": lambda x, o: np.sqrt(x * x, out=o), "exp": lambda x, o: np.exp(x, out=o),
    "tanh": lambda x, o: np.tanh(x, out=o), "maximum": lambda x, o: np.maximum(x, 0.0, out=o),
    "greater": lambda x, o: np.greater(x, 0.0), "add.reduce": lambda x, o: np.add.reduce(x.reshape(256, 256), axis=-1),
    "maximum.reduce": lambda x, o: np.maximum.reduce(x.reshape(256, 256), axis=-1),
    "setitem": lambda x, o: o.__setitem__(x > 0, -np.inf),  # a masked write (2 of 4 bytes per element)
}
LOOP_COUNTS = ("token", "round", "draft call", "judged", "rejected")  # what a decoding loop's own time is priced by
ALIASES = {"true_divide": "divide", "less": "greater", "greater_equal": "greater", "less_equal": "greater",
           "minimum": "maximum", "negative": "multiply", "absolute": "multiply"}


def envelope(rates) -> np.ndarray:
    """Rates by growing working set, each raised to the fastest of the larger ones: a larger working set
    is never read faster, so a probe below a larger one's rate was slowed by something else (a busy core)."""
    return np.maximum.accumulate(np.asarray(rates, float)[::-1])[::-1]


def read_curve(read_rates) -> np.ndarray:
    """Read rates by working set as the model uses them: the largest MEMORY_PROBES probes, all far past
    the last cache, take their median (one probe slowed by another process must not set memory's rate
    for every working set beyond it), then the envelope."""
    rates = np.array([r for _, r in read_rates], float)
    rates[-MEMORY_PROBES:] = np.median(rates[-MEMORY_PROBES:])
    return envelope(rates)


@dataclass(frozen=True)
class Machine:
    """Measured constants of one machine (one thread): seconds, bytes/s, FLOP/s."""
    call: float  # fixed cost of one small numpy call
    engine_call: dict  # {"plain": s, "lean": s}: a numpy call with the engine's own Python around it
    read_rates: tuple  # ((working-set bytes, read bytes/s), ...), smallest first
    rates: dict  # {(product, rows, weight bytes): FLOP/s}; product "numpy", "one-row batch" or "kernel"
    per_element: dict  # {ufunc name: seconds per element}
    caches: dict = field(default_factory=dict)  # {"L1d": bytes, "L2": bytes, "L3": bytes} as the system reports
    loop: dict = field(default_factory=dict)  # {"greedy" | "sampled": {LOOP_COUNTS name: s}}: a loop's own time

    @property
    def memory_bandwidth(self) -> float:
        """Read bytes/s from memory: the median of the probes with the largest working sets, far beyond the last cache."""
        return float(read_curve(self.read_rates)[-1])

    @property
    def peak(self) -> float:
        """The fastest weight product measured, FLOP/s (numpy's, many rows, weights in L2)."""
        return float(max(v for (p, _, _), v in self.rates.items() if p == "numpy"))

    def card(self) -> str:
        """The machine card: the few numbers every chapter quotes as "this machine"."""
        return (f"{cpu_model()}, one BLAS thread: a numpy call {self.call * 1e6:.1f} us alone, "
                f"{self.engine_call['plain'] * 1e6:.1f} / {self.engine_call['lean'] * 1e6:.1f} us inside the plain / "
                f"lean engine; one-row products read "
                f"{self.memory_bandwidth / 1e9:.1f} GB/s from memory; products peak at {self.peak / 1e9:.0f} GFLOP/s")

    def bandwidth(self, working_set: float) -> float:
        """Read bandwidth for a working set of this many bytes, interpolated in log size between the probes."""
        sizes = [size for size, _ in self.read_rates]
        return float(np.interp(np.log(max(working_set, 1.0)), np.log(sizes), read_curve(self.read_rates)))

    def rate(self, rows: int, product: str = "numpy", working_set: float = 0.0) -> float:
        """FLOP/s of a weight product over `rows` rows whose weights stream from a working set of this
        many bytes: interpolated in log rows, then in log size between the levels probed."""
        measured = {r for p, r, _ in self.rates if p == product}
        if not measured or not min(measured) <= rows <= max(measured):
            product = "numpy"  # the engine's product beyond the rows another product is made for
        by_level = []
        for level in RATE_LEVELS:
            measured = sorted((r, v) for (p, r, size), v in self.rates.items()
                              if p == product and (size == level or (r >= LARGE_ROWS and size == RATE_LEVELS[0])))
            rs, vs = zip(*measured)
            by_level.append(np.interp(np.log(rows), np.log(rs), vs))
        return float(np.interp(np.log(max(working_set, 1.0)), np.log(RATE_LEVELS), envelope(by_level)))

    def element(self, name: str) -> float:
        """Seconds per element of a ufunc (a reduction as "add.reduce"); unknown ones cost as a multiply."""
        base, _, method = name.partition(".")
        key = ALIASES.get(base, base) + (f".{method}" if method and method != "__call__" else "")
        return self.per_element.get(key, self.per_element["multiply"])


@dataclass
class Prediction:
    """A predicted time in seconds and where it goes."""
    seconds: float
    parts: dict  # {"calls": s, "weight products": s, "attention products": s, "elementwise": s, "copies": s}
    by_name: dict = field(default_factory=dict)  # {op name: s} beyond the fixed cost of its calls

    def __str__(self):
        parts = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in self.parts.items() if v)
        return f"{self.seconds * 1e3:.3f} ms ({parts} us)"


def card_constants(m: Machine) -> str:
    """The constants, a few to a line."""
    def rows_of(items, per_line=5, indent="  "):
        return "\n".join(indent + ", ".join(items[k:k + per_line]) for k in range(0, len(items), per_line))
    caches = ", ".join(f"{k} {v / 2**10:,.0f} KiB" for k, v in m.caches.items()) or "not reported"
    lines = [f"caches (as the system reports them): {caches}",
             f"a numpy call: {m.call * 1e6:.2f} us alone; in the engine: "
             + ", ".join(f"{k} {v * 1e6:.2f}" for k, v in m.engine_call.items()) + " us",
             "read GB/s by working set:",
             rows_of([f"{s / 2**20:g} MiB {bw / 1e9:.0f}" for s, bw in m.read_rates], 4),
             "product GFLOP/s by rows, weights of " + " / ".join(f"{s / 2**20:g}" for s in RATE_LEVELS) + " MiB:"]
    for product in ("numpy", "one-row batch", "kernel"):
        rows = sorted({r for p, r, _ in m.rates if p == product})
        lines.append(f"  {product}:")
        lines.append(rows_of([f"{r}: " + "/".join(f"{m.rates[product, r, s] / 1e9:.0f}" for s in RATE_LEVELS
                                                  if (product, r, s) in m.rates) for r in rows], 6, "    "))
    lines.append("elementwise ns per element:")
    lines.append(rows_of([f"{k} {v * 1e9:.2f}" for k, v in m.per_element.items()], 6))
    lines.append("a decoding loop's own us (target-only: per token; speculative: per round, draft call, judged, rejected):")
    lines += [f"  {kind}: " + ", ".join(f"{name} {s * 1e6:.1f}" for name, s in costs.items()) for kind, costs in m.loop.items()]
    return "\n".join(lines)


def working_set(ops) -> int:
    """Bytes a step streams: every product's second operand (weights, cached K and V), once."""
    return sum(op.streamed for op in ops if op.kind == "matmul")


def predict(counts, machine: Machine, product: str = "numpy", path: str = None) -> Prediction:
    """The time of a step from its counted ops. product: the weight product the step uses for its
    rows (the lean model's choice, `LeanModel.products[T]`); path: "plain" or "lean" to charge each
    call what it costs inside that engine (measured on a tiny model), None for a bare numpy call."""
    ops = counts.ops if isinstance(counts, OpCounts) else counts
    ws = working_set(ops)
    parts = dict.fromkeys(("calls", "weight products", "attention products", "elementwise", "copies"), 0.0)
    by_name = {}
    for op in ops:
        if op.kind == "matmul":
            if op.name == "weights":  # its FLOPs at the product's rate, never faster than its weights' read
                part, t = "weight products", max(op.flops / machine.rate(op.rows, product, ws),
                                                 op.streamed / machine.bandwidth(ws))
            else:  # batched over heads: numpy's product, its K or V streaming with the step's working set
                part, t = "attention products", max(op.streamed / machine.bandwidth(ws),
                                                    op.flops / machine.rate(op.rows, "numpy", op.streamed))
        elif op.kind == "ufunc":
            part, t = "elementwise", max(op.flops * machine.element(op.name), op.bytes / machine.bandwidth(op.bytes))
        else:
            part, t = "copies", op.bytes / machine.bandwidth(op.bytes)
        parts[part] += t
        by_name[op.name] = by_name.get(op.name, 0.0) + t
    parts["calls"] = len(ops) * (machine.engine_call[path] if path else machine.call)
    return Prediction(sum(parts.values()), parts, by_name)


def predict_decoding(machine: Machine, target_call: float, temperature: float, n_tokens: int, stats=None,
                     draft_call: float = 0.0, call_cost=None) -> float:
    """Seconds to emit n_tokens: target-only (stats None), each token one target call of target_call
    seconds; or speculative, from the run's counts (`SpecStats` totals: rounds, draft calls, judged,
    accepted), each round one target call over its drafted tokens plus one at call_cost[T] x target_call
    (V(T)), each draft call draft_call seconds. Both with the card's loop costs on top."""
    loop = machine.loop["sampled" if temperature > 0 else "greedy"]
    if stats is None:
        return n_tokens * (target_call + loop["token"])
    k = round(stats["drafted"] / stats["rounds"]) + 1  # tokens per target call, the run's typical round
    counts = {"token": 0, "round": stats["rounds"], "draft call": stats["draft_calls"], "judged": stats["judged"],
              "rejected": stats["judged"] - stats["accepted"]}
    return (stats["rounds"] * call_cost[k] * target_call + stats["draft_calls"] * draft_call
            + sum(counts[name] * loop[name] for name in LOOP_COUNTS))


# ----------------------------------------------------------------------------- predicted against measured

class Predictions:
    """Every timing the cost model predicted in this run beside its measurement."""

    def __init__(self, machine, out):
        self.machine, self.out, self.points = machine, out, []  # (group, label, predicted, measured, Prediction)

    def add(self, group, label, predicted, measured, prediction=None):
        self.points.append((group, label, predicted, measured, prediction))

    def keep_faster(self, seconds: dict):
        """Hold the points {(group, label): seconds} timed again to the faster of their two measurements."""
        self.points = [(group, label, p, min(m, seconds.get((group, label), m)), prediction)
                       for group, label, p, m, prediction in self.points]

    def errors(self) -> np.ndarray:
        return np.array([p / m - 1 for _, _, p, m, _ in self.points])

    def report(self):
        errors = np.abs(self.errors())
        self.out(f"\nthe cost model against every measurement of this run: {len(self.points)} points, "
                 f"median |predicted / measured - 1| {np.median(errors):.0%}, worst {errors.max():.0%}")
        for group in dict.fromkeys(g for g, *_ in self.points):
            ratios = [p / m for g, _, p, m, _ in self.points if g == group]
            self.out(f"  {group:34s} {len(ratios):3d} points, predicted / measured {min(ratios):.2f}..{max(ratios):.2f}")
        self.out("  the worst five:")
        for i in np.argsort(-errors)[:5]:
            group, label, p, m, prediction = self.points[i]
            where = f"  [{prediction}]" if prediction else ""
            self.out(f"    {group}, {label}: predicted {p:.4g}, measured {m:.4g} ({p / m:.2f}){where}")


def plain_builder(cfg):
    """A step builder (params -> step(new_tokens, cache)) for the plain cached path."""
    return lambda p: (lambda new, cache: forward_cached(p, cfg, new, cache))


def lean_builder(cfg):
    """A step builder for the lean path, counted with numpy's products (each product one call, whichever runs)."""
    return lambda p: LeanModel(p, cfg, products="numpy")


def predict_calls(machine, builder, params, cfg, position, sizes, products=None, path="lean") -> dict:
    """{T: Prediction} for cached calls over T tokens after `position`."""
    counts = step_counts(builder, params, cfg, position, sizes)
    return {T: predict(c, machine, products[T] if products and T in products else "numpy", path) for T, c in counts.items()}
