"""A shared prefix on a GPU: what recomputing it costs, what keeping it costs, and when reloading an
evicted copy beats recomputing it.

Prefix caching (chapter 3, vLLM's automatic prefix caching) trades memory for time to first token:
the prefix's K/V stay resident instead of being prefilled again. Once evicted to host memory (as
LMCache and the engines' CPU offloading do; CachedAttention, Gao et al. 2024, USENIX ATC, saves
multi-turn conversations' caches this way), a prefix can come back over the host link instead of
being recomputed. Both costs grow about linearly with its length, so the choice reduces to one
bandwidth: reloading wins when the link delivers the prefix's K/V bytes faster than the GPU's
prefill produces them, above kv_bytes / prefill_seconds. The prefill is the H100 model's
(`lib.gpu.step`), the bytes the formula's (`lib.gpu.memory`).
"""
from lib.gpu.step import GPUClock

# The H100 SXM data sheet's host link: PCIe Gen5 x16, "128 GB/s" counted in both directions.
PCIE_GEN5 = 64e9  # bytes per second, one way


def prefix_costs(clock: GPUClock, tokens: int, link: float = PCIE_GEN5) -> dict:
    """For a prefix of `tokens` on `clock`'s model and GPU: its prefill seconds, its K/V bytes (kept
    resident to be reused), the seconds to reload them over `link` bytes/s, and the link bandwidth
    at which reloading and recomputing take as long."""
    prefill = clock.prefill_seconds(tokens)
    kv = clock.spec.kv_bytes(tokens, 1, clock.dtype)  # bytes
    return {"prefill": prefill, "kv_bytes": kv, "reload": kv / link, "break_even": kv / prefill}
