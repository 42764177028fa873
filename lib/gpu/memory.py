"""How much memory the KV cache takes: the formula and a reader of Hugging Face `config.json` files
(the real models the book prices are in `lib.gpu.models`); and what a decode step reads of the
weights, and what fits on one GPU (the step's time is `lib.gpu.step`).

bytes = batch x sum over layers of (2 x KV heads x head dim x cached positions x bytes per element)

where a full-attention layer caches every position and a sliding-window layer at most its window
(Beltagy et al. 2020; Mistral 7B's rolling buffer, Jiang et al. 2023; Gemma 3's local layers,
Gemma Team 2025). Grouped-query attention (Ainslie et al. 2023) shrinks "KV heads". Multi-head
latent attention (DeepSeek-AI 2024, DeepSeek-V2 and V3) caches one compressed latent of
kv_lora_rank + qk_rope_head_dim values per layer and position instead of K and V heads.
Hybrid models cache K and V in their attention layers only; their linear-attention layers (Gated
DeltaNet in Qwen3-Next, Yang et al. 2025) or state-space layers (Mamba in Jamba, Lieber et al.
2024) keep a fixed-size state per sequence, the same at any length, which `KVSpec.state` counts.

Around the formula: the multi-head baseline of a model (every query head its own K/V head), the
share of each GPU under tensor parallelism (K/V heads split across GPUs, replicated when there
are more GPUs than heads), and what fits beside the weights on one GPU. A step reads every weight but two kinds: the rows of an
untied input embedding are gathered, not read whole (a tied one is read by the output head), and
of a mixture-of-experts layer (Shazeer et al. 2017; Fedus et al. 2022) only the experts its
tokens were routed to: k of E per token, so E x (1 - (1 - k/E)^B) of them for B tokens when
routing is uniform and independent (what load balancing aims at).
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path

from lib.checks import check_config, check_count, is_number
from lib.config import ModelConfig, is_int

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1, "int4": 0.5,
               "mxfp4": 4.25 / 8}  # MXFP4: 32 four-bit values share one 8-bit scale (OCP MX spec)


@dataclass(frozen=True)
class KVSpec:
    """What the formula reads of a model: a record that `from_hf_config` and `from_model_config`
    fill in from what they checked, so it trusts its fields."""
    name: str
    n_layer: int
    n_kv_head: int
    head_dim: int
    windows: tuple  # per layer: None for full attention, the sliding window in positions, 0 for a state instead
    n_params: float = 0.0  # for the size of the weights
    source: str = ""
    n_head: int = 0  # query heads, for the multi-head baseline; 0: as many as KV heads
    latent: int = 0  # MLA: values cached per layer and position instead of K/V heads; 0: none
    embedding: float = 0.0  # parameters of an untied input embedding: its rows are gathered, not read
    experts: int = 0  # mixture of experts: routed experts per MoE layer; 0: a dense model
    active: int = 0  # routed experts each token goes to
    expert_params: float = 0.0  # parameters of all routed experts of all layers (part of n_params)
    state: int = 0  # values each sequence keeps whatever its length: linear-attention or state-space layers' state

    def positions(self, tokens: int) -> list:
        """Cached positions per layer for a sequence of `tokens` (0 in a layer that keeps a state instead)."""
        return [tokens if w is None else min(tokens, w) for w in self.windows]

    def values_per_position(self) -> int:
        """Values one layer caches per position: K and V of every KV head, or MLA's latent."""
        return self.latent or 2 * self.n_kv_head * self.head_dim

    def kv_bytes(self, tokens: int, batch: int = 1, dtype: str = "bfloat16") -> float:
        """Bytes of K and V for `batch` sequences of `tokens` each, and of their constant state if any."""
        return batch * dtype_bytes(dtype) * (self.values_per_position() * sum(self.positions(tokens)) + self.state)

    def bytes_per_token(self, dtype: str = "bfloat16") -> float:
        """Bytes each new token adds once every sliding window is full (full-attention layers only)."""
        return self.values_per_position() * dtype_bytes(dtype) * sum(w is None for w in self.windows)

    def max_tokens(self, budget: float, batch: int = 1, dtype: str = "bfloat16"):
        """The longest sequence length whose cache for `batch` sequences fits in `budget` bytes
        (-1 if not even an empty one does; None if any length fits, every layer being windowed)."""
        if budget < 0:
            return -1
        if self.bytes_per_token() == 0 and self.kv_bytes(max(self.windows), batch, dtype) <= budget:
            return None
        low, high = 0, max(w or 0 for w in self.windows) + int(budget // (batch * self.bytes_per_token(dtype) or 1)) + 1
        while high - low > 1:  # kv_bytes(low) <= budget < kv_bytes(high)
            mid = (low + high) // 2
            low, high = (mid, high) if self.kv_bytes(mid, batch, dtype) <= budget else (low, mid)
        return low

    def multi_head(self) -> "KVSpec":
        """The same model with a K/V head for every query head and no latent: what it would cache
        without GQA, MQA or MLA (for MLA, DeepSeek-V2's comparison: 2 x heads x head dim per layer)."""
        return replace(self, name=f"{self.name}, multi-head", n_kv_head=self.n_head or self.n_kv_head, latent=0)

    def per_gpu(self, tp: int) -> "KVSpec":
        """One GPU's share under `tp`-way tensor parallelism: n_kv_head / tp K/V heads each, or
        one head (replicated) when tp exceeds them (tp divides the heads or is a multiple of them); an
        MLA latent serves every head and is whole on every GPU; a constant state splits with its heads."""
        weights = dict(n_params=self.n_params / tp, embedding=self.embedding / tp, expert_params=self.expert_params / tp,
                       state=self.state // tp)
        if self.latent:
            return replace(self, **weights)
        return replace(self, n_kv_head=max(1, self.n_kv_head // tp), n_head=self.n_head and max(1, self.n_head // tp),
                       **weights)

    def weight_bytes(self, dtype: str = "bfloat16", expert_dtype: str = "", batch: int = 0) -> float:
        """Bytes of the weights, the routed experts in `expert_dtype` ('' for `dtype`): as stored
        (batch 0), or as one decode step of `batch` sequences reads them: without the gathered
        embedding rows, and of the routed experts the expected share its tokens were sent to."""
        per_expert_param = dtype_bytes(dtype if expert_dtype == "" else expert_dtype)
        share = expected_experts(self.experts, self.active, batch) / self.experts if batch and self.experts else 1.0
        dense = self.n_params - self.expert_params - (self.embedding if batch else 0)
        return dense * dtype_bytes(dtype) + self.expert_params * share * per_expert_param


def expected_experts(experts: int, active: int, tokens: int) -> float:
    """Distinct experts of one MoE layer that `tokens` tokens are routed to, in expectation, when
    each token picks `active` of `experts` uniformly and independently: E x (1 - (1 - k/E)^B)."""
    return experts * (1 - (1 - active / experts) ** tokens)


@dataclass(frozen=True)
class GPU:
    """A GPU's data-sheet constants: the book's one record of each GPU it prices (`H100`), copied
    from the data sheet, so unchecked."""
    name: str
    memory: float  # bytes, as the driver reports them
    bandwidth: float  # bytes per second from that memory
    flops: float  # dense bf16 FLOP/s
    source: str = ""


# NVIDIA's H100 SXM data sheet: "80 GB" of HBM3 at 3.35 TB/s, 989 TFLOP/s dense bf16; the driver
# (nvidia-smi on an H100 80GB HBM3) reports 81,559 MiB, the memory an engine can allocate from.
H100 = GPU("H100 SXM", 81559 * 2**20, 3.35e12, 989e12,
           "NVIDIA H100 Tensor Core GPU data sheet (3.35 TB/s HBM3, 989 TFLOP/s dense BF16); 81,559 MiB per nvidia-smi")


UTILIZATION = 0.9  # the share of GPU memory vLLM's engine may use: gpu_memory_utilization, 0.9 by default
# (vLLM's engine arguments; 0.92 in recent releases): the book's one memory share


WORKSPACE = 2 * 2**30  # bytes an engine is assumed to keep aside for activations and buffers: the book's one
# budget rule is UTILIZATION of the memory, less the weights, less this (chapter 4 compares it with what vLLM's
# logs kept aside)


def kv_budget(gpu: GPU, weight_bytes: float, utilization: float = UTILIZATION, workspace: float = WORKSPACE) -> float:
    """Bytes left for the KV cache on one GPU: the share of its memory the engine may use, less the
    weights it holds and the workspace of activations and buffers (by default the book's one rule:
    UTILIZATION and WORKSPACE). Negative when the weights alone do not fit."""
    return gpu.memory * utilization - weight_bytes - workspace


def dtype_bytes(dtype: str) -> float:
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


LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")  # the layer_types entries the formula knows
# A linear-attention layer (Gated DeltaNet) keeps per sequence a state of value heads x key dim x value dim and a
# causal convolution's last kernel - 1 inputs over its q, k and v channels; a Mamba layer (Jamba) keeps
# d_inner x d_state and d_inner x (d_conv - 1), where d_inner = expand x hidden_size (transformers' caches).
STATE_FIELDS = {"linear_attention": ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                                     "linear_num_key_heads", "linear_conv_kernel_dim"),
                "mamba": ("mamba_expand", "mamba_d_state", "mamba_d_conv")}


def _layer_types(config: dict, layers: int):
    """The config's per-layer types when it declares them, as a list or (hybrid models) as a period:
    Qwen3-Next's `full_attention_interval` k (layer i full when (i + 1) % k == 0, the others linear),
    Jamba's `attn_layer_period` p and `attn_layer_offset` o (layer i attention when i % p == o, the others
    Mamba); None when it declares none."""
    if config.get("layer_types"):
        return config["layer_types"]
    if config.get("full_attention_interval") is not None:
        k = _count(config, "full_attention_interval")
        return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(layers)]
    if config.get("attn_layer_period") is not None:
        p = _count(config, "attn_layer_period")
        o = config.get("attn_layer_offset", 0)
        check_count(o, "config.json's attn_layer_offset", 0, high=p - 1)
        return ["full_attention" if i % p == o else "mamba" for i in range(layers)]
    return None


def _state_values(config: dict, kind: str, hidden: int) -> int:
    """Values one layer of `kind` keeps per sequence, from the config's fields (a ValueError naming those missing)."""
    missing = [key for key in STATE_FIELDS[kind] if config.get(key) is None]
    if missing:
        raise ValueError(f"{kind} layers keep a state the formula sizes from {', '.join(STATE_FIELDS[kind])}; "
                         f"config.json lacks {', '.join(missing)}")
    if kind == "mamba":
        inner = _count(config, "mamba_expand") * hidden
        return inner * (_count(config, "mamba_d_state") + _count(config, "mamba_d_conv") - 1)
    v_heads, k_dim, v_dim, k_heads, kernel = (_count(config, key) for key in STATE_FIELDS[kind])
    channels = 2 * k_heads * k_dim + v_heads * v_dim  # the convolution runs over q, k and v
    return v_heads * k_dim * v_dim + channels * (kernel - 1)


def from_hf_config(config, name: str = "", n_params: float = 0.0, source: str = "") -> KVSpec:
    """A KVSpec from a Hugging Face config.json (path or dict).

    head_dim absent -> hidden_size / num_attention_heads (v_head_dim for MLA); num_key_value_heads
    absent -> heads; `layer_types` with "sliding_attention" entries, or a `sliding_window_pattern`
    p (Gemma 3: layer i is global when (i + 1) % p == 0), or a `sliding_window` on every layer
    (Mistral v0.1 style) -> windowed layers; `kv_lora_rank` -> an MLA latent of kv_lora_rank +
    qk_rope_head_dim values. With `n_params` given, the weights' parts a step does not read whole:
    `vocab_size` x hidden_size of input embedding unless `tie_word_embeddings` (transformers'
    default, true), and routed experts (`num_local_experts`, `n_routed_experts` or `num_experts`;
    `num_experts_per_tok`), each 3 matrices of hidden x `moe_intermediate_size` (else
    `intermediate_size`) in every layer from `first_k_dense_replace` on.
    """
    config = read_config(config)
    try:
        layers, heads, hidden = (_count(config, key) for key in ("num_hidden_layers", "num_attention_heads", "hidden_size"))
    except KeyError as err:
        raise ValueError(f"config.json lacks {err.args[0]!r}, needed for the KV cache size") from None
    kv_heads = heads if config.get("num_key_value_heads") is None else _count(config, "num_key_value_heads")
    if heads % kv_heads:
        raise ValueError(f"n_head={heads} is not a multiple of n_kv_head={kv_heads} (num_attention_heads, num_key_value_heads)")
    latent = 0
    if config.get("kv_lora_rank") is not None:
        latent = _count(config, "kv_lora_rank") + _count(config, "qk_rope_head_dim")
        config = {"head_dim": config.get("v_head_dim")} | config
    if config.get("head_dim") is None and hidden % heads:
        raise ValueError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}, and head_dim is not given")
    head_dim = hidden // heads if config.get("head_dim") is None else _count(config, "head_dim")
    window = None if config.get("sliding_window") is None else _count(config, "sliding_window")
    state = 0  # values per sequence of the layers that keep a state instead of K and V
    types, pattern = _layer_types(config, layers), config.get("sliding_window_pattern")
    if not types and pattern is not None and window is not None:
        pattern = _count(config, "sliding_window_pattern")
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if types:
        if not (isinstance(types, list) and len(types) == layers and all(isinstance(t, str) for t in types)):
            raise ValueError(f"config.json's layer_types must be a list of {layers} strings, got {types!r:.80}")
        unknown = sorted(set(types) - set(LAYER_TYPES) - {"mamba"})
        if unknown:  # another attention (chunked, ...) caches differently: never read it as full
            raise ValueError(f"layer_types entries {unknown} are not {', '.join(LAYER_TYPES)}, the three this formula knows")
        if "sliding_attention" in types and window is None:
            raise ValueError("layer_types has sliding_attention layers but the config gives no sliding_window")
        windows = tuple(window if t == "sliding_attention" else 0 if t in STATE_FIELDS else None for t in types)
        state = sum(types.count(kind) * _state_values(config, kind, hidden) for kind in STATE_FIELDS if kind in types)
    elif window is not None and config.get("use_sliding_window", True):
        windows = (window,) * layers
    else:
        windows = (None,) * layers
    name = config.get("model_type", "model") if name == "" else name
    for value, label in ((name, "name"), (source, "source")):
        if not isinstance(value, str):
            raise TypeError(f"{label} must be a str, got {type(value).__name__}")
    weights = _weight_parts(config, layers, hidden) if n_params else {}
    least = weights.get("embedding", 0) + weights.get("expert_params", 0)  # parts of n_params
    if not (is_number(n_params) and least <= n_params < float("inf")):
        raise ValueError(f"n_params must be a finite number >= {least:.4g} (its embedding + expert_params), got {n_params!r}")
    return KVSpec(name, layers, kv_heads, head_dim, windows, n_params, source, heads, latent, state=state, **weights)


def _weight_parts(config: dict, layers: int, hidden: int) -> dict:
    """KVSpec's embedding, experts, active and expert_params from a config.json's fields."""
    parts = {}
    if config.get("vocab_size") is not None and not config.get("tie_word_embeddings", True):
        parts["embedding"] = _count(config, "vocab_size") * hidden
    key = next((k for k in ("num_local_experts", "n_routed_experts", "num_experts") if config.get(k)), None)
    if key:
        needed = {"num_experts_per_tok": config.get("num_experts_per_tok"),
                  "moe_intermediate_size or intermediate_size": config.get("moe_intermediate_size", config.get("intermediate_size"))}
        missing = [name for name, value in needed.items() if value is None]
        if missing:
            raise ValueError(f"config.json has routed experts ({key}) but lacks {' and '.join(missing)}, needed for the weights a step reads")
        if (config.get("expert_layer_period") or 1) != 1 or (config.get("decoder_sparse_step") or 1) != 1:
            raise ValueError("config.json puts experts in some layers only (expert_layer_period or decoder_sparse_step);"
                             " the weights' parts count them in every layer from first_k_dense_replace on")
        size = next(k for k in ("moe_intermediate_size", "intermediate_size") if config.get(k) is not None)
        dense = config.get("first_k_dense_replace") or 0
        check_count(dense, "config.json's first_k_dense_replace", 0, high=layers - 1)
        experts, active = _count(config, key), _count(config, "num_experts_per_tok")
        if active > experts:
            raise ValueError(f"config.json's num_experts_per_tok={active} is more than its {experts} routed experts")
        parts.update(experts=experts, active=active, expert_params=(layers - dense) * experts * 3 * hidden * _count(config, size))
    return parts


def from_model_config(cfg: ModelConfig, name: str = "this book's target") -> KVSpec:
    """The book's model read as the config.json that would describe it (untied head, full attention)."""
    check_config(cfg)
    fields = {"num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
              "hidden_size": cfg.n_embd}
    return from_hf_config(fields, name, cfg.n_params())
