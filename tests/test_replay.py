"""The replay of recorded completions gives the schedule of the server with the model in the loop;
a request's tokens do not depend on the schedule (its own random generator, any batch, any rung);
the GPU clock is the data sheet's arithmetic at the share torchao's measurement implies."""
import numpy as np
import pytest

from lib.fast.lean import LeanModel
from lib.gpu.memory import H100
from lib.gpu.models import LLAMA_3_8B
from lib.gpu.published import TORCHAO
from lib.gpu.step import GPUClock, gpu_clock
from lib.measure.clocks import FittedClock

TORCHAO_STEP = 1 / TORCHAO.value
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


def test_gpu_clock():
    clock = gpu_clock()
    assert np.isclose(clock.decode_step(1, 200), TORCHAO_STEP)  # calibrated on torchao's batch-1 step
    assert 0.5 < clock.efficiency < 0.7
    assert clock.decode_step(16, 200) < 1.05 * clock.decode_step(1, 200)  # weights dominate: batch 16 costs about batch 1
    assert clock([(0, 1, 199)]) == clock.decode_step(1, 200)
    assert clock([(0, 2000, 0)]) > 2 * clock.decode_step(1, 200)  # a long prompt reaches the compute roof
    free = H100.memory * 0.9 - LLAMA_3_8B.weight_bytes()
    assert clock.blocks() == int(free // (16 * LLAMA_3_8B.kv_bytes(1)))
    slow = GPUClock(LLAMA_3_8B, H100, clock.efficiency, clock.overhead, compute_efficiency=0.5)
    assert slow([(0, 2000, 0)]) > 1.9 * (clock([(0, 2000, 0)]) - clock.overhead)  # compute-bound: twice the FLOP time
    assert slow.decode(4, 200) == clock.decode_step(4, 200)  # memory-bound steps unchanged
    for bad in (dict(efficiency=0), dict(efficiency=1.5), dict(overhead=-1.0), dict(spec="llama"),
                dict(compute_efficiency=0), dict(compute_efficiency=2.0)):
        with pytest.raises((ValueError, TypeError)):
            GPUClock(**bad)
    with pytest.raises(ValueError, match="rows"):
        clock([])
