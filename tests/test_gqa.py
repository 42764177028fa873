import numpy as np
import pytest
from conftest import perturbed_params

from lib.config import TARGET
from lib.gqa import mean_pool_kv
from lib.model import forward


def test_pooling_identical_heads_changes_nothing():
    params = perturbed_params(TARGET, seed=7)
    C, D = TARGET.n_embd, TARGET.head_dim
    for i in range(TARGET.n_layer):  # make K/V heads (0, 1) and (2, 3) equal: a GQA model in disguise
        w = params[f"h.{i}.attn.c_attn.weight"]
        for start in (C, 2 * C):
            heads = w[:, start:start + C].reshape(C, 2, 2, D)
            heads[:, :, 1] = heads[:, :, 0]
    pooled, cfg = mean_pool_kv(params, TARGET, 2)
    assert cfg.n_kv_head == 2 and pooled["h.0.attn.c_attn.weight"].shape == (C, C + 2 * 2 * D)
    tokens = np.arange(50) * 3 % 96
    np.testing.assert_allclose(forward(pooled, cfg, tokens), forward(params, TARGET, tokens), atol=1e-5)


def test_pooled_heads_are_group_means():
    params = perturbed_params(TARGET, seed=8)
    pooled, cfg = mean_pool_kv(params, TARGET, 1)
    C, D = TARGET.n_embd, TARGET.head_dim
    w, p = params["h.1.attn.c_attn.weight"], pooled["h.1.attn.c_attn.weight"]
    np.testing.assert_allclose(p[:, C:C + D], w[:, C:2 * C].reshape(C, 4, D).mean(axis=1), atol=1e-7)
    np.testing.assert_array_equal(p[:, :C], w[:, :C])  # queries untouched


def test_bad_head_counts():
    params = perturbed_params(TARGET)
    with pytest.raises(ValueError, match="n_head=4 is not divisible by n_kv_head=3"):
        mean_pool_kv(params, TARGET, 3)
