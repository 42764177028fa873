"""Every bad input gets a clear error that names the problem, and leaves the cache as it was."""
import json

import numpy as np
import pytest
from conftest import perturbed_params

from lib.cache.kv_cache import KVCache
from lib.config import DRAFT, ModelConfig
from lib.generation import generate
from lib.model import Model, forward, forward_cached, load, save

PARAMS = perturbed_params(DRAFT)


def test_cache_overflow_says_capacity_and_request():
    cache = KVCache(DRAFT, max_len=10)
    forward_cached(PARAMS, DRAFT, np.arange(8), cache)
    with pytest.raises(ValueError, match="holds 10 positions, 8 are used and 3 more were asked"):
        forward_cached(PARAMS, DRAFT, np.arange(3), cache)
    assert cache.n == 8


def test_positions_past_block_size():
    with pytest.raises(ValueError, match=r"positions 0\.\.512 go past the context of 512"):
        forward(PARAMS, DRAFT, np.zeros(513, dtype=int))
    cache = KVCache(DRAFT)
    forward_cached(PARAMS, DRAFT, np.zeros(510, dtype=int), cache)
    with pytest.raises(ValueError, match=r"positions 510\.\.512 go past the context"):
        forward_cached(PARAMS, DRAFT, np.zeros(3, dtype=int), cache)
    assert cache.n == 510


def test_bad_tokens_do_not_touch_the_cache():
    cache = KVCache(DRAFT, 16)
    forward_cached(PARAMS, DRAFT, np.arange(4), cache)
    before = [k.copy() for k in cache.k]
    for bad, message in [([1, 96], "token id 96 at index 1"), ([-1], "token id -1"), ([], "non-empty"),
                         ([[1, 2]], "1-D"), ([1.5], "integer ids"), (np.array([-3], np.int8), "token id -3"),
                         (np.array([2, 2**63], np.uint64), f"token id {2**63} at index 1")]:
        with pytest.raises(ValueError, match=message):
            forward_cached(PARAMS, DRAFT, np.array(bad), cache)
    assert cache.n == 4 and all((a == b).all() for a, b in zip(before, cache.k))


def test_cache_of_another_model_is_refused():
    with pytest.raises(ValueError, match="this KV cache was made for"):
        forward_cached(PARAMS, DRAFT, [1], KVCache(ModelConfig(2, 2, 2, 48)))


def test_bad_cache_arguments():
    with pytest.raises(ValueError, match="max_len must be an integer in 1..512"):
        KVCache(DRAFT, 513)
    with pytest.raises(ValueError, match="dtype must be one of float32, float16, fp8, int8, int4, got 'int32'"):
        KVCache(DRAFT, 8, dtype="int32")
    with pytest.raises(ValueError, match="granularity must be one of position, head, tensor"):
        KVCache(DRAFT, 8, dtype="int8", granularity="block")
    with pytest.raises(ValueError, match="needs fixed scales"):
        KVCache(DRAFT, 8, dtype="int8", granularity="head")


def test_bad_config():
    with pytest.raises(ValueError, match="n_head=4 is not divisible by n_kv_head=3"):
        ModelConfig(1, 4, 3, 32)
    with pytest.raises(ValueError, match="n_embd=30 is not divisible by n_head=4"):
        ModelConfig(1, 4, 4, 30)


def test_negative_temperature():
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        generate(Model(PARAMS, DRAFT), [1, 2], 3, temperature=-1)


def test_prompt_plus_generation_longer_than_context():
    with pytest.raises(ValueError, match=r"n_new \(the prompt holds 500 of 512 positions\) must be an integer in 1..12, got 13"):
        generate(Model(PARAMS, DRAFT), np.zeros(500, dtype=int), 13)


def test_missing_weights_say_how_to_retrain(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python -m lib.train target"):
        load("target", folder=tmp_path)
    save(PARAMS, DRAFT, "draft", {"note": "test"}, folder=tmp_path)
    (tmp_path / "draft.npz").unlink()
    with pytest.raises(FileNotFoundError, match=r"draft.npz is missing; retrain with `python -m lib.train draft`"):
        load("draft", folder=tmp_path)


def test_corrupt_weights_say_how_to_retrain(tmp_path):
    save(PARAMS, DRAFT, "draft", {}, folder=tmp_path)
    params, cfg = load("draft", folder=tmp_path)
    assert cfg == DRAFT and all((params[k] == PARAMS[k]).all() for k in PARAMS)
    data = (tmp_path / "draft.npz").read_bytes()
    (tmp_path / "draft.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"draft.npz is corrupt.*python -m lib.train draft"):
        load("draft", folder=tmp_path)
    (tmp_path / "draft.json").write_text("{not json")
    with pytest.raises(FileNotFoundError, match=r"draft.json is missing or corrupt.*python -m lib.train draft"):
        load("draft", folder=tmp_path)


def test_weights_that_do_not_match_their_config(tmp_path):
    save(PARAMS, DRAFT, "draft", {}, folder=tmp_path)
    meta = json.loads((tmp_path / "draft.json").read_text())
    meta["config"]["n_layer"] = 2
    (tmp_path / "draft.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="n_layer=2.*but the weights were saved for ModelConfig\\(n_layer=1"):
        load("draft", folder=tmp_path)
    meta["config"]["n_layer"], meta["config"]["n_head"], meta["config"]["n_kv_head"] = 1, 3, 3  # same shapes
    (tmp_path / "draft.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="n_head=3.*but the weights were saved for .*n_head=2"):
        load("draft", folder=tmp_path)
