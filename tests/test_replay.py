"""The replay of recorded completions gives the schedule of the server with the model in the loop;
a request's tokens do not depend on the schedule (its own random generator, any batch, any rung);
the GPU clock is the data sheet's arithmetic at the share torchao's measurement implies."""
from dataclasses import replace

import numpy as np
import pytest

from lib.fast.lean import LeanModel
from lib.gpu.step import gpu_clock
from lib.measure.clocks import FittedClock
from lib.model import load
from lib.serve import LADDER, make_trace, serve
from lib.serve.replay import Replay, completions

PARAMS, CFG = load("target")
LEAN = LeanModel(PARAMS, CFG)
COST = FittedClock((1, 2, 64), (1.1e-3, 1.12e-3, 2.4e-3), 1e-4)
TRACE = make_trace(24, 900.0, seed=3, prompt_len=(8, 40), n_new=(2, 40))


@pytest.mark.parametrize("name", list(LADDER))
def test_replay_gives_the_served_schedule(name):
    """Same steps at the same times, same tokens at the same times, same preemptions (a small pool)."""
    tokens = completions(LEAN, TRACE)
    full = serve(LEAN, TRACE, 12, LADDER[name], clock=COST, max_tokens=40, batch_wait=2e-3)
    replay = serve(Replay(CFG, TRACE, tokens), TRACE, 12, LADDER[name], clock=COST, max_tokens=40, batch_wait=2e-3)
    assert np.array_equal(full.timeline, replay.timeline)
    assert (full.preemptions, full.recomputed, full.prefilled) == (replay.preemptions, replay.recomputed,
                                                                   replay.prefilled)
    for a, b in zip(full.outcomes, replay.outcomes):
        assert a.tokens == b.tokens == tokens[a.request.rid] and a.times == b.times
    m = replay.pool.manager
    assert m.num_free == m.num_blocks and not m.tables


def test_tokens_do_not_depend_on_the_schedule_when_sampling():
    """At temperature 0.8 each request draws from its own generator: the same tokens in any rung
    (batches, preemptions) as decoded in completions' batches."""
    tokens = completions(LEAN, TRACE, temperature=0.8, batch=5)
    for name in ("static", "paged (vLLM)", "+ token budget (v1)"):
        rep = serve(LEAN, TRACE, 12, LADDER[name], clock=COST, max_tokens=40, temperature=0.8)
        assert all(o.tokens == tokens[o.request.rid] for o in rep.outcomes)


def test_itl_and_tpot_agree():
    rep = serve(LEAN, TRACE, 64, LADDER["Orca"], clock=COST)
    for o in rep.outcomes:
        assert len(o.times) == len(o.tokens) and o.times[0] == o.first and o.times[-1] == o.finish
        if len(o.tokens) > 1:
            assert np.isclose(o.itl.mean(), o.tpot) and np.all(o.itl > 0)
    s = rep.summary()
    assert s["ITL p50 ms"] <= s["ITL p99 ms"]


def test_replay_refuses_wrong_records():
    replay = Replay(CFG, TRACE, completions(LEAN, TRACE))
    pool = replay.new_pool(64, 16, False)
    seq = pool.add(0, TRACE[0].prompt[:1])
    wrong = (int(TRACE[0].prompt[1]) + 1) % CFG.vocab_size
    with pytest.raises(ValueError, match="differ from the record"):
        replay.feed([seq], [[wrong]])
    with pytest.raises(ValueError, match="clock"):
        serve(Replay(CFG, TRACE, completions(LEAN, TRACE)), TRACE, 64, LADDER["Orca"])


def test_a_lower_flops_share_slows_only_compute_bound_steps():
    """The fitted GPU clock (tests/test_gpu.py covers the rest) with half its FLOP share."""
    clock = gpu_clock()
    slow = replace(clock, flops_share=clock.flops_share / 2)
    assert slow([(0, 2000, 0)]) > 1.9 * (clock([(0, 2000, 0)]) - clock.overhead)  # compute-bound: twice the FLOP time
    assert slow.decode_step(4, 200) == clock.decode_step(4, 200)  # memory-bound steps unchanged
