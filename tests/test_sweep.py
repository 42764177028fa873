"""The sweep's bookkeeping: distributions from SpecStats, the formula's, and the sweep's rows."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lib.book.studies.sweep import call_costs, k_sweep, merged, predictions, tokens_per_call_distribution, truncated_geometric
from lib.corpus import held_out_prompts
from lib.fast.lean import LeanModel
from lib.model import load
from lib.speculative import speculative_generate


@settings(max_examples=50, deadline=None)
@given(alpha=st.floats(0.0, 1.0), k=st.integers(1, 12))
def test_truncated_geometric_is_a_distribution_with_the_formulas_mean(alpha, k):
    p = truncated_geometric(alpha, k)
    assert p.shape == (k + 1,) and (p >= 0).all() and abs(p.sum() - 1) < 1e-12
    mean = (np.arange(1, k + 2) * p).sum()  # tokens emitted per round
    expected = k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    assert abs(mean - expected) < 1e-9


def test_tokens_per_call_distribution_counts_every_round():
    """From the per-position counts: its mean is emitted / target calls, exactly."""
    target, draft = LeanModel(*load("target")), LeanModel(*load("draft"))
    runs = [speculative_generate(target, draft, p, 41, k=4, temperature=0.7, seed=i)
            for i, p in enumerate(held_out_prompts(3))]
    stats = merged([s for _, s in runs])
    share = tokens_per_call_distribution(stats)
    assert share.shape == (5,) and abs(share.sum() - 1) < 1e-12 and (share >= 0).all()
    assert abs((np.arange(1, 6) * share).sum() - stats["emitted"] / stats["target_calls"]) < 1e-12


def test_sweep_rows_hold_the_measurements_and_predictions():
    target, draft = LeanModel(*load("target")), LeanModel(*load("draft"))
    rows = k_sweep(target, {"draft": draft}, held_out_prompts(2), 12, [1, 3], 0.0, repeats=2)
    costs = call_costs(target, [2, 4], repeats=1)
    predictions(rows, 0.25, costs)
    assert set(rows) == {("draft", 1), ("draft", 3)}
    for (_, k), r in rows.items():
        assert r["identical"] is True and r["speedup"] > 0 and 0 <= r["alpha"] <= 1
        assert len(r["ratios"]) == 2 and r["speedup"] == np.median(r["ratios"])
        assert 1 <= r["tpc"] <= k + 1 and r["theorem"] > 0 and r["with_call_cost"] > 0
    assert costs[1] == 1.0 and costs[0] > 0


def test_acceptance_on_text_is_the_mean_overlap_of_the_two_distributions():
    """alpha from text: 1 for a model against itself; otherwise the mean over positions of
    sum(min(p, q)) (at temperature 0, of argmax agreement), each chunk read as its own pass."""
    from lib.book.studies.sweep import acceptance_on_text
    from lib.model import forward
    from lib.sampling import probs_from_logits
    target, draft = load("target"), load("draft")
    text = np.arange(300) % target[1].vocab_size
    assert acceptance_on_text(target, target, text, (0.0, 0.7)) == pytest.approx({0.0: 1.0, 0.7: 1.0}, abs=1e-12)
    chunks = [text[:100], text[100:200], text[200:]]
    for temperature in (0.0, 0.7):
        overlap = np.concatenate([np.minimum(probs_from_logits(forward(*target, w), temperature),
                                             probs_from_logits(forward(*draft, w), temperature)).sum(-1)
                                  for w in chunks]).mean()
        alpha = acceptance_on_text(target, draft, text, (temperature,), chunk=100)[temperature]
        assert alpha == pytest.approx(overlap, rel=1e-12) and 0 < alpha < 1


def test_split_mean_call_parts_sum_to_the_mean_of_group_medians():
    from lib.book.studies.sweep import split_mean_call
    log = [(1, 1.0)] * 3 + [(2, 1.5)] * 4 + [(16, 4.0)] + [(1, 9.0)]  # one stray one-token call: the median holds
    parts = split_mean_call(log, 1, one=2.0)
    assert parts["usual"] == 0.5 and parts["short"] == 0.0
    assert np.isclose(parts["catch-up"], 4 / 9 * 0.5 / 2) and np.isclose(parts["prefill"], 1 / 9 * 3.0 / 2)


def test_clocked_logs_each_call_and_a_run_draws_catch_up_calls():
    from lib.book.studies.sweep import Clocked
    target, draft = LeanModel(*load("target")), LeanModel(*load("draft"))
    tgt, drf = Clocked(target), Clocked(draft)
    prompt = held_out_prompts(1, 16)[0]
    tokens, stats = speculative_generate(tgt, drf, prompt, 24, k=1, temperature=0.0)
    sizes = [n for n, _ in drf.log]
    assert drf.calls == stats.draft_calls and sizes[0] == len(prompt)  # the draft reads the prompt first
    # k = 1: each round that accepted its draft token makes the next round's first draft call read two tokens
    assert sizes.count(2) in (stats.accepted, stats.accepted - 1) and stats.accepted > 0
    assert tgt.seconds == sum(s for _, s in tgt.log)
