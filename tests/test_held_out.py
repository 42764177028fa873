"""The book's one held-out loss (`lib.train.held_out_loss`) is the training record's."""
import json
from pathlib import Path

import pytest

from lib.corpus import load_corpus
from lib.model import load
from lib.train import held_out_loss

RECORD = json.loads((Path(__file__).parents[1] / "lib" / "weights" / "target.json").read_text())


def test_held_out_loss_on_four_windows_is_the_records_sample_loss():
    if load_corpus().sha256 != RECORD["corpus_sha256"]:
        pytest.skip("this Python's standard library differs from the one the weights were trained on")
    loss, on = held_out_loss(*load("target"), windows=4)
    assert round(loss, 4) == round(RECORD["held_out_sample_loss"], 4)
    assert on.startswith("the first 4 of ")


@pytest.mark.parametrize("windows", [0, -1, 10_000])
def test_held_out_loss_rejects_impossible_window_counts(windows):
    with pytest.raises(ValueError, match="windows must be between 1 and"):
        held_out_loss(*load("target"), windows=windows)
