"""lib.book.studies.roof: the rate table's cells and the slowest-stand-in rule, on made-up rates."""
from lib.book.studies.roof import RATE_HEADER, against, layout_rates, rate_cells, slowest


def entry(fastest, median, low, high):
    return {"rate": fastest * 1e9, "median": median * 1e9, "low": low * 1e9, "high": high * 1e9}


def test_rate_cells_print_the_fastest_round_then_the_median_inside_its_quartiles():
    assert "fastest round" in RATE_HEADER and "median" in RATE_HEADER
    assert rate_cells(entry(15.7, 15.2, 14.8, 15.6)) == " 15.7 | 15.2 (14.8 to 15.6)"


def test_slowest_is_named_only_beyond_the_rounds_spread():
    apart = {"a": entry(16, 15, 14.5, 15.5), "b": entry(12, 11, 10.8, 11.2), "c": entry(16, 15.2, 15, 15.4)}
    assert slowest(apart) == "b"
    close = {"a": entry(16, 15, 14, 16), "b": entry(16, 14.8, 14, 15.6)}
    assert slowest(close) is None


def test_row_times_times_one_call_of_each_row_count_after_the_cached_tokens():
    from lib.book.studies.roof import row_times
    from lib.config import ModelConfig
    from lib.fast.lean import LeanModel
    from lib.model import init_params

    cfg = ModelConfig(n_layer=1, n_head=2, n_kv_head=2, n_embd=16)
    model, seen = LeanModel(init_params(cfg), cfg, products="numpy"), set()

    def step(new_tokens, cache):  # the model, recording each call's new tokens and the cached ones before it
        seen.add((len(new_tokens), cache.n))
        return model(new_tokens, cache)
    times = row_times(step, cfg, (1, 3), position=5, repeats=2, warmup_seconds=0.0)
    assert set(times) == {1, 3} and all(t > 0 for t in times.values())
    assert seen == {(5, 0), (1, 5), (3, 5)}  # the cached prefix once, then every call after its 5 tokens


def test_against_holds_the_whole_middle_half_of_the_rounds_to_the_rate():
    words = ("faster than", "about as fast as", "slower than")
    assert against(entry(26, 14.3, 13.3, 17.7), 15.4e9, words) == "about as fast as"  # fastest round alone above
    assert against(entry(30, 25, 23, 27), 15.4e9, words) == "faster than"
    assert against(entry(14, 12, 11, 13), 15.4e9, words) == "slower than"


def test_layout_rates_times_the_four_products_over_the_same_bytes():
    import numpy as np
    weights = [np.asfortranarray(np.ones(shape, np.float32)) for shape in ((8, 16), (17, 8))]
    rates = layout_rates(weights, repeats=1)
    assert set(rates) == {"x @ W", "x @ W, row-major", "W.T @ x", "dot"} and all(r > 0 for r in rates.values())
