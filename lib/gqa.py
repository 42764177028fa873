"""Grouped-query attention from a multi-head checkpoint: mean-pool the K and V heads of each group.

Ainslie et al. 2023 ("GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
Checkpoints") convert a model by averaging the key and value projection heads within each group,
then "uptrain" it for a small fraction (about 5%) of the original steps. Query head h reads K/V
head h // (n_head / n_kv_head), so group j averages the old K/V heads of query heads j*G..(j+1)*G-1.
"""
from dataclasses import replace

import numpy as np

from lib.config import ModelConfig


def mean_pool_kv(params: dict, cfg: ModelConfig, n_kv_head: int):
    """Return (params, cfg) with n_kv_head K/V heads, each the mean of the group it replaces."""
    new_cfg = replace(cfg, n_kv_head=n_kv_head)
    C, D, ratio = cfg.n_embd, cfg.head_dim, cfg.n_kv_head // n_kv_head
    out = dict(params)
    for i in range(cfg.n_layer):
        w = params[f"h.{i}.attn.c_attn.weight"]  # (C, C + 2*Hkv*D)
        pooled = [w[:, start:start + cfg.kv_dim].reshape(C, n_kv_head, ratio, D).mean(axis=2).reshape(C, n_kv_head * D)
                  for start in (C, C + cfg.kv_dim)]  # K, then V: (C, n_kv_head*D) each
        out[f"h.{i}.attn.c_attn.weight"] = np.concatenate([w[:, :C], *pooled], axis=1).astype(w.dtype)
    return out, new_cfg
