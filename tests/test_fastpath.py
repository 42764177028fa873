"""The one-token fast path's study (chapters 10 and 12): its counts by kind, and the same logits off the fast path."""
import numpy as np

from lib.book.studies.fastpath import MatrixNorm, fast_path_share
from lib.cache.kv_cache import KVCache
from lib.fast.lean import LeanModel
from lib.model import load


def test_counts_by_kind_and_a_share_of_the_excess():
    """Two LayerNorm calls more for each of 2L + 1 norms, one mask addition a layer; the share is the priced calls
    over the measured excess, or over the excess the caller gives (its value is a timing, not checked here)."""
    params, cfg = load("target")
    r = fast_path_share(LeanModel(params, cfg, "numpy"), params, position=16, repeats=3)
    assert r["norm_calls"] == 2 * (2 * cfg.n_layer + 1) and r["mask_calls"] == cfg.n_layer
    assert np.isclose(r["fast_us"], r["norm_calls"] * r["norm_us"] + r["mask_calls"] * r["mask_us"])
    assert np.isclose(r["share"], r["fast_us"] / max(r["excess_us"], 1e-3))
    given = fast_path_share(LeanModel(params, cfg, "numpy"), params, position=16, excess=1e-4, repeats=3)
    assert np.isclose(given["excess_us"], 100.0) and np.isclose(given["share"], given["fast_us"] / 100.0)  # the caller's excess


def test_matrix_norm_gives_the_lean_logits():
    """Off the fast path, one token's logits agree with the lean path's to float32 rounding."""
    params, cfg = load("target")
    tokens = np.arange(9) % cfg.vocab_size
    outs = []
    for model in (LeanModel(params, cfg, "numpy"), MatrixNorm(params, cfg, "numpy")):
        cache = KVCache(cfg)
        model(tokens[:8], cache)
        outs.append(model(tokens[8:], cache))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)
