"""Chapter 5's exercise: grouped-query attention for one decode step.

The reader writes `gqa_decode`: the new token's H query heads against the cached K/V of Hkv
heads, query head h reading K/V head h // G (G = H / Hkv) without copying K or V. The check runs
it on layer 0's real queries, keys and values of the shipped models with 2, 1 and 4 K/V heads
(grouped, multi-query, multi-head) and compares it with `lib.model.attention`; a wrong head is
matched against what each K/V head, with and without the 1/sqrt(D) scale, would have given.
"""
import numpy as np

from lib.book.exercises import Wrong, call, run, verdict
from lib.model import attention, embed, layer_norm, load, split_qkv

MODELS = ("target-kv2", "target-kv1", "target")  # 2, 1 and 4 K/V heads for 4 query heads


def gqa_decode(q, k, v):
    """Attention of one new token: q (H, 1, D) over k, v (Hkv, S, D); returns (H, 1, D)."""
    H, _, D = q.shape
    Hkv = k.shape[0]
    qg = q.reshape(Hkv, H // Hkv, D)  # (Hkv, G, D): a group's query heads as rows
    scores = qg @ k.transpose(0, 2, 1) / np.sqrt(D)  # (Hkv, G, S)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))  # (Hkv, G, S)
    weights /= weights.sum(axis=-1, keepdims=True)
    return (weights @ v).reshape(H, 1, D)  # (H, 1, D)


def layer0_qkv(params, cfg, tokens):
    """Layer 0's q of the last token (H, 1, D) and k, v of every token (Hkv, S, D)."""
    h = layer_norm(embed(params, tokens, 0), params["h.0.ln_1.weight"], params["h.0.ln_1.bias"])  # (S, C)
    q, k, v = split_qkv(h @ params["h.0.attn.c_attn.weight"], cfg)  # (H, S, D), (Hkv, S, D) x 2
    return q[:, -1:], k, v


def _diagnosis(q, k, v, got_h, h, G) -> str:
    """What query head h read: the K/V head (scaled or not) whose output its own matches, if any."""
    D = q.shape[-1]
    for j in range(k.shape[0]):
        for scale, note in ((1.0, ""), (np.sqrt(D), " without the 1/sqrt(D) scale")):
            one = attention(q[h:h + 1] * scale, k[j:j + 1], v[j:j + 1])  # (1, 1, D)
            if not np.allclose(got_h, one[0], rtol=1e-4, atol=1e-5):
                continue
            if j == h // G:
                return f"query head {h} reads the right K/V head ({j}), but{note}"
            return f"query head {h} reads K/V head {j}{note}, expected K/V head {h // G} (h // G with G = {G})"
    return (f"query head {h}'s output matches no K/V head's, scaled or not "
            f"(is the softmax taken over the positions, the last axis?)")


@verdict
def check(fn, tokens):
    """Verdict on the reader's gqa_decode against lib.model.attention on real layer-0 inputs."""
    for name in MODELS:
        params, cfg = load(name)
        q, k, v = layer0_qkv(params, cfg, tokens)
        H, Hkv, G = cfg.n_head, cfg.n_kv_head, cfg.n_head // cfg.n_kv_head
        case = f"{name} ({H} query heads, {Hkv} K/V heads, G = {G}, {len(tokens)} positions)"
        expected = attention(q, k, v)  # (H, 1, D)
        got = call(fn, q.copy(), k.copy(), v.copy(), case=case)
        if np.shape(got) != expected.shape:
            raise Wrong(f"{case}: the output must be (H, 1, D) = {expected.shape}, got shape {np.shape(got)}")
        for h in range(H):
            if not np.allclose(got[h], expected[h], rtol=1e-4, atol=1e-5):
                raise Wrong(f"{case}: {_diagnosis(q, k, v, got[h], h, G)} (largest difference from "
                            f"attention's output: {np.abs(got[h] - expected[h]).max():.3g})")


def attempt(fn, tokens) -> None:
    """Chapter 5's check cell."""
    run(check, (fn,), (gqa_decode,), tokens)
