"""lib.book.studies.roof: the rate table's cells and the slowest-stand-in rule, on made-up rates."""
from lib.book.studies.roof import RATE_HEADER, rate_cells, slowest


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
