"""The scheduler: every request completes with the tokens it gets alone, or is rejected with its
reason; it never stalls, and the pool ends empty. Time comes from a cost model here, so each
schedule is the same on every run."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lib.fast.batch import BatchedModel
from lib.fast.lean import LeanModel
from lib.generation import generate
from lib.measure.clocks import FittedClock, StandInClock, crossing, crossover_rate, fit_clock, steady_state
from lib.measure.counting import batched_call
from lib.model import load
from lib.serve import LADDER, Policy, Request, make_trace, serve
from lib.timing import single_thread

PARAMS, CFG = load("target")
LEAN = LeanModel(PARAMS, CFG)
DRAFT = LeanModel(*load("draft"))
COST = FittedClock((1, 2, 64), (1.1e-3, 1.12e-3, 2.4e-3), 1e-4)  # seconds per step, by its rows
DRAFT_COST = FittedClock((1, 64), (2e-4, 5e-4), 2e-5)
_SOLO = {}


def solo(req):
    """Greedy decoding of one request alone (memoized: hypothesis reuses prompts)."""
    key = (tuple(req.prompt.tolist()), req.n_new)
    if key not in _SOLO:
        _SOLO[key] = generate(LEAN, req.prompt, req.n_new).tokens.tolist()
    return _SOLO[key]


def check_report(report, trace):
    m = report.pool.manager
    assert m.num_free == m.num_blocks and not m.tables and set(m.ref) == {0}, "leaked blocks"
    for out in report.outcomes:
        if out.rejected:
            assert not out.tokens
        else:
            assert out.tokens == solo(out.request)
            assert out.request.arrival <= out.first <= out.finish


@settings(max_examples=25, deadline=None)
@given(num_blocks=st.integers(2, 14), block_size=st.sampled_from([2, 4, 8]),
       burstiness=st.sampled_from([0.1, 0.5, 1.0]), n=st.integers(1, 8), seed=st.integers(0, 99),
       policy=st.sampled_from(["continuous", "static"]), prefix=st.booleans(), system=st.booleans(),
       max_batch=st.integers(1, 6), watermark=st.sampled_from([0.0, 0.3]), budget=st.sampled_from([None, 7, 12]),
       mixed=st.booleans(), reserve=st.sampled_from(["paged", "max"]), speculate=st.booleans())
def test_tiny_pools_and_bursty_traces(num_blocks, block_size, burstiness, n, seed, policy, prefix, system, max_batch,
                                      watermark, budget, mixed, reserve, speculate):
    trace = make_trace(n, rate=500.0, seed=seed, burstiness=burstiness, prompt_len=(1, 12), n_new=(1, 10),
                       system=np.arange(6) * 7 % CFG.vocab_size if system else ())
    reserve = "max" if policy == "static" else reserve
    rung = Policy(policy, reserve, mixed, prefix, budget, max_batch, watermark)
    report = serve(LEAN, trace, num_blocks, rung, block_size, clock=COST, batch_wait=2e-3, max_tokens=10,
                   draft=DRAFT if speculate else None, draft_clock=DRAFT_COST if speculate else None, k=3)
    check_report(report, trace)
    for out in report.outcomes:
        length = 10 if reserve == "max" else out.request.n_new
        need = -(-(len(out.request.prompt) + length - 1) // block_size)
        assert bool(out.rejected) == (need > num_blocks)
        assert not out.rejected or f"has {num_blocks}" in out.rejected
    if reserve == "max":
        assert report.preemptions == 0
    if speculate:
        assert not any(report.draft_pool.manager.ref)


def test_requests_that_can_never_fit_are_rejected_with_their_reason():
    prompt = np.arange(20) % CFG.vocab_size
    trace = [Request(0, 0.0, prompt, 500), Request(1, 0.0, prompt, 200), Request(2, 0.0, prompt, 8)]
    report = serve(LEAN, trace, num_blocks=8, block_size=16, clock=COST)
    reasons = [o.rejected for o in report.outcomes]
    assert "longer than the context of 512 positions" in reasons[0]
    assert "needs 14 blocks of 16 positions, the whole pool has 8" in reasons[1]
    assert reasons[2] == "" and len(report.outcomes[2].tokens) == 8
    check_report(report, trace)


def test_preemption_recomputes_and_changes_nothing():
    """A pool that holds one long request at a time: the newer ones are preempted and recomputed."""
    trace = make_trace(6, rate=1000.0, seed=3, prompt_len=(20, 30), n_new=(30, 40))
    report = serve(LEAN, trace, num_blocks=6, block_size=16, clock=COST)
    assert report.preemptions > 0 and report.recomputed > 0
    assert sum(o.preempted for o in report.outcomes) == report.preemptions
    check_report(report, trace)


def test_shared_system_prompt_is_computed_once_per_residency():
    system = np.arange(64) * 5 % CFG.vocab_size
    trace = make_trace(8, rate=1e6, seed=1, prompt_len=(8, 16), n_new=(4, 8), system=system)
    shared = serve(LEAN, trace, num_blocks=64, policy=Policy(prefix_caching=True), block_size=16, clock=COST)
    alone = serve(LEAN, trace, num_blocks=64, policy=Policy(prefix_caching=False), block_size=16, clock=COST)
    assert shared.peak_blocks < alone.peak_blocks
    assert alone.prefilled == sum(len(r.prompt) for r in trace) > shared.prefilled
    check_report(shared, trace)
    check_report(alone, trace)


def test_temperature_sampling_matches_each_request_sampled_alone():
    trace = make_trace(5, rate=1000.0, seed=2, prompt_len=(8, 16), n_new=(20, 30))
    report = serve(LEAN, trace, num_blocks=5, block_size=16, temperature=0.8, clock=COST)
    assert report.preemptions > 0
    for out in report.outcomes:
        alone = generate(LEAN, out.request.prompt, out.request.n_new, 0.8, seed=out.request.rid)
        assert out.tokens == alone.tokens.tolist()


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "temperature must be"),
    ({"num_blocks": 0}, "num_blocks must be"),
    ({"max_tokens": 1}, "max_tokens must be"),
    ({"k": 0}, "k must be"),
    ({"batch_wait": -1.0}, "batch_wait must be"),
    ({"draft": DRAFT, "clock": COST}, "clock and draft_clock go together"),
])
def test_bad_settings_are_refused(kwargs, message):
    args = {"num_blocks": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        serve(LEAN, make_trace(2, 10.0), **args)


@pytest.mark.parametrize("kwargs, message", [
    ({"batching": "fifo"}, "batching/reserve must be one of"),
    ({"max_batch": 0}, "max_batch must be"),
    ({"watermark": 1.0}, "watermark must be"),
    ({"token_budget": 0}, "token_budget must be"),
    ({"batching": "static", "reserve": "paged"}, "reserve must be"),
])
def test_bad_policies_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Policy(**kwargs)
    with pytest.raises(TypeError, match="policy must be a lib.serve.Policy"):
        serve(LEAN, make_trace(2, 10.0), 8, policy=dict(kwargs))


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="n_new must be"):
        serve(LEAN, [Request(0, 0.0, np.array([1, 2]), 0)], 8)
    with pytest.raises(ValueError, match="unique"):
        serve(LEAN, [Request(0, 0.0, np.array([1]), 2)] * 2, 8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        serve(LEAN, [Request(0, 0.0, np.array([1, 999]), 2)], 8)
    with pytest.raises(ValueError, match="rate > 0"):
        make_trace(3, rate=0.0)
    with pytest.raises(ValueError, match="ranges of positive lengths"):
        make_trace(3, rate=1.0, n_new=(5, 2))


def test_step_cost_interpolates_its_points_and_adds_a_cost_per_sequence():
    assert COST([(0, 1, 5)]) == pytest.approx(1.1e-3)
    assert COST([(0, 33, 0)]) == pytest.approx(1.12e-3 + 31 / 62 * 1.28e-3)
    assert COST([(0, 1, 0), (1, 1, 9)]) == pytest.approx(1.12e-3 + 1e-4)
    assert COST([(0, 128, 0)]) == pytest.approx(2.4e-3 + 64 * 1.28e-3 / 62)  # past the last point: linear


def test_steady_state_is_littles_law_over_a_poisson_batch():
    batch, tpot = steady_state(COST, 300.0, 20.0)
    assert tpot > COST.decode_step(1) and batch > 1  # requests overlap: a mean batch above one
    light, heavy = steady_state(COST, 1.0, 20.0), steady_state(COST, 3000.0, 20.0)
    assert light[1] == pytest.approx(COST.decode_step(1), rel=0.05) and heavy[1] > tpot  # more load, slower tokens
    assert steady_state(COST, 1e9, 20.0) == (float("inf"), float("inf"))
    rates = list(np.geomspace(1, 1e4, 40))
    dear_rows = FittedClock((1, 2, 64), (1e-3, 1.1e-3, 2e-2), 1e-4)  # rows past a few cost their arithmetic
    assert steady_state(dear_rows, 1.0, 20.0, DRAFT_COST, 0.8, 4)[1] < 0.9 * dear_rows.decode_step(1)
    cross = crossover_rate(dear_rows, DRAFT_COST, 0.8, 4, 20.0, rates)
    assert 1 < cross < 1e4
    assert np.isnan(crossing([1, 2], [2.0, 1.5]))


@pytest.mark.parametrize("name", list(LADDER))
def test_every_rung_of_the_ladder_serves_exactly(name):
    trace = make_trace(10, rate=300.0, seed=4, prompt_len=(8, 40), n_new=(4, 30), system=np.arange(20) % 90)
    report = serve(LEAN, trace, 24, LADDER[name], clock=COST, max_tokens=30, batch_wait=5e-3)
    check_report(report, trace)
    assert report.summary()["completed"] == 10


def test_speculative_batch_equals_greedy_and_accepts():
    trace = make_trace(6, rate=500.0, seed=5, prompt_len=(10, 30), n_new=(10, 40))
    report = serve(LEAN, trace, 40, clock=COST, draft=DRAFT, k=4, draft_clock=DRAFT_COST)
    check_report(report, trace)
    s = report.summary()
    assert 0 < s["accepted/drafted"] <= 1 and report.draft_pool.manager.num_free == report.draft_pool.manager.num_blocks


def test_speculative_batch_under_preemption_still_equals_greedy():
    """A pool that cannot hold everyone: speculating sequences are preempted, recomputed, and both
    their caches freed; the tokens are still each request's greedy decoding."""
    trace = make_trace(6, rate=1000.0, seed=3, prompt_len=(20, 30), n_new=(30, 40))
    report = serve(LEAN, trace, 6, clock=COST, draft=DRAFT, k=3, draft_clock=DRAFT_COST)
    assert report.preemptions > 0
    check_report(report, trace)
    assert report.draft_pool.manager.num_free == report.draft_pool.manager.num_blocks


def test_speculative_batch_samples_at_temperature_and_cleans_up():
    trace = make_trace(5, rate=500.0, seed=6, prompt_len=(10, 20), n_new=(10, 30))
    report = serve(LEAN, trace, 40, clock=COST, draft=DRAFT, k=4, draft_clock=DRAFT_COST, temperature=0.8)
    m = report.pool.manager
    assert m.num_free == m.num_blocks and not any(m.ref)
    assert all(len(o.tokens) == o.request.n_new for o in report.outcomes)
    assert 0 < report.summary()["accepted/drafted"] < 1


def test_the_latest_arrival_is_preempted_first():
    trace = make_trace(6, rate=1000.0, seed=3, prompt_len=(20, 30), n_new=(30, 40))
    report = serve(LEAN, trace, 6, clock=COST)
    first = min(report.outcomes, key=lambda o: o.request.arrival)
    assert first.preempted == 0 and report.preemptions > 0


def test_shadow_times_the_rows_and_frees_its_sequences():
    shadow = StandInClock(LEAN, num_blocks=16)
    assert shadow([("a", 1, 30), ("b", 5, 0)]) > 0
    assert shadow.seqs["a"].n == 31 and shadow.seqs["b"].n == 5
    shadow([("a", 1, 10)])  # the served sequence was truncated: so is its shadow
    assert shadow.seqs["a"].n == 11
    shadow.free("a")
    shadow.free("b")
    assert shadow.pool.manager.num_free == 16


def test_a_fitted_clock_gives_the_same_schedule_every_run():
    positions = np.random.default_rng(0).integers(16, 129, 4)
    with single_thread():
        clock = fit_clock(LEAN, positions, sizes=(1, 2, 4), chunks=(8,), repeats=1)
    assert list(clock.seconds) == sorted(clock.seconds) and len(clock.decode_times) == 3
    trace = make_trace(8, rate=2000.0, seed=3)
    runs = [serve(LEAN, trace, 24, clock=clock) for _ in range(2)]
    assert runs[0].summary() == runs[1].summary()
    assert np.array_equal(runs[0].timeline, runs[1].timeline)


def test_batched_call_feeds_chunks_and_leaves_the_pool_as_it_was():
    engine = BatchedModel(LEAN)
    call = batched_call(engine, [20, 40], n_tokens=8)
    for _ in range(3):
        call()  # would run out of the pool's blocks if the chunks were kept
