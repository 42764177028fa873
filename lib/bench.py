"""`python -m lib.bench`: the benchmark report. Every speed the engine claims, measured in one
run with single-threaded BLAS, warm-up and back-to-back pairs, each beside the cost model's
prediction (`lib.measure.costmodel`, calibrated at the start of the run), then every goal with its
measured value. The timers and counters it uses are `lib.timing`'s.

    python -m lib.bench
"""
import time

import numpy as np

from threadpoolctl import threadpool_info

from lib.cache.kv_cache import KVCache
from lib.corpus import held_out_prompts
from lib.generation import generate
from lib.kernels import CANDIDATES
from lib.lean import LeanModel
from lib.measure import cachebytes
from lib.measure.clocks import fit_clock
from lib.measure.costmodel import (Predictions, calibrate, card_path, describe, h100_line, lean_builder, load_card,
                                   plain_builder, predict, predict_calls)
from lib.measure.counting import cached_call, numpy_calls_per_step, step_counts
from lib.measure.load_study import decode_speedup, load_study
from lib.measure.standins import STANDINS, StandInStep, standin, standin_params, weight_bytes
from lib.measure.sweep import call_costs, draft_cost, predictions, sweep
from lib.model import cached_step, load
from lib.speculative import expected_speedup
from lib.timing import matmul_gflops, median_time, memory_gbps, paired, single_thread

FUSED_POINT = (16, 1023)  # (batch, context) of the quantized-cache goals: the cache about 4x the weights' bytes


def serving_rows(out=print):
    """The serving lines of `python -m lib.bench`: batched decode of the trained target and of the
    12x768 stand-in, then `lib.measure.load_study.load_study`; returns the goals as (text, value, met)."""
    target, draft = load("target"), load("draft")
    lean = LeanModel(*target)
    positions = np.random.default_rng(0).integers(16, 129, 32)  # cached tokens of each sequence
    with single_thread():
        out("batched decode of the target, lean, B sequences at positions 16..128 (paired with each alone)")
        for B in (1, 4, 16, 32):
            alone, batched, gain = decode_speedup(lean, positions[:B])
            out(f"  B = {B:2d}: alone {alone * 1e3:6.2f} ms, batched {batched * 1e3:6.2f} ms per step, "
                f"{B / batched:7.0f} tokens/s, {gain:.2f}x")
        chunks = (4, 16, 64, 256)
        big_clock = fit_clock(standin("12x768"), positions, chunks=chunks, repeats=3)
        small_clock = fit_clock(standin("4x256"), positions, chunks=chunks, repeats=3)
        big = dict(big_clock.decode_times)
        out("12x768 stand-in, batched decode: " + ", ".join(f"B = {B}: {t * 1e3:.0f} ms" for B, t in big.items()))
        study = load_study(target, draft, big_clock, small_clock, out=out)
    big16 = 16 * big[1] / big[16]
    paged = study["good"]["paged (vLLM)"] / max(study["good"]["static"], 1e-9)
    measured, predicted = study["crossover"]
    gap = abs(measured / predicted - 1) if np.isfinite(measured / predicted) else float("inf")
    return [("12x768 stand-in: batched decode, B = 16 >= 5 x the tokens/s of B = 1", big16, big16 >= 5),
            ("stand-in cost: paged continuous goodput >= 2 x static's, at static's best rate", paged, paged >= 2),
            ("stand-in cost: speculative in the batch, TPOT p50 >= 1.3 x better at the lowest rate",
             study["gains"][0], study["gains"][0] >= 1.3),
            ("... measured crossover rate within 25% of the predicted one (|gap|; inf: none measured)", gap,
             gap <= 0.25),
            ("served tokens equal solo decoding, no block leaked, every run (1 = yes)", float(study["exact"]),
             study["exact"])]


def _product_times(C, rows=(2, 5, 9)):
    """Microseconds of one (T, C+1) @ (C+1, 3C) product (a layer's q|k|v) with each candidate of
    `lib.kernels` (numpy's general product, a batch of one-row products, the small-rows kernel)."""
    rng = np.random.default_rng(0)
    w = np.asfortranarray(rng.standard_normal((C + 1, 3 * C), np.float32))
    out = {}
    for t in rows:
        a = rng.standard_normal((t, C + 1), np.float32)
        out[t] = {name: median_time(lambda: f(a, w), min_seconds=0.01) * 1e6 for name, f in CANDIDATES.items()}
    return out


def _goal_lines(goals, out):
    out("goals")
    for text, value, met in goals:
        out(f"  {'met    ' if met else 'NOT MET'}  {text}: {value:.2f}")


def run(out=print, recalibrate: bool = False):
    """Print the benchmark table and the goals; returns the measured ratios."""


    target, draft = load("target"), load("draft")
    (tp, tcfg), (dp, dcfg) = target, draft
    lean_t, lean_d, numpy_t = LeanModel(tp, tcfg), LeanModel(dp, dcfg), LeanModel(tp, tcfg, "numpy")
    plain_t = cached_step(target)[1]
    ratios, sizes = {}, range(2, 10)
    with single_thread():
        blas = [(i["internal_api"], i["num_threads"], i.get("architecture")) for i in threadpool_info()]
        out(f"BLAS (limited for timing): {blas}")
        out(f"peak float32 matmul {matmul_gflops(1024, 1024, 1024):.1f} GFLOP/s, copy bandwidth "
            f"{memory_gbps():.1f} GB/s (reads and writes; for the record, not used below)\n")
        start = time.perf_counter()
        machine = None if recalibrate else load_card()
        fresh = machine is None
        if fresh:
            machine = calibrate(None, refresh=True)
        ratios["calibration_s"] = time.perf_counter() - start
        out("the machine card: " + machine.card())
        out(f"  ({'measured now' if fresh else 'loaded'}: {card_path()}; `python -m lib.bench --recalibrate` measures it again)")
        out("  the cost model's constants:\n  " + describe(machine).replace("\n", "\n  ") + "\n")
        pred = Predictions(machine, out)

        out("cached decode step of the target (ms)     plain     lean   lean/plain (paired)   predicted: plain     lean")
        for pos in (16, 64, 128, 256, 511):
            a, b, ratios[f"step_{pos}"] = paired(cached_call(plain_t, tcfg, pos), cached_call(lean_t, tcfg, pos))
            pa = predict_calls(machine, plain_builder(tcfg), tp, tcfg, pos, (1,), path="plain")[1]
            pb = predict_calls(machine, lean_builder(tcfg), tp, tcfg, pos, (1,), lean_t.products)[1]
            pred.add("decode step, plain", f"position {pos}", pa.seconds, a, pa)
            pred.add("decode step, lean", f"position {pos}", pb.seconds, b, pb)
            out(f"  position {pos:3d}                         {a * 1e3:7.3f}  {b * 1e3:7.3f}   {ratios[f'step_{pos}']:6.2f}"
                f"               {pa.seconds * 1e3:7.3f}  {pb.seconds * 1e3:7.3f}")
        calls_plain = numpy_calls_per_step(lambda p: cached_step((p, tcfg))[1], tp, tcfg, 128)
        calls_lean = numpy_calls_per_step(lambda p: LeanModel(p, tcfg), tp, tcfg, 128)
        out(f"  numpy calls per step                    {calls_plain:5d}    {calls_lean:5d}")
        ratios["tiny_step"] = paired(cached_call(numpy_t, tcfg, 128), cached_call(lean_t, tcfg, 128))[2]
        out(f"  lean step with the measured products vs numpy's products only, position 128: {ratios['tiny_step']:.2f}\n")

        out("prefill (ms)                       one call  one by one  ratio   predicted one call")
        for n in (16, 64, 256):
            def fill(chunk):
                cache = KVCache(tcfg, n)
                for i in range(0, n, chunk):
                    plain_t(np.arange(i, min(i + chunk, n)) % tcfg.vocab_size, cache)
            a, b = median_time(lambda: fill(n), repeats=5), median_time(lambda: fill(1), repeats=3, warmup=1)
            pa = predict_calls(machine, plain_builder(tcfg), tp, tcfg, 0, (n,), path="plain")[n]
            pred.add("prefill, plain", f"{n} tokens", pa.seconds, a, pa)
            out(f"  {n:3d} tokens (plain path)             {a * 1e3:7.2f}   {b * 1e3:8.2f}  {b / a:5.1f}x   {pa.seconds * 1e3:7.2f}")

        prompt = held_out_prompts(1)[0]
        t_none = median_time(lambda: generate(tp, tcfg, prompt, 256, use_cache=False), repeats=1, warmup=0)
        t_plain = median_time(lambda: generate(tp, tcfg, prompt, 256), repeats=3, warmup=1)
        t_lean = median_time(lambda: generate(tp, tcfg, prompt, 256, step=lean_t), repeats=3, warmup=1)
        out(f"\n256-token greedy generation: no cache {t_none:.3f} s, plain cache {t_plain:.3f} s, lean cache "
            f"{t_lean:.3f} s ({t_none / t_lean:.0f}x and {t_plain / t_lean:.1f}x faster)")

        out("\nV(T): a T-token call over a one-token call, position 64 (median of back-to-back pairs)")
        costs = {"tiny, numpy": call_costs(numpy_t, sizes), "tiny, measured choice": call_costs(lean_t, sizes)}
        large_cfg = STANDINS["12x768"]
        counted = {"tiny": (step_counts(lean_builder(tcfg), tp, tcfg, 64, range(1, 10)), numpy_t, lean_t),
                   "12x768 stand-in": (step_counts(lean_builder(large_cfg), standin_params(large_cfg), large_cfg, 64, range(1, 10)),)}
        del numpy_t
        large = standin("12x768", products="numpy")
        costs["12x768 stand-in, numpy"] = call_costs(large, sizes, repeats=5)
        counted["12x768 stand-in"] += (large,)
        del large
        large = standin("12x768")
        costs["12x768 stand-in, measured choice"] = call_costs(large, sizes, repeats=5)
        counted["12x768 stand-in"] += (large,)
        predicted = {}  # {series: {T: Prediction}}
        for model_name, (counts, *models) in counted.items():
            for kind, model in zip(("numpy", "measured choice"), models):
                predicted[f"{model_name}, {kind}"] = {T: predict(c, machine, model.products[T], "lean") for T, c in counts.items()}
        out("  " + " " * 32 + "".join(f"{T:>6d}" for T in sizes) + "   1 token (ms)")
        for name, v in costs.items():
            p = predicted[name]
            out(f"  {name:32s}" + "".join(f"{v[T]:6.2f}" for T in sizes) + f"   {v[0] * 1e3:8.3f}")
            out(f"  {'  predicted':32s}" + "".join(f"{p[T].seconds / p[1].seconds:6.2f}" for T in sizes)
                + f"   {p[1].seconds * 1e3:8.3f}")
            for T in sizes:
                pred.add(f"V(T), {name}", f"T = {T}", p[T].seconds / p[1].seconds, v[T])
        out(f"  products chosen by row count: tiny {lean_t.products}, 12x768 {large.products}")
        C = tcfg.n_embd
        out(f"  one (T, {C + 1}) @ ({C + 1}, {3 * C}) product, us: " + ", ".join(
            f"T={t}: " + " / ".join(f"{name} {us:.1f}" for name, us in row.items()) for t, row in _product_times(C).items()))
        ratios["verify_5_large"] = costs["12x768 stand-in, measured choice"][5]
        step_large, bytes_large = costs["12x768 stand-in, measured choice"][0], weight_bytes(large)
        ratios["verify_5_large_vs_model"] = ratios["verify_5_large"] / (
            predicted["12x768 stand-in, measured choice"][5].seconds / predicted["12x768 stand-in, measured choice"][1].seconds)
        out("  decode step of each stand-in (ms): " + ", ".join(f"{n}" for n in STANDINS))
        for name, scfg in STANDINS.items():
            model = large if name == "12x768" else standin(name)
            p = predict_calls(machine, lean_builder(scfg), standin_params(scfg), scfg, 64, (1,), model.products)[1] \
                if name != "12x768" else predicted["12x768 stand-in, measured choice"][1]
            t = step_large if name == "12x768" else median_time(cached_call(model, scfg, 64), repeats=5)
            pred.add("decode step, stand-ins", name, p.seconds, t, p)
            out(f"    {name:7s} measured {t * 1e3:7.2f}, predicted {p.seconds * 1e3:7.2f}")
        ratios["large_vs_bandwidth"] = step_large / (bytes_large / machine.memory_bandwidth)
        out(f"  12x768 stand-in decode step {step_large * 1e3:.1f} ms for {bytes_large / 1e6:.0f} MB of weights: it streamed "
            f"{bytes_large / step_large / 1e9:.1f} GB/s against the card's {machine.memory_bandwidth / 1e9:.1f} GB/s "
            f"({ratios['large_vs_bandwidth']:.2f}x the time of reading them at the card's rate)")

        prompts, shadow = held_out_prompts(4), StandInStep(lean_t, large)
        # the model's V(k+1) and c for both regimes: the trained target, and the trained target run beside the stand-in
        tiny_p, large_p = predicted["tiny, measured choice"], predicted["12x768 stand-in, measured choice"]
        draft_p = predict_calls(machine, lean_builder(dcfg), dp, dcfg, 64, (1,), lean_d.products)[1].seconds
        model_vc = {"": ({T: tiny_p[T].seconds / tiny_p[1].seconds for T in tiny_p}, draft_p / tiny_p[1].seconds),
                    "large_": ({T: (tiny_p[T].seconds + large_p[T].seconds) / (tiny_p[1].seconds + large_p[1].seconds)
                                for T in tiny_p}, draft_p / (tiny_p[1].seconds + large_p[1].seconds))}
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
                v_model, c_model = model_vc[tag]
                for (_, k), r in rows.items():
                    r["model"] = expected_speedup(r["alpha"], k, c_model, verify=v_model[k + 1])
                    pred.add(f"speculative, {'stand-in' if tag else 'trained'} cost", f"T={temp} k={k}", r["model"], r["speedup"])
                    out(f"    T={temp} k={k}: alpha {r['alpha']:.3f}, speed-up {r['speedup']:.2f}x "
                        f"(Theorem 3.8: {r['theorem']:.2f}x, +verify: {r['with_verify']:.2f}x, cost model: {r['model']:.2f}x)")
                k, best = max(((k, r) for (_, k), r in rows.items()), key=lambda kr: kr[1]["speedup"])
                ratios[f"{tag}spec_{temp}"], ratios[f"{tag}spec_vs_verify_{temp}"] = best["speedup"], best["speedup"] / best["with_verify"]
                ratios[f"{tag}spec_vs_model_{temp}"] = best["speedup"] / best["model"]
                out(f"    -> best k = {k} at T={temp}: {best['speedup']:.2f}x ({'faster' if best['speedup'] > 1 else 'slower'}), "
                    f"{best['speedup'] / best['with_verify']:.2f} of Theorem 3.8 with the measured V and c")

        B, L = FUSED_POINT
        out(f"\nbatched decode step at the 12x768 stand-in's cost (1,024 positions), batch {B} x context {L}, by KV "
            "storage form (lib.measure.cachebytes: the fused paged read; predicted, then measured)")
        fused = cachebytes.sweep(machine, cachebytes.standin(), standin_params(cachebytes.STANDIN), [FUSED_POINT])
        for (_, _, dtype), r in fused.items():
            ratios[f"fused_{dtype}"] = r["seconds"] / fused[B, L, "float32"]["seconds"]
            ratios[f"fused_{dtype}_vs_model"] = r["seconds"] / r["predicted"]
            pred.add("quantized cache step, stand-in", dtype, r["predicted"], r["seconds"])
            out(f"  {dtype:8s} cache {r['kv_bytes'] / 1e6:5.0f} MB: {r['seconds'] * 1e3:6.1f} ms "
                f"({ratios[f'fused_{dtype}']:.2f}x float32), predicted {r['predicted'] * 1e3:6.1f} ms")
    ratios["calls_lean"] = calls_lean
    pred.report()
    h100, published = h100_line(out)
    errors = np.abs(pred.errors())
    out("")
    serving_goals = serving_rows(out)
    spec_gap = max(abs(ratios[f"large_spec_vs_verify_{t}"] - 1) for t in (0.0, 0.7))
    fused_gap = max(abs(ratios[f"fused_{d}_vs_model"] - 1) for d in ("int8", "fp8", "int4"))
    _goal_lines([
        ("cost model: predicted points in this run >= 40", len(errors), len(errors) >= 40),
        ("cost model: median |predicted / measured - 1| <= 0.15", np.median(errors), np.median(errors) <= 0.15),
        ("cost model: worst |predicted / measured - 1| <= 0.40", errors.max(), errors.max() <= 0.40),
    ] + ([("cost model: calibration <= 20 s", ratios["calibration_s"], ratios["calibration_s"] <= 20)] if fresh else []) + [
        ("cost model: H100 data-sheet prediction / published measurement within 0.7..1.3", h100 / published,
         0.7 <= h100 / published <= 1.3),
        ("12x768 stand-in decode step <= 1.5 x weight bytes / read bandwidth", ratios["large_vs_bandwidth"],
         ratios["large_vs_bandwidth"] <= 1.5),
        ("V(5) on the 12x768 stand-in, measured / predicted within 0.75..1.33", ratios["verify_5_large_vs_model"],
         0.75 <= ratios["verify_5_large_vs_model"] <= 1.33),
        ("speculative at the stand-in's cost, best k, T=0.7 > 1 (a gain)", ratios["large_spec_0.7"], ratios["large_spec_0.7"] > 1),
        ("... and >= 0.85 of the cost model's prediction", ratios["large_spec_vs_model_0.7"], ratios["large_spec_vs_model_0.7"] >= 0.85),
        ("speculative at the stand-in's cost, best k, T=0 > 1 (a gain)", ratios["large_spec_0.0"], ratios["large_spec_0.0"] > 1),
        ("... and >= 0.85 of the cost model's prediction", ratios["large_spec_vs_model_0.0"], ratios["large_spec_vs_model_0.0"] >= 0.85),
        ("... within 15% of Theorem 3.8 with the measured V and c (largest gap)", spec_gap, spec_gap <= 0.15),
        (f"quantized cache at the stand-in's cost (B {FUSED_POINT[0]} x L {FUSED_POINT[1]}): int8 step / float32 step <= 0.75", ratios["fused_int8"],
         ratios["fused_int8"] <= 0.75),
        ("... fp8 step / float32 step <= 0.8", ratios["fused_fp8"], ratios["fused_fp8"] <= 0.8),
        ("... int4 step / float32 step <= 0.65", ratios["fused_int4"], ratios["fused_int4"] <= 0.65),
        ("... the int8, fp8 and int4 steps within 20% of the cost model (worst measured / predicted - 1)", fused_gap,
         fused_gap <= 0.2),
        ("tiny lean step, measured products / numpy's products only <= 1.05", ratios["tiny_step"], ratios["tiny_step"] <= 1.05),
        ("numpy calls per lean step <= 150", calls_lean, calls_lean <= 150),
    ] + serving_goals, out)
    return ratios


if __name__ == "__main__":
    import sys
    run(recalibrate="--recalibrate" in sys.argv[1:])
