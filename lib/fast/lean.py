"""The lean cached path: the same model as `model.forward_cached`, with fewer and cheaper numpy calls.

A small model on a CPU is limited by the fixed cost of each numpy call, not by arithmetic
(the same observation that motivates fused kernels and CUDA graphs in GPU servers). So the
work is moved from every call to load time, where it is free. Done once, when the model is
loaded (the weight processing of TransformerLens, Nanda & Bloom 2022):

- LayerNorm gains and biases are folded into the matrix that follows them, and each bias
  rides along as an extra weight row against a constant 1 column of the input buffer;
- the attention scale 1/sqrt(D) is folded into the query columns;
- every matrix that writes into the residual stream, and the embeddings, are centred (each
  row minus its mean), so the residual stream always has zero mean and LayerNorm needs no
  centring: the stream is only ever read through LayerNorm, which ignores its mean;
- GELU's constants are folded into the MLP weights: with h' = s*h and s^3 = c*0.044715,
  GELU(h) = 0.5 h (1 + tanh(c(h + 0.044715 h^3))) = (h' / 2s) (1 + tanh(h'(h'^2 + c/s))), the
  1/2s going into the MLP's output matrix: six calls instead of eight.

Per call: LayerNorm is two numpy calls for one token (a dot product, the rest in Python floats)
and four for several; there is no mask for a single new token; softmax skips the row maximum
unless a row's sum of exponentials leaves the range where that is exact (`LeanModel.__call__`);
softmax and GELU work in place with `out=` on preallocated buffers. The target's decode step
makes about 90 numpy calls against the plain path's 214 (counted by `lib.measure.counting`). It is tested exact against the plain
reference `model.forward`, for any shape (cost stand-ins of GPT-2-small size included).

Weight products: for 2-9 rows (verifying draft tokens) a general product is slow (see
`lib.fast.kernels`), so when the model is built each candidate for 1..9 rows (numpy's product, a
batch of one-row products, the small-rows kernel of `lib.fast.kernels`) is timed on the model's own
matrices, and numpy's product is used for that T unless another is clearly faster
(`products="auto"`, `lib.fast.kernels.fastest_products`). The choice is measured, not assumed,
because it differs between a model whose weights sit in cache and one that streams them from
memory, and between machines.
`products="numpy"` keeps numpy's products only (the weights in numpy's usual layout).
"""
import math
from types import SimpleNamespace

import numpy as np

from lib.cache.kv_cache import KVCache
from lib.checks import check_option, check_params
from lib.config import ModelConfig
from lib.fast.kernels import MAX_ROWS, candidates, fastest_products
from lib.model import GELU_C, LN_EPS
from lib.timing import single_thread

GELU_S = (GELU_C * 0.044715) ** (1 / 3)  # h' = GELU_S * h makes the cubic coefficient 1
SUM_MIN = 2.0 ** -100  # a row sum below this could lose precision to underflowed exponentials
BATCHED_ROWS = 5  # with products="numpy", up to this many rows go through as one-row products
TIMED_BYTES = 32 * 2**20  # products="auto" times a pass over at most this many bytes of weights


def _stacked(top, row, order):
    """[top ; row] as one float32 array in memory order `order` ("C" or "F"), of top's array type."""
    out = np.empty_like(top, np.float32, order=order, shape=(top.shape[0] + 1, top.shape[1]))  # (K + 1, N)
    out[:-1], out[-1] = top, row
    return out


def _folded(g, b, w, bias=None, scale=None, order="C"):
    """LayerNorm(x; g, b) @ w + bias == [xhat, 1] @ w' with w' = [g[:, None] * w ; b @ w + bias]."""
    w2 = _stacked(g[:, None] * w, b @ w + (0 if bias is None else bias), order)  # (C + 1, out)
    if scale is not None:
        w2 *= np.asarray(scale, np.float32)
    return w2


def _centred(w, order="C"):
    """w with each row's mean removed: every output of u @ w then has zero mean over its row."""
    return (w - w.mean(axis=-1, keepdims=True)).astype(np.float32, order=order, copy=False)


class LeanModel:
    """Weights prepared for fast cached calls. `model(new_tokens, cache)` == forward_cached(...)."""

    def __init__(self, params, cfg: ModelConfig, products="auto"):
        check_option(products, "products", ("auto", "numpy", "kernel"))
        check_params(params, cfg)
        self.cfg = cfg
        order = "C" if products == "numpy" else "F"  # "F": each output column's weights contiguous, for the kernel
        C, D = cfg.n_embd, cfg.head_dim
        scale = np.ones(C + 2 * cfg.kv_dim, np.float32)
        scale[:C] = 1.0 / math.sqrt(D)  # attention scale folded into the query columns
        self.wte, self.wpe = _centred(params["wte.weight"]), _centred(params["wpe.weight"])
        self.layers = []
        for i in range(cfg.n_layer):
            p = f"h.{i}."
            mproj = _stacked(params[p + "mlp.c_proj.weight"] / (2 * GELU_S), params[p + "mlp.c_proj.bias"], order)
            self.layers.append((
                _folded(params[p + "ln_1.weight"], params[p + "ln_1.bias"], params[p + "attn.c_attn.weight"],
                        scale=scale, order=order),  # (C + 1, C + 2*KV)
                _centred(params[p + "attn.c_proj.weight"], order),  # (C, C)
                _folded(params[p + "ln_2.weight"], params[p + "ln_2.bias"], params[p + "mlp.c_fc.weight"],
                        params[p + "mlp.c_fc.bias"], scale=GELU_S, order=order),  # (C + 1, 4C), gives h' = s*h
                _centred(mproj, order),  # (4C + 1, C): [2s * gelu(h), 1] @ this == gelu(h) @ c_proj + bias, centred
            ))
        self.head = _folded(params["ln_f.weight"], params["ln_f.bias"], params["lm_head.weight"].T, order=order)
        self.products, self.product_times = self._choose_products(products)
        self.product_fns = {T: candidates(T)[name] for T, name in self.products.items()}  # T -> a @ w
        self.mean_eps = np.append(np.full(C, 1.0 / C), LN_EPS).astype(np.float32)[:, None]  # (C + 1, 1)
        self.causal = np.triu(np.full((cfg.block_size, cfg.block_size), -np.inf, np.float32), 1)  # row i sees 0..i
        self.hidden = self.layers[0][2].shape[1]  # the MLP's width (4C in GPT-2)
        self.store = _Buffers(self.head, 1, cfg, self.hidden)  # grows to the most rows seen; memory stays bounded
        self.buffers = {}  # T -> views of the first T rows of self.store

    def _choose_products(self, products):
        """{T: name of the product used for T rows} for T = 1..MAX_ROWS, and the products' measured
        times ({} unless measured). "numpy": numpy's layout and products, as before the kernel;
        "kernel": the kernel for 2..MAX_ROWS rows, BLAS's gemv for one."""
        if products == "numpy":
            return {T: "numpy" if T == 1 or T > BATCHED_ROWS else "one-row batch" for T in range(1, MAX_ROWS + 1)}, {}
        if products == "kernel":
            return {T: "numpy" if T == 1 else "kernel" for T in range(1, MAX_ROWS + 1)}, {}
        matrices, size = [self.head.view(np.ndarray)], self.head.nbytes
        for layer in self.layers:  # the first layers, enough to stream from memory as a step does
            if size >= TIMED_BYTES:
                break
            matrices += [w.view(np.ndarray) for w in layer]
            size += sum(w.nbytes for w in layer)
        with single_thread():
            return fastest_products(matrices)

    def _buffers(self, T):
        if T not in self.buffers:
            if T > self.store.rows:
                self.store, self.buffers = _Buffers(self.head, max(T, 2 * self.store.rows), self.cfg, self.hidden), {}
            self.buffers[T] = self.store.first(T)
        return self.buffers[T]

    def _product(self, T):
        """The a @ w used for T rows: the chosen product up to MAX_ROWS, numpy's general product
        beyond (np.matmul: np.dot's out= must be contiguous, and the buffers' column views are not)."""
        return self.product_fns.get(T, np.matmul)

    def _normalize(self, x, b):
        """Write x / sqrt(mean(x^2) + eps) into b.xn, the first C columns of
        b.xa; return b.xa. x has zero mean (see the module docstring), so this
        is LayerNorm without gain and bias."""
        if len(x) == 1:  # one token: scalar arithmetic is cheaper in Python
            rms = math.sqrt(float(np.vdot(x, x)) / x.shape[1] + LN_EPS)
            np.multiply(x, 1.0 / rms, out=b.xn)
            return b.xa
        return self._normalize_rows(x, b)

    def _normalize_rows(self, x, b):
        """_normalize for several tokens, in four numpy calls (one token takes two: the fast path)."""
        np.multiply(x, x, out=b.sqn)  # (T, C) beside a 1 column
        np.dot(b.sq, self.mean_eps, out=b.var)  # (T, 1) mean of squares + eps
        np.sqrt(b.var, out=b.var)
        np.divide(x, b.var, out=b.xn)
        return b.xa

    def __call__(self, new_tokens, cache: KVCache) -> np.ndarray:
        """Append new tokens at positions cache.n.. and return their logits (T, V).

        Softmax first runs without subtracting the row maximum (two calls fewer per layer). Every
        row's sum of exponentials is kept, and the fast result is used only if all of them lie in
        [SUM_MIN, float32 max]: then no exponential overflowed (each is at most its row's finite
        sum) and none that underflowed matters (at most 512 * 2^-149 against a sum of at least
        2^-100), so each weight is exp(s_j) / sum, the stable softmax's value, to float32 rounding.
        Otherwise (one score past ~88, a dozen near 85 whose sum overflows, or every score of a row
        far below 0) the step is rerun with the maximum subtracted. The cache advances only after
        that, so both runs write the same positions. The tokens are checked ids (as `feed` passes
        them) and the cache, made for this model, has room for them."""
        start, tokens = cache.n, new_tokens
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):  # checked just below
            logits, sums = self._forward(tokens, start, cache, stable=False)
            exact = SUM_MIN <= float(sums.min()) and math.isfinite(float(sums.max()))  # NaN fails both
        if not exact:
            logits, _ = self._forward(tokens, start, cache, stable=True)  # rewrites the same positions
        cache.advance(len(tokens))
        return logits

    def _forward(self, tokens, start, cache, stable):
        cfg, T = self.cfg, len(tokens)
        S = start + T
        C, KV, D, Hkv, G = cfg.n_embd, cfg.kv_dim, cfg.head_dim, cfg.n_kv_head, cfg.group_size
        b, mm = self._buffers(T), self._product(T)
        x = self.wte[tokens] + self.wpe[start:S]  # (T, C) the residual stream, zero mean per row
        mask = self.causal[start:S, :S] if T > 1 else None  # (T, S): -inf on future positions
        for i, (attn_w, proj_w, fc_w, mproj_w) in enumerate(self.layers):
            qkv = mm(self._normalize(x, b), attn_w)  # (T, C + 2*KV), bias and scale folded in
            q, k, v = _heads(qkv, T, C, KV, Hkv, G, D)
            cache.write(i, k, v)
            k_all, v_all = cache.read(i, S)  # (Hkv, S, D)
            att = np.matmul(q, k_all.transpose(0, 2, 1))  # (Hkv, G*T, S)
            if mask is not None:
                att.reshape(Hkv, G, T, S)[...] += mask
            if stable:
                att -= att.max(axis=-1, keepdims=True)
            np.exp(att, out=att)
            sums = att.sum(axis=-1, keepdims=True, out=b.sums[i])  # (Hkv, G*T, 1), checked by __call__
            att /= sums
            y = np.matmul(att, v_all)  # (Hkv, G*T, D)
            y = y.reshape(1, C) if T == 1 else y.reshape(Hkv, G, T, D).transpose(2, 0, 1, 3).reshape(T, C)
            x += mm(y, proj_w)
            mm(self._normalize(x, b), fc_w, out=b.hn)  # (T, 4C) h' = s*h
            np.multiply(b.hn, b.hn, out=b.u)  # 2s * GELU(h) = h' (1 + tanh(h' (h'^2 + c/s)))
            b.u += GELU_C / GELU_S
            b.u *= b.hn
            np.tanh(b.u, out=b.u)
            b.u += 1.0
            b.hn *= b.u
            x += mm(b.ha, mproj_w)  # (T, C), bias folded in
        return mm(self._normalize(x, b), self.head), b.sums  # (T, V), (L, Hkv, G*T, 1)


def _heads(qkv, T, C, KV, Hkv, G, D):
    """Split (T, C + 2*KV) into q (Hkv, G*T, D), grouped by the K/V head it reads, and k, v
    (Hkv, T, D). Views only; a single token needs fewer of them."""
    if T == 1:
        return qkv[0, :C].reshape(Hkv, G, D), qkv[0, C:C + KV].reshape(Hkv, 1, D), qkv[0, C + KV:].reshape(Hkv, 1, D)
    return (qkv[:, :C].reshape(T, Hkv, G, D).transpose(1, 2, 0, 3).reshape(Hkv, G * T, D),
            qkv[:, C:C + KV].reshape(T, Hkv, D).transpose(1, 0, 2), qkv[:, C + KV:].reshape(T, Hkv, D).transpose(1, 0, 2))


class _Buffers:
    """Preallocated arrays for up to `rows` new tokens; `like` keeps the weights' array type, so
    lib.measure.counting.count_ops also sees calls on the buffers."""

    def __init__(self, like, rows, cfg: ModelConfig, hidden: int):
        self.rows, self.C, self.G, self.hidden = rows, cfg.n_embd, cfg.group_size, hidden
        C = cfg.n_embd
        self.xa = np.ones_like(like, shape=(rows, C + 1), order="C")  # normalized input beside a 1 column
        self.sq = np.ones_like(like, shape=(rows, C + 1), order="C")  # squares beside a 1 column (picks up eps)
        self.var = np.empty_like(like, shape=(rows, 1), order="C")
        self.ha = np.ones_like(like, shape=(rows, hidden + 1), order="C")  # MLP activation beside a 1 column
        self.u = np.empty_like(like, shape=(rows, hidden), order="C")
        self.sums = np.empty_like(like, shape=(cfg.n_layer, cfg.n_kv_head, cfg.group_size * rows, 1), order="C")

    def first(self, T) -> SimpleNamespace:
        """Views of the first T rows, and of their first C (or hidden) columns: xn, sqn, hn; and of
        every layer's softmax row sums: sums (L, Hkv, G*T, 1)."""
        C, xa, sq, ha = self.C, self.xa[:T], self.sq[:T], self.ha[:T]
        return SimpleNamespace(xa=xa, xn=xa[:, :C], sq=sq, sqn=sq[:, :C], var=self.var[:T],
                               ha=ha, hn=ha[:, :self.hidden], u=self.u[:T], sums=self.sums[:, :, :self.G * T])
