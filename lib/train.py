"""Training the models: a hand-written backward pass and AdamW, in numpy.

The forward pass here is the batched twin of `model.forward` that keeps what the backward
pass needs; a test checks that both give the same loss, and every gradient is checked
against finite differences in float64. AdamW (Loshchilov & Hutter 2019) with linear
warm-up and cosine decay; batches are random windows of the standard-library corpus.

    python -m lib.train target        # the shipped run (see lib/weights/target.json)
    python -m lib.train draft
    python -m lib.train target-kv2    # the target pooled to 2 K/V heads, then uptrained (chapter 5)
    python -m lib.train target-kv1
    python -m lib.train target-kv4    # the control: the target's 4 K/V heads kept, trained on the same way
"""
import argparse
import math
import time

import numpy as np
from tqdm.auto import tqdm

from lib.config import DRAFT, TARGET, ModelConfig
from lib.corpus import load_corpus
from lib.gqa import mean_pool_kv
from lib.model import GELU_C, LN_EPS, init_params, load, save

PRESETS = {"target": TARGET, "draft": DRAFT}
UPTRAINED = {"target-kv2": 2, "target-kv1": 1, "target-kv4": 4}  # name -> K/V heads from the shipped target's 4
DEFAULTS = {"target": (4500, 2.5e-3, 200, 250), "draft": (3000, 4e-3, 200, 250),  # steps, peak lr, warm-up,
            **{name: (225, 1e-3, 20, 25) for name in UPTRAINED}}  # evaluate every n steps


# ----------------------------------------------------------------------------- layer pairs

def ln_fwd(x, g, b, eps=LN_EPS):
    mu = x.mean(axis=-1, keepdims=True)  # (B, T, 1)
    rstd = 1.0 / np.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps)  # (B, T, 1)
    xhat = (x - mu) * rstd  # (B, T, C)
    return xhat * g + b, (xhat, rstd, g)


def ln_bwd(dy, saved):
    xhat, rstd, g = saved
    dxhat = dy * g  # (B, T, C)
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    return dx, (dy * xhat).sum(axis=(0, 1)), dy.sum(axis=(0, 1))


def gelu_fwd(x):
    t = np.tanh(GELU_C * (x + 0.044715 * x * x * x))  # (B, T, 4C)
    return 0.5 * x * (1.0 + t), (x, t)


def gelu_bwd(dy, saved):
    x, t = saved
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * x * x))


def attn_fwd(qkv, cfg: ModelConfig):
    """Causal grouped-query attention over a batch. qkv: (B, T, C + 2*KV) -> y (B, T, C)."""
    B, T, _ = qkv.shape
    C, KV, D, Hkv, G = cfg.n_embd, cfg.kv_dim, cfg.head_dim, cfg.n_kv_head, cfg.group_size
    q = qkv[..., :C].reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    k = qkv[..., C:C + KV].reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)  # (B, Hkv, T, D)
    v = qkv[..., C + KV:].reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)  # (B, Hkv, T, D)
    scale = 1.0 / math.sqrt(D)
    future = np.triu(np.full((T, T), -np.inf, qkv.dtype), 1)  # (T, T)
    att = (q @ k.transpose(0, 1, 3, 2) * scale).reshape(B, Hkv, G, T, T) + future
    att = np.exp(att - att.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    att = att.reshape(B, Hkv, G * T, T)  # (B, Hkv, G*T, T) probabilities
    y = att @ v  # (B, Hkv, G*T, D)
    y = y.reshape(B, Hkv, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, C)
    return y, (q, k, v, att, scale)


def attn_bwd(dy, saved, cfg: ModelConfig):
    q, k, v, att, scale = saved
    B, T, C = dy.shape
    Hkv, G, D = cfg.n_kv_head, cfg.group_size, cfg.head_dim
    dy = dy.reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    datt = dy @ v.transpose(0, 1, 3, 2)  # (B, Hkv, G*T, T)
    dv = att.transpose(0, 1, 3, 2) @ dy  # (B, Hkv, T, D)
    ds = att * (datt - (datt * att).sum(-1, keepdims=True)) * scale  # (B, Hkv, G*T, T)
    dq = ds @ k  # (B, Hkv, G*T, D)
    dk = ds.transpose(0, 1, 3, 2) @ q  # (B, Hkv, T, D)
    dq = dq.reshape(B, Hkv, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, C)
    dk = dk.transpose(0, 2, 1, 3).reshape(B, T, cfg.kv_dim)
    dv = dv.transpose(0, 2, 1, 3).reshape(B, T, cfg.kv_dim)
    return np.concatenate([dq, dk, dv], axis=-1)  # (B, T, C + 2*KV)


def matmul_bwd(dy, x, w):
    """y = x @ w over (B, T, .): returns dx and dw."""
    return dy @ w.T, x.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])


# ----------------------------------------------------------------------------- loss and gradients

def loss_and_grads(params, cfg: ModelConfig, idx, targets, need_grads=True):
    """Mean cross-entropy (nats per token) of targets given idx, both (B, T); grads keyed like params."""
    B, T = idx.shape
    x = params["wte.weight"][idx] + params["wpe.weight"][:T]  # (B, T, C)
    saved = []
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        h1, ln1 = ln_fwd(x, params[p + "ln_1.weight"], params[p + "ln_1.bias"])
        y, att = attn_fwd(h1 @ params[p + "attn.c_attn.weight"], cfg)  # (B, T, C)
        x = x + y @ params[p + "attn.c_proj.weight"]
        h2, ln2 = ln_fwd(x, params[p + "ln_2.weight"], params[p + "ln_2.bias"])
        f, gl = gelu_fwd(h2 @ params[p + "mlp.c_fc.weight"] + params[p + "mlp.c_fc.bias"])  # (B, T, 4C)
        x = x + f @ params[p + "mlp.c_proj.weight"] + params[p + "mlp.c_proj.bias"]
        saved.append((h1, ln1, y, att, h2, ln2, f, gl))
    hf, lnf = ln_fwd(x, params["ln_f.weight"], params["ln_f.bias"])
    logits = hf @ params["lm_head.weight"].T  # (B, T, V)
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))  # (B, T, V)
    loss = -np.take_along_axis(logp, targets[..., None], -1).mean()
    if not need_grads:
        return float(loss), None

    grads = {}
    dlogits = np.exp(logp)  # (B, T, V) softmax
    np.put_along_axis(dlogits, targets[..., None], np.take_along_axis(dlogits, targets[..., None], -1) - 1, -1)
    dlogits /= B * T
    grads["lm_head.weight"] = dlogits.reshape(-1, cfg.vocab_size).T @ hf.reshape(-1, cfg.n_embd)  # (V, C)
    dx, grads["ln_f.weight"], grads["ln_f.bias"] = ln_bwd(dlogits @ params["lm_head.weight"], lnf)
    for i in reversed(range(cfg.n_layer)):
        p = f"h.{i}."
        h1, ln1, y, att, h2, ln2, f, gl = saved[i]
        grads[p + "mlp.c_proj.bias"] = dx.sum(axis=(0, 1))
        df, grads[p + "mlp.c_proj.weight"] = matmul_bwd(dx, f, params[p + "mlp.c_proj.weight"])
        df = gelu_bwd(df, gl)  # (B, T, 4C)
        grads[p + "mlp.c_fc.bias"] = df.sum(axis=(0, 1))
        dh2, grads[p + "mlp.c_fc.weight"] = matmul_bwd(df, h2, params[p + "mlp.c_fc.weight"])
        dxl, grads[p + "ln_2.weight"], grads[p + "ln_2.bias"] = ln_bwd(dh2, ln2)
        dx = dx + dxl
        dy, grads[p + "attn.c_proj.weight"] = matmul_bwd(dx, y, params[p + "attn.c_proj.weight"])
        dqkv = attn_bwd(dy, att, cfg)
        dh1, grads[p + "attn.c_attn.weight"] = matmul_bwd(dqkv, h1, params[p + "attn.c_attn.weight"])
        dxl, grads[p + "ln_1.weight"], grads[p + "ln_1.bias"] = ln_bwd(dh1, ln1)
        dx = dx + dxl
    grads["wpe.weight"] = np.zeros_like(params["wpe.weight"])
    grads["wpe.weight"][:T] = dx.sum(axis=0)
    grads["wte.weight"] = np.zeros_like(params["wte.weight"])
    np.add.at(grads["wte.weight"], idx.reshape(-1), dx.reshape(-1, cfg.n_embd))
    return float(loss), grads


# ----------------------------------------------------------------------------- optimisation

def lr_at(step, steps, lr, warmup, min_ratio=0.05):
    """Linear warm-up, then cosine decay to min_ratio * lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


class AdamW:
    def __init__(self, params, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, clip=1.0):
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.betas, self.eps, self.wd, self.clip, self.t = betas, eps, weight_decay, clip, 0

    def step(self, params, grads, lr):
        """One update in place; returns the gradient norm before clipping."""
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
        scale = min(1.0, self.clip / (norm + 1e-12))
        self.t += 1
        b1, b2 = self.betas
        for k, w in params.items():
            g = grads[k] * scale
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
            mhat = self.m[k] / (1 - b1 ** self.t)
            vhat = self.v[k] / (1 - b2 ** self.t)
            if w.ndim == 2:  # decay matrices, not gains and biases
                w -= lr * self.wd * w
            w -= lr * mhat / (np.sqrt(vhat) + self.eps)
        return norm


def windows(data, n, seq_len, rng):
    """n random training windows: inputs and next-token targets, each (n, seq_len)."""
    starts = rng.integers(0, len(data) - seq_len - 1, n)
    idx = np.stack([data[s:s + seq_len + 1] for s in starts])  # (n, seq_len + 1)
    return idx[:, :-1], idx[:, 1:]


def held_out_windows(data, seq_len, count=None):
    """Consecutive non-overlapping windows of the held-out text (the first `count`, or all)."""
    n = (len(data) - 1) // seq_len if count is None else count
    idx = np.stack([data[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])
    return idx[:, :-1], idx[:, 1:]


def evaluate(params, cfg, data, seq_len=512, count=None, batch=8):
    """Held-out loss in nats per character over non-overlapping windows."""
    x, y = held_out_windows(data, seq_len, count)
    losses = [loss_and_grads(params, cfg, x[i:i + batch], y[i:i + batch], need_grads=False)[0] * len(x[i:i + batch])
              for i in range(0, len(x), batch)]
    return sum(losses) / len(x)


def held_out_loss(params, cfg, windows=None, corpus=None):
    """The book's one held-out loss: nats per character over non-overlapping 512-character
    windows of the held-out text, exactly as the training records compute it. windows=None uses
    all of them (the records' `held_out_loss`); windows=n the first n (the records' curves use 32).
    Returns (loss, on) where `on` names the windows, e.g. "the first 32 of 322 held-out windows"."""
    data = (load_corpus() if corpus is None else corpus).held_out
    total = (len(data) - 1) // 512
    if windows is not None and not 1 <= windows <= total:
        raise ValueError(f"windows must be between 1 and {total} (the held-out windows), got {windows}")
    on = (f"all {total} held-out windows" if windows in (None, total)
          else f"the first {windows} of {total} held-out windows")
    return evaluate(params, cfg, data, 512, windows), on


def train(cfg: ModelConfig, steps: int, batch: int = 8, seq_len: int = 512, lr: float = 2e-3,
          warmup: int = 200, seed: int = 0, eval_every: int = 250, eval_windows: int = 32,
          corpus=None, progress: bool = True, init: dict | None = None):
    """Train from scratch, or go on from `init` parameters (uptraining); returns (params, record)
    where record holds the loss curves and timing."""
    corpus = load_corpus() if corpus is None else corpus
    params = init_params(cfg, seed) if init is None else {k: v.astype(np.float32) for k, v in init.items()}
    opt = AdamW(params)
    rng = np.random.default_rng(seed)
    curve = {"step": [], "train_loss": [], "eval_step": [], "held_out_loss": []}
    start = time.perf_counter()
    bar = tqdm(range(steps), disable=not progress, desc=f"{cfg.n_layer}-layer")
    for step in bar:
        x, y = windows(corpus.train, batch, seq_len, rng)
        loss, grads = loss_and_grads(params, cfg, x, y)
        opt.step(params, grads, lr_at(step, steps, lr, warmup))
        curve["step"].append(step)
        curve["train_loss"].append(round(loss, 4))
        if (step + 1) % eval_every == 0 or step == steps - 1:
            curve["eval_step"].append(step + 1)
            curve["held_out_loss"].append(round(evaluate(params, cfg, corpus.held_out, seq_len, eval_windows), 4))
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{(step + 1) * batch * seq_len / elapsed:,.0f}")
    seconds = time.perf_counter() - start
    record = {"steps": steps, "batch": batch, "seq_len": seq_len, "lr": lr, "warmup": warmup, "seed": seed,
              "seconds": round(seconds, 1), "tokens_per_second": round(steps * batch * seq_len / seconds),
              "corpus_sha256": corpus.sha256, "corpus": corpus.summary_line(), "skipped_modules": list(corpus.skipped),
              "curve": curve}
    return params, record


def main(argv=None):
    ap = argparse.ArgumentParser(description="Train the target or draft model on the standard-library corpus, "
                                             "or uptrain a grouped-query version of the shipped target.")
    ap.add_argument("model", choices=sorted(DEFAULTS))
    ap.add_argument("--steps", type=int, default=None, help="default: " + ", ".join(
        f"{name} {v[0]}" for name, v in DEFAULTS.items()))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default per model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for <model>.npz/.json (default: lib/weights)")
    args = ap.parse_args(argv)
    steps, lr, warmup, eval_every = DEFAULTS[args.model]
    steps, lr = args.steps or steps, args.lr or lr
    init, record_extra = None, {}
    if args.model in UPTRAINED:
        init, cfg = mean_pool_kv(*load("target"), UPTRAINED[args.model])
        pooled = cfg.n_kv_head < TARGET.n_kv_head  # target-kv4 keeps its heads: the control
        record_extra = {"converted_from": "target", "conversion": "mean-pooled K/V heads (Ainslie et al. 2023)"
                        if pooled else "none: the control, the same training without pooling"}
    else:
        cfg = PRESETS[args.model]
    corpus = load_corpus()
    if init is not None:
        record_extra["held_out_loss_at_conversion"] = round(evaluate(init, cfg, corpus.held_out, args.seq_len), 4)
    params, record = train(cfg, steps, args.batch, args.seq_len, lr, warmup, seed=args.seed,
                           eval_every=eval_every, corpus=corpus, init=init)
    record.update(record_extra)
    record["held_out_loss"] = round(evaluate(params, cfg, corpus.held_out, args.seq_len), 4)
    record["held_out_sample_loss"] = round(evaluate(params, cfg, corpus.held_out, args.seq_len, count=4), 5)
    kwargs = {} if args.out is None else {"folder": args.out}
    path = save(params, cfg, args.model, record, **kwargs)
    print(f"held-out loss {record['held_out_loss']:.4f} nats/char after {steps} steps "
          f"({record['seconds'] / 60:.1f} min, {record['tokens_per_second']:,} tokens/s); saved {path}")


if __name__ == "__main__":
    main()
