"""The lean cached path: the same model as `model.forward_cached`, with fewer and cheaper numpy calls.

A small model on a CPU is limited by the fixed cost of each numpy call, not by arithmetic
(the same observation that motivates fused kernels and CUDA graphs in GPU servers). Done once
when the model is loaded: LayerNorm gains and biases are folded into the matrix that follows
them, the attention scale 1/sqrt(D) into the query columns, and every weight is made
contiguous. Per call: row means by matmul instead of np.mean, x*x*x instead of x**3, no mask
for a single new token, exp/sum/divide in place with `out=`. It is tested exact against the
plain reference `model.forward`.
"""
import math

import numpy as np

from .config import ModelConfig
from .kv_cache import KVCache
from .model import check_tokens, forward_cached

GELU_C = math.sqrt(2.0 / math.pi)


def _folded(g, b, w, bias=None, scale=None):
    """LayerNorm(x; g, b) @ w + bias == [xhat, 1] @ w' with w' = [g[:, None] * w ; b @ w + bias].

    The bias rides along as the last row, multiplied by a constant 1 column of the input buffer.
    """
    w2 = np.vstack([g[:, None] * w, (b @ w + (0 if bias is None else bias))[None, :]])  # (C + 1, out)
    if scale is not None:
        w2 = w2 * scale
    return w2.astype(np.float32)  # a fresh C-contiguous array (of the input's array type)


def _with_bias(w, bias, scale=1.0):
    """[u, 1] @ w' == scale * u @ w + bias."""
    return np.vstack([w * scale, bias[None, :]]).astype(np.float32)


class LeanModel:
    """Weights prepared for fast cached calls. `model(new_tokens, cache)` == forward_cached(...)."""

    def __init__(self, params, cfg: ModelConfig):
        self.cfg = cfg
        C, D = cfg.n_embd, cfg.head_dim
        scale = np.ones(C + 2 * cfg.kv_dim, np.float32)
        scale[:C] = 1.0 / math.sqrt(D)  # attention scale folded into the query columns
        self.wte, self.wpe = params["wte.weight"], params["wpe.weight"]
        self.layers = []
        for i in range(cfg.n_layer):
            p = f"h.{i}."
            self.layers.append((
                _folded(params[p + "ln_1.weight"], params[p + "ln_1.bias"], params[p + "attn.c_attn.weight"], scale=scale),
                params[p + "attn.c_proj.weight"].astype(np.float32),  # contiguous copy
                _folded(params[p + "ln_2.weight"], params[p + "ln_2.bias"], params[p + "mlp.c_fc.weight"],
                        params[p + "mlp.c_fc.bias"]),
                _with_bias(params[p + "mlp.c_proj.weight"], params[p + "mlp.c_proj.bias"], 0.5),  # GELU's 0.5
            ))
        self.head = _folded(params["ln_f.weight"], params["ln_f.bias"], params["lm_head.weight"].T)
        self.center = np.eye(C, dtype=np.float32) - 1.0 / C  # x @ center == x - mean(x)
        self.causal = np.triu(np.full((cfg.block_size, cfg.block_size), -np.inf, np.float32), 1)  # row i sees 0..i
        self.mean_vec = np.full((C, 1), 1.0 / C, np.float32)
        self.buffers = {}  # T -> (normalized input with a 1 column (T, C+1), MLP hidden with a 1 column (T, 4C+1))

    def _buffers(self, T):
        if T not in self.buffers:
            C = self.cfg.n_embd
            # ones_like keeps the weights' array type, so lib.bench.count_ops also sees the buffers
            xa, ua = np.ones_like(self.head, shape=(T, C + 1)), np.ones_like(self.head, shape=(T, 4 * C + 1))
            self.buffers[T] = (xa, xa[:, :C], ua, ua[:, :4 * C])
        return self.buffers[T]

    def _normalize(self, x, xa, xn):
        """Write (x - mean) / sqrt(var + eps) into xn, the first C columns of xa; return xa."""
        np.matmul(x, self.center, out=xn)  # (T, C) centred (xn is a strided view: dot's out= needs contiguous)
        var = (xn * xn) @ self.mean_vec  # (T, 1)
        var += 1e-5
        np.sqrt(var, out=var)
        xn /= var
        return xa

    def __call__(self, new_tokens, cache: KVCache) -> np.ndarray:
        """Append new tokens at positions cache.n.. and return their logits (T, V)."""
        cfg = self.cfg
        start = cache.n
        tokens = check_tokens(new_tokens, cfg, start)
        T = len(tokens)
        cache.check_room(T)
        S = start + T
        C, KV, D, Hkv, G = cfg.n_embd, cfg.kv_dim, cfg.head_dim, cfg.n_kv_head, cfg.group_size
        xa, xn, ua, un = self._buffers(T)
        x = self.wte[tokens] + self.wpe[start:S]  # (T, C) the residual stream
        mask = self.causal[start:S, :S] if T > 1 else None  # (T, S): -inf on future positions
        for i, (attn_w, proj_w, fc_w, mproj_w) in enumerate(self.layers):
            qkv = np.dot(self._normalize(x, xa, xn), attn_w)  # (T, C + 2*KV), bias and scale folded in
            q = qkv[:, :C].reshape(T, Hkv, G, D).transpose(1, 2, 0, 3).reshape(Hkv, G * T, D)
            cache.write(i, qkv[:, C:C + KV].reshape(T, Hkv, D).transpose(1, 0, 2),
                        qkv[:, C + KV:].reshape(T, Hkv, D).transpose(1, 0, 2))
            k_all, v_all = cache.read(i, S)  # (Hkv, S, D)
            att = q @ k_all.transpose(0, 2, 1)  # (Hkv, G*T, S)
            if mask is not None:
                att.reshape(Hkv, G, T, S)[...] += mask
            att -= att.max(axis=-1, keepdims=True)
            np.exp(att, out=att)
            att /= att.sum(axis=-1, keepdims=True)
            y = (att @ v_all).reshape(Hkv, G, T, D).transpose(2, 0, 1, 3).reshape(T, C)  # (T, C)
            x += np.dot(y, proj_w)
            np.matmul(self._normalize(x, xa, xn), fc_w, out=un)  # (T, 4C) = h
            u = un * un  # GELU: h (1 + tanh(c h (1 + 0.044715 h^2))), its 0.5 folded into mproj_w
            u *= GELU_C * 0.044715
            u += GELU_C
            u *= un
            np.tanh(u, out=u)
            u += 1.0
            un *= u
            x += np.dot(ua, mproj_w)  # (T, C), bias folded in
        cache.advance(T)
        return np.dot(self._normalize(x, xa, xn), self.head)  # (T, V)


def cached_step(model):
    """A model as (cfg, step): a (params, cfg) pair steps with the plain `forward_cached`, a
    LeanModel with itself. step(new_tokens, cache) -> logits (T, V)."""
    if isinstance(model, LeanModel):
        return model.cfg, model
    params, cfg = model
    return cfg, lambda tokens, cache: forward_cached(params, cfg, tokens, cache)
