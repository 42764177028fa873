"""The traced server is the server: the same report as `serve` on every rung; the states it records agree
with each request's token times (and a state changed by hand does not); the small trace shows what the
serving chapter's figure says it shows; the drawing makes one cell per recorded state."""
from dataclasses import replace

import matplotlib.pyplot as plt
import numpy as np
import pytest

from lib.book.studies.long_ladder import CONTEXT, vllm_ladder
from lib.book.studies.timeline import (
    ABSENT,
    DECODE,
    PREEMPTED,
    PREFILL,
    STRIP_TRACE,
    TIMELINE_BLOCKS,
    TIMELINE_MAX_TOKENS,
    TIMELINE_PREFIX,
    WAITING,
    agrees,
    draw,
    small_trace,
    timeline_runs,
    traced,
)
from lib.gpu.step import gpu_clock
from lib.serve import LADDER, serve
from lib.serve.lengths import LengthsReplay, ledger_config

GPU = gpu_clock()
ENGINE = LengthsReplay(ledger_config(GPU.spec, CONTEXT))
WAIT = 4 * GPU.decode_step(1, TIMELINE_PREFIX)


def run(name):
    """The small trace through one rung, traced and plain."""
    kwargs = dict(clock=GPU, batch_wait=WAIT, max_tokens=TIMELINE_MAX_TOKENS)
    trace = small_trace()
    return (traced(ENGINE, trace, TIMELINE_BLOCKS, LADDER[name], **kwargs),
            serve(ENGINE, trace, TIMELINE_BLOCKS, LADDER[name], **kwargs))


@pytest.mark.parametrize("name", list(LADDER))
def test_the_traced_run_is_the_server_run_and_its_states_agree_with_the_token_times(name):
    trail, plain = run(name)
    rep = trail.report
    assert np.array_equal(rep.timeline, plain.timeline) and rep.preemptions == plain.preemptions
    assert all(a.times == b.times for a, b in zip(rep.outcomes, plain.outcomes))
    assert trail.states.shape == (len(rep.outcomes), rep.steps) and agrees(trail)
    in_step = (trail.states == PREFILL) | (trail.states == DECODE)
    assert np.array_equal(in_step.sum(axis=0), rep.timeline[:, 1])  # the step's sequences, as the server counted them


@pytest.mark.parametrize("change", ["decode to waiting", "waiting to decode", "prefill ends early", "early arrival",
                                    "preempted as waiting"])
def test_a_state_changed_by_hand_disagrees(change):
    trail, _ = run("+ token budget (v1)" if change == "prefill ends early" else "paged (vLLM)")
    states = trail.states
    i, j = [(i, j) for i, j in zip(*np.nonzero(states == DECODE)) if j > 0 and states[i, j - 1] == DECODE][0]
    if change == "decode to waiting":
        states[i, j] = WAITING
    elif change == "waiting to decode":
        i, j = np.argwhere(states == WAITING)[0]
        states[i, j] = DECODE
        trail.tokens[i, j] = 1
    elif change == "prefill ends early":  # a chunked prefill's last step drawn as a decode
        i = int(np.argmax([np.sum(row == PREFILL) for row in states]))
        j = np.flatnonzero(states[i] == PREFILL)[-1]
        states[i, j], trail.tokens[i, j] = DECODE, 1
    elif change == "preempted as waiting":
        states[states == PREEMPTED] = WAITING
    else:
        i = int(np.argmax(states[:, 0] == ABSENT))
        states[i, 0] = WAITING
    assert not agrees(trail)


def test_the_small_trace_shows_what_the_figure_says():
    """Continuous batching ends sooner than static, paging sooner than Orca and preempts once, prefix caching
    sooner still and preempts nothing; a whole long prompt makes one long step, chunks of 512 do not."""
    trails = timeline_runs(GPU, {name: LADDER[name] for name in ("static", "Orca", "paged (vLLM)", "+ prefix caching")})
    steps = [t.report.steps for t in trails.values()]
    assert steps == sorted(steps, reverse=True) and len(set(steps)) == 4
    assert np.any(trails["paged (vLLM)"].states == PREEMPTED)
    assert not np.any(trails["+ prefix caching"].states == PREEMPTED)
    rung = vllm_ladder()["+ token budget (v1)"]
    strips = list(timeline_runs(GPU, {b: replace(rung, token_budget=b) for b in (8192, 512)}, STRIP_TRACE,
                                GPU.blocks()).values())
    assert all(agrees(t) for t in strips)
    whole, chunked = (t.seconds.max() for t in strips)
    assert whole > 5 * chunked  # a 4,096-token prompt in one step against chunks of at most 512 tokens
    assert strips[1].tokens[strips[1].states == PREFILL].max() <= 512 < strips[0].tokens.max()


def test_draw_makes_a_cell_per_state_in_a_step():
    trail, _ = run("paged (vLLM)")
    fig, ax = plt.subplots()
    draw(ax, trail)
    cells = sum(len(c.get_paths()) for c in ax.collections)
    assert cells == np.count_nonzero(trail.states != ABSENT)
    plt.close(fig)
