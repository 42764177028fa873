"""How much memory the KV cache takes: the formula, real model configurations, and a reader of
Hugging Face `config.json` files.

bytes = batch x sum over layers of (2 x KV heads x head dim x cached positions x bytes per element)

where a full-attention layer caches every position and a sliding-window layer at most its window
(Beltagy et al. 2020; Mistral 7B's rolling buffer, Jiang et al. 2023). Grouped-query attention
(Ainslie et al. 2023) shrinks "KV heads". The figures of each model below are copied from its
official config.json, whose address is kept with it.
"""
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ModelConfig, is_int

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class KVSpec:
    name: str
    n_layer: int
    n_kv_head: int
    head_dim: int
    windows: tuple  # per layer: None for full attention, else the sliding window in positions
    n_params: float = 0.0  # for the size of the weights
    source: str = ""

    def __post_init__(self):
        """A spec that could report zero or negative bytes is refused: every count at least 1."""
        for name in ("name", "source"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"KVSpec.{name} must be a str, got {type(getattr(self, name)).__name__}")
        for name in ("n_layer", "n_kv_head", "head_dim"):
            _check_int(f"KVSpec.{name}", getattr(self, name), 1)
        if not isinstance(self.windows, tuple) or len(self.windows) != self.n_layer:
            raise ValueError(f"KVSpec.windows must be a tuple of one entry per layer ({self.n_layer}), "
                             f"got {self.windows!r:.80}")
        for w in self.windows:
            if w is not None:
                _check_int("KVSpec.windows entry (a sliding window)", w, 1)
        if isinstance(self.n_params, bool) or not isinstance(self.n_params, (int, float, np.integer, np.floating)) \
                or not 0 <= self.n_params < float("inf"):
            raise ValueError(f"KVSpec.n_params must be a finite number >= 0, got {self.n_params!r}")

    def positions(self, tokens: int) -> list:
        """Cached positions per layer for a sequence of `tokens`."""
        _check_int("tokens", tokens, 0)
        return [tokens if w is None else min(tokens, w) for w in self.windows]

    def kv_bytes(self, tokens: int, batch: int = 1, dtype: str = "bfloat16") -> float:
        """Bytes of K and V for `batch` sequences of `tokens` each."""
        _check_int("batch", batch, 1)
        per_position = 2 * self.n_kv_head * self.head_dim * dtype_bytes(dtype)
        return batch * per_position * sum(self.positions(tokens))

    def bytes_per_token(self, dtype: str = "bfloat16") -> float:
        """Bytes each new token adds once every sliding window is full (full-attention layers only)."""
        return 2 * self.n_kv_head * self.head_dim * dtype_bytes(dtype) * sum(w is None for w in self.windows)

    def weight_bytes(self, dtype: str = "bfloat16") -> float:
        return self.n_params * dtype_bytes(dtype)


def _check_int(name: str, value, low: int) -> None:
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def dtype_bytes(dtype: str) -> float:
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def _count(config: dict, key: str) -> int:
    """config[key] as a positive integer, or a ValueError naming the field."""
    value = config[key]
    if not is_int(value) or value < 1:
        raise ValueError(f"config.json's {key} must be a positive integer, got {value!r}")
    return value


def read_config(config) -> dict:
    """A config.json's fields: the dict itself, or the JSON object read from a path."""
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, Path)):
        raise TypeError(f"config must be a dict or the path of a config.json, got {type(config).__name__}")
    path = Path(config)
    try:
        fields = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"config file {path} is not a readable JSON file ({type(err).__name__}: {err})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"config file {path} holds a JSON {type(fields).__name__}, not an object of fields")
    return fields


def from_hf_config(config, name: str = "", n_params: float = 0.0, source: str = "") -> KVSpec:
    """A KVSpec from a Hugging Face config.json (path or dict).

    head_dim absent -> hidden_size / num_attention_heads; num_key_value_heads absent -> heads;
    `layer_types` with "sliding_attention" entries, or a `sliding_window` on every layer
    (Mistral v0.1 style) -> windowed layers.
    """
    config = read_config(config)
    if not isinstance(name, str):
        raise TypeError(f"name must be a str ('' for the config's model_type), got {type(name).__name__}")
    try:
        layers, heads, hidden = (_count(config, key) for key in ("num_hidden_layers", "num_attention_heads", "hidden_size"))
    except KeyError as err:
        raise ValueError(f"config.json lacks {err.args[0]!r}, needed for the KV cache size") from None
    kv_heads = heads if config.get("num_key_value_heads") is None else _count(config, "num_key_value_heads")
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}")
    if config.get("head_dim") is None and hidden % heads:
        raise ValueError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}, and head_dim is not given")
    head_dim = hidden // heads if config.get("head_dim") is None else _count(config, "head_dim")
    window = None if config.get("sliding_window") is None else _count(config, "sliding_window")
    types = config.get("layer_types")
    if types:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise ValueError(f"config.json's layer_types must be a list of strings, got {types!r:.80}")
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    elif window is not None and config.get("use_sliding_window", True):
        windows = (window,) * layers
    else:
        windows = (None,) * layers
    return KVSpec(name or config.get("model_type", "model"), layers, kv_heads, head_dim, windows, n_params, source)


def from_model_config(cfg: ModelConfig, name: str = "this book's target") -> KVSpec:
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a lib.config.ModelConfig, got {type(cfg).__name__}")
    return KVSpec(name, cfg.n_layer, cfg.n_kv_head, cfg.head_dim, (None,) * cfg.n_layer, cfg.n_params())


# The fields of each official config.json that the formula needs, with its address.
REAL_MODELS = [
    from_hf_config({"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "head_dim": 128, "hidden_size": 4096}, "Qwen3-8B", 8.2e9,
                   "https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json"),
    from_hf_config({"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                    "hidden_size": 8192}, "Qwen2.5-72B-Instruct", 72.7e9,
                   "https://huggingface.co/Qwen/Qwen2.5-72B-Instruct/blob/main/config.json"),
    from_hf_config({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "hidden_size": 4096, "sliding_window": 4096}, "Mistral-7B-v0.1", 7.24e9,
                   "https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json"),
    from_hf_config({"num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
                    "head_dim": 64, "hidden_size": 2880, "sliding_window": 128,
                    "layer_types": ["sliding_attention", "full_attention"] * 12}, "gpt-oss-20b", 20.9e9,
                   "https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json"),
]
