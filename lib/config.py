"""Model configurations: the shape of a GPT-2-style decoder (Radford et al. 2019).

`TARGET` is the model the book speeds up; `DRAFT` is the small model that proposes tokens in
speculative decoding (Leviathan et al. 2023). Both read the same 96-character vocabulary.
`n_kv_head < n_head` gives grouped-query attention (Ainslie et al. 2023).
"""
from dataclasses import dataclass

import numpy as np


def is_int(value) -> bool:
    """An integer count: a Python or numpy integer, not a bool (which Python counts as an int)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int
    n_head: int
    n_kv_head: int  # == n_head: multi-head; 1: multi-query; between: grouped-query
    n_embd: int
    block_size: int = 512  # learned positions, so also the longest context
    vocab_size: int = 96

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))  # np.int64 -> int, so configs compare and serialize alike
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def group_size(self) -> int:
        """Query heads that share one K/V head (llama2.c's kv_mul)."""
        return self.n_head // self.n_kv_head

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    def parameter_shapes(self) -> dict:
        """Every parameter's shape, keyed like the GPT-2 checkpoint (Conv1D weights are (in, out))."""
        C, V = self.n_embd, self.vocab_size
        shapes = {"wte.weight": (V, C), "wpe.weight": (self.block_size, C)}
        for i in range(self.n_layer):
            shapes.update({
                f"h.{i}.ln_1.weight": (C,), f"h.{i}.ln_1.bias": (C,),
                f"h.{i}.attn.c_attn.weight": (C, C + 2 * self.kv_dim),  # fused q | k | v, no bias
                f"h.{i}.attn.c_proj.weight": (C, C),  # no bias
                f"h.{i}.ln_2.weight": (C,), f"h.{i}.ln_2.bias": (C,),
                f"h.{i}.mlp.c_fc.weight": (C, 4 * C), f"h.{i}.mlp.c_fc.bias": (4 * C,),
                f"h.{i}.mlp.c_proj.weight": (4 * C, C), f"h.{i}.mlp.c_proj.bias": (C,),
            })
        shapes.update({"ln_f.weight": (C,), "ln_f.bias": (C,), "lm_head.weight": (V, C)})  # untied
        return shapes

    def n_params(self) -> int:
        total = 0
        for shape in self.parameter_shapes().values():
            count = 1
            for dim in shape:
                count *= dim
            total += count
        return total


TARGET = ModelConfig(n_layer=4, n_head=4, n_kv_head=4, n_embd=96)  # 513,600 parameters
DRAFT = ModelConfig(n_layer=1, n_head=2, n_kv_head=2, n_embd=48)  # 61,968 parameters
