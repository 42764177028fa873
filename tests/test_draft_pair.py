"""The trained pair's alpha lent to an 8B/1B pair on the fitted H100 clock (lib.book.studies.draft_pair), and the
published CUDA-graph timing chapters 11 and 12 quote (lib.gpu.published)."""
import pytest

from lib.book.studies.draft_pair import K, crossover, h100_pair, pair_alpha, per_token
from lib.gpu.published import LLAMA_CPP_GRAPHS_H100
from lib.speculative import expected_speedup


def test_pair_alpha_is_a_repeatable_share():
    alpha = pair_alpha(K)
    assert 0 < alpha < 1 and pair_alpha(K) == alpha  # counted over seeded runs: the same on every call


@pytest.mark.parametrize("alpha", [0.3, 0.65, 0.9])
def test_per_token_at_batch_one_is_theorem_3_8_with_the_clocks_costs(alpha):
    target, draft = h100_pair()
    context = 1024
    one = target.decode_step(1, context + 1)
    c, v = draft.decode_step(1, context + 1) / one, target.decode_step(1, context + K + 1, new=K + 1) / one
    assert per_token(alpha, 1, 0, context, target, draft) == one
    gain = one / per_token(alpha, 1, K, context, target, draft)
    assert gain == pytest.approx(expected_speedup(alpha, K, c, call_cost=v), rel=1e-12)


def test_crossover_is_the_first_batch_where_speculation_loses():
    target, draft = h100_pair()
    b = crossover(0.65, K, 256, target, draft)
    assert b is not None and b > 1
    slower = lambda n: per_token(0.65, n, K, 256, target, draft) > per_token(0.65, n, 0, 256, target, draft)
    assert slower(b) and not any(slower(n) for n in range(1, b))
    assert crossover(0.0, K, 256, target, draft) == 1  # nothing accepted: speculation never pays


def test_the_graph_timing_quotes_its_figures():
    record = LLAMA_CPP_GRAPHS_H100
    assert f"{record.eager}" in record.figure and f"{record.graphs}" in record.figure
    assert record.url.startswith("https://") and record.speedup == pytest.approx(1.14, abs=0.005)  # "14% speedup"
