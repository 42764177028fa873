"""The lengths-only replay gives the schedule of the replay of decoded tokens (and so of the server
with the model in the loop, tests/test_replay.py); its traces have the lengths and shared prefixes
they state; on the H100 clock the long trace fills the pool."""
import numpy as np
import pytest

from lib.fast.lean import LeanModel
from lib.gpu.step import gpu_clock
from lib.measure.clocks import FittedClock
from lib.model import load
from lib.serve import LADDER, make_trace, serve
from lib.serve.lengths import ANSWER, LengthsReplay, ledger_config, lengths_trace
from lib.serve.replay import Replay, completions

PARAMS, CFG = load("target")
COST = FittedClock((1, 2, 64), (1.1e-3, 1.12e-3, 2.4e-3), 1e-4)
TRACE = make_trace(24, 900.0, seed=3, prompt_len=(8, 40), n_new=(2, 40), system=np.arange(20) % 96)


@pytest.mark.parametrize("name", list(LADDER))
def test_lengths_give_the_replayed_schedule(name):
    """Same steps at the same times, same preemptions and recomputations (a small pool), same token times."""
    tokens = completions(LeanModel(PARAMS, CFG), TRACE)
    kwargs = dict(clock=COST, max_tokens=40, batch_wait=2e-3)
    decoded = serve(Replay(CFG, TRACE, tokens), TRACE, 12, LADDER[name], **kwargs)
    lengths = serve(LengthsReplay(CFG), TRACE, 12, LADDER[name], **kwargs)
    assert np.array_equal(decoded.timeline, lengths.timeline)
    assert (decoded.preemptions, decoded.recomputed, decoded.prefilled) == (lengths.preemptions, lengths.recomputed,
                                                                            lengths.prefilled)
    for a, b in zip(decoded.outcomes, lengths.outcomes):
        assert a.times == b.times and b.tokens == [ANSWER] * b.request.n_new
    m = lengths.pool.manager
    assert m.num_free == m.num_blocks and not m.tables


def test_a_lengths_trace_has_its_lengths_and_shared_prefixes():
    trace = lengths_trace(200, 3.0, seed=1, prefixes=3, prefix_len=64, prompt_len=(16, 256), n_new=(4, 64))
    own = np.array([len(r.prompt) - 64 for r in trace])
    answers = np.array([r.n_new for r in trace])
    assert own.min() >= 16 and own.max() <= 256 and answers.min() >= 4 and answers.max() <= 64
    assert len({r.prompt[:64].tobytes() for r in trace}) == 3  # three shared prefixes
    again = lengths_trace(200, 9.0, seed=1, prefixes=3, prefix_len=64, prompt_len=(16, 256), n_new=(4, 64))
    assert all(np.array_equal(a.prompt, b.prompt) and a.n_new == b.n_new for a, b in zip(trace, again))
    assert again[-1].arrival < trace[-1].arrival  # a higher rate: only the arrivals move


def test_prefix_caching_computes_a_shared_prefix_once_per_pool():
    trace = lengths_trace(40, 50.0, seed=2, prefixes=2, prefix_len=256, prompt_len=(32, 64), n_new=(4, 8))
    engine = LengthsReplay(ledger_config(gpu_clock().spec, 4096))
    runs = {name: serve(engine, trace, 2000, LADDER[name], clock=gpu_clock()) for name in
            ("paged (vLLM)", "+ prefix caching")}
    saved = runs["paged (vLLM)"].prefilled - runs["+ prefix caching"].prefilled
    assert saved == (len(trace) - 2) * 256  # every request after each prefix's first: its 16 blocks were cached
