"""The shipped checkpoints: they load, their held-out loss is what their record says, and the
headline exactness case holds on them."""
import numpy as np
import pytest

from lib.config import DRAFT, TARGET
from lib.corpus import load_corpus
from lib.generation import generate
from lib.model import Model, load, load_metadata
from lib.tokenizer import encode
from lib.train import evaluate


@pytest.mark.parametrize("name,cfg,goal", [("target", TARGET, 1.6), ("draft", DRAFT, 2.1)])
def test_shipped_weights_load_and_match_their_record(name, cfg, goal):
    params, loaded_cfg = load(name)
    meta = load_metadata(name)
    assert loaded_cfg == cfg
    assert all(p.dtype == np.float32 for p in params.values())
    corpus = load_corpus()
    if corpus.sha256 != meta["corpus_sha256"]:
        pytest.skip("this Python's standard library differs from the one the weights were trained on")
    sample = evaluate(params, cfg, corpus.held_out, meta["seq_len"], count=4)
    assert sample == pytest.approx(meta["held_out_sample_loss"], abs=1e-4)
    assert meta["held_out_loss"] <= goal


def test_context_is_cached_exactly_on_the_headline_prompt():
    """Greedy 96 characters from '    def __init__(self, ' with and without the cache: same tokens."""
    params, cfg = load("target")
    prompt = encode("    def __init__(self, ")
    cached = generate(Model(params, cfg), prompt, 96)
    plain = generate(Model(params, cfg), prompt, 96, use_cache=False)
    np.testing.assert_array_equal(cached.tokens, plain.tokens)
    assert np.abs(cached.logits - plain.logits).max() < 1e-4
