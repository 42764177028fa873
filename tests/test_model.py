"""The model: parameter counts, cached == reference, grouped-query attention."""
import math

import numpy as np
import pytest
from conftest import GQA, MQA, perturbed_params
from hypothesis import given, settings
from hypothesis import strategies as st

from lib.cache.kv_cache import KVCache
from lib.config import DRAFT, TARGET, ModelConfig
from lib.model import attention, forward, forward_cached, init_params


def test_parameter_counts_match_the_article():
    assert TARGET.n_params() == 513_600
    assert DRAFT.n_params() == 61_968
    assert sum(p.size for p in init_params(TARGET).values()) == 513_600


def test_parameter_names_follow_the_gpt2_checkpoint():
    names = set(TARGET.parameter_shapes())
    for key in ("wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight",
                "h.3.attn.c_proj.weight", "h.3.mlp.c_fc.bias", "h.3.mlp.c_proj.weight", "ln_f.bias", "lm_head.weight"):
        assert key in names
    assert "h.0.attn.c_attn.bias" not in names and "h.0.attn.c_proj.bias" not in names


def test_gqa_shrinks_only_the_kv_projection():
    assert GQA.parameter_shapes()["h.0.attn.c_attn.weight"] == (32, 32 + 2 * 2 * 8)


def run_in_chunks(params, cfg, tokens, sizes):
    cache = KVCache(cfg, len(tokens))
    out, i = [], 0
    for size in sizes:
        out.append(forward_cached(params, cfg, tokens[i:i + size], cache))
        i += size
    assert cache.n == len(tokens)
    return np.concatenate(out)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_cached_equals_reference_for_any_chunking(model, data):
    params, cfg = model
    n = data.draw(st.integers(1, min(cfg.block_size, 96)), label="length")
    tokens = np.array(data.draw(st.lists(st.integers(0, cfg.vocab_size - 1), min_size=n, max_size=n)))
    sizes = []
    while sum(sizes) < n:
        sizes.append(data.draw(st.integers(1, n - sum(sizes)), label="chunk"))
    np.testing.assert_allclose(run_in_chunks(params, cfg, tokens, sizes), forward(params, cfg, tokens), atol=1e-5, rtol=0)


def test_float16_cache_stays_close_to_reference():
    params, cfg = perturbed_params(TARGET), TARGET
    tokens = np.arange(80) % 96
    cache = KVCache(cfg, 80, dtype=np.float16)
    logits = np.concatenate([forward_cached(params, cfg, tokens[:50], cache), forward_cached(params, cfg, tokens[50:], cache)])
    assert cache.nbytes == KVCache(cfg, 80).nbytes // 2
    assert np.abs(logits - forward(params, cfg, tokens)).max() < 1e-2


def per_head_attention(q, k, v):
    """Textbook attention, one query head at a time, head h reading K/V head h // (H / Hkv)."""
    H, T, D = q.shape
    Hkv, S, _ = k.shape
    out = np.zeros_like(q)
    for h in range(H):
        kv = h // (H // Hkv)
        for t in range(T):
            pos = S - T + t
            scores = np.array([q[h, t] @ k[kv, j] / math.sqrt(D) for j in range(pos + 1)])
            w = np.exp(scores - scores.max())
            out[h, t] = (w / w.sum()) @ v[kv, :pos + 1]
    return out


@pytest.mark.parametrize("H,Hkv,T,S", [(4, 4, 5, 5), (4, 2, 3, 7), (4, 1, 1, 6), (8, 2, 6, 6), (2, 1, 4, 9),
                                     (8, 2, 1, 40), (8, 8, 1, 40), (8, 1, 2, 12)])  # scores as k @ q^T when G*T < S
def test_grouped_attention_matches_a_per_head_reference(H, Hkv, T, S):
    rng = np.random.default_rng(H * 100 + Hkv * 10 + T)
    q, k, v = rng.standard_normal((H, T, 8)), rng.standard_normal((Hkv, S, 8)), rng.standard_normal((Hkv, S, 8))
    np.testing.assert_allclose(attention(q, k, v), per_head_attention(q, k, v), atol=1e-12)


@pytest.mark.parametrize("gqa_cfg", [GQA, MQA], ids=["gqa", "mqa"])
def test_gqa_equals_multi_head_with_duplicated_kv_heads(gqa_cfg):
    """A GQA model is exactly the multi-head model whose K/V heads are copied within each group."""
    mha_cfg = ModelConfig(gqa_cfg.n_layer, gqa_cfg.n_head, gqa_cfg.n_head, gqa_cfg.n_embd, gqa_cfg.block_size)
    gqa = perturbed_params(gqa_cfg, seed=3)
    mha = dict(gqa)
    C, D, G = gqa_cfg.n_embd, gqa_cfg.head_dim, gqa_cfg.group_size
    for i in range(gqa_cfg.n_layer):
        w = gqa[f"h.{i}.attn.c_attn.weight"]  # (C, C + 2*Hkv*D)
        k = w[:, C:C + gqa_cfg.kv_dim].reshape(C, gqa_cfg.n_kv_head, 1, D)
        v = w[:, C + gqa_cfg.kv_dim:].reshape(C, gqa_cfg.n_kv_head, 1, D)
        rep = lambda a: np.broadcast_to(a, (C, gqa_cfg.n_kv_head, G, D)).reshape(C, C)
        mha[f"h.{i}.attn.c_attn.weight"] = np.concatenate([w[:, :C], rep(k), rep(v)], axis=1)
    tokens = np.arange(40) * 7 % 96
    np.testing.assert_allclose(forward(gqa, gqa_cfg, tokens), forward(mha, mha_cfg, tokens), atol=1e-5)
    cache = KVCache(gqa_cfg)
    assert cache.k[0].shape == (gqa_cfg.n_kv_head, gqa_cfg.block_size, D)  # K/V stored once per group
    np.testing.assert_allclose(forward_cached(gqa, gqa_cfg, tokens, cache), forward(mha, mha_cfg, tokens), atol=1e-5)


def test_truncate_then_recompute_matches_reference():
    params, cfg = perturbed_params(GQA), GQA
    tokens = np.arange(30) % 96
    cache = KVCache(cfg)
    forward_cached(params, cfg, tokens[:20], cache)
    forward_cached(params, cfg, (tokens[20:25] + 1) % 96, cache)  # rejected draft tokens
    cache.truncate(20)
    np.testing.assert_allclose(forward_cached(params, cfg, tokens[20:], cache), forward(params, cfg, tokens)[20:], atol=1e-5)


def test_copied_cache_is_independent():
    params, cfg = perturbed_params(DRAFT), DRAFT
    tokens = np.arange(40) % 96
    cache = KVCache(cfg, 64)
    forward_cached(params, cfg, tokens[:30], cache)
    twin = cache.copy()
    forward_cached(params, cfg, tokens[30:], cache)
    assert twin.n == 30
    np.testing.assert_allclose(forward_cached(params, cfg, tokens[30:], twin), forward(params, cfg, tokens)[30:], atol=1e-5)
