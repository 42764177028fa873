"""Every public callable of lib, fuzzed: valid arguments mixed with wrong types, wrong shapes, NaN
and inf, empty, huge, tiny and negative values, unknown option names and mismatched partners.

A call either returns a result that passes its contract, or raises ValueError or TypeError
(FileNotFoundError for a file that does not exist, as `lib.model.load`) from code inside lib, with
a message that names a bad argument; a call given a bad argument must raise; and an argument that
holds state (a cache, a pool, a block manager, an array, a dict of parameters) is unchanged after a
call that raised. `test_every_public_callable_is_fuzzed_or_exempt` enumerates lib, so a new public
function fails it until it gets a spec here or an entry in EXEMPT with a reason.

Examples per callable: the hypothesis profile's (100 by default; HYPOTHESIS_PROFILE=thorough, registered
in conftest.py, gives 1000).
"""
import copy
import importlib
import inspect
import math
import pkgutil
import re
import tempfile
import traceback
from pathlib import Path

import numpy as np
import pytest
from conftest import GQA, perturbed_params
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lib
from lib import checks, config, gqa, kv_scales, model, sampling, speculative, tokenizer
from lib.cache import kivi, kivi_parts, kv_cache, quant
from lib.cache.kv_cache import KVCache
from lib.cache.paged import BlockManager, PagedKVCache, PagedSequence
from lib.config import DRAFT, ModelConfig
from lib.fast import batch, kernels, lean
from lib.gpu import memory, models
from lib.measure import stats

generate = importlib.import_module("lib.generation")  # lib.generate is also the function lib re-exports

LIB_DIR = Path(lib.__file__).parent
PARAMS = perturbed_params(DRAFT, seed=5)
OTHER = perturbed_params(GQA, seed=6)  # parameters of another config: a mismatched partner
V = DRAFT.vocab_size
FOLDER = tempfile.mkdtemp()  # checkpoints written by the save spec
model.save(PARAMS, DRAFT, "draft", {}, folder=FOLDER)
EXAMPLES = settings().max_examples  # per callable: the profile's (conftest.py)
ALLOWED = (ValueError, TypeError, FileNotFoundError)
STATEFUL = (np.ndarray, dict, list, KVCache, kivi.KiviCache, PagedKVCache, PagedSequence, BlockManager)

# ----------------------------------------------------------------------------- argument strategies
# Each strategy draws (value, bad): bad is True when the value must be refused.

NOT_INT = (None, "3", 1.5, True, math.nan, [1], b"1")
NOT_REAL = (None, "0.5", math.nan, math.inf, -math.inf, [0.5], True)
UNKNOWN = ("bogus", "", None, 3, "INT8", ("int8",))


def good(strategy):
    return strategy.map(lambda v: (v, False))


def bad(*values):
    """Bad values; a callable is called for each draw, so arrays are never shared between calls."""
    return st.sampled_from(values).map(lambda v: (v() if callable(v) else v, True))


def arg(valid, *invalid):
    return st.one_of(good(valid), bad(*invalid)) if invalid else good(valid)


def count(lo, hi=None, top=64):
    """Integers lo..hi (lo..top if there is no upper limit); below lo, above hi and non-integers are bad."""
    return arg(st.integers(lo, top if hi is None else hi), lo - 1, *([hi + 1] if hi is not None else []), *NOT_INT)


def real(lo, hi, *extra_bad):
    return arg(st.floats(lo, hi), *NOT_REAL, *extra_bad)


def option(names, *extra_bad):
    return arg(st.sampled_from(names), *UNKNOWN, *extra_bad)


def token_ids(cfg=DRAFT, max_size=6):
    return st.lists(st.integers(0, cfg.vocab_size - 1), min_size=1, max_size=max_size).map(np.array)


def tokens(cfg=DRAFT, max_size=6, vocabulary=True):
    """Token ids; with `vocabulary`, an id past the vocabulary is bad too (a block manager knows none)."""
    return arg(token_ids(cfg, max_size), lambda: np.array([], np.int64), lambda: np.array([[1, 2]]),
               lambda: np.array([1.5]), *[lambda: np.array([cfg.vocab_size])] * vocabulary, lambda: np.array([-1]), "ab", None)


def distributions(n):
    return st.lists(st.floats(0.01, 1.0), min_size=n, max_size=n).map(lambda w: np.array(w) / sum(w))


def probs(n, partnered=0):
    """Distributions over n outcomes; with a partner, one over n + partnered outcomes is bad too (give
    partners different numbers, so two bad lengths never match)."""
    return arg(distributions(n), lambda: np.full(n, 2.0 / n), lambda: np.full(n, 1.0 / n) - (np.arange(n) == 0) * 2,
               lambda: np.full(n, np.nan), lambda: np.zeros(0), lambda: np.full((2, n), 0.5 / n),
               *[lambda: np.full(n + partnered, 1.0 / (n + partnered))] * bool(partnered), lambda: np.array(["0.5"] * n), None)


def values(shape=(2, 3, 4)):
    return arg(st.floats(-10, 10).map(lambda x: np.random.default_rng(0).standard_normal(shape) * x + x),
               lambda: np.full(shape, np.nan), lambda: np.full(shape, np.inf), lambda: np.zeros((0,)),
               lambda: np.array("x"), None)


def cfgs():
    return arg(st.sampled_from([DRAFT]), None, lambda: dict(DRAFT.__dict__), lambda: PARAMS)


def params():
    return arg(st.just(PARAMS), None, lambda: OTHER, lambda: {k: v for k, v in PARAMS.items() if k != "ln_f.bias"},
               lambda: {k: v.astype(np.int32) for k, v in PARAMS.items()}, lambda: [PARAMS])


def rngs():
    return arg(st.integers(0, 9).map(np.random.default_rng), None, 3, lambda: np.random.RandomState(0))


def fed_cache(draw, dtype="float32", max_len=12):
    cache = KVCache(DRAFT, max_len, dtype)
    n = draw(st.integers(0, 4))
    if n:
        model.forward_cached(PARAMS, DRAFT, np.arange(n) + 1, cache)
    return cache


def caches(draw, dtype="float32"):
    return draw(arg(st.just(fed_cache(draw, dtype)), None, lambda: object(), lambda: KVCache(GQA, 8), lambda: PARAMS))


def pool_with_sequence(draw):
    pool = PagedKVCache(DRAFT, num_blocks=draw(st.integers(6, 10)), block_size=draw(st.integers(1, 4)))
    prompt = draw(token_ids(DRAFT, 4))
    seq = pool.add("a", prompt)
    if draw(st.booleans()):
        seq.feed(prompt[seq.n:], STEP)
    return pool, seq


def STEP(new_tokens, cache):
    return model.forward_cached(PARAMS, DRAFT, new_tokens, cache)


def steps():
    return arg(st.just(STEP), None, "forward", 3)


def kv_shaped(cache, T):
    shape = (cache.cfg.n_kv_head, T, cache.cfg.head_dim)
    return arg(st.just(np.ones(shape, np.float32)), lambda: np.ones(shape[:2] + (shape[2] + 1,)), None,
               lambda: np.ones((shape[0], 0, shape[2])), lambda: np.ones(shape[1:]))

# ----------------------------------------------------------------------------- contracts


def finite(result) -> bool:
    """Every number in the result is finite."""
    if isinstance(result, (tuple, list)):
        return all(finite(r) for r in result)
    if isinstance(result, dict):
        return all(finite(r) for r in result.values())
    if isinstance(result, np.ndarray) and result.dtype.kind in "iuf":
        return bool(np.isfinite(result).all())
    if isinstance(result, float):
        return math.isfinite(result)
    return True


def is_distribution(result) -> bool:
    return result.ndim >= 1 and np.allclose(result.sum(axis=-1), 1.0) and (result >= 0).all()


def anything(result) -> bool:
    return True


# ----------------------------------------------------------------------------- specs
# name -> function of `draw` returning (call, {argument: (value, bad)}, contract on the result)


def spec(name, contract=finite):
    def register(fn):
        SPECS[name] = (fn, contract)
        return fn
    return register


SPECS = {}


@spec("config.is_int", contract=lambda r: isinstance(r, bool))
def _(d):
    return config.is_int, {"value": d(arg(st.one_of(st.integers(), st.floats(), st.none(), st.text(max_size=2))))}


@spec("config.ModelConfig")
def _(d):
    fields = {name: d(count(1, top=8)) for name in ("n_layer", "n_head", "n_kv_head")}
    fields["n_embd"] = d(count(1, top=64))
    return ModelConfig, fields


for _method in ("parameter_shapes", "n_params"):
    spec(f"config.ModelConfig.{_method}")(lambda d, m=_method: (getattr(ModelConfig, m), {"self": d(good(st.sampled_from([DRAFT, GQA])))}))


@spec("tokenizer.encode", contract=lambda r: r.dtype == np.int64)
def _(d):
    return tokenizer.encode, {"text": d(arg(st.text(alphabet=tokenizer.VOCAB, max_size=8), "é", "\x00", b"ab", None, 3, ["a"]))}


@spec("tokenizer.decode", contract=lambda r: isinstance(r, str))
def _(d):
    ids = arg(st.lists(st.integers(0, V - 1), max_size=6), lambda: [V], lambda: [-1], lambda: [1.5], "ab", lambda: [None])
    return tokenizer.decode, {"tokens": d(ids)}


@spec("checks.check_temperature")
def _(d):
    return checks.check_temperature, {"temperature": d(real(0, 5, -0.5))}


@spec("checks.check_seed")
def _(d):
    return checks.check_seed, {"seed": d(count(0, None))}


@spec("checks.check_count", contract=lambda r: isinstance(r, int) and r >= 2)
def _(d):
    return checks.check_count, {"value": d(count(2, None)), "name": d(good(st.just("value"))), "low": d(good(st.just(2)))}  # the name it is told


@spec("checks.check_config", contract=lambda r: isinstance(r, ModelConfig))
def _(d):
    return checks.check_config, {"cfg": d(arg(st.sampled_from([DRAFT, GQA]), None, "DRAFT", (1, 2, 3)))}


def logits():
    return arg(st.integers(1, 8).map(lambda n: np.random.default_rng(n).standard_normal(n)), lambda: np.zeros(0),
               lambda: np.array([0.0, np.nan]), lambda: np.array([np.inf, 0.0]), lambda: np.full(3, -np.inf),
               lambda: np.array(["a"]), lambda: np.float64(1.0), None)


@spec("checks.check_logits")
def _(d):
    return checks.check_logits, {"logits": d(logits())}


@spec("sampling.probs_from_logits", contract=is_distribution)
def _(d):
    return sampling.probs_from_logits, {"logits": d(logits()), "temperature": d(real(0, 5, -1.0))}


@spec("checks.check_probs", contract=is_distribution)
def _(d):
    return checks.check_probs, {"probs": d(probs(d(st.integers(1, 6))))}


@spec("checks.check_rng")
def _(d):
    return checks.check_rng, {"rng": d(rngs())}


@spec("sampling.sample", contract=lambda r: isinstance(r, int))
def _(d):
    return sampling.sample, {"probs": d(probs(d(st.integers(1, 6)))), "rng": d(rngs())}


@spec("sampling.next_token", contract=lambda r: isinstance(r, int))
def _(d):
    return sampling.next_token, {"logits": d(logits()), "temperature": d(real(0, 5, -1.0)), "rng": d(rngs())}


@spec("stats.tvd", contract=lambda r: 0 <= r <= 1 + 1e-9)
def _(d):
    n = d(st.integers(1, 6))
    return stats.tvd, {"a": d(probs(n, 1)), "b": d(probs(n, 2))}


@spec("stats.tvd_noise_floor", contract=lambda r: 0 <= r <= 1)
def _(d):
    return stats.tvd_noise_floor, {"p": d(probs(d(st.integers(1, 6)))), "n": d(count(1, None))}


@spec("stats.chi_square_pvalue", contract=lambda r: 0 <= r <= 1)
def _(d):
    n = d(st.integers(1, 6))
    counts = arg(st.lists(st.integers(1, 50), min_size=n, max_size=n).map(np.array), lambda: np.zeros(n),
                 lambda: -np.ones(n), lambda: np.ones(n + 2), lambda: np.full(n, np.nan), None)
    return stats.chi_square_pvalue, {"counts": d(counts), "p": d(probs(n, 1))}


@spec("stats.pool_rare")
def _(d):
    n = d(st.integers(1, 6))
    freqs = arg(distributions(n), lambda: np.ones(n + 2), lambda: np.full(n, np.nan), None, "x")
    call = lambda p, freqs, min_prob: stats.pool_rare(p, freqs, min_prob=min_prob)
    return call, {"p": d(probs(n, 1)), "freqs": d(freqs), "min_prob": d(real(0, 1, -0.1, 1.5))}


@spec("stats.two_sample_tvd_null")
def _(d):
    return stats.two_sample_tvd_null, {"p": d(probs(d(st.integers(1, 6)))), "n": d(count(1, top=100)),
                                       "trials": d(count(1, top=20)), "seed": d(count(0, None))}


for _name in ("check_pq", "residual", "step_distribution"):
    @spec(f"speculative.{_name}", contract=anything if _name == "check_pq" else is_distribution)
    def _(d, fn=getattr(speculative, _name)):
        n = d(st.integers(1, 6))
        return fn, {"p": d(probs(n, 1)), "q": d(probs(n, 2))}


@spec("speculative.accept_or_resample", contract=lambda r: isinstance(r[0], bool) and isinstance(r[1], int))
def _(d):
    n = d(st.integers(1, 6))
    return speculative.accept_or_resample, {"p": d(probs(n, 1)), "q": d(probs(n, 2)), "x": d(count(0, n - 1)), "rng": d(rngs())}


@spec("speculative.check_pair")
def _(d):
    dynamic = d(st.booleans())  # k_max counts only with dynamic k
    return speculative.check_pair, {"target_cfg": d(cfgs()), "draft_cfg": d(cfgs()), "k": d(count(1, 512)),
                                    "dynamic": (dynamic, False), "k_max": d(count(1, 512) if dynamic else good(st.integers()))}


def formula_args(d, with_costs):
    args = {"alpha": d(real(0, 1, -0.1, 1.5)), "k": d(count(1))}
    if with_costs:
        args.update(c=d(real(0, 10, -1.0)), verify=d(real(0.1, 10, 0.0)))
    return args


spec("speculative.check_formula_args")(lambda d: (speculative.check_formula_args, formula_args(d, True)))
spec("speculative.expected_tokens_per_call", contract=lambda r: r >= 1)(
    lambda d: (speculative.expected_tokens_per_call, formula_args(d, False)))
spec("speculative.expected_speedup", contract=lambda r: r > 0)(lambda d: (speculative.expected_speedup, formula_args(d, True)))
spec("speculative.PromptLookup", contract=anything)(lambda d: (speculative.PromptLookup, {"max_ngram": d(count(1))}))


def pairs():
    return arg(st.just((PARAMS, DRAFT)), None, lambda: (DRAFT, PARAMS), lambda: (OTHER, DRAFT), lambda: PARAMS)


@spec("speculative.speculative_generate", contract=lambda r: r[0].dtype == np.int64 and finite(r[0]))
def _(d):
    draft = d(st.one_of(pairs(), good(st.builds(speculative.PromptLookup, st.integers(1, 3)))))
    dynamic = d(st.booleans())  # k_max counts only with dynamic k
    return speculative.speculative_generate, {
        "target": d(pairs()), "draft": draft, "prompt": d(tokens()), "n_new": d(count(1, top=4)), "k": d(count(1, top=4)),
        "temperature": d(real(0, 2, -1.0)), "seed": d(count(0, None)), "dynamic": (dynamic, False),
        "k_max": d(count(1, top=8) if dynamic else good(st.integers()))}


@spec("checks.check_tokens", contract=lambda r: r.dtype == np.int64)
def _(d):
    return checks.check_tokens, {"tokens": d(tokens()), "cfg": d(good(st.just(DRAFT))), "start": d(count(0, 511))}


@spec("model.forward")
def _(d):
    return model.forward, {"params": d(params()), "cfg": d(cfgs()), "tokens": d(tokens())}


@spec("checks.check_params")
def _(d):
    return checks.check_params, {"params": d(params()), "cfg": d(cfgs())}


@spec("checks.check_cache")
def _(d):
    return checks.check_cache, {"cache": caches(d), "cfg": d(cfgs())}


@spec("model.forward_cached")
def _(d):
    return model.forward_cached, {"params": d(params()), "cfg": d(cfgs()), "new_tokens": d(tokens()), "cache": caches(d)}


@spec("model.init_params")
def _(d):
    return model.init_params, {"cfg": d(cfgs()), "seed": d(count(0, None)),
                               "dtype": d(arg(st.sampled_from([np.float32, np.float64]), np.int32, "x", None))}


def checkpoint_names():
    return arg(st.just("draft"), None, 3, "", "a/b")


@spec("model.save", contract=anything)
def _(d):
    folder = d(arg(st.just(tempfile.mkdtemp()), None, 3))
    metadata = d(arg(st.just({"note": "fuzz"}), None, "x", ["a"]))
    return model.save, {"params": d(params()), "cfg": d(cfgs()), "name": d(checkpoint_names()),
                        "metadata": metadata, "folder": folder}


@spec("model.load_metadata", contract=lambda r: isinstance(r, dict))
def _(d):
    return model.load_metadata, {"name": d(checkpoint_names()), "folder": d(arg(st.just(FOLDER), None, 3, "/nonexistent"))}


@spec("model.load")
def _(d):
    return model.load, {"name": d(checkpoint_names()), "folder": d(arg(st.just(FOLDER), None, 3, "/nonexistent"))}


def dtypes():
    return arg(st.sampled_from(kv_cache.DTYPES), "int32", "bfloat16", None, 3, np.int32)


def calibrations(none=True):
    """The draft's (k_max, v_max) pair, (n_layer, n_kv_head) each; wrong shapes, zeros and non-pairs are bad."""
    return arg(st.just((np.ones((1, 2)), np.ones((1, 2)))), lambda: (np.ones((1, 3)), np.ones((1, 2))),
               lambda: (np.zeros((1, 2)), np.ones((1, 2))), lambda: np.ones((1, 2)), "x", *[None] * (not none))


@spec("kv_cache.KVCache", contract=anything)
def _(d):
    max_len = arg(st.one_of(st.none(), st.integers(1, 512)), 0, 513, 1.5, "3", True)  # None: the context
    return KVCache, {"cfg": d(cfgs()), "max_len": d(max_len), "dtype": d(dtypes()),
                     "granularity": d(option(quant.GRANULARITIES)), "calibration": d(calibrations())}


@spec("kv_cache.storage", contract=anything)
def _(d):
    return kv_cache.storage, {"cfg": d(cfgs()), "dtype": d(dtypes()), "granularity": d(option(quant.GRANULARITIES)),
                              "calibration": d(calibrations())}


@spec("kv_cache.check_calibration", contract=anything)
def _(d):
    return kv_cache.check_calibration, {"cfg": d(good(st.just(DRAFT))), "kind": d(good(st.sampled_from(kv_cache.DTYPES))),
                                        "calibration": d(calibrations(none=False))}


@spec("kv_cache.fixed_scales")
def _(d):
    return kv_cache.fixed_scales, {"kind": d(option(quant.QUANTIZED)), "granularity": d(option(("head", "tensor"), "position")),
                                   "calibration": d(arg(st.just((np.ones((1, 2)), np.ones((1, 2)))), None,
                                                        lambda: (np.zeros((1, 2)), np.ones((1, 2)))))}


@spec("kv_cache.KVCache.check_room")
def _(d):
    return KVCache.check_room, {"self": d(good(st.just(fed_cache(d)))), "count": d(count(0, top=16))}


@spec("kv_cache.KVCache.write")
def _(d):
    cache = fed_cache(d, d(st.sampled_from(kv_cache.DTYPES)))
    T = d(st.integers(1, 3))
    return KVCache.write, {"self": d(good(st.just(cache))), "layer": d(count(0, 0)), "k": d(kv_shaped(cache, T)),
                           "v": d(kv_shaped(cache, T))}


@spec("kv_cache.KVCache.read")
def _(d):
    cache = fed_cache(d, d(st.sampled_from(kv_cache.DTYPES)))
    return KVCache.read, {"self": d(good(st.just(cache))), "layer": d(count(0, 0)), "end": d(count(1, max(cache.n, 1)))}


@spec("kv_cache.KVCache.advance")
def _(d):
    return KVCache.advance, {"self": d(good(st.just(fed_cache(d)))), "count": d(arg(st.nothing(), 1, 0, -1, 1.5, None))}


@spec("kv_cache.KVCache.feed")
def _(d):
    return KVCache.feed, {"self": d(good(st.just(fed_cache(d)))), "new_tokens": d(tokens()), "step": d(steps())}


@spec("kv_cache.KVCache.truncate", contract=anything)
def _(d):
    cache = fed_cache(d)
    return KVCache.truncate, {"self": d(good(st.just(cache))), "n": d(count(0, cache.n))}


def fed_kivi(draw):
    cache = kivi.KiviCache(DRAFT, 12, draw(st.sampled_from(kivi.BITS)), draw(st.integers(1, 4)))
    n = draw(st.integers(0, 6))
    if n:
        model.forward_cached(PARAMS, DRAFT, np.arange(n) + 1, cache)
    return cache


@spec("kivi.KiviCache", contract=anything)
def _(d):
    return kivi.KiviCache, {"cfg": d(cfgs()), "max_len": d(arg(st.integers(1, 512), 0, 513, 1.5, "3")),
                            "bits": d(arg(st.sampled_from(kivi.BITS), 3, 8, True, None, "2")),
                            "residual": d(arg(st.integers(1, 64), 0, -1, 1.5, None))}


@spec("kivi_parts.KiviParts", contract=anything)
def _(d):
    return kivi_parts.KiviParts, {"cfg": d(cfgs()), "max_len": d(arg(st.integers(1, 512), 0, 513, 1.5, "3")),
                                  "bits": d(arg(st.sampled_from(kivi.BITS), 3, 8, True, None, "2")),
                                  "keys": d(arg(st.sampled_from(kivi_parts.KEYS), "head", None, 1)),
                                  "zero_point": d(arg(st.booleans(), 1, None, "yes")),
                                  "residual": d(arg(st.integers(1, 64), -1, 1.5, None)),
                                  "window": d(arg(st.sampled_from(list(kivi_parts.WINDOWS)), "int8", None, 2))}


@spec("kivi.KiviCache.write")
def _(d):
    cache, T = fed_kivi(d), d(st.integers(1, 5))
    return kivi.KiviCache.write, {"self": d(good(st.just(cache))), "layer": d(count(0, 0)), "k": d(kv_shaped(cache, T)),
                                  "v": d(kv_shaped(cache, T))}


@spec("kivi.KiviCache.read")
def _(d):
    cache = fed_kivi(d)
    return kivi.KiviCache.read, {"self": d(good(st.just(cache))), "layer": d(count(0, 0)), "end": d(count(1, max(cache.n, 1)))}


@spec("kivi.KiviCache.truncate", contract=anything)
def _(d):
    cache = fed_kivi(d)
    return kivi.KiviCache.truncate, {"self": d(good(st.just(cache))), "n": d(count(0, cache.n))}


spec("kivi.KiviCache.check_room")(lambda d: (kivi.KiviCache.check_room, {"self": d(good(st.just(fed_kivi(d)))),
                                                                        "count": d(count(0, top=12))}))
spec("kivi.KiviCache.advance")(lambda d: (kivi.KiviCache.advance, {"self": d(good(st.just(fed_kivi(d)))),
                                                                  "count": d(arg(st.nothing(), 1, 0, -1, 1.5, None))}))
spec("kivi.KiviCache.feed")(lambda d: (kivi.KiviCache.feed, {"self": d(good(st.just(fed_kivi(d)))), "new_tokens": d(tokens()),
                                                            "step": d(steps())}))
spec("kivi.KiviCache.copy", contract=anything)(lambda d: (kivi.KiviCache.copy, {"self": d(good(st.just(fed_kivi(d))))}))


spec("kv_cache.check_step")(lambda d: (kv_cache.check_step, {"step": d(steps())}))
spec("kv_cache.KVCache.copy", contract=anything)(lambda d: (KVCache.copy, {"self": d(good(st.just(fed_cache(d))))}))


@spec("quant.check_kind")
def _(d):
    return quant.check_kind, {"kind": d(option(quant.QUANTIZED))}


@spec("quant.check_granularity")
def _(d):
    return quant.check_granularity, {"granularity": d(option(quant.GRANULARITIES))}


@spec("quant.check_values")
def _(d):
    return quant.check_values, {"x": d(values())}


@spec("quant.check_scales")
def _(d):
    scale = arg(st.floats(1e-3, 10), 0.0, -1.0, math.nan, math.inf, lambda: np.ones(5), "x", None)
    return quant.check_scales, {"scale": d(scale), "shape": d(good(st.just((2, 3, 4))))}


def scales_for(shape):
    return arg(st.floats(1e-3, 10).map(lambda s: np.full(shape[:-1] + (1,), s, np.float32)), 0.0, -1.0, math.nan,
               lambda: np.ones(shape[-1] + 1), "x", None)


@spec("quant.quantize")
def _(d):
    return quant.quantize, {"x": d(values()), "scale": d(scales_for((2, 3, 4))), "kind": d(option(quant.QUANTIZED))}


@spec("quant.dequantize")
def _(d):
    kind = d(st.sampled_from(quant.QUANTIZED))
    codes = quant.quantize(np.ones((2, 3, 4)), 0.1, kind)
    return quant.dequantize, {"codes": d(arg(st.just(codes), lambda: codes.astype(np.float64), None, "x")),
                              "scale": d(scales_for((2, 3, 4))), "kind": d(arg(st.just(kind), *UNKNOWN))}


@spec("quant.position_scales", contract=lambda r: r.dtype == np.float16 and (r > 0).all())
def _(d):
    return quant.position_scales, {"x": d(values()), "kind": d(option(quant.QUANTIZED))}


@spec("quant.smallest_coded", contract=lambda r: r > 0)
def _(d):
    return quant.smallest_coded, {"kind": d(option(quant.QUANTIZED))}


@spec("kv_scales.kv_maxima")
def _(d):
    return kv_scales.kv_maxima, {"params": d(params()), "cfg": d(cfgs()), "tokens": d(tokens())}


@spec("quant.static_scales")
def _(d):
    absmax = arg(st.floats(0.1, 10).map(lambda m: np.full((1, 2), m)), lambda: np.zeros((1, 2)), lambda: np.full((1, 2), np.nan),
                 lambda: np.ones(2), lambda: np.array([["x", "y"]]), None)
    return quant.static_scales, {"absmax": d(absmax), "granularity": d(option(("head", "tensor"), "position")),
                                 "kind": d(option(quant.QUANTIZED))}


@spec("quant.fp8_encode", contract=lambda r: r.dtype == np.uint8)
def _(d):
    return quant.fp8_encode, {"x": d(values())}


@spec("quant.fp8_decode")
def _(d):
    codes = arg(st.integers(0, 255).filter(lambda c: c & 0x7F != 0x7F).map(lambda c: np.full(4, c, np.uint8)),
                lambda: np.full(4, 0x7F, np.uint8), lambda: np.full(4, 300), lambda: np.full(4, -1),
                lambda: np.full(4, 1.5), "x", None)
    return quant.fp8_decode, {"codes": d(codes)}


@spec("memory.KVSpec", contract=anything)
def _(d):
    n = d(st.integers(1, 4))
    return memory.KVSpec, {"name": d(arg(st.just("m"), None, 3)), "n_layer": d(arg(st.just(n), 0, 1.5, None)),
                           "n_kv_head": d(count(1)), "head_dim": d(count(1)),
                           "windows": d(arg(st.just((None,) * n), lambda: (0,) * n, lambda: [None] * n, (None,) * (n + 1), "x")),
                           "n_params": d(real(0, 1e12, -1.0)), "source": d(arg(st.just(""), 3)),
                           "n_head": d(arg(st.just(0), -1, 1.5, None)), "latent": d(count(0)),
                           "embedding": d(arg(st.just(0.0), -1.0, 2e12, math.nan, "1")),  # 2e12: more than n_params
                           "experts": d(arg(st.just(0), -1, 1.5, 4)), "active": d(arg(st.just(0), -1, 1.5, 5)),
                           "expert_params": d(arg(st.just(0.0), -1.0, 2e12, math.inf, None))}


def kv_spec(d):
    return d(good(st.sampled_from(models.REAL_MODELS)))


@spec("memory.KVSpec.positions")
def _(d):
    return memory.KVSpec.positions, {"self": kv_spec(d), "tokens": d(count(0, top=10**6))}


@spec("memory.KVSpec.kv_bytes", contract=lambda r: r >= 0)
def _(d):
    return memory.KVSpec.kv_bytes, {"self": kv_spec(d), "tokens": d(count(0, top=10**6)), "batch": d(count(1)),
                                    "dtype": d(option(tuple(memory.DTYPE_BYTES)))}


@spec("memory.KVSpec.bytes_per_token", contract=lambda r: r >= 0)
def _(d):
    return memory.KVSpec.bytes_per_token, {"self": kv_spec(d), "dtype": d(option(tuple(memory.DTYPE_BYTES)))}


@spec("memory.KVSpec.weight_bytes", contract=lambda r: r >= 0)
def _(d):
    return memory.KVSpec.weight_bytes, {"self": kv_spec(d), "dtype": d(option(tuple(memory.DTYPE_BYTES))),
                                        "expert_dtype": d(arg(st.sampled_from(("",) + tuple(memory.DTYPE_BYTES)),
                                                              "bogus", None, 3, "INT8")),
                                        "batch": d(count(0, top=10**4))}


@spec("memory.expected_experts", contract=lambda r: r >= 0)
def _(d):
    return memory.expected_experts, {"experts": d(arg(st.integers(8, 256), 0, -1, 1.5, None, True)),
                                     "active": d(arg(st.integers(1, 8), 0, 1.5, None, 257)), "tokens": d(count(0, top=10**4))}


@spec("memory.KVSpec.values_per_position", contract=lambda r: r > 0)
def _(d):
    return memory.KVSpec.values_per_position, {"self": kv_spec(d)}


@spec("memory.KVSpec.max_tokens", contract=lambda r: r is None or r >= -1)
def _(d):
    return memory.KVSpec.max_tokens, {"self": kv_spec(d), "budget": d(arg(st.floats(-1e3, 1e12), None, "1", math.nan, math.inf, True)),
                                      "batch": d(count(1)), "dtype": d(option(tuple(memory.DTYPE_BYTES)))}


@spec("memory.KVSpec.multi_head", contract=lambda r: r.latent == 0 and r.n_kv_head >= 1)
def _(d):
    return memory.KVSpec.multi_head, {"self": kv_spec(d)}


@spec("memory.KVSpec.per_gpu", contract=lambda r: r.kv_bytes(8) > 0)
def _(d):
    return memory.KVSpec.per_gpu, {"self": kv_spec(d), "tp": d(arg(st.sampled_from([1, 2, 4, 8, 16]), 0, 3, 1.5, None))}


@spec("memory.GPU", contract=anything)
def _(d):
    return memory.GPU, {"name": d(good(st.just("g"))), "memory": d(real(1, 1e12, 0.0, -1.0)),
                        "bandwidth": d(real(1, 1e13, 0.0)), "flops": d(real(1, 1e16, 0.0, -1.0)),
                        "source": d(good(st.just("")))}


def gpus(d):
    return d(arg(st.just(memory.H100), None, "H100", lambda: {"memory": 80e9}))


@spec("memory.kv_budget", contract=lambda r: r <= memory.H100.memory)
def _(d):
    return memory.kv_budget, {"gpu": gpus(d), "weight_bytes": d(real(0, 1e12, -1.0)),
                              "utilization": d(real(0.01, 1, 0.0, 1.5)), "workspace": d(real(0, 1e10, -1.0))}


@spec("memory.step_seconds", contract=lambda r: r >= 0)
def _(d):
    return memory.step_seconds, {"gpu": gpus(d), "weight_bytes": d(real(0, 1e12, -1.0)), "kv_bytes": d(real(0, 1e12, -1.0))}


@spec("memory.dtype_bytes", contract=lambda r: r > 0)
def _(d):
    return memory.dtype_bytes, {"dtype": d(option(tuple(memory.DTYPE_BYTES)))}


HF = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}


def hf_configs(fields=True):
    """Configs as dicts or paths; with `fields`, a dict with a bad or missing field is bad too."""
    bad_fields = [lambda: HF | {"num_hidden_layers": 0}, lambda: HF | {"layer_types": "x"}, lambda: HF | {"head_dim": 1.5},
                  lambda: {"hidden_size": 64}]
    return arg(st.just(HF), None, lambda: [HF], "/nonexistent/config.json", 3, *bad_fields * fields)


@spec("memory.read_config", contract=lambda r: isinstance(r, dict))
def _(d):
    return memory.read_config, {"config": d(hf_configs(fields=False))}


@spec("memory.from_hf_config", contract=lambda r: r.kv_bytes(8) > 0)
def _(d):
    return memory.from_hf_config, {"config": d(hf_configs()), "name": d(arg(st.just("m"), 3, None)),
                                   "n_params": d(real(0, 1e12, -1.0))}


@spec("memory.from_model_config", contract=lambda r: r.kv_bytes(8) > 0)
def _(d):
    return memory.from_model_config, {"cfg": d(cfgs())}


@spec("gqa.mean_pool_kv")
def _(d):
    return gqa.mean_pool_kv, {"params": d(params()), "cfg": d(cfgs()), "n_kv_head": d(count(1, 2))}


@spec("generation.check_request")
def _(d):
    return generate.check_request, {"prompt_len": d(count(1, top=10)), "n_new": d(count(1, top=10)),
                                    "context": d(count(1, top=512)), "temperature": d(real(0, 2, -1.0))}


@spec("generation.generate", contract=lambda r: finite(r.tokens) and r.tokens.dtype == np.int64)
def _(d):
    return generate.generate, {"params": d(params()), "cfg": d(cfgs()), "prompt": d(tokens()), "n_new": d(count(1, top=4)),
                               "temperature": d(real(0, 2, -1.0)), "seed": d(count(0, None)),
                               "use_cache": d(good(st.booleans()))}


@spec("generation.complete", contract=lambda r: isinstance(r, str))
def _(d):
    prompt = arg(st.text(alphabet=tokenizer.VOCAB, min_size=1, max_size=6), "", "é", None, 3)
    return generate.complete, {"params": d(params()), "cfg": d(cfgs()), "prompt": d(prompt), "n_new": d(count(1, top=4)),
                               "temperature": d(real(0, 2, -1.0)), "seed": d(count(0, None))}


def lean_models():
    return good(st.sampled_from(["numpy", "kernel"]).map(lambda p: lean.LeanModel(PARAMS, DRAFT, p)))


@spec("lean.LeanModel", contract=anything)
def _(d):
    return lean.LeanModel, {"params": d(params()), "cfg": d(cfgs()), "products": d(option(("numpy", "kernel"), "auto "))}


@spec("model.cached_step", contract=anything)
def _(d):
    return model.cached_step, {"model": d(st.one_of(pairs(), lean_models()))}


@spec("batch.check_batch")
def _(d):
    cache = fed_cache(d)
    token_lists = arg(st.just([[1]]), lambda: [], lambda: [[1], [2]], None)
    cache_lists = arg(st.just([cache]), lambda: [cache, cache], lambda: [object()], lambda: [KVCache(GQA, 8)], None)
    return batch.check_batch, {"cfg": d(good(st.just(DRAFT))), "new_tokens": d(token_lists), "caches": d(cache_lists)}


@spec("batch.BatchedModel", contract=anything)
def _(d):
    return batch.BatchedModel, {"model": d(st.one_of(pairs(), lean_models()))}


@spec("batch.BatchedModel.step")
def _(d):
    a, b = fed_cache(d), fed_cache(d)
    token_lists = arg(st.tuples(token_ids(max_size=3), token_ids(max_size=3)).map(list), lambda: [[1]], lambda: [[96], [1]],
                      lambda: [[1.5], [1]], None)
    cache_lists = arg(st.just([a, b]), lambda: [a, a], lambda: [a, object()], lambda: [a, KVCache(GQA, 8)], None)
    engine = batch.BatchedModel(d(st.sampled_from([(PARAMS, DRAFT), lean.LeanModel(PARAMS, DRAFT, "numpy")])))
    return batch.BatchedModel.step, {"self": (engine, False), "new_tokens": d(token_lists), "caches": d(cache_lists)}


@spec("batch.BatchedModel.feed")
def _(d):
    pool, seq = pool_with_sequence(d)
    engine = batch.BatchedModel((PARAMS, DRAFT))
    return batch.BatchedModel.feed, {"self": (engine, False), "seqs": d(arg(st.just([seq]), lambda: [seq, seq], None, lambda: [object()])),
                                     "new_tokens": d(arg(st.just([[1]]), lambda: [], lambda: [[96]], None))}


@spec("kernels.rows_product")
def _(d):
    T, K, N = d(st.integers(1, 9)), d(st.integers(2, 8)), d(st.integers(1, 8))  # K > 1: a C-ordered w is not column-major
    a = arg(st.just(np.ones((T, K), np.float32)), lambda: np.ones((T, K + 1), np.float32), lambda: np.ones(K, np.float32),
            lambda: np.ones((K + 1, T + 1), np.float32).T, None)
    w = arg(st.just(np.asfortranarray(np.ones((K, N), np.float32))), lambda: np.ones((K, N + 1), np.float32), None)
    return kernels.rows_product, {"a": d(a), "w": d(w)}


@spec("kernels.rows_as_batch")
def _(d):
    T, K, N = d(st.integers(1, 9)), d(st.integers(1, 8)), d(st.integers(1, 8))
    a = arg(st.just(np.ones((T, K), np.float32)), lambda: np.ones((T, K + 1), np.float32), lambda: np.ones(K, np.float32), None)
    w = arg(st.just(np.ones((K, N), np.float32)), lambda: np.ones((K + 2, N), np.float32), None)
    return kernels.rows_as_batch, {"a": d(a), "w": d(w)}


@spec("kernels.candidates", contract=lambda r: "numpy" in r)
def _(d):
    return kernels.candidates, {"T": d(count(1))}


@spec("blocks.BlockManager", contract=anything)
def _(d):
    return BlockManager, {"num_blocks": d(count(1)), "block_size": d(count(1)), "prefix_caching": d(good(st.booleans()))}


def manager_with_sequence(d):
    return pool_with_sequence(d)[0].manager


def seq_ids():
    return arg(st.just("a"), "nobody", None, lambda: ["a"])


for _name, _args in [("can_allocate", lambda d: {"n_tokens": d(count(1))}),
                     ("allocate", lambda d: {"seq_id": d(arg(st.just("b"), "a", lambda: ["b"])), "tokens": d(tokens(vocabulary=False))}),
                     ("append_need", lambda d: {"seq_id": d(seq_ids()), "n": d(count(1))}),
                     ("can_append", lambda d: {"seq_id": d(seq_ids()), "n": d(count(1))}),
                     ("reserve", lambda d: {"seq_id": d(seq_ids()), "new_tokens": d(tokens(vocabulary=False))}),
                     ("truncate", lambda d: {"seq_id": d(seq_ids()), "n": d(arg(st.just(0), -1, 1.5, None))}),
                     ("fork", lambda d: {"parent": d(seq_ids()), "child": d(arg(st.just("c"), "a", lambda: ["c"]))}),
                     ("deallocate", lambda d: {"seq_id": d(seq_ids())})]:
    spec(f"blocks.BlockManager.{_name}", contract=anything)(
        lambda d, m=_name, a=_args: (getattr(BlockManager, m), {"self": (manager_with_sequence(d), False), **a(d)}))


@spec("paged.PagedKVCache", contract=anything)
def _(d):
    return PagedKVCache, {"cfg": d(cfgs()), "num_blocks": d(count(1, top=16)), "block_size": d(count(1, top=16)),
                          "prefix_caching": d(good(st.booleans()))}


@spec("paged.PagedKVCache.add", contract=anything)
def _(d):
    pool, _ = pool_with_sequence(d)
    return PagedKVCache.add, {"self": (pool, False), "seq_id": d(arg(st.just("b"), "a", lambda: ["b"])), "prompt": d(tokens())}


@spec("paged.PagedKVCache.fork", contract=anything)
def _(d):
    pool, seq = pool_with_sequence(d)
    return PagedKVCache.fork, {"self": (pool, False), "parent": d(arg(st.just(seq), None, "a", lambda: object())),
                               "child_id": d(arg(st.just("c"), "a", lambda: ["c"]))}


@spec("paged.PagedKVCache.free", contract=anything)
def _(d):
    pool, seq = pool_with_sequence(d)
    return PagedKVCache.free, {"self": (pool, False), "seq": d(arg(st.just(seq), None, "a", lambda: object()))}


@spec("paged.PagedSequence.feed")
def _(d):
    pool, seq = pool_with_sequence(d)
    return PagedSequence.feed, {"self": (seq, False), "new_tokens": d(tokens()), "step": d(steps())}


@spec("paged.PagedSequence.check_room")
def _(d):
    pool, seq = pool_with_sequence(d)
    return PagedSequence.check_room, {"self": (seq, False), "count": d(arg(st.nothing(), 1, -1, 1.5, None))}


@spec("paged.PagedSequence.write")
def _(d):
    pool, seq = pool_with_sequence(d)
    return PagedSequence.write, {"self": (seq, False), "layer": d(count(0, 0)), "k": d(kv_shaped(seq, 1)), "v": d(kv_shaped(seq, 1))}


@spec("paged.PagedSequence.read")
def _(d):
    pool, seq = pool_with_sequence(d)
    end = count(1, seq.n) if seq.n else arg(st.nothing(), 1, 0, None)
    return PagedSequence.read, {"self": (seq, False), "layer": d(count(0, 0)), "end": d(end)}


@spec("paged.PagedSequence.advance")
def _(d):
    pool, seq = pool_with_sequence(d)
    return PagedSequence.advance, {"self": (seq, False), "count": d(arg(st.nothing(), 1, 0, -1, 1.5, None))}


@spec("paged.PagedSequence.truncate", contract=anything)
def _(d):
    pool, seq = pool_with_sequence(d)
    return PagedSequence.truncate, {"self": (seq, False), "n": d(count(0, seq.n))}


# ----------------------------------------------------------------------------- exempt, with reasons

REFERENCE = "a building block of the frozen reference forward: its inputs are checked by forward and forward_cached, fuzzed here"
PROTOCOL = "a step of a protocol driven by a fuzzed caller, which checks what it passes"
RECORD = "a record the engine fills in (a dataclass or NamedTuple), not an entry point"
MEASURES = "measures time or reads the machine: slow or machine-dependent; tested in its own test file"
EXEMPT = {
    **{f"model.{n}": REFERENCE for n in ("layer_norm", "gelu", "softmax", "attention", "split_qkv", "mlp", "embed", "head")},
    "checks.is_number": "a predicate (True or False for any value): the rule check_temperature applies",
    "sampling.draw": "the unchecked inner loop of `sample` for distributions the engine computed; `sample` is its checked form",
    "quant.Form": "a record built once per storage form in lib.cache.quant.FORMS; storage() picks one by its checked name",
    "quant.Form.encode": "the unchecked twin of quant.quantize (its checked form) for the caches' hot path",
    "quant.Form.decode": "the unchecked twin of quant.dequantize (its checked form) for the caches' hot path",
    "quant.Form.width": "arithmetic on a head_dim that storage() has checked against the form's packing",
    "speculative.target_cache": PROTOCOL + " (speculative_generate)",
    "speculative.ModelDrafter": PROTOCOL + " (speculative_generate's drafter)",
    "speculative.ModelDrafter.propose": PROTOCOL + " (speculative_generate's drafter)",
    "speculative.ModelDrafter.keep": PROTOCOL + " (speculative_generate's drafter)",
    "speculative.PromptLookup.start": PROTOCOL + " (speculative_generate's drafter)",
    "speculative.PromptLookup.propose": PROTOCOL + " (speculative_generate's drafter)",
    "speculative.PromptLookup.keep": PROTOCOL + " (speculative_generate's drafter)",
    "speculative.SpecStats": RECORD,
    "speculative.verify": "accept_or_resample's rule without its checks, for distributions the engine computed "
                          "(speculative_generate and the server); tests/test_speculative.py",
    **{f"model.KVStore{m}": "a typing Protocol: the cache interface forward_cached needs, implemented by the caches "
       "fuzzed here" for m in ("", ".advance", ".check_room", ".read", ".write")},
    "blocks.BlockManager.commit": PROTOCOL + " (PagedSequence.feed; tests/test_paged_stateful.py)",
    "blocks.BlockManager.rollback": PROTOCOL + " (PagedSequence.feed; tests/test_paged_stateful.py)",
    "paged.PagedSequence": "made by PagedKVCache.add and fork, fuzzed here",
    "blocks.Reservation": RECORD,
    "blocks.chain_hash": "the block manager's hash of token ids its callers checked",
    "batch.masked_attention": "compiled kernel behind BatchedModel.step, which checks its inputs",
    "paged_kernel.paged_attention": "the compiled kernel behind BatchedModel.step, which checks its inputs",
    "paged_kernel.attend_paged": "the compiled kernel's caller inside BatchedModel.step, which checks its inputs; "
                                 "tests/test_quant_attention.py",
    "paged_kernel.prefetch": "a compiled intrinsic, callable only inside compiled code",
    "paged_kernel.bits_to_float": "a compiled intrinsic, callable only inside compiled code",
    "paged_kernel.exp_nonpositive": "compiled arithmetic inside the kernel, held to np.exp in tests/test_quant_attention.py",
    "kivi_parts.KiviParts.advance": PROTOCOL + " (forward_cached's end of a step; tests/test_kivi_parts.py)",
    "paged.PagedKVCache.store": PROTOCOL + " (PagedSequence.write and BatchedModel.step)",
    "paged.PagedKVCache.load": PROTOCOL + " (PagedSequence.read)",
    "generation.Generation": RECORD,
    "kernels.fastest_products": MEASURES,
    "corpus.Corpus": RECORD,
    "corpus.Corpus.describe": RECORD,
    "corpus.load_corpus": "reads the training text (2 MB) from the standard library; tests/test_held_out.py",
    "corpus.held_out_prompts": "reads the training text (2 MB) from the standard library; tests/test_held_out.py",
    **{f"timing.{n}": MEASURES for n in (
        "single_thread", "median_time", "paired_times", "paired", "paired_speedup", "matmul_gflops", "memory_gbps")},
    **{f"prose.{n}": "a chapter's prose numbers (glued in its kernel, read back from its stored run); "
       "tests/test_frame.py runs them on every chapter" for n in ("prose", "glued", "shown")},
    **{n: "the serving simulation, stateful and timed; tests/test_serving.py (Policy's checks included)" for n in (
        "trace.Request", "trace.make_trace", "trace.rejection_reason", "report.Outcome", "report.Report",
        "report.Report.summary", "report.Report.goodput", "report.Report.attainment", "policy.Policy",
        "policy.Policy.answer_length", "server.serve",
        "server.Server", "server.Server.run")},
    **{f"scheduler.{n}": PROTOCOL + " (serve's step loop; tests/test_serving.py)" for n in (
        "Running", "Scheduler", "Scheduler.arrive", "Scheduler.batch_due", "Scheduler.blocks", "Scheduler.finish",
        "Scheduler.plan", "Scheduler.release", "Scheduler.schedule", "Scheduler.set_aside", "Scheduler.used")},
    **{f"replay.{n}": "the serving simulation's replay of recorded completions, stateful; tests/test_replay.py" for n in (
        "completions", "Replay", "Replay.new_pool", "Replay.feed", "LedgerPool", "LedgerPool.add", "LedgerPool.free",
        "LedgerSequence", "LedgerSequence.truncate")},
    "corpus.held_out_spans": "reads the held-out corpus; tests/test_serving.py (make_trace)",
    **{f"train.{n}": "training (minutes of work, hand-written backward pass); tests/test_train.py" for n in (
        "ln_fwd", "ln_bwd", "gelu_fwd", "gelu_bwd", "attn_fwd", "attn_bwd", "matmul_bwd", "loss_and_grads", "lr_at",
        "AdamW", "AdamW.step", "windows", "held_out_windows", "evaluate", "held_out_loss", "train", "main")},
    "widgets.slider_plot": "renders every figure of a slider grid; tests/test_widgets.py",
}

# ----------------------------------------------------------------------------- the tests


MEASURING = ("lib.measure.", "lib.bench")  # the floors that measure time or read the machine (MEASURES): exempt
# as a folder, and the benchmark report (python -m lib.bench), except where a callable has a spec here (lib.measure.stats)
EXERCISES = "lib.book.exercises"  # exempt as a folder: a chapter's exercise checks the reader's function, and
# tests/test_exercises.py feeds each check its solution and wrong versions


def public_callables(package=lib) -> dict:
    """{module.name and module.Class.method: its lib module} of every public function, class and
    method defined in lib and its subpackages; `module` is the module's own name (unique in lib)."""
    names = {}
    for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        module = importlib.import_module(info.name)
        short = info.name.rsplit(".", 1)[1]
        for name, obj in vars(module).items():
            if name.startswith("_") or not callable(obj) or getattr(obj, "__module__", None) != module.__name__:
                continue
            names[f"{short}.{name}"] = info.name
            if inspect.isclass(obj):
                names.update({f"{short}.{name}.{m}": info.name for m, f in vars(obj).items()
                              if not m.startswith("_") and inspect.isfunction(f)})
    return names


def test_every_public_callable_is_fuzzed_or_exempt():
    found = public_callables()
    assert len({name.split(".")[0] for name in found}) == len({module for module in found.values()}), \
        "two lib modules share a name: the names here would be ambiguous"
    measured = {name for name, module in found.items() if module.startswith(MEASURING) or module.startswith(EXERCISES)}
    names = set(found)
    uncovered, stale = names - set(SPECS) - set(EXEMPT) - measured, (set(SPECS) | set(EXEMPT)) - names
    assert not uncovered, f"add a spec or an EXEMPT entry with a reason for {sorted(uncovered)}"
    assert not stale, f"a spec or EXEMPT entry for callables that no longer exist: {sorted(stale)}"
    assert not set(SPECS) & set(EXEMPT)


def same(a, b) -> bool:
    """Equal values: arrays elementwise (NaN equal to NaN), objects without their own == by their attributes."""
    if a is b:
        return True
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a).__eq__ is object.__eq__:  # compared by identity: compare a copy by its attributes
        return type(a) is type(b) and same(getattr(a, "__dict__", None), getattr(b, "__dict__", None))
    return a == b or (isinstance(a, float) and math.isnan(a) and isinstance(b, float) and math.isnan(b))


ALIASES = {  # other words a message may use for an argument
    "cfg": ("config", "ModelConfig"), "self": ("KV cache", "sequence", "KV pool"), "text": ("character", "str"),
    "new_tokens": ("token", "tokens"), "prompt": ("token", "tokens", "character", "str"), "tokens": ("token", "prompt"),
    "target": ("model", "cfg", "params"), "draft": ("model", "cfg", "params"), "model": ("params", "cfg"),
    "seq_id": ("sequence",), "parent": ("sequence",), "child": ("sequence",), "child_id": ("sequence",),
    "seqs": ("sequence",), "caches": ("cache", "KV cache"), "probs": ("probabilities",), "scale": ("scales",),
    "absmax": ("calibration",), "x": ("values", "K/V values"), "folder": ("weights",), "name": ("weights",),
    "config": ("config file", "config.json"), "count": ("positions",)}


def names_an_argument(message: str, names) -> bool:
    """The message names one of the call's arguments, as a whole word (or an alias: `cfg` as config, ...)."""
    words = {w for n in names for w in (n, *ALIASES.get(n, ()))}
    return any(re.search(rf"(?<![A-Za-z_]){re.escape(w)}(?![A-Za-z_])", message) for w in words)


def check_call(call, args, contract):
    """Call with the drawn values; judge the outcome as the module docstring says."""
    values = [v for v, _ in args.values()]
    bad = [name for name, (_, is_bad) in args.items() if is_bad]
    before = [copy.deepcopy(v) if isinstance(v, STATEFUL) else None for v in values]
    try:
        result = call(*values)
    except ALLOWED as err:
        last = Path(traceback.extract_tb(err.__traceback__)[-1].filename)
        assert LIB_DIR in last.parents, f"{type(err).__name__} raised outside lib, in {last}: {err}"
        assert names_an_argument(str(err), list(args)), f"message names none of {list(args)}: {err}"
        for name, value, old in zip(args, values, before):
            assert old is None or same(old, value), f"{name} changed by a call that raised {err!r}"
        return
    assert not bad, f"bad {bad} accepted silently, returned {result!r:.200}"
    assert contract(result), f"result breaks its contract: {result!r:.200}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_bad_input_anywhere_gets_a_clear_error_and_changes_nothing(name):
    make, contract = SPECS[name]

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data):
        call, args = make(data.draw)
        check_call(call, args, contract)
    fuzz()
