"""A GPT-2-shaped decoder in plain numpy functions (Radford et al. 2019; picoGPT's layout).

Pre-LN blocks, learned position embeddings, a fused q|k|v projection and an output projection
without bias, a 4x MLP with tanh-GELU, a final LayerNorm and an untied output head. Parameters
are a flat dict keyed like the GPT-2 checkpoint (`h.0.attn.c_attn.weight`, ...).

`forward` is the plain reference: it recomputes everything from the tokens, the same in every chapter
(the fast paths live in `lib.fast`).
`forward_cached` appends 1..n tokens to a `KVCache` and returns their logits, so decoding one
token, prefilling a prompt and verifying k draft tokens are the same call; both run the layers
through `block`. `Model(params, cfg)` is that cached call as a `Step`, the one interface every
generator, the batched engine and the server take. Grouped-query attention (Ainslie et al. 2023)
groups the query heads over shared K/V heads; K/V are never repeated.
"""
import json
import math
from pathlib import Path
from typing import Protocol

import numpy as np

from lib.checks import check_cache, check_config, check_count, check_params, check_tokens, entry_point
from lib.config import ModelConfig

WEIGHTS_DIR = Path(__file__).parent / "weights"
GELU_C = math.sqrt(2.0 / math.pi)  # GPT-2's tanh approximation of GELU
LN_EPS = 1e-5
CONFIG_KEY = "__config__"  # the npz entry that holds the config the weights were saved for


def check_forward(params, cfg: ModelConfig, tokens) -> tuple:
    """`forward`'s rule: params of cfg's shape, token ids that fit its context."""
    check_params(params, cfg)
    return params, cfg, check_tokens(tokens, cfg)


def check_forward_cached(params, cfg: ModelConfig, new_tokens, cache) -> tuple:
    """`forward_cached`'s rule: params of cfg's shape, a cache made for cfg, new token ids that fit
    the context after its positions and the room it has left."""
    check_params(params, cfg)
    check_cache(cache, cfg)
    new_tokens = check_tokens(new_tokens, cfg, cache.n)
    cache.check_room(len(new_tokens))
    return params, cfg, new_tokens, cache


class KVStore(Protocol):
    """What `forward_cached` needs of a cache (lib.cache.kv_cache.KVCache, a paged sequence, KIVI's
    store): n positions held, room for more, and per-layer write/read, committed by advance."""
    cfg: ModelConfig
    n: int

    def check_room(self, count: int) -> None: ...
    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None: ...
    def read(self, layer: int, length: int) -> tuple: ...
    def advance(self, count: int) -> None: ...


# ----------------------------------------------------------------------------- building blocks

def layer_norm(x, g, b, eps=LN_EPS):
    mu = x.mean(axis=-1, keepdims=True)  # (..., 1)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)  # (..., 1)
    return (x - mu) / np.sqrt(var + eps) * g + b  # (..., C)


def gelu(x):
    """The tanh approximation used by GPT-2. The cube is two multiplies: numpy's `x ** 3` goes
    through its general power, hundreds of times slower per element than a multiply."""
    return 0.5 * x * (1.0 + np.tanh(GELU_C * (x + 0.044715 * (x * x * x))))


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def attention(q, k, v):
    """Causal attention of T new queries over S = start + T keys, the queries being the last T.

    q: (H, T, D); k, v: (Hkv, S, D). Query head h reads K/V head h // G (G = H / Hkv): the G
    heads of a group are the rows of one product per K/V head, which reads K and V once.
    """
    H, T, D = q.shape
    Hkv, S, _ = k.shape
    G = H // Hkv
    att = q.reshape(Hkv, G * T, D) @ k.transpose(0, 2, 1) / math.sqrt(D)  # (Hkv, G*T, S)
    future = np.arange(S) > np.arange(S - T, S)[:, None]  # (T, S): keys after each query
    att = np.where(future, -np.inf, att.reshape(Hkv, G, T, S))  # (Hkv, G, T, S)
    y = softmax(att).reshape(Hkv, G * T, S) @ v  # (Hkv, G*T, D)
    return y.reshape(H, T, D)


def split_qkv(qkv, cfg: ModelConfig):
    """(T, C + 2*Hkv*D) -> q (H, T, D), k (Hkv, T, D), v (Hkv, T, D)."""
    T = qkv.shape[0]
    C, KV, D = cfg.n_embd, cfg.kv_dim, cfg.head_dim
    q = qkv[:, :C].reshape(T, cfg.n_head, D).transpose(1, 0, 2)  # (H, T, D)
    k = qkv[:, C:C + KV].reshape(T, cfg.n_kv_head, D).transpose(1, 0, 2)  # (Hkv, T, D)
    v = qkv[:, C + KV:].reshape(T, cfg.n_kv_head, D).transpose(1, 0, 2)  # (Hkv, T, D)
    return q, k, v


def mlp(x, params, i):
    p = f"h.{i}."
    h = layer_norm(x, params[p + "ln_2.weight"], params[p + "ln_2.bias"])  # (T, C)
    h = gelu(h @ params[p + "mlp.c_fc.weight"] + params[p + "mlp.c_fc.bias"])  # (T, 4C)
    return h @ params[p + "mlp.c_proj.weight"] + params[p + "mlp.c_proj.bias"]  # (T, C)


def embed(params, tokens, start):
    T = len(tokens)
    return params["wte.weight"][tokens] + params["wpe.weight"][start:start + T]  # (T, C)


def head(params, x):
    x = layer_norm(x, params["ln_f.weight"], params["ln_f.bias"])  # (T, C)
    return x @ params["lm_head.weight"].T  # (T, V)


# ----------------------------------------------------------------------------- forward passes

def block(params, cfg: ModelConfig, i: int, x, cache=None):
    """Layer i on the rows x (T, C): x + attention(ln_1(x)), then x + mlp(x), mlp applying ln_2
    itself. Without a cache the rows are the whole sequence; with one, their K/V are written at
    positions cache.n.. and the queries attend over every position it holds."""
    p = f"h.{i}."
    T = len(x)
    h = layer_norm(x, params[p + "ln_1.weight"], params[p + "ln_1.bias"])  # (T, C)
    q, k, v = split_qkv(h @ params[p + "attn.c_attn.weight"], cfg)  # (H|Hkv, T, D)
    if cache is not None:
        cache.write(i, k, v)
        k, v = cache.read(i, cache.n + T)  # (Hkv, n+T, D): every position so far
    y = attention(q, k, v).transpose(1, 0, 2).reshape(T, cfg.n_embd)  # (T, C)
    x = x + y @ params[p + "attn.c_proj.weight"]  # (T, C)
    return x + mlp(x, params, i)  # (T, C)


@entry_point(check_forward)
def forward(params, cfg: ModelConfig, tokens) -> np.ndarray:
    """Reference forward pass: logits (T, V) for every position, recomputed from scratch."""
    x = embed(params, tokens, 0)  # (T, C)
    for i in range(cfg.n_layer):
        x = block(params, cfg, i, x)  # (T, C)
    return head(params, x)  # (T, V)


@entry_point(check_forward_cached)
def forward_cached(params, cfg: ModelConfig, new_tokens, cache: KVStore) -> np.ndarray:
    """Append new tokens at positions cache.n.. and return their logits (T, V): prefill, one
    decode step and the verification of k draft tokens are this one call."""
    x = embed(params, new_tokens, cache.n)  # (T, C)
    for i in range(cfg.n_layer):
        x = block(params, cfg, i, x, cache)  # (T, C)
    cache.advance(len(new_tokens))
    return head(params, x)  # (T, V)


class Step(Protocol):
    """A model as the engine runs it: its config, and a call that appends new tokens to a cache
    and returns their logits (T, V). `Model` is the plain one; `lib.fast.lean.LeanModel` and
    `lib.measure.standins.StandInStep` are others."""
    cfg: ModelConfig

    def __call__(self, new_tokens, cache: KVStore) -> np.ndarray: ...


class Model:
    """The plain model as a Step: GPT-2 parameters and their config, checked against each other
    once, here; a call is `forward_cached`."""

    def __init__(self, params, cfg: ModelConfig):
        check_params(params, cfg)
        self.params, self.cfg = params, cfg

    def __call__(self, new_tokens, cache: KVStore) -> np.ndarray:
        return forward_cached(self.params, self.cfg, new_tokens, cache)


# ----------------------------------------------------------------------------- parameters

def init_params(cfg: ModelConfig, seed: int = 0, dtype=np.float32) -> dict:
    """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
    check_config(cfg)
    check_count(seed, "seed", 0)
    try:
        floating = dtype is not None and np.dtype(dtype).kind == "f"  # np.dtype(None) would be float64
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(f"dtype must be a float dtype such as np.float32, got {dtype!r}")
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in cfg.parameter_shapes().items():
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            params[name] = np.ones(shape, dtype)
        elif name.endswith(".bias"):
            params[name] = np.zeros(shape, dtype)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
            params[name] = (rng.standard_normal(shape) * std).astype(dtype)
    return params


def save(params, cfg: ModelConfig, name: str, metadata: dict, folder=WEIGHTS_DIR) -> Path:
    """Write <name>.npz (float32 parameters) and <name>.json (config and training record): the
    trainer's verb (`lib.train`), for the parameters it trained; a chapter loads them."""
    folder = _weights_path(name, folder, ".npz").parent
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / f"{name}.npz", **{k: np.asarray(v, np.float32) for k, v in params.items()},
             **{CONFIG_KEY: np.array(json.dumps(cfg.__dict__))})  # the weights carry their config
    record = {"config": cfg.__dict__, **metadata}
    (folder / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return folder / f"{name}.npz"


def _weights_path(name, folder, suffix) -> Path:
    """folder / <name><suffix>, with name a file stem and folder a path."""
    if not isinstance(name, str) or not name or "/" in name:
        raise TypeError(f"name must be the file stem of a checkpoint such as 'target', got {name!r}")
    if not isinstance(folder, (str, Path)):
        raise TypeError(f"folder must be a path, got {type(folder).__name__}")
    return Path(folder) / f"{name}{suffix}"


def load_metadata(name: str, folder=WEIGHTS_DIR) -> dict:
    """The training record <name>.json beside the weights: a JSON object with the model's config."""
    path = _weights_path(name, folder, ".json")
    retrain = f"retrain with `python -m lib.train {name}`"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"weights metadata {path} is missing or corrupt ({err}); {retrain}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise FileNotFoundError(f"weights metadata {path} is corrupt (no config object); {retrain}")
    return meta


def load(name: str = "target", folder=WEIGHTS_DIR):
    """Load shipped weights: returns (params, cfg). A missing or corrupt file says how to retrain."""
    path = _weights_path(name, folder, ".npz")
    retrain = f"retrain with `python -m lib.train {name}`"
    meta = load_metadata(name, folder)
    try:
        cfg = ModelConfig(**meta["config"])
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path.with_suffix('.json')} holds no valid config ({err}); {retrain}") from None
    try:
        with open(path, "rb") as file, np.load(file) as data:
            params = {k: data[k] for k in data.files}
        saved = ModelConfig(**json.loads(str(params.pop(CONFIG_KEY))))
    except FileNotFoundError:
        raise FileNotFoundError(f"weights file {path} is missing; {retrain}") from None
    except Exception as err:  # zip, pickle and key errors all mean the same thing to a reader
        raise ValueError(f"weights file {path} is corrupt ({type(err).__name__}: {err}); {retrain}") from None
    if saved != cfg:
        raise ValueError(f"{path.with_suffix('.json')} holds {cfg}, but the weights were saved for {saved}; {retrain}")
    expected = cfg.parameter_shapes()
    if set(params) != set(expected):
        missing, extra = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
        raise ValueError(f"weights file {path} does not match its config (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}); {retrain}")
    for key, shape in expected.items():
        if params[key].shape != shape or params[key].dtype.kind != "f" or not np.isfinite(params[key]).all():
            raise ValueError(f"weights file {path} is corrupt: {key} has shape {params[key].shape}, "
                             f"expected float {shape}, or non-finite values; {retrain}")
    return params, cfg
