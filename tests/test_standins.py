"""Cost stand-ins run on the lean path exactly, and a cost shadow changes no token."""
import numpy as np
import pytest

from lib.cache.kv_cache import KVCache
from lib.config import ModelConfig
from lib.corpus import held_out_prompts
from lib.fast.lean import LeanModel
from lib.generation import generate
from lib.measure.standins import DRAFT_STANDINS, STANDINS, StandInStep, standin, weight_bytes
from lib.model import forward, init_params, load
from lib.speculative import speculative_generate

SMALL = ModelConfig(n_layer=2, n_head=6, n_kv_head=3, n_embd=48)  # a shape unlike the trained models'


def test_standin_weights_have_the_shapes_of_their_config_in_float32():
    params = init_params(SMALL)  # a stand-in's weights: GPT-2's initialisation of its shape
    assert {k: v.shape for k, v in params.items()} == SMALL.parameter_shapes()
    assert all(v.dtype == np.float32 for v in params.values())
    assert 0.015 < params["h.0.mlp.c_fc.weight"].std() < 0.025  # GPT-2's initial scale
    np.testing.assert_array_equal(init_params(SMALL, seed=3)["wte.weight"], init_params(SMALL, seed=3)["wte.weight"])


@pytest.mark.parametrize("products", ["numpy", "kernel", "auto"])
def test_lean_path_is_exact_on_a_standin_shape(products):
    """Random chunk sizes 1..10 (one row, the 2..8-row products, numpy beyond) against the reference."""
    params = init_params(SMALL, seed=1)
    lean, rng = LeanModel(params, SMALL, products), np.random.default_rng(0)
    tokens = rng.integers(0, SMALL.vocab_size, 90)
    cache, out, i = KVCache(SMALL), [], 0
    while i < len(tokens):
        size = int(rng.integers(1, 11))
        out.append(lean(tokens[i:i + size], cache))
        i += size
    np.testing.assert_allclose(np.concatenate(out), forward(params, SMALL, tokens), atol=1e-5, rtol=0)


def test_standins_are_named_and_sized():
    assert list(STANDINS) == sorted(STANDINS, key=lambda n: STANDINS[n].n_params())
    small = standin("4x256")
    assert small.cfg == STANDINS["4x256"] and 10e6 < weight_bytes(small) < 16e6
    draft_shape = standin("2x256")  # a draft's cost, kept apart from the large stand-ins chapter 2 loops over
    assert draft_shape.cfg == DRAFT_STANDINS["2x256"] and 5e6 < weight_bytes(draft_shape) < 8e6
    assert not set(DRAFT_STANDINS) & set(STANDINS)


def test_cost_shadow_gives_the_models_tokens_and_follows_its_cache():
    """Target-only and speculative decoding through a shadow give the trained model's tokens; the
    stand-in's cache ends as long as the real one and saw every call's size."""
    target, draft = LeanModel(*load("target")), LeanModel(*load("draft"))
    stand = standin("4x256")
    prompt = held_out_prompts(1)[0]
    shadow = StandInStep(target, stand)
    greedy = generate(target, prompt, 40).tokens
    np.testing.assert_array_equal(generate(shadow, prompt, 40).tokens, greedy)
    assert shadow.calls == [len(prompt)] + [1] * 39 and shadow.standin_cache.n == len(prompt) + 39
    shadow.calls.clear()
    tokens, stats = speculative_generate(shadow, draft, prompt, 40, k=3, temperature=0.0)
    np.testing.assert_array_equal(tokens, greedy)
    assert len(shadow.calls) == stats.target_calls and sum(shadow.calls) > 40
    assert set(shadow.calls[1:]) <= {1, 2, 3, 4}

