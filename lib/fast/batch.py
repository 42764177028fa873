"""Batched decoding: one step for many sequences, each at its own position with its own cache.

A decode step of one sequence reads every weight to produce one token. Stacking the new rows
of B sequences makes each weight product serve all of them at once: the iteration-level
batching of Orca (Yu et al. 2022), whose "selective batching" runs the products on the stacked
rows and attention sequence by sequence, since each sequence attends to its own keys. Rows
may be ragged: one new token for a decoding sequence, a whole prompt for one being prefilled.

Attention: paged sequences of one pool are written through their block tables in one scatter
per layer and read by one compiled kernel that walks each row's block table, as PagedAttention
does (Kwon et al. 2023, vLLM): no gather, no padding. Any other caches go through their own
`write` and `read`, padded to the longest, one masked product for all one-token rows and one
per prompt. Both the plain weights and the lean path's folded weights (`lib.fast.lean.LeanModel`)
run here; every sequence's logits equal decoding it alone (tests/test_batch.py).
"""
import math

import numpy as np

from lib.cache.paged import PagedSequence, check_feed, reserved
from lib.checks import check_cache
from lib.fast.lean import GELU_S, LeanModel
from lib.fast.paged_kernel import attend_paged
from lib.model import GELU_C, LN_EPS, Model, head, layer_norm, mlp


class _Plain:
    """The GPT-2 parameters as they are, through lib.model's own blocks."""

    def __init__(self, params, cfg):
        self.p, self.cfg, self.q_scale = params, cfg, 1.0 / math.sqrt(cfg.head_dim)

    def embed(self, tokens, positions):
        return self.p["wte.weight"][tokens] + self.p["wpe.weight"][positions]  # (R, C)

    def qkv(self, x, i):
        h = layer_norm(x, self.p[f"h.{i}.ln_1.weight"], self.p[f"h.{i}.ln_1.bias"])  # (R, C)
        return h @ self.p[f"h.{i}.attn.c_attn.weight"]  # (R, C + 2*KV)

    def proj(self, y, i):
        return y @ self.p[f"h.{i}.attn.c_proj.weight"]  # (R, C)

    def mlp(self, x, i):
        return mlp(x, self.p, i)  # (R, C)

    def head(self, x):
        return head(self.p, x)  # (R, V)


class _Lean:
    """A LeanModel's folded weights: inputs are normalized rows beside a 1 column (see lib.fast.lean).
    Up to lib.fast.kernels.MAX_ROWS rows use the product the LeanModel chose by timing its own weights (BLAS's
    general product packs the weights, costly for a few rows); more rows use numpy's product on
    C-ordered copies, the layout it runs fastest."""

    def __init__(self, model: LeanModel):
        self.cfg, self.q_scale = model.cfg, 1.0  # 1/sqrt(D) is folded into the queries
        self.few = model.product_fns  # T -> the product the LeanModel chose, up to MAX_ROWS rows
        c_order = lambda w: np.ascontiguousarray(w.view(np.ndarray))
        self.wte, self.wpe = c_order(model.wte), c_order(model.wpe)
        self.stored = [*model.layers, (model.head,)]  # as the LeanModel keeps them
        self.c_ordered = [tuple(c_order(w) for w in ws) for ws in self.stored]

    def _product(self, x, i, j):
        """x (R, K) @ matrix j of layer i (i = n_layer: the output head)."""
        few = self.few.get(len(x))
        return few(x, self.stored[i][j]) if few else x @ self.c_ordered[i][j]

    def _normalized(self, x):
        xa = np.ones((len(x), x.shape[1] + 1), np.float32)  # (R, C + 1)
        ms = np.einsum("rc,rc->r", x, x)[:, None] / x.shape[1] + LN_EPS  # (R, 1); x has zero mean
        np.divide(x, np.sqrt(ms), out=xa[:, :-1])
        return xa

    def embed(self, tokens, positions):
        return self.wte[tokens] + self.wpe[positions]  # (R, C), zero mean per row

    def qkv(self, x, i):
        return self._product(self._normalized(x), i, 0)  # (R, C + 2*KV)

    def proj(self, y, i):
        return self._product(np.ascontiguousarray(y), i, 1)  # (R, C)

    def mlp(self, x, i):
        h = self._product(self._normalized(x), i, 2)  # (R, 4C): h' = s * h
        u = h * h  # 2s * GELU(h) = h' (1 + tanh(h' (h'^2 + c/s)))
        u += GELU_C / GELU_S
        u *= h
        np.tanh(u, out=u)
        u += 1.0
        ha = np.ones((len(x), h.shape[1] + 1), np.float32)  # (R, 4C + 1): beside a 1 column
        np.multiply(h, u, out=ha[:, :-1])
        return self._product(ha, i, 3)  # (R, C), bias folded in

    def head(self, x):
        return self._product(self._normalized(x), self.cfg.n_layer, 0)  # (R, V)


def masked_attention(q, k, v, pos, scale):
    """Attention of queries at positions `pos` over keys 0..S-1, a key visible iff its index <= pos.

    Head-major, so one batched product covers every (head, sequence) pair: q (Hkv, B, G, T, D);
    k, v (Hkv, B, S, D); pos (B, T). Padding past a sequence's end is masked like the future.
    Returns (Hkv, B, G, T, D)."""
    Hkv, B, G, T, D = q.shape
    att = np.matmul(q.reshape(Hkv, B, G * T, D), k.transpose(0, 1, 3, 2))  # (Hkv, B, G*T, S)
    if scale != 1.0:
        att *= scale
    hidden = np.arange(k.shape[2])[None, None, :] > pos[:, :, None]  # (B, T, S)
    if hidden.any():
        att.reshape(Hkv, B, G, T, -1)[...] += np.where(hidden, np.float32(-np.inf), np.float32(0))[:, None]
    att -= att.max(axis=-1, keepdims=True)
    np.exp(att, out=att)
    att /= att.sum(axis=-1, keepdims=True)
    return np.matmul(att, v).reshape(Hkv, B, G, T, D)


class _Rows:
    """Where each sequence's new rows sit in the stacked batch, and how its K/V is stored."""

    def __init__(self, caches, lengths, cfg):
        self.caches, self.cfg = caches, cfg
        self.start = np.array([c.n for c in caches])  # (B,) first new position of each sequence
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])  # (B + 1,) row ranges
        self.seq = seq = np.repeat(np.arange(len(caches)), lengths)  # (R,) which sequence each row is
        self.pos = self.start[seq] + np.arange(self.offsets[-1]) - self.offsets[seq]  # (R,) positions
        self.single = [b for b, t in enumerate(lengths) if t == 1]  # decoding rows: attended together
        self.multi = [b for b, t in enumerate(lengths) if t > 1]  # prompts: each attended alone
        pools = {id(c.pool) for c in caches if isinstance(c, PagedSequence)}
        self.paged = len(pools) == 1 and all(isinstance(c, PagedSequence) for c in caches)
        if self.paged:  # every row's (block, offset) slot, and the block tables side by side
            self.pool, bs = caches[0].pool, caches[0].pool.manager.block_size
            width = -(-int(self.pos.max() + 1) // bs)
            self.tables = np.zeros((len(caches), width), np.int64)  # (B, blocks), unused entries 0
            for b, c in enumerate(caches):
                used = c.block_table[:width]
                self.tables[b, :len(used)] = used
            self.slots = self.tables[seq, self.pos // bs], self.pos % bs  # (R,), (R,)

    def write(self, i, k, v):
        """K, V of every new row, (R, Hkv, D), into the caches."""
        if self.paged:
            self.pool.store(i, *self.slots, k, v)
            return
        for b, c in enumerate(self.caches):
            rows = slice(self.offsets[b], self.offsets[b + 1])
            c.write(i, k[rows].transpose(1, 0, 2), v[rows].transpose(1, 0, 2))  # (Hkv, T, D)

    def read(self, i, seqs, space):
        """K, V of the listed (contiguous) caches up to their last new position, padded, in views
        of the work space: (Hkv, b, S, D) each. Padding holds stale but finite values, masked later."""
        ends = self.start[seqs] + self.offsets[np.add(seqs, 1)] - self.offsets[seqs]
        S = int(ends.max())
        Hkv, D, b = self.cfg.n_kv_head, self.cfg.head_dim, len(seqs)
        k, v = space.kv((Hkv, b, S, D))
        for j, (s, e) in enumerate(zip(seqs, ends)):
            k[:, j, :e], v[:, j, :e] = self.caches[s].read(i, int(e))  # (Hkv, e, D) each
        return k, v


class _Space:
    """Work space for the padded K and V, grown to the largest batch seen and then reused: a
    fresh array of a megabyte per layer would cost its page faults on every step."""

    def __init__(self):
        self.k = self.v = np.zeros(0, np.float32)

    def kv(self, shape):
        size = int(np.prod(shape))
        if size > self.k.size:  # zeros: padding must never hold NaN
            self.k, self.v = np.zeros(2 * size, np.float32), np.zeros(2 * size, np.float32)
        return self.k[:size].reshape(shape), self.v[:size].reshape(shape)


def _attend(rows: _Rows, i, q, k, v, scale, space):
    """Write the new K/V of layer i, then attention for every row: q (R, H, D) -> (R, C)."""
    cfg = rows.cfg
    Hkv, G, D = cfg.n_kv_head, cfg.group_size, cfg.head_dim
    rows.write(i, k, v)
    if rows.paged:
        return attend_paged(q, rows.pool, i, rows.tables, rows.seq, rows.pos, scale).reshape(len(q), cfg.n_embd)
    y = np.empty((len(q), cfg.n_embd), np.float32)  # (R, C)
    groups = ([rows.single] if rows.single else []) + [[b] for b in rows.multi]
    for seqs in groups:
        at = np.concatenate([np.arange(rows.offsets[b], rows.offsets[b + 1]) for b in seqs])  # their rows
        T = len(at) // len(seqs)
        at = slice(None) if len(at) == len(q) else at  # every row: no copies
        qs = q[at].reshape(len(seqs), T, Hkv, G, D).transpose(2, 0, 3, 1, 4)  # (Hkv, b, G, T, D)
        pos = rows.start[seqs][:, None] + np.arange(T)  # (b, T)
        out = masked_attention(qs, *rows.read(i, seqs, space), pos, scale)  # (Hkv, b, G, T, D)
        y[at] = out.transpose(1, 3, 0, 2, 4).reshape(-1, cfg.n_embd)
    return y


class BatchedModel:
    """A model that steps many sequences at once: `feed` on paged sequences (checked), `step` on
    any caches (KVCache) that have room. model: a LeanModel, or a lib.model.Model for the plain path."""

    def __init__(self, model):
        if not isinstance(model, (LeanModel, Model)):
            raise TypeError(f"model must be a lib.model.Model or a lib.fast.lean.LeanModel, got {type(model).__name__}")
        self.w = _Lean(model) if isinstance(model, LeanModel) else _Plain(model.params, model.cfg)
        self.cfg, self.space = self.w.cfg, _Space()

    def step(self, new_tokens, caches):
        """Append new_tokens[b] to caches[b] for every b in one pass (distinct caches of this model,
        with room); returns each one's logits (T_b, V)."""
        w, cfg = self.w, self.cfg
        lengths = [len(t) for t in new_tokens]
        rows = _Rows(caches, lengths, cfg)
        C, KV, H, Hkv, D = cfg.n_embd, cfg.kv_dim, cfg.n_head, cfg.n_kv_head, cfg.head_dim
        x = w.embed(np.concatenate(new_tokens), rows.pos)  # (R, C)
        for i in range(cfg.n_layer):
            qkv = w.qkv(x, i)  # (R, C + 2*KV)
            q, k, v = (qkv[:, :C].reshape(-1, H, D), qkv[:, C:C + KV].reshape(-1, Hkv, D),
                       qkv[:, C + KV:].reshape(-1, Hkv, D))  # (R, H, D), (R, Hkv, D), (R, Hkv, D)
            x = x + w.proj(_attend(rows, i, q, k, v, w.q_scale, self.space), i)  # (R, C)
            x = x + w.mlp(x, i)  # (R, C)
        for c, t in zip(caches, lengths):
            c.advance(t)
        logits = w.head(x)  # (R, V)
        return [logits[a:b] for a, b in zip(rows.offsets[:-1], rows.offsets[1:])]

    def feed(self, seqs, new_tokens):
        """Advance paged sequences by one batched step: every sequence's tokens and blocks are
        checked, then each one's slots are reserved and `step` runs once for all of them."""
        new_tokens = check_feed(seqs, new_tokens)
        for seq in seqs:
            check_cache(seq, self.cfg)
        with reserved(seqs, new_tokens):
            return self.step(new_tokens, seqs)
