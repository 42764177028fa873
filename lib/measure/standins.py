"""Cost stand-ins: models of realistic shape with random weights, to measure what a large model
costs on this machine. They never produce text.

The trained target is 2 MB: its weights live in the CPU's caches, and a decode step is bound
by call overhead and arithmetic. A real LLM streams its weights from memory at every step
(Pope et al. 2022), the regime in which speculative decoding pays (Leviathan et al. 2023). A
stand-in has the shape of such a model (GPT-2 small: 12 layers of width 768, 340 MB of float32
weights) and random weights, enough to time it honestly.

`StandInStep` is the book's stand-in device, which joins the two: the trained model makes every
decision (its tokens, its acceptances), and each of its calls is repeated, with the same number of tokens, on a stand-in whose own KV
cache is kept at the same length, truncated whenever the real one was. Timing a generation
through it measures the trained model's decoding at the stand-in's cost.
"""
import numpy as np

from lib.cache.kv_cache import KVCache
from lib.config import ModelConfig
from lib.fast.lean import LeanModel
from lib.model import init_params

STANDINS = {  # name -> shape; all read the book's 96-character vocabulary
    "4x256": ModelConfig(n_layer=4, n_head=4, n_kv_head=4, n_embd=256),  # 13 MB
    "6x384": ModelConfig(n_layer=6, n_head=6, n_kv_head=6, n_embd=384),  # 43 MB
    "8x512": ModelConfig(n_layer=8, n_head=8, n_kv_head=8, n_embd=512),  # 101 MB
    "12x768": ModelConfig(n_layer=12, n_head=12, n_kv_head=12, n_embd=768),  # 340 MB, GPT-2 small's shape
}
DRAFT_STANDINS = {  # a draft's cost: shadowing the trained draft, c is about 0.05 beside the 8x512 stand-in
    "2x256": ModelConfig(n_layer=2, n_head=4, n_kv_head=4, n_embd=256),  # 6 MB
}


def standin(name: str, products: str = "auto", seed: int = 0) -> LeanModel:
    """The lean model of stand-in `name` (a key of STANDINS or DRAFT_STANDINS), for timing only:
    GPT-2's initialisation (`lib.model.init_params`) of its shape."""
    cfg = {**STANDINS, **DRAFT_STANDINS}[name]
    return LeanModel(init_params(cfg, seed), cfg, products)


def weight_bytes(model: LeanModel) -> int:
    """Bytes of the weights a decode step reads: every layer's matrices and the output head
    (the embedding rows it looks up are a negligible part)."""
    return sum(w.nbytes for layer in model.layers for w in layer) + model.head.nbytes


class StandInStep:
    """The stand-in device for one sequence: a cached step that returns `model`'s logits after
    running a call of the same size on `standin`, whose own cache follows the real cache's length
    (`lib.measure.clocks.StandInClock` is the same device for a batch). Use it wherever a LeanModel
    goes (`generate`, `speculative_generate`). `calls` records each call's size. Its callers pass a
    stand-in with at least the model's positions and make every call on the real cache through
    it; behind the boundary (lib.checks), it checks neither."""

    def __init__(self, model, standin_model: LeanModel):
        self.cfg, self.step = model.cfg, model
        self.standin = standin_model
        self.standin_cache = KVCache(standin_model.cfg)
        self.calls = []  # tokens per call, in order

    def __call__(self, new_tokens, cache) -> np.ndarray:
        start = cache.n
        logits = self.step(new_tokens, cache)  # the real model's logits: the entry point that called it checked the tokens
        self.standin_cache.truncate(start)  # the real cache was truncated to `start` (or is new) since the last call
        self.standin(new_tokens, self.standin_cache)
        self.calls.append(len(logits))
        return logits
