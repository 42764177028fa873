"""Measuring: median timers with single-threaded BLAS, and FLOPs and bytes counted from the
shapes of the matrix products a function actually runs.

Timing follows the usual benchmarking rules (warm-up, repeats, median; one BLAS thread so
runs compare). Counting runs the function on parameters viewed as an ndarray subclass whose
`__array_ufunc__` / `__array_function__` hooks see every numpy call: each `matmul` adds
2*m*k*n (times its batch) FLOPs and the bytes of its operands and result, the roofline
model's "bytes moved" (Williams et al. 2009).

    python -m lib.bench      # the benchmark table: ratios measured in one run
"""
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits


@contextmanager
def single_thread():
    """One BLAS thread, so timings compare across calls and machines."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def median_time(fn, repeats: int = 7, warmup: int = 2, min_seconds: float = 0.0) -> float:
    """Median wall time of fn() in seconds, after warm-up calls. With min_seconds, each repeat
    loops fn until that much time has passed and reports the time per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        times.append(elapsed / n)
    return float(np.median(times))


def paired_times(baseline, candidate, repeats: int = 3, min_seconds: float = 0.0) -> np.ndarray:
    """Times of baseline and candidate run back to back, `repeats` times: (repeats, 2) seconds.
    Ratios taken row by row are immune to slow drifts of the machine's speed."""
    timed = lambda fn: median_time(fn, repeats=1, warmup=0, min_seconds=min_seconds)
    return np.array([(timed(baseline), timed(candidate)) for _ in range(repeats)])


def paired(baseline, candidate, repeats: int = 9, min_seconds: float = 0.01):
    """(baseline seconds, candidate seconds, candidate / baseline), each the median over
    back-to-back pairs, for timing single calls."""
    times = paired_times(baseline, candidate, repeats, min_seconds)
    return float(np.median(times[:, 0])), float(np.median(times[:, 1])), float(np.median(times[:, 1] / times[:, 0]))


def paired_speedup(baseline, candidate, repeats: int = 3, min_seconds: float = 0.0) -> float:
    """Median over back-to-back runs of baseline time / candidate time."""
    times = paired_times(baseline, candidate, repeats, min_seconds)
    return float(np.median(times[:, 0] / times[:, 1]))


@dataclass
class OpCounts:
    flops: int = 0  # 2*m*k*n per matmul
    bytes: int = 0  # operands read + result written, per matmul
    matmuls: int = 0
    numpy_calls: int = 0  # every ufunc and array-function call that touched a counted array

    @property
    def intensity(self) -> float:
        """Arithmetic intensity of the products, FLOP per byte."""
        return self.flops / self.bytes if self.bytes else 0.0


def count_ops(fn, params: dict) -> OpCounts:
    """Run fn(counted_params) and count its numpy calls, and the FLOPs and bytes of its matmuls."""
    counts = OpCounts()

    def plain(x):
        return x.view(np.ndarray) if isinstance(x, Counted) else x

    def wrap(result):
        if isinstance(result, np.ndarray) and not isinstance(result, Counted):
            return result.view(Counted)
        if isinstance(result, tuple):
            return tuple(wrap(r) for r in result)
        return result

    class Counted(np.ndarray):
        def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
            counts.numpy_calls += 1
            inputs = [plain(x) for x in inputs]
            if "out" in kwargs:
                kwargs["out"] = tuple(plain(x) for x in kwargs["out"])
            result = getattr(ufunc, method)(*inputs, **kwargs)
            if ufunc is np.matmul and method == "__call__":
                a, b = np.asarray(inputs[0]), np.asarray(inputs[1])
                m, k, n = a.shape[-2] if a.ndim > 1 else 1, a.shape[-1], b.shape[-1]
                batch = int(np.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), dtype=np.int64))
                counts.matmuls += 1
                counts.flops += 2 * batch * m * k * n
                counts.bytes += a.nbytes + b.nbytes + np.asarray(result).nbytes
            return wrap(result)

        def __array_function__(self, func, types, args, kwargs):
            counts.numpy_calls += 1
            args = tuple(plain(a) if not isinstance(a, (list, tuple)) else type(a)(plain(x) for x in a) for a in args)
            return wrap(func(*args, **{k: plain(v) for k, v in kwargs.items()}))

    fn({k: v.view(Counted) for k, v in params.items()})
    return counts


def matmul_gflops(m: int, k: int = 96, n: int = 384, seconds: float = 0.05) -> float:
    """Measured GFLOP/s of an (m, k) @ (k, n) float32 product on one thread."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    out = np.empty((m, n), np.float32)
    with single_thread():
        t = median_time(lambda: np.matmul(a, b, out=out), repeats=5, min_seconds=seconds)
    return 2 * m * k * n / t / 1e9


def memory_gbps(mbytes: int = 256) -> float:
    """Measured copy bandwidth in GB/s (bytes read + bytes written) over a buffer far larger than cache."""
    src = np.ones(mbytes * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    t = median_time(lambda: np.copyto(dst, src), repeats=5, warmup=1)
    return 2 * src.nbytes / t / 1e9


def read_gbps(mbytes: int = 512, repeats: int = 7) -> float:
    """Measured read bandwidth in GB/s, STREAM's idea (McCalpin 1995) for the access a decode step
    makes: one BLAS thread multiplies a vector by a float32 matrix of `mbytes` MB (far larger
    than the caches), reading each element once. Like STREAM, the best of the repeats."""
    m = np.ones((mbytes * 2**20 // 4096, 1024), np.float32)  # (rows, 1024), every page written
    x = np.ones(1024, np.float32)
    with single_thread():
        np.dot(m, x)
        t = min(median_time(lambda: np.dot(m, x), repeats=1, warmup=0) for _ in range(repeats))
    return m.nbytes / t / 1e9


# ----------------------------------------------------------------------------- the benchmark

def held_out_prompts(count: int = 4, length: int = 16):
    """`count` line starts of `length` characters, spread evenly over the held-out text (lines
    whose start holds at least 12 non-blank characters)."""
    from .corpus import load_corpus
    from .tokenizer import decode, encode
    lines = [l for l in decode(load_corpus().held_out).split("\n") if len(l[:length].strip()) >= 12]
    return [encode(lines[i * len(lines) // count][:length]) for i in range(count)]


def stepper(step, cfg, position: int, n_tokens: int = 1):
    """A function that runs step(new_tokens, cache) on n_tokens new tokens after `position`
    cached ones, then drops them again: one cached call, ready to time."""
    from .kv_cache import KVCache
    cache = KVCache(cfg)
    step(np.arange(position) % cfg.vocab_size, cache)
    new = np.arange(n_tokens) % cfg.vocab_size

    def call():
        step(new, cache)
        cache.truncate(position)
    return call


def _product_times(C, rows=(2, 5, 9)):
    """Microseconds of one (T, C+1) @ (C+1, 3C) product (a layer's q|k|v) with each candidate of
    `lib.kernels` (numpy's general product, a batch of one-row products, the small-rows kernel)."""
    from .kernels import CANDIDATES
    rng = np.random.default_rng(0)
    w = np.asfortranarray(rng.standard_normal((C + 1, 3 * C), np.float32))
    out = {}
    for t in rows:
        a = rng.standard_normal((t, C + 1), np.float32)
        out[t] = {name: median_time(lambda: f(a, w), min_seconds=0.01) * 1e6 for name, f in CANDIDATES.items()}
    return out


def numpy_calls_per_step(step_builder, params, cfg, position: int = 128) -> int:
    """Numpy calls of one decode step at `position` by step_builder(params) (a function of
    (new_tokens, cache)), not counting the calls that build it."""
    from .kv_cache import KVCache
    cache = KVCache(cfg)
    step_builder(params)(np.arange(position) % cfg.vocab_size, cache)
    build = count_ops(step_builder, params).numpy_calls
    return count_ops(lambda p: step_builder(p)([5], cache), params).numpy_calls - build


def _goal_lines(goals, out):
    out("goals")
    for text, value, met in goals:
        out(f"  {'met    ' if met else 'NOT MET'}  {text}: {value:.2f}")


def run(out=print):
    """Print the benchmark table and the goals; returns the measured ratios."""
    from threadpoolctl import threadpool_info

    from .generate import generate
    from .kv_cache import KVCache
    from .lean import LeanModel, cached_step
    from .model import load
    from .standins import CostShadow, standin, weight_bytes
    from .sweep import call_costs, draft_cost, predictions, sweep

    target, draft = load("target"), load("draft")
    (tp, tcfg), (dp, dcfg) = target, draft
    lean_t, lean_d, numpy_t = LeanModel(tp, tcfg), LeanModel(dp, dcfg), LeanModel(tp, tcfg, "numpy")
    plain_t = cached_step(target)[1]
    ratios, sizes = {}, range(2, 10)
    with single_thread():
        blas = [(i["internal_api"], i["num_threads"], i.get("architecture")) for i in threadpool_info()]
        out(f"BLAS (limited for timing): {blas}")
        bandwidth = read_gbps()
        out(f"peak float32 matmul {matmul_gflops(1024, 1024, 1024):.1f} GFLOP/s, copy bandwidth {memory_gbps():.1f} GB/s, "
            f"read bandwidth {bandwidth:.1f} GB/s\n")

        out("cached decode step of the target (ms)     plain     lean   lean/plain (paired)")
        for pos in (16, 64, 128, 256, 511):
            a, b, ratios[f"step_{pos}"] = paired(stepper(plain_t, tcfg, pos), stepper(lean_t, tcfg, pos))
            out(f"  position {pos:3d}                         {a * 1e3:7.3f}  {b * 1e3:7.3f}   {ratios[f'step_{pos}']:6.2f}")
        calls_plain = numpy_calls_per_step(lambda p: cached_step((p, tcfg))[1], tp, tcfg, 128)
        calls_lean = numpy_calls_per_step(lambda p: LeanModel(p, tcfg), tp, tcfg, 128)
        out(f"  numpy calls per step                    {calls_plain:5d}    {calls_lean:5d}")
        ratios["tiny_step"] = paired(stepper(numpy_t, tcfg, 128), stepper(lean_t, tcfg, 128))[2]
        out(f"  lean step with the measured products vs numpy's products only, position 128: {ratios['tiny_step']:.2f}\n")

        out("prefill (ms)                       one call  one by one  ratio")
        for n in (64, 256):
            def fill(chunk):
                cache = KVCache(tcfg, n)
                for i in range(0, n, chunk):
                    plain_t(np.arange(i, min(i + chunk, n)) % tcfg.vocab_size, cache)
            a, b = median_time(lambda: fill(n), repeats=5), median_time(lambda: fill(1), repeats=3, warmup=1)
            out(f"  {n:3d} tokens (plain path)             {a * 1e3:7.2f}   {b * 1e3:8.2f}  {b / a:5.1f}x")

        prompt = held_out_prompts(1)[0]
        t_none = median_time(lambda: generate(tp, tcfg, prompt, 256, use_cache=False), repeats=1, warmup=0)
        t_plain = median_time(lambda: generate(tp, tcfg, prompt, 256), repeats=3, warmup=1)
        t_lean = median_time(lambda: generate(tp, tcfg, prompt, 256, step=lean_t), repeats=3, warmup=1)
        out(f"\n256-token greedy generation: no cache {t_none:.3f} s, plain cache {t_plain:.3f} s, lean cache "
            f"{t_lean:.3f} s ({t_none / t_lean:.0f}x and {t_plain / t_lean:.1f}x faster)")

        out("\nV(T): a T-token call over a one-token call, position 64 (fastest of back-to-back pairs)")
        costs = {"tiny, numpy": call_costs(numpy_t, sizes), "tiny, measured choice": call_costs(lean_t, sizes)}
        del numpy_t
        large = standin("12x768", products="numpy")
        costs["12x768 stand-in, numpy"] = call_costs(large, sizes, repeats=5)
        del large
        large = standin("12x768")
        costs["12x768 stand-in, measured choice"] = call_costs(large, sizes, repeats=5)
        out("  " + " " * 32 + "".join(f"{T:>6d}" for T in sizes) + "   1 token (ms)")
        for name, v in costs.items():
            out(f"  {name:32s}" + "".join(f"{v[T]:6.2f}" for T in sizes) + f"   {v[0] * 1e3:8.3f}")
        out(f"  products chosen by row count: tiny {lean_t.products}, 12x768 {large.products}")
        C = tcfg.n_embd
        out(f"  one (T, {C + 1}) @ ({C + 1}, {3 * C}) product, us: " + ", ".join(
            f"T={t}: " + " / ".join(f"{name} {us:.1f}" for name, us in row.items()) for t, row in _product_times(C).items()))
        ratios["verify_5_large"] = costs["12x768 stand-in, measured choice"][5]
        step_large, bytes_large = costs["12x768 stand-in, measured choice"][0], weight_bytes(large)
        ratios["large_vs_bandwidth"] = step_large / (bytes_large / (bandwidth * 1e9))
        out(f"  12x768 stand-in decode step {step_large * 1e3:.1f} ms for {bytes_large / 1e6:.0f} MB of weights: "
            f"{ratios['large_vs_bandwidth']:.2f}x the time of reading them at {bandwidth:.1f} GB/s")

        prompts, shadow = held_out_prompts(4), CostShadow(lean_t, large)
        regimes = {"": (lean_t, draft_cost(lean_t, lean_d), costs["tiny, measured choice"], prompts, 96, (1, 2, 3, 4, 6, 8), 2),
                   "large_": (shadow, draft_cost(shadow, lean_d, repeats=5), call_costs(shadow, sizes, repeats=5),
                              prompts[:2], 48, (2, 3, 4, 6), 1)}
        out(f"\nc (draft step / target step): {regimes[''][1]:.2f} at the trained target's cost, "
            f"{regimes['large_'][1]:.4f} at the stand-in's")
        out("speculative decoding vs target-only decoding, lean draft (Theorem 3.8 from the measured alpha and c; "
            "'+verify': the same with the measured V(k+1))")
        for tag, (tgt, c, v, ps, n, ks, repeats) in regimes.items():
            out(f"  {'at the 12x768 stand-in' if tag else 'trained target'}'s cost, {len(ps)} prompts x {n} tokens")
            for temp in (0.0, 0.7):
                rows = sweep(tgt, {"draft": lean_d}, ps, n, ks, temp, repeats)
                predictions(rows, c, v)
                for (_, k), r in rows.items():
                    out(f"    T={temp} k={k}: alpha {r['alpha']:.3f}, speed-up {r['speedup']:.2f}x "
                        f"(Theorem 3.8: {r['theorem']:.2f}x, +verify: {r['with_verify']:.2f}x)")
                k, best = max(((k, r) for (_, k), r in rows.items()), key=lambda kr: kr[1]["speedup"])
                ratios[f"{tag}spec_{temp}"], ratios[f"{tag}spec_vs_verify_{temp}"] = best["speedup"], best["speedup"] / best["with_verify"]
                out(f"    -> best k = {k} at T={temp}: {best['speedup']:.2f}x ({'faster' if best['speedup'] > 1 else 'slower'}), "
                    f"{best['speedup'] / best['with_verify']:.2f} of Theorem 3.8 with the measured V and c")
    ratios["calls_lean"] = calls_lean
    from .serving import bench_rows  # serving imports this module's timers
    out("")
    serving_goals = bench_rows(out)
    spec_gap = max(abs(ratios[f"large_spec_vs_verify_{t}"] - 1) for t in (0.0, 0.7))
    _goal_lines([
        ("12x768 stand-in decode step <= 1.5 x weight bytes / read bandwidth", ratios["large_vs_bandwidth"],
         ratios["large_vs_bandwidth"] <= 1.5),
        ("V(5) <= 2.0 on the 12x768 stand-in (measured choice of products)", ratios["verify_5_large"],
         ratios["verify_5_large"] <= 2.0),
        ("speculative at the stand-in's cost, best k, T=0.7 >= 1.5x", ratios["large_spec_0.7"], ratios["large_spec_0.7"] >= 1.5),
        ("speculative at the stand-in's cost, best k, T=0 >= 1.7x", ratios["large_spec_0.0"], ratios["large_spec_0.0"] >= 1.7),
        ("... within 15% of Theorem 3.8 with the measured V and c (largest gap)", spec_gap, spec_gap <= 0.15),
        ("tiny lean step, measured products / numpy's products only <= 1.05", ratios["tiny_step"], ratios["tiny_step"] <= 1.05),
        ("numpy calls per lean step <= 150", calls_lean, calls_lean <= 150),
    ] + serving_goals, out)
    return ratios


if __name__ == "__main__":
    run()
