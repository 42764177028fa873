"""The trained pair's acceptance rate lent to an 8B target with a 1B-sized draft on a GPU clock: chapter 10's
H100 model of speculative decoding, and chapter 11's lever table and crossover.

alpha is counted, not timed: accepted over judged drafts in speculative runs of the trained target and draft
(`lib.load`'s "target" and "draft", each a LeanModel) on chapter 10's stand-in prompts. The stand-in device
changes a call's time, not its tokens (`lib.measure.standins.StandInStep`), so chapter 10's stand-in sweep at the
same k counts the same drafts. The seconds per token are Leviathan et al. 2023's rounds (eq. 1's tokens per
verification) priced by the book's step formula (`lib.gpu.step`), whose fitted clock prices the 1B draft at the
8B's bandwidth share, fixed cost and tiles.
"""
from dataclasses import replace

import lib
from lib.book.studies.sweep import merged
from lib.corpus import held_out_prompts
from lib.fast.lean import LeanModel
from lib.gpu.memory import H100, from_hf_config
from lib.gpu.models import LLAMA_3_8B
from lib.gpu.step import gpu_clock
from lib.speculative import expected_tokens_per_call, speculative_generate

PROMPTS, N_NEW, TEMPERATURE, K = 3, 96, 0.7, 3  # chapter 10's stand-in sweep: held_out_prompts(4, 16)[:3], 96 new tokens
LLAMA_3_2_1B = from_hf_config({"num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                               "head_dim": 64, "hidden_size": 2048, "vocab_size": 128256, "tie_word_embeddings": True},
                              "Llama-3.2-1B", 1.24e9, "https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json")
C_HIGHER = (0.3, 0.4)  # c if a 1B model's small kernels reach less of the bandwidth than the 8B's (chapter 10)


def pair_alpha(k: int = K, temperature: float = TEMPERATURE) -> float:
    """alpha of the trained pair at k: accepted over judged drafts, summed over speculative runs of chapter 10's
    stand-in prompts (`held_out_prompts(4, 16)[:PROMPTS]`, N_NEW tokens each, seed i for prompt i)."""
    target, draft = (LeanModel(*lib.load(name)) for name in ("target", "draft"))
    stats = merged([speculative_generate(target, draft, p, N_NEW, k=k, temperature=temperature, seed=i)[1]
                    for i, p in enumerate(held_out_prompts(4, 16)[:PROMPTS])])
    return stats["accepted"] / stats["judged"]


def h100_pair():
    """The fitted H100 clocks of Llama-3.1-8B and of a Llama-3.2-1B draft at the same shares, fixed cost and tiles."""
    target = gpu_clock(LLAMA_3_8B, H100)
    return target, replace(target, spec=LLAMA_3_2_1B)


def per_token(alpha: float, batch: int, k: int, context: int, target, draft) -> float:
    """Seconds per output token of each sequence: target-only (k = 0), or k draft steps and one verification of
    k + 1 rows per sequence, which emit eq. 1's E tokens each at alpha. target, draft: GPU clocks (`h100_pair`)."""
    if k == 0:
        return target.decode_step(batch, context + 1)
    verify = target.decode_step(batch, context + k + 1, new=k + 1)
    return (verify + k * draft.decode_step(batch, context + 1)) / expected_tokens_per_call(alpha, k)


def crossover(alpha: float, k: int, context: int, target, draft, largest: int = 4096):
    """The smallest batch (1 to `largest`) at which speculation's seconds per token exceed target-only's, or None."""
    return next((b for b in range(1, largest + 1)
                 if per_token(alpha, b, 0, context, target, draft) < per_token(alpha, b, k, context, target, draft)), None)
