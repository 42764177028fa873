"""The engine of the book: a small numpy GPT-2-shaped model and the techniques that make its
inference fast, one module per idea (the README lists them). Every chapter imports it; the
names most chapters use are re-exported here."""
from lib.cache.kv_cache import KVCache
from lib.config import DRAFT, TARGET, ModelConfig
from lib.generation import Generation, complete, generate
from lib.model import Model, forward, forward_cached, load, load_metadata
from lib.tokenizer import decode, encode

__all__ = ["DRAFT", "TARGET", "ModelConfig", "Generation", "complete", "generate", "KVCache",
           "Model", "forward", "forward_cached", "load", "load_metadata", "decode", "encode"]
