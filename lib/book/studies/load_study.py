"""The serving chapter's study: the ladder of policies over arrival rates on the CPU stand-in's fitted
clock, 1,000 requests per rate and several seeds through `lib.serve.replay` (each request decoded
once by the trained model; the H100 clock's ladder is `lib.book.studies.long_ladder`), and
speculative decoding inside the batch below saturation, with the crossover its queueing model
predicts (`lib.measure.clocks.crossover_rate`). Every served token is checked against decoding
the request alone, and every pool against leaked blocks. `serving_rows` prints these, with batched
decoding beside them, as the serving lines of `python -m lib.bench`.

Goodput and the SLO-capacity rate follow DistServe (Zhong et al. 2024).
"""
import numpy as np

from lib.fast.batch import BatchedModel
from lib.corpus import load_corpus
from lib.generation import generate
from lib.fast.lean import LeanModel
from lib.gpu.step import gpu_clock
from lib.measure.clocks import crossing, crossover_rate, fit_clock
from lib.measure.counting import batched_call, cached_call
from lib.measure.standins import standin
from lib.model import load
from lib.book.studies.long_ladder import LONG_RATE, LONG_SLO, LONG_TRACE, long_runs, vllm_ladder
from lib.book.studies.sweep import acceptance_on_text
from lib.serve import LADDER, make_trace, serve
from lib.serve.replay import Replay, completions
from lib.timing import paired, single_thread


def decode_speedup(lean, positions, repeats: int = 9):
    """One batched decode step for sequences at `positions` against decoding each alone on the
    lean path, timed back to back: (seconds for all alone, seconds batched, speed-up), medians."""
    solos = [cached_call(lean, lean.cfg, int(p)) for p in positions]
    alone, batched, ratio = paired(lambda: [s() for s in solos], batched_call(BatchedModel(lean), positions), repeats)
    return alone, batched, 1.0 / ratio


def sweep_rates(model, policies: dict, rates, trace: dict, num_blocks: int, **common) -> dict:
    """Each policy (name -> a Policy, or serve keywords such as dict(policy=..., draft=..., k=...)) at
    each arrival rate, on the trace make_trace(**trace) draws at that rate: {name: {rate: Report}}.
    `common` goes to every run (a clock, max_tokens...)."""
    runs = {name: {} for name in policies}
    for rate in rates:
        requests = make_trace(**{**trace, "rate": float(rate)})
        for name, run in policies.items():
            kwargs = run if isinstance(run, dict) else {"policy": run}
            runs[name][rate] = serve(model, requests, num_blocks, **{**common, **kwargs})
    return runs


LOAD_TRACE = dict(n=64, seed=0, burstiness=1.0, prompt_len=(8, 48), n_new=(4, 128))  # Poisson arrivals
LOAD_BLOCKS, SPEC_BLOCKS = 96, 256  # the ladder's pool; speculation's, large enough that memory never binds
LOAD_FRACTIONS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)  # rates, as shares of what a batch of 32 serves
SLO_STEPS = dict(ttft=25, tpot=3)  # latency targets in one-sequence decode steps of the clock
SPEC_REQUESTS, SPEC_FRACTIONS = 64, (0.1, 0.15, 0.2, 0.3, 0.4, 0.6)  # below saturation: a steady state exists
SPEC_POLICY = LADDER["+ prefix caching"]  # no token budget: one would cap a batch at budget / (k + 1)


SERVE_N, SERVE_SEEDS = 1000, (0, 1, 2)  # requests per rate and the seeds of their traces (arrivals, prompts, lengths)
LADDER_FRACTIONS = (0.1, 0.3)  # the two clocks' ladders: rates as shares of what a batch of 32 serves
RATE_BATCH = 32  # the decode batch whose throughput the rates are shares of


def load_rates(big_clock, mean_new: float, fractions, step32: float = None) -> list:
    """Arrival rates (requests/s) as shares of what a decode batch of 32 serves on the clock (its
    step of RATE_BATCH sequences: big_clock.decode_step(32), or `step32` seconds if given)."""
    step32 = big_clock.decode_step(RATE_BATCH) if step32 is None else step32
    return [float(f"{RATE_BATCH / step32 / mean_new * f:.3g}") for f in fractions]


def replays(model, trace: dict, seeds=SERVE_SEEDS) -> dict:
    """{seed: a Replay of make_trace(**trace, seed=seed)}: each request decoded once by `model`. The
    traces of one seed differ across rates only in their arrival times, so one Replay serves all."""
    out = {}
    for seed in seeds:
        requests = make_trace(**{**trace, "seed": seed, "rate": 1.0})
        out[seed] = Replay(model.cfg, requests, completions(model, requests))
    return out


def ladder_runs(replayed: dict, policies: dict, rates, trace: dict, num_blocks: int, **common) -> dict:
    """{name: {rate: [Report per seed]}}: each policy at each rate on each seed's replay."""
    runs = {name: {rate: [] for rate in rates} for name in policies}
    for seed, replay in replayed.items():
        for rate in rates:
            requests = make_trace(**{**trace, "seed": seed, "rate": float(rate)})
            for name, policy in policies.items():
                runs[name][rate].append(serve(replay, requests, num_blocks, policy, **common))
    return runs


def across_seeds(reports, f) -> tuple:
    """(median, lowest, highest) of f(report) over one cell's seeds."""
    values = [f(rep) for rep in reports]
    return float(np.median(values)), float(min(values)), float(max(values))


def gpu_ladder(out=print) -> dict:
    """The ladder's goodput per rung on the H100 clock where memory binds (`lib.book.studies.long_ladder`),
    seed 0: {rung: requests/s within the targets}."""
    runs = long_runs(gpu_clock(), vllm_ladder(), seeds=(0,))
    good = {name: reps[0].goodput(**LONG_SLO) for name, reps in runs.items()}
    out(f"H100 clock (Llama-3-8B), {LONG_TRACE['n']} long requests at {LONG_RATE} requests/s, vLLM's caps: goodput "
        + ", ".join(f"{k} {v:.2f}" for k, v in good.items()))
    return good


def best_rate(runs: dict, slo: dict) -> float:
    """The rate, of {rate: Report}, at which a policy's goodput within slo (ttft, tpot) was highest."""
    return max(runs, key=lambda rate: runs[rate].goodput(**slo))


def slo_capacity(runs: dict, slo: dict, share: float = 0.9) -> float:
    """The highest rate, of {rate: Report}, at which `share` of the requests met both targets
    (DistServe's capacity, Zhong et al. 2024); 0 if none."""
    return max((rate for rate, rep in runs.items() if rep.attainment(**slo) >= share), default=0.0)


def load_study(target, draft, big_clock, small_clock, k: int = 4, out=print) -> dict:
    """The serving chapter's measurements at the stand-in's fitted cost: the ladder over the rates,
    and SPEC_POLICY with and without speculative decoding below saturation, with the crossover
    predicted by lib.measure.clocks.crossover_rate. target, draft: (params, cfg) pairs; the clocks from
    lib.measure.clocks.fit_clock. Returns the numbers the goals need."""
    lean = LeanModel(*target)
    held_out = load_corpus().held_out
    trace = dict(LOAD_TRACE, system=held_out[2000:2032])
    t1, max_tokens = big_clock.decode_step(1), trace["n_new"][1]
    slo = {name: steps * t1 for name, steps in SLO_STEPS.items()}
    sample = make_trace(2000, 1.0, prompt_len=trace["prompt_len"], n_new=trace["n_new"])
    mean_new = float(np.mean([r.n_new for r in sample]))
    mean_prompt = float(np.mean([len(r.prompt) for r in sample]))  # after the shared system prompt, cached
    rates = load_rates(big_clock, mean_new, LOAD_FRACTIONS)
    ladder = sweep_rates(lean, LADDER, rates, trace, LOAD_BLOCKS, clock=big_clock, max_tokens=max_tokens,
                         batch_wait=4 * t1)
    spec_rates = load_rates(big_clock, mean_new, SPEC_FRACTIONS)
    spec = {"plain": SPEC_POLICY, "speculative": dict(policy=SPEC_POLICY, draft=LeanModel(*draft), k=k)}
    spec_trace = dict(trace, n=SPEC_REQUESTS)
    specs = sweep_rates(lean, spec, spec_rates, spec_trace, SPEC_BLOCKS, clock=big_clock, draft_clock=small_clock,
                        max_tokens=max_tokens)
    exact = True
    for t, policies, runs, rs in ((trace, LADDER, ladder, rates), (spec_trace, spec, specs, spec_rates)):
        for rate in rs:
            solo = {r.rid: generate(lean, r.prompt, r.n_new).tokens.tolist()
                    for r in make_trace(**{**t, "rate": float(rate)})}
            for rep in (runs[n][rate] for n in policies):
                m = rep.pool.manager
                exact &= all(o.tokens == solo[o.request.rid] for o in rep.outcomes)
                exact &= m.num_free == m.num_blocks and not any(m.ref)
    goal_rate = best_rate(ladder["static"], slo)
    good = {n: ladder[n][goal_rate].goodput(**slo) for n in LADDER}
    ratio = lambda key: [specs["plain"][r].summary()[key] / specs["speculative"][r].summary()[key]
                         for r in spec_rates]
    gains, means = ratio("TPOT p50 ms"), ratio("TPOT mean ms")
    alpha = acceptance_on_text(target, draft, held_out[:4096], [0.0])[0.0]
    fine = list(np.geomspace(spec_rates[0] / 2, spec_rates[-1] * 2, 60))
    predicted = crossover_rate(big_clock, small_clock, alpha, k, mean_new, fine, mean_prompt)
    measured = crossing(spec_rates, means)  # the statistic steady_state predicts
    out(f"serving at the 12x768 stand-in's fitted cost, {trace['n']} Poisson requests per rate, rates {rates}")
    out(f"  goodput at {goal_rate} requests/s (static batching's best): "
        + ", ".join(f"{n} {g:.2f}" for n, g in good.items()))
    out(f"  speculative (k = {k}) TPOT gain at {spec_rates} requests/s, p50: " + ", ".join(f"{g:.2f}x" for g in gains)
        + "; mean: " + ", ".join(f"{g:.2f}x" for g in means))
    out(f"  crossover on the mean: measured {measured:.2f}, predicted {predicted:.2f} requests/s (alpha {alpha:.2f})")
    return dict(good=good, gains=gains, crossover=(measured, predicted), exact=exact)


def serving_rows(out=print):
    """The serving lines of `python -m lib.bench`: batched decode of the trained target and of the
    12x768 stand-in, then `lib.book.studies.load_study.load_study`; returns the goals as (text, value, met)."""
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
        on_gpu = gpu_ladder(out=out)
    big16 = 16 * big[1] / big[16]
    orca = study["good"]["Orca"] / max(study["good"]["static"], 1e-9)
    orca_gpu = on_gpu["Orca"] / max(on_gpu["static"], 1e-9)
    measured, predicted = study["crossover"]
    gap = abs(measured / predicted - 1) if np.isfinite(measured / predicted) else float("inf")
    return [("12x768 stand-in: batched decode, B = 16 >= 5 x the tokens/s of B = 1", big16, big16 >= 5),
            ("stand-in cost: continuous batching's (Orca's) goodput >= 2 x static's, at static's best rate", orca,
             orca >= 2),
            ("H100 clock, long requests at vLLM's caps: continuous batching's (Orca's) goodput >= 1.5 x static's",
             orca_gpu, orca_gpu >= 1.5),
            ("stand-in cost: speculative in the batch, TPOT p50 >= 1.3 x better at the lowest rate",
             study["gains"][0], study["gains"][0] >= 1.3),
            ("... measured crossover rate within 25% of the predicted one (|gap|; inf: none measured)", gap,
             gap <= 0.25),
            ("served tokens equal solo decoding, no block leaked, every run (1 = yes)", float(study["exact"]),
             study["exact"])]
