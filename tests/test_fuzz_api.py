"""The engine's boundary, fuzzed: every entry point listed in `lib.checks.BOUNDARY` gets valid
arguments mixed with wrong types, wrong shapes, NaN and inf, empty, huge, tiny and negative values,
unknown option names and mismatched partners.

A call either returns a result that passes its contract, or raises ValueError or TypeError
(FileNotFoundError for a file that does not exist, as `lib.model.load`) from code inside lib, with
a message that names a bad argument; a call given a bad argument must raise; and an argument that
holds state (a cache, a pool, a block manager, an array, a dict of parameters) is unchanged after a
call that raised. `test_the_declared_boundary_is_fuzzed` holds the specs here equal to the boundary:
what lies behind it is the algorithm, written without checks, and is tested for what it computes.

Examples per entry point: the hypothesis profile's (100 by default; HYPOTHESIS_PROFILE=thorough,
registered in conftest.py, gives 1000).
"""
import copy
import importlib
import math
import re
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import pytest
from conftest import GQA, perturbed_params
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lib
from lib import checks, kv_scales, model, speculative, tokenizer
from lib.cache import kivi, kivi_parts, kv_cache, quant
from lib.cache.kv_cache import KVCache
from lib.cache.paged import BlockManager, PagedKVCache, PagedSequence
from lib.config import DRAFT, ModelConfig
from lib.fast import batch, lean
from lib.gpu import memory

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


@spec("config.ModelConfig")
def _(d):
    fields = {name: d(count(1, top=8)) for name in ("n_layer", "n_head", "n_kv_head")}
    fields["n_embd"] = d(count(1, top=64))
    return ModelConfig, fields


@spec("tokenizer.encode", contract=lambda r: r.dtype == np.int64)
def _(d):
    return tokenizer.encode, {"text": d(arg(st.text(alphabet=tokenizer.VOCAB, max_size=8), "é", "\x00", b"ab", None, 3, ["a"]))}


@spec("tokenizer.decode", contract=lambda r: isinstance(r, str))
def _(d):
    ids = arg(st.lists(st.integers(0, V - 1), max_size=6), lambda: [V], lambda: [-1], lambda: [1.5], "ab", lambda: [None])
    return tokenizer.decode, {"tokens": d(ids)}


MODEL = model.Model(PARAMS, DRAFT)


def models():
    """A Step (the plain model or the lean path); a (params, cfg) pair, bare params and the rest are bad."""
    return arg(st.sampled_from([MODEL, lean.LeanModel(PARAMS, DRAFT, "numpy")]), None, lambda: (PARAMS, DRAFT),
               lambda: (DRAFT, PARAMS), lambda: PARAMS, "model")


@spec("model.Model", contract=anything)
def _(d):
    return model.Model, {"params": d(params()), "cfg": d(cfgs())}


@spec("speculative.speculative_generate", contract=lambda r: r[0].dtype == np.int64 and finite(r[0]))
def _(d):
    draft = d(st.one_of(models(), good(st.builds(speculative.PromptLookup, st.integers(1, 3)))))
    dynamic = d(st.booleans())  # k_max counts only with dynamic k
    return speculative.speculative_generate, {
        "target": d(models()), "draft": draft, "prompt": d(tokens()), "n_new": d(count(1, top=4)), "k": d(count(1, top=4)),
        "temperature": d(real(0, 2, -1.0)), "seed": d(count(0, None)), "dynamic": (dynamic, False),
        "k_max": d(count(1, top=8) if dynamic else good(st.integers()))}


@spec("model.forward")
def _(d):
    return model.forward, {"params": d(params()), "cfg": d(cfgs()), "tokens": d(tokens())}


@spec("model.forward_cached")
def _(d):
    return model.forward_cached, {"params": d(params()), "cfg": d(cfgs()), "new_tokens": d(tokens()), "cache": caches(d)}


@spec("model.init_params")
def _(d):
    return model.init_params, {"cfg": d(cfgs()), "seed": d(count(0, None)),
                               "dtype": d(arg(st.sampled_from([np.float32, np.float64]), np.int32, "x", None))}


def checkpoint_names():
    return arg(st.just("draft"), None, 3, "", "a/b")


@spec("model.load_metadata", contract=lambda r: isinstance(r, dict))
def _(d):
    return model.load_metadata, {"name": d(checkpoint_names()), "folder": d(arg(st.just(FOLDER), None, 3, "/nonexistent"))}


@spec("model.load")
def _(d):
    return model.load, {"name": d(checkpoint_names()), "folder": d(arg(st.just(FOLDER), None, 3, "/nonexistent"))}


def dtypes():
    return arg(st.sampled_from(kv_cache.DTYPES), "int32", "bfloat16", None, 3, np.int32)


def maxima(none=True):
    """The draft's (k_max, v_max) pair, (n_layer, n_kv_head) each; wrong shapes, zeros and non-pairs are bad."""
    return arg(st.just((np.ones((1, 2)), np.ones((1, 2)))), lambda: (np.ones((1, 3)), np.ones((1, 2))),
               lambda: (np.zeros((1, 2)), np.ones((1, 2))), lambda: np.ones((1, 2)), "x", *[None] * (not none))


@spec("kv_cache.KVCache", contract=anything)
def _(d):
    max_len = arg(st.one_of(st.none(), st.integers(1, 512)), 0, 513, 1.5, "3", True)  # None: the context
    return KVCache, {"cfg": d(cfgs()), "max_len": d(max_len), "dtype": d(dtypes()),
                     "granularity": d(option(quant.GRANULARITIES)), "maxima": d(maxima())}


@spec("kv_cache.KVCache.feed")
def _(d):
    return KVCache.feed, {"self": d(good(st.just(fed_cache(d)))), "new_tokens": d(tokens()), "step": d(steps())}


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
                            "recent": d(arg(st.integers(1, 64), 0, -1, 1.5, None))}


@spec("kivi_parts.KiviParts", contract=anything)
def _(d):
    return kivi_parts.KiviParts, {"cfg": d(cfgs()), "max_len": d(arg(st.integers(1, 512), 0, 513, 1.5, "3")),
                                  "bits": d(arg(st.sampled_from(kivi.BITS), 3, 8, True, None, "2")),
                                  "keys": d(arg(st.sampled_from(kivi_parts.KEYS), "head", None, 1)),
                                  "zero_point": d(arg(st.booleans(), 1, None, "yes")),
                                  "recent": d(arg(st.integers(1, 64), -1, 1.5, None)),
                                  "recent_dtype": d(arg(st.sampled_from(list(kivi_parts.RECENT_DTYPES)), "int8", None, 2))}


spec("kivi.KiviCache.feed")(lambda d: (kivi.KiviCache.feed, {"self": d(good(st.just(fed_kivi(d)))), "new_tokens": d(tokens()),
                                                            "step": d(steps())}))
@spec("kv_scales.kv_maxima")
def _(d):
    return kv_scales.kv_maxima, {"params": d(params()), "cfg": d(cfgs()), "tokens": d(tokens())}


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


@spec("generation.generate", contract=lambda r: finite(r.tokens) and r.tokens.dtype == np.int64)
def _(d):
    return generate.generate, {"model": d(models()), "prompt": d(tokens()), "n_new": d(count(1, top=4)),
                               "temperature": d(real(0, 2, -1.0)), "seed": d(count(0, None)),
                               "use_cache": d(good(st.booleans()))}


@spec("generation.complete", contract=lambda r: isinstance(r, str))
def _(d):
    prompt = arg(st.text(alphabet=tokenizer.VOCAB, min_size=1, max_size=6), "", "é", None, 3)
    return generate.complete, {"model": d(models()), "prompt": d(prompt), "n_new": d(count(1, top=4)),
                               "temperature": d(real(0, 2, -1.0)), "seed": d(count(0, None))}


def lean_models():
    return good(st.sampled_from(["numpy", "kernel"]).map(lambda p: lean.LeanModel(PARAMS, DRAFT, p)))


@spec("lean.LeanModel", contract=anything)
def _(d):
    return lean.LeanModel, {"params": d(params()), "cfg": d(cfgs()), "products": d(option(("numpy", "kernel"), "auto "))}


@spec("batch.BatchedModel", contract=anything)
def _(d):
    return batch.BatchedModel, {"model": d(st.one_of(models(), lean_models()))}


@spec("batch.BatchedModel.feed")
def _(d):
    pool, seq = pool_with_sequence(d)
    engine = batch.BatchedModel(MODEL)
    return batch.BatchedModel.feed, {"self": (engine, False), "seqs": d(arg(st.just([seq]), lambda: [seq, seq], None, lambda: [object()])),
                                     "new_tokens": d(arg(st.just([[1]]), lambda: [], lambda: [[96]], None))}


@spec("blocks.BlockManager", contract=anything)
def _(d):
    return BlockManager, {"num_blocks": d(count(1)), "block_size": d(count(1)), "prefix_caching": d(good(st.booleans()))}


@spec("paged.PagedKVCache", contract=anything)
def _(d):
    return PagedKVCache, {"cfg": d(cfgs()), "num_blocks": d(count(1, top=16)), "block_size": d(count(1, top=16)),
                          "prefix_caching": d(good(st.booleans()))}


@spec("paged.PagedKVCache.add", contract=anything)
def _(d):
    pool, _ = pool_with_sequence(d)
    return PagedKVCache.add, {"self": (pool, False), "seq_id": d(arg(st.just("b"), "a", lambda: ["b"])), "prompt": d(tokens())}


@spec("paged.PagedSequence.feed")
def _(d):
    pool, seq = pool_with_sequence(d)
    return PagedSequence.feed, {"self": (seq, False), "new_tokens": d(tokens()), "step": d(steps())}


# ----------------------------------------------------------------------------- exempt, with reasons

REFERENCE = "a building block of the frozen reference forward: its inputs are checked by forward and forward_cached, fuzzed here"
PROTOCOL = "a step of a protocol driven by a fuzzed caller, which checks what it passes"
RECORD = "a record the engine fills in (a dataclass or NamedTuple), not an entry point"
MEASURES = "measures time or reads the machine: slow or machine-dependent; tested in its own test file"

# ----------------------------------------------------------------------------- the tests


ELSEWHERE = {  # boundary entries whose bad input is tested in their own file: slow or stateful to fuzz here
    "policy.Policy": "tests/test_serving.py: each setting refused with its name",
    "server.serve": "tests/test_serving.py: a bad trace, policy or clock refused before anything runs",
}


def short_name(dotted: str) -> str:
    """lib.cache.paged.PagedKVCache.add -> paged.PagedKVCache.add (a module's own name is unique in lib)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        obj = module
        for attr in parts[i:]:
            obj = getattr(obj, attr)  # an entry that no longer exists fails here
        assert callable(obj), f"{dotted} is not callable"
        return ".".join([parts[i - 1], *parts[i:]])
    raise AssertionError(f"{dotted}: no such module")


def test_the_declared_boundary_is_fuzzed():
    """Every entry point in lib.checks.BOUNDARY has a spec here (or a test named in ELSEWHERE), and every
    spec is an entry point: what lies behind the boundary is the algorithm, unchecked."""
    boundary = {short_name(name) for name in checks.BOUNDARY}
    assert len(boundary) == len(checks.BOUNDARY), "two boundary entries share a short name"
    assert not boundary - set(SPECS) - set(ELSEWHERE), f"add a spec for {sorted(boundary - set(SPECS) - set(ELSEWHERE))}"
    assert not set(SPECS) - boundary, f"specs for callables behind the boundary: {sorted(set(SPECS) - boundary)}"
    assert not set(SPECS) & set(ELSEWHERE)
    modules = {name.rsplit(".", 1)[0] for name in checks.BOUNDARY if name.rsplit(".", 1)[0] in sys.modules}
    assert len({m.rsplit(".", 1)[1] for m in modules}) == len(modules), "two boundary modules share a name"


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
