"""One bad input of each kind found by an adversarial probe of the public API: each gets an
exception of the right type whose message names the problem, and changes no state (cache n and
contents, block tables, free list, reference counts)."""
import gc
import json
import warnings

import numpy as np
import pytest
from conftest import GQA, perturbed_params, pool_state

from lib import tokenizer
from lib.book.widgets import slider_plot
from lib.cache.kv_cache import KVCache
from lib.cache.paged import BlockManager, PagedKVCache
from lib.config import DRAFT, ModelConfig
from lib.fast.lean import LeanModel
from lib.generation import complete, generate
from lib.gpu import memory
from lib.model import Model, forward, forward_cached, load, save
from lib.sampling import probs_from_logits
from lib.speculative import (
    PromptLookup,
    speculative_generate,
)

PARAMS = perturbed_params(DRAFT, seed=3)
MODEL = Model(PARAMS, DRAFT)
OTHER = perturbed_params(GQA, seed=4)  # params of another config
RNG = np.random.default_rng(0)
HF = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}


def without(key):
    params = dict(PARAMS)
    del params[key]
    return params


def wrong_bias():
    params = dict(PARAMS)
    params["h.0.mlp.c_fc.bias"] = np.zeros(1, np.float32)  # would broadcast silently
    return params


CASES = [
    # (what, call, exception, message)
    ("forward with another config's params", lambda: forward(OTHER, DRAFT, [1, 2]), ValueError, r"params\['wte.weight'\] is float32 \(96, 32\).*needs float \(96, 48\)"),
    ("forward with a bias of the wrong shape", lambda: forward(wrong_bias(), DRAFT, [1]), ValueError, r"h.0.mlp.c_fc.bias'\] is float32 \(1,\)"),
    ("(cfg, params) reversed", lambda: forward(DRAFT, PARAMS, [1]), TypeError, r"cfg must be a lib.config.ModelConfig.*reversed"),
    ("LeanModel with another config's params", lambda: LeanModel(OTHER, DRAFT), ValueError, r"params\['wte.weight'\]"),
    ("a cache that is not a cache", lambda: forward_cached(PARAMS, DRAFT, [1], object()), TypeError, "expected a KV cache"),
    ("temperature None", lambda: generate(MODEL, [1], 2, temperature=None), TypeError, "temperature must be a number"),
    ("temperature '0.5'", lambda: generate(MODEL, [1], 2, temperature="0.5"), TypeError, "temperature must be a number"),
    ("seed 'abc'", lambda: generate(MODEL, [1], 2, seed="abc"), ValueError, "seed must be an integer >= 0, got 'abc'"),
    ("seed 1.5", lambda: generate(MODEL, [1], 2, seed=1.5), ValueError, "seed must be an integer >= 0"),
    ("seed -1", lambda: generate(MODEL, [1], 2, seed=-1), ValueError, "seed must be an integer >= 0, got -1"),
    ("speculative with a pair reversed", lambda: speculative_generate((DRAFT, PARAMS), MODEL, [1], 2), TypeError, "must be a Step"),
    ("k = 1e9", lambda: speculative_generate(MODEL, MODEL, [1], 2, k=10**9), ValueError, "must be an integer in 1..512"),
    ("dynamic k above k_max", lambda: speculative_generate(MODEL, MODEL, [1], 2, k=4, dynamic=True, k_max=2), ValueError, "above k_max=2"),
    ("PromptLookup(max_ngram=2.5)", lambda: PromptLookup(max_ngram=2.5), ValueError, "max_ngram must be an integer >= 1, got 2.5"),
    ("BlockManager with a float size", lambda: BlockManager(4.5, 4), ValueError, "num_blocks must be an integer >= 1, got 4.5"),
    ("int8 cache with all-zero calibration", lambda: KVCache(DRAFT, 8, "int8", "head", (np.zeros((1, 2)), np.ones((1, 2)))), ValueError, "maxima k_max must be finite numbers >= "),
    ("int4 cache with NaN calibration", lambda: KVCache(DRAFT, 8, "int4", "tensor", (np.full((1, 2), np.nan), np.ones((1, 2)))), ValueError, "maxima k_max must be finite"),
    ("HF config with 0 heads", lambda: memory.from_hf_config(HF | {"num_attention_heads": 0}), ValueError, "num_attention_heads must be a positive integer, got 0"),
    ("HF config with kv heads 0", lambda: memory.from_hf_config(HF | {"num_key_value_heads": 0}), ValueError, "num_key_value_heads must be a positive integer, got 0"),
    ("HF config with non-dividing heads", lambda: memory.from_hf_config(HF | {"num_key_value_heads": 3}), ValueError, "n_head=4 is not a multiple of n_kv_head=3"),
    ("HF config with a string", lambda: memory.from_hf_config(HF | {"hidden_size": "64"}), ValueError, "hidden_size must be a positive integer, got '64'"),
    ("HF config with a list", lambda: memory.from_hf_config(HF | {"num_hidden_layers": [2]}), ValueError, "num_hidden_layers must be"),
    ("HF config with sliding_window 0", lambda: memory.from_hf_config(HF | {"sliding_window": 0}), ValueError, "sliding_window must be a positive integer"),
    ("ModelConfig with a bool", lambda: ModelConfig(True, 2, 2, 48), ValueError, "n_layer must be a positive integer, got True"),
    ("complete with a vocabulary the tokenizer lacks", lambda: complete(Model(perturbed_params(ModelConfig(1, 2, 2, 48, vocab_size=100)), ModelConfig(1, 2, 2, 48, vocab_size=100)), "a", 2), ValueError, "96-character vocabulary"),
    ("decode of non-integer ids", lambda: tokenizer.decode([1.5]), ValueError, "integer token ids"),
    ("encode(None)", lambda: tokenizer.encode(None), TypeError, "encode takes a str, got NoneType"),
    ("encode(bytes)", lambda: tokenizer.encode(b"abc"), TypeError, "decode bytes to str first"),
    ("from_model_config(None)", lambda: memory.from_model_config(None), TypeError, "cfg must be a lib.config.ModelConfig, got NoneType"),
    ("HF config that is a list", lambda: memory.from_hf_config([HF]), TypeError, "config must be a dict or the path of a config.json, got list"),
    ("HF config None", lambda: memory.from_hf_config(None), TypeError, "config must be a dict or the path of a config.json, got NoneType"),
    ("HF config at a path that does not exist", lambda: memory.from_hf_config("/nonexistent/config.json"), FileNotFoundError, "config file /nonexistent/config.json does not exist"),
    ("HF config with layer_types a number", lambda: memory.from_hf_config(HF | {"layer_types": 2}), ValueError, "layer_types must be a list of 2 strings, got 2"),
    ("HF config with an unknown layer type", lambda: memory.from_hf_config(HF | {"num_hidden_layers": 2, "layer_types": ["full_attention", "chunked_attention"]}), ValueError, "entries \\['chunked_attention'\\] are not full_attention, sliding_attention, linear_attention"),
    ("HF config with linear layers but no state sizes", lambda: memory.from_hf_config(HF | {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]}), ValueError, "config.json lacks linear_num_value_heads"),
    ("HF config with experts but no experts per token", lambda: memory.from_hf_config(HF | {"num_local_experts": 8, "intermediate_size": 16, "vocab_size": 10}, n_params=1e6), ValueError, "lacks num_experts_per_tok"),
    ("HF config with sliding layers but no window", lambda: memory.from_hf_config(HF | {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}), ValueError, "no sliding_window"),
    ("load with a folder None", lambda: load("draft", folder=None), TypeError, "folder must be a path, got NoneType"),
    ("load with a name None", lambda: load(None), TypeError, "name must be the file stem of a checkpoint"),
    ("float32 cache of an unknown granularity", lambda: KVCache(DRAFT, 8, "float32", "block"), ValueError, "granularity must be one of position, head, tensor, got 'block'"),
]


@pytest.mark.parametrize("call, exception, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error(call, exception, message):
    with pytest.raises(exception, match=message):
        call()


def test_slider_values_may_be_any_iterable():
    """Accepted on purpose: a generator of values is read once into a list."""
    assert len(slider_plot(lambda k: str(k), {"k": (k for k in (1, 2))}).children) == 2


def test_numpy_integers_are_accepted_where_ints_are_expected():
    cfg = ModelConfig(np.int64(1), np.int64(2), np.int64(2), np.int64(48))
    assert cfg == DRAFT and isinstance(cfg.n_layer, int)
    assert memory.from_hf_config(HF).n_kv_head == 4  # absent: as many KV heads as heads
    assert BlockManager(np.int64(4), np.int64(2)).num_blocks == 4


def test_subnormal_temperature_is_greedy_not_nan():
    p = probs_from_logits([1.0, 3.0, 2.0], 1e-310)
    assert np.array_equal(p, [0.0, 1.0, 0.0])


@pytest.mark.parametrize("what, bad", [
    ("feed a freed sequence", lambda pool, seq: seq.feed([1], lambda t, c: forward_cached(PARAMS, DRAFT, t, c))),
    ("feed a float token", lambda pool, seq: seq.feed([1.5], lambda t, c: forward_cached(PARAMS, DRAFT, t, c))),
    ("feed an out-of-range token", lambda pool, seq: seq.feed([96], lambda t, c: forward_cached(PARAMS, DRAFT, t, c))),
    ("add a float prompt", lambda pool, seq: pool.add("c", [1.0, 2.0])),
    ("add an id twice", lambda pool, seq: pool.add("a", [1, 2])),
])
def test_paged_misuse_is_a_clear_error_and_changes_nothing(what, bad):
    pool = PagedKVCache(DRAFT, num_blocks=6, block_size=4)
    a = pool.add("a", [1, 2, 3, 4, 5])
    a.feed([1, 2, 3, 4, 5], lambda t, c: forward_cached(PARAMS, DRAFT, t, c))
    b = pool.add("b", [1, 2, 3, 4, 9])
    pool.free(b)
    before = pool_state(pool)
    seq = b if what == "feed a freed sequence" else a
    with pytest.raises(ValueError, match="unknown sequence|integer|outside the vocabulary|already allocated|cannot truncate"):
        bad(pool, seq)
    after = pool_state(pool)
    assert after[0] == before[0] and all((x == y).all() for x, y in zip(after[1], before[1]))


def test_truncated_checkpoint_leaks_no_file_handle(tmp_path):
    save(PARAMS, DRAFT, "draft", {}, folder=tmp_path)
    data = (tmp_path / "draft.npz").read_bytes()
    (tmp_path / "draft.npz").write_bytes(data[: len(data) // 3])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="corrupt"):
            load("draft", folder=tmp_path)
        gc.collect()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)]


def test_string_weights_are_corrupt_not_a_numpy_error(tmp_path):
    params = dict(PARAMS)
    save(params, DRAFT, "draft", {}, folder=tmp_path)
    with np.load(tmp_path / "draft.npz") as data:
        arrays = {k: data[k] for k in data.files}
    arrays["ln_f.bias"] = np.array(["x"] * 48)
    np.savez(tmp_path / "draft.npz", **arrays)
    with pytest.raises(ValueError, match="ln_f.bias has shape \\(48,\\), expected float"):
        load("draft", folder=tmp_path)
    meta = json.loads((tmp_path / "draft.json").read_text())
    assert meta["config"]["n_head"] == 2


@pytest.mark.parametrize("text, error, message", [
    ("{not json", ValueError, "is not a readable JSON file"),
    ("[1, 2]", ValueError, "holds a JSON list, not an object of fields"),
])
def test_a_config_file_that_is_not_a_json_object(tmp_path, text, error, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(error, match=message):
        memory.from_hf_config(tmp_path / "config.json")


@pytest.mark.parametrize("meta, message", [
    ([1, 2], "is corrupt \\(no config object\\)"),
    ({"config": None}, "is corrupt \\(no config object\\)"),
])
def test_metadata_without_a_config_object(tmp_path, meta, message):
    save(PARAMS, DRAFT, "draft", {}, folder=tmp_path)
    (tmp_path / "draft.json").write_text(json.dumps(meta))
    with pytest.raises(FileNotFoundError, match=message):
        load("draft", folder=tmp_path)


def test_metadata_with_an_invalid_config_names_the_json(tmp_path):
    save(PARAMS, DRAFT, "draft", {}, folder=tmp_path)
    (tmp_path / "draft.json").write_text(json.dumps({"config": {"n_layer": 0}}))
    with pytest.raises(ValueError, match="draft.json holds no valid config.*python -m lib.train draft"):
        load("draft", folder=tmp_path)
