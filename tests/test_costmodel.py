"""The cost model's arithmetic: a prediction is the sum its docstring states, with the constants
given; interpolation stays between the measured points. (The GPU's step is tests/test_gpu.py.)"""
import dataclasses
import math

import pytest

from lib.measure.card import cache_sizes, measure
from lib.measure.costmodel import LOOP_COUNTS, Machine, predict, predict_decoding
from lib.measure.counting import Op

LEVELS = (256 * 2**10, 16 * 2**20, 256 * 2**20)
MACHINE = Machine(
    call=1e-6, engine_call={"lean": 2e-6, "plain": 3e-6},
    read_rates=((2**10, 100e9), (2**20, 50e9), (2**28, 12e9), (2**29, 10e9), (2**30, 4e9)),  # the last slowed by a busy core
    rates={**{(p, r, s): r * 10e9 / (1 + LEVELS.index(s)) for p in ("numpy", "kernel") for r in range(1, 16) for s in LEVELS},
           **{("numpy", r, LEVELS[0]): r * 10e9 for r in (16, 64, 512)}},
    per_element={"multiply": 1e-9, "exp": 4e-9, "add.reduce": 2e-9})


def test_bandwidth_is_interpolated_in_log_size_and_clamped():
    assert MACHINE.bandwidth(2**20) == pytest.approx(50e9)
    assert MACHINE.bandwidth(2**15) == pytest.approx(75e9)  # halfway between 2^10 and 2^20 in log size
    assert MACHINE.bandwidth(1) == 100e9
    assert MACHINE.bandwidth(2**40) == MACHINE.bandwidth(2**28) == 10e9  # memory: the median of the three largest probes


def test_product_rate_by_rows_and_level_and_unknown_product_falls_back_to_numpy():
    assert MACHINE.rate(4, "kernel", LEVELS[0]) == pytest.approx(40e9)
    assert MACHINE.rate(4, "kernel", LEVELS[2]) == pytest.approx(40e9 / 3)
    assert MACHINE.rate(64, "kernel", LEVELS[2]) == pytest.approx(640e9)  # large rows: timed in L2 only
    assert MACHINE.rate(4, "one-row batch", LEVELS[0]) == MACHINE.rate(4, "numpy", LEVELS[0])


def test_element_cost_names_reductions_and_aliases():
    assert MACHINE.element("exp.__call__") == 4e-9
    assert MACHINE.element("add.reduce") == 2e-9
    assert MACHINE.element("negative.__call__") == 1e-9  # costs as a multiply


def test_prediction_is_the_sum_of_calls_and_each_ops_roofline():
    ws = 3 * 2**20  # the weights and K streamed: the working set
    ops = [Op("matmul", "weights", flops=2 * 4 * 1024 * 768, bytes=0, rows=4, streamed=2 * 2**20),
           Op("matmul", "attention", flops=2 * 2**18, bytes=0, rows=1, streamed=2**20, batch=4),
           Op("ufunc", "exp.__call__", flops=1000, bytes=8000),
           Op("function", "concatenate", bytes=2**20)]
    p = predict(ops, MACHINE, "kernel", path="lean")
    weights = ops[0].flops / MACHINE.rate(4, "kernel", ws)
    attention = max(2**20 / MACHINE.bandwidth(ws), ops[1].flops / MACHINE.rate(1, "numpy", 2**20))
    elementwise = max(1000 * 4e-9, 8000 / MACHINE.bandwidth(8000))
    copies = 2**20 / MACHINE.bandwidth(2**20)
    assert p.parts == pytest.approx({"calls": 4 * 2e-6, "weight products": weights, "attention products": attention,
                                     "elementwise": elementwise, "copies": copies})
    assert p.seconds == pytest.approx(sum(p.parts.values()))
    assert predict(ops, MACHINE).parts["calls"] == 4 * 1e-6  # a bare numpy call without a path


def test_cache_sizes_are_bytes():
    assert all(isinstance(v, int) and v > 0 for v in cache_sizes().values())


def test_calibration_gives_finite_positive_constants():
    machine = measure()
    values = [machine.call, *machine.engine_call.values(), *(bw for _, bw in machine.read_rates),
              *machine.rates.values(), *machine.per_element.values()]
    assert all(math.isfinite(v) and v >= 0 for v in values)
    assert {p for p, _, _ in machine.rates} == {"numpy", "one-row batch", "kernel"}
    assert set(machine.loop) == {"greedy", "sampled"}
    assert all(set(costs) == set(LOOP_COUNTS) and all(math.isfinite(v) and v >= 0 for v in costs.values())
               for costs in machine.loop.values())
    assert machine.loop["sampled"]["token"] > machine.loop["greedy"]["token"]  # a softmax and a draw vs an argmax


def test_decoding_is_the_calls_plus_the_loops_own_costs():
    loop = {"greedy": dict(zip(LOOP_COUNTS, (1e-6, 2e-6, 3e-6, 4e-6, 5e-6))),
            "sampled": dict(zip(LOOP_COUNTS, (10e-6, 20e-6, 30e-6, 40e-6, 50e-6)))}
    machine = dataclasses.replace(MACHINE, loop=loop)
    assert predict_decoding(machine, 1e-3, 0.0, 100) == pytest.approx(100 * (1e-3 + 1e-6))
    assert predict_decoding(machine, 1e-3, 0.7, 100) == pytest.approx(100 * (1e-3 + 10e-6))
    stats = {"rounds": 30, "drafted": 90, "draft_calls": 90, "judged": 80, "accepted": 70}  # k = 3: 4-token calls
    V = {4: 1.5}
    expected = 30 * 1.5 * 1e-3 + 90 * 1e-4 + 30 * 20e-6 + 90 * 30e-6 + 80 * 40e-6 + 10 * 50e-6
    assert predict_decoding(machine, 1e-3, 0.7, 100, stats, 1e-4, V) == pytest.approx(expected)


def test_the_card_is_measured_once_kept_and_measured_again_when_its_key_changes(tmp_path, monkeypatch):
    from lib.measure import card
    monkeypatch.setattr(card, "CARD_DIR", tmp_path)
    measured = []
    monkeypatch.setattr(card, "measure", lambda: measured.append(1) or MACHINE)
    first = card.calibrate(out=None)
    assert measured == [1] and first == MACHINE and card.card_path().exists()
    assert card.calibrate(out=None) == MACHINE and measured == [1]  # loaded: the same constants, not measured
    card.calibrate(out=None, refresh=True)
    assert measured == [1, 1]
    monkeypatch.setattr(card, "card_key", lambda: {"cpu": "another"})
    card.calibrate(out=None)
    assert measured == [1, 1, 1]  # another key: another card
    card.card_path().write_text("{not json")
    card.calibrate(out=None)
    assert measured == [1, 1, 1, 1]  # an unreadable card is measured again


def test_the_card_quotes_one_bandwidth_and_one_peak():
    assert MACHINE.memory_bandwidth == 10e9  # the largest working sets' median rate
    assert MACHINE.peak == 512 * 10e9
    assert "10.0 GB/s" in MACHINE.card() and "5120 GFLOP/s" in MACHINE.card() and "3.0 / 2.0 us" in MACHINE.card()
