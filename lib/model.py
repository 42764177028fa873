"""A GPT-2-shaped decoder in plain numpy functions (Radford et al. 2019; picoGPT's layout).

Pre-LN blocks, learned position embeddings, a fused q|k|v projection and an output projection
without bias, a 4x MLP with tanh-GELU, a final LayerNorm and an untied output head. Parameters
are a flat dict keyed like the GPT-2 checkpoint (`h.0.attn.c_attn.weight`, ...).

`forward` is the plain reference: it recomputes everything from the tokens and never changes.
`forward_cached` appends 1..n tokens to a `KVCache` and returns their logits, so decoding one
token, prefilling a prompt and verifying k draft tokens are the same call. Grouped-query
attention (Ainslie et al. 2023) groups the query heads over shared K/V heads; K/V are never
repeated.
"""
import json
import math
from pathlib import Path
from typing import Protocol

import numpy as np

from lib.checks import check_cache, check_config, check_params, check_seed, check_tokens
from lib.config import ModelConfig

WEIGHTS_DIR = Path(__file__).parent / "weights"
GELU_C = math.sqrt(2.0 / math.pi)  # GPT-2's tanh approximation of GELU
LN_EPS = 1e-5
CONFIG_KEY = "__config__"  # the npz entry that holds the config the weights were saved for




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
    heads of a group are the rows of one product per K/V head, which reads K and V once
    (FlashAttention-2 reshapes a decoding step's queries the same way). With fewer query rows
    than positions, the scores are computed as k @ q^T, positions as the product's rows:
    OpenBLAS runs a product of a few rows several times slower per byte (chapter 5).
    """
    H, T, D = q.shape
    Hkv, S, _ = k.shape
    G = H // Hkv
    qg = q.reshape(Hkv, G * T, D)  # (Hkv, G*T, D): a group's queries side by side
    scale = 1.0 / math.sqrt(D)
    if G * T < S:  # few query rows (decode): positions as the rows, scaled into C order
        att = np.multiply((k @ qg.transpose(0, 2, 1)).transpose(0, 2, 1), scale, order="C")  # (Hkv, G*T, S)
    else:
        att = qg @ k.transpose(0, 2, 1) * scale  # (Hkv, G*T, S)
    if T > 1:  # a single new token may see every cached position
        future = np.arange(S)[None, :] > np.arange(S - T, S)[:, None]  # (T, S)
        att = att.reshape(Hkv, G, T, S)
        att[:, :, future] = -np.inf
        att = att.reshape(Hkv, G * T, S)
    y = softmax(att) @ v  # (Hkv, G*T, D)
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

def forward(params, cfg: ModelConfig, tokens) -> np.ndarray:
    """Reference forward pass: logits (T, V) for every position, recomputed from scratch."""
    check_params(params, cfg)
    tokens = check_tokens(tokens, cfg)
    x = embed(params, tokens, 0)  # (T, C)
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        h = layer_norm(x, params[p + "ln_1.weight"], params[p + "ln_1.bias"])  # (T, C)
        q, k, v = split_qkv(h @ params[p + "attn.c_attn.weight"], cfg)  # (H|Hkv, T, D)
        y = attention(q, k, v).transpose(1, 0, 2).reshape(len(tokens), cfg.n_embd)  # (T, C)
        x = x + y @ params[p + "attn.c_proj.weight"]  # (T, C)
        x = x + mlp(x, params, i)  # (T, C)
    return head(params, x)  # (T, V)


def forward_cached(params, cfg: ModelConfig, new_tokens, cache: KVStore) -> np.ndarray:
    """Append new tokens at positions cache.n.. and return their logits (T, V).

    Everything is checked before the cache is touched, so a bad call leaves it as it was.
    """
    check_params(params, cfg)
    check_cache(cache, cfg)
    start = cache.n
    tokens = check_tokens(new_tokens, cfg, start)
    T = len(tokens)
    cache.check_room(T)
    x = embed(params, tokens, start)  # (T, C)
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        h = layer_norm(x, params[p + "ln_1.weight"], params[p + "ln_1.bias"])  # (T, C)
        q, k, v = split_qkv(h @ params[p + "attn.c_attn.weight"], cfg)  # (H|Hkv, T, D)
        cache.write(i, k, v)
        k_all, v_all = cache.read(i, start + T)  # (Hkv, start+T, D)
        y = attention(q, k_all, v_all).transpose(1, 0, 2).reshape(T, cfg.n_embd)  # (T, C)
        x = x + y @ params[p + "attn.c_proj.weight"]  # (T, C)
        x = x + mlp(x, params, i)  # (T, C)
    cache.advance(T)
    return head(params, x)  # (T, V)


def cached_step(model):
    """A model as (cfg, step): a (params, cfg) pair steps with the plain `forward_cached`; a
    LeanModel, or any step object with a ModelConfig `cfg` (such as `lib.measure.standins.StandInStep`),
    with itself. step(new_tokens, cache) -> logits (T, V)."""
    if isinstance(getattr(model, "cfg", None), ModelConfig) and callable(model):
        return model.cfg, model
    if not (isinstance(model, tuple) and len(model) == 2):
        raise TypeError(f"a model is a (params, cfg) pair or a LeanModel, got {type(model).__name__}")
    params, cfg = model
    check_params(params, cfg)
    return cfg, lambda tokens, cache: forward_cached(params, cfg, tokens, cache)


# ----------------------------------------------------------------------------- parameters

def init_params(cfg: ModelConfig, seed: int = 0, dtype=np.float32) -> dict:
    """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
    check_config(cfg)
    check_seed(seed)
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
    """Write <name>.npz (float32 parameters) and <name>.json (config and training record)."""
    check_params(params, cfg)
    path = _weights_path(name, folder, ".npz")
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict (the training record), got {type(metadata).__name__}")
    folder = path.parent
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
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"weights metadata {path} is missing or corrupt ({err}); "
                                f"retrain with `python -m lib.train {name}`") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise FileNotFoundError(f"weights metadata {path} is corrupt (no config object); "
                                f"retrain with `python -m lib.train {name}`")
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
        raise ValueError(f"{path.with_suffix('.json')} says the model is {cfg}, but the weights were saved "
                         f"for {saved}; {retrain}")
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
