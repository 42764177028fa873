"""One step of a real model on a GPU: the book's one step-time formula, used by every chapter, the
serving clock and the bench.

A step of T new tokens (one per sequence in decode, many in a prefill) runs, in every layer, the
weight products and attention over each sequence's own cache as separate kernels whose times add
(the JAX scaling book's inference chapter, Austin et al. 2025, adds the two):

    seconds = overhead
            + max(weight bytes / (b x bandwidth), 2 N x ceil(T / tile) x tile / (f x FLOP/s))
            + max(K/V bytes / (b x bandwidth), attention FLOPs / (f x FLOP/s))

N is the parameters a token's products use; the weights are read once for all T rows (Pope et al.
2022); of a prompt, only the last token needs logits, so the output head (vocabulary x hidden, the
size of an untied model's input embedding) multiplies one row per prompt, not T (vLLM computes a
prompt's logits at its last position; a tied model's head is not recorded apart and is charged on
every row); tensor cores compute whole tiles of rows, so a few rows cost a tile (Hopper's wgmma takes
64 rows per warpgroup); attention scores each new token against every cached position before it
(4 x layers x heads x head dim FLOPs per pair), and reads each sequence's K/V once. b and f are
the shares of the data sheet's bandwidth and FLOP/s that real kernels achieve. Named after what
they measure (PaLM, Chowdhery et al. 2022, for MFU):

- MBU, model bandwidth utilisation: the bytes a step must read / its time / the data sheet's bandwidth;
- MFU, model FLOPs utilisation: the FLOPs a step must do / its time / the data sheet's FLOP/s.

The data sheet's step is b = f = 1, a tile of 1 row, no overhead. `gpu_clock` fits b to torchao's
batch-1 measurement (a row since withdrawn from its README, slower than current engines' batch-1 steps; the
page "The H100 model, compared with measurements" states which way the clock errs); f and the tile are stated below, and `lib.gpu.published` holds the published
measurements the fitted clock is checked against (`validation`).
"""
import math
from dataclasses import dataclass, replace
from functools import cached_property

from lib.gpu.memory import GPU, H100, KVSpec, dtype_bytes, kv_budget
from lib.gpu.models import LLAMA_3_8B
from lib.gpu.published import LOGINET, PUBLISHED, TORCHAO

STEP_OVERHEAD = 0.5e-3  # seconds per step beyond bytes and FLOPs (scheduling, sampling, launches): stated, not measured
FLOPS_SHARE = 0.6  # share of the dense bf16 peak that a step's products reach (MFU of large GEMMs): stated with
# the one published prefill in view (VLLM_PREFILL in lib.gpu.published), so that check is not independent of it;
# `implied_flops_share` gives the share that record alone implies
TILE = 64  # rows a tensor-core product computes at once: Hopper's wgmma instructions take M = 64 per warpgroup


@dataclass(frozen=True)
class GPUClock:
    """Steps of `spec` on `gpu`: its weights in `dtype`, the achieved shares of the data sheet's
    bandwidth and FLOP/s, a fixed cost per step, tensor-core tiles of `tile` rows. The defaults are
    the data sheet's; `gpu_clock` gives the clock fitted to a published measurement. As a serving
    clock (`lib.serve.serve(cost=...)`) it prices a step given as rows (sequence, new tokens,
    cached positions before the step)."""
    spec: KVSpec = LLAMA_3_8B
    gpu: GPU = H100
    bandwidth_share: float = 1.0
    overhead: float = 0.0
    dtype: str = "bfloat16"
    flops_share: float = 1.0
    tile: int = 1

    @cached_property
    def params_per_token(self) -> float:
        """Parameters a token's products use: all but the gathered embedding rows; of an MoE, the experts it is sent to."""
        return self.spec.weight_bytes(self.dtype, batch=1) / dtype_bytes(self.dtype)

    @cached_property
    def head_params(self) -> float:
        """Parameters of the output head, which only a token that needs logits multiplies: an untied
        model's is its input embedding's shape; a tied model's is not recorded apart (0: every row pays it)."""
        return self.spec.embedding

    def product_flops(self, tokens: float, logits: float) -> float:
        """FLOPs of the weight products for `tokens` rows, of which `logits` go through the output head."""
        return 2 * ((self.params_per_token - self.head_params) * tokens + self.head_params * logits)

    @cached_property
    def flops_per_pair(self) -> int:
        """Attention FLOPs per (new token, cached position) pair: q.k and the weighted v, per layer and head."""
        return 4 * self.spec.n_layer * (self.spec.n_head or self.spec.n_kv_head) * self.spec.head_dim

    def seconds(self, weight_bytes: float, product_flops: float, kv_bytes: float, attention_flops: float) -> float:
        """One step: the weight products, read once or computed, then attention over each sequence's own K/V."""
        read, compute = self.bandwidth_share * self.gpu.bandwidth, self.flops_share * self.gpu.flops
        products = max(weight_bytes / read, product_flops / compute)
        attention = max(kv_bytes / read, attention_flops / compute)
        return self.overhead + products + attention

    def breakdown(self, tokens: int, kv_bytes: float, pairs: float, logits: int = None) -> dict:
        """A step of `tokens` new tokens whose attention reads `kv_bytes` of K/V and scores `pairs`
        (token, position) pairs, `logits` of them (default: all) through the output head: its seconds
        and their two terms, what it reads and computes, its MBU and MFU, and which roof bounds its
        weight products."""
        logits = tokens if logits is None else logits
        weights = self.spec.weight_bytes(self.dtype, batch=tokens)
        flops, attention_flops = self.product_flops(tokens, logits), self.flops_per_pair * pairs
        tiles = lambda rows: math.ceil(rows / self.tile) * self.tile
        charged = self.product_flops(tiles(tokens), tiles(logits))  # whole tiles of rows
        seconds = self.seconds(weights, charged, kv_bytes, attention_flops)
        read, compute = self.bandwidth_share * self.gpu.bandwidth, self.flops_share * self.gpu.flops
        products, attention = max(weights / read, charged / compute), max(kv_bytes / read, attention_flops / compute)
        return {"seconds": seconds, "products": products, "attention": attention,
                "weights": weights, "kv": kv_bytes, "flops": flops + attention_flops,
                "mbu": (weights + kv_bytes) / seconds / self.gpu.bandwidth,
                "mfu": (flops + attention_flops) / seconds / self.gpu.flops,
                "bound": "compute" if charged / compute > weights / read else "memory"}

    def decode_breakdown(self, batch: int, context: int, new: int = 1) -> dict:
        """The breakdown of a step of `batch` sequences fed `new` tokens each (a decode step, or the
        verification of new - 1 drafts), holding `context` positions each after it."""
        pairs = batch * (new * (context - new) + new * (new + 1) / 2)  # each new token against the positions up to it
        return self.breakdown(batch * new, self.spec.kv_bytes(context, batch, self.dtype), pairs)

    def decode_step(self, batch: int, context: int = 1024, new: int = 1) -> float:
        """Seconds of a step of `batch` sequences fed `new` tokens each (1: a decode step), `context` positions each."""
        return self.decode_breakdown(batch, context, new)["seconds"]

    def prefill_seconds(self, tokens: int, batch: int = 1) -> float:
        """Seconds of one step that computes `batch` prompts of `tokens` tokens each, from an empty cache:
        logits for each prompt's last token only."""
        return self.prefill_breakdown(tokens, batch)["seconds"]

    def prefill_breakdown(self, tokens: int, batch: int = 1) -> dict:
        """The breakdown of one step that computes `batch` prompts of `tokens` tokens each, from an empty cache."""
        kv = self.spec.kv_bytes(tokens, batch, self.dtype)
        return self.breakdown(batch * tokens, kv, batch * tokens * (tokens + 1) / 2, logits=batch)

    def __call__(self, rows) -> float:
        """Seconds of a serving step: each row (key, new tokens, cached positions before them[, tokens
        that need logits]); without the fourth field every new token does (a decode step, a verification;
        a prompt chunk needs at most its last)."""
        rows = [(*row, row[1]) if len(row) == 3 else tuple(row) for row in rows]
        if any(self.spec.windows):  # sliding windows: each sequence's cache is capped on its own
            kv = sum(self.spec.kv_bytes(start + n, 1, self.dtype) for _, n, start, _ in rows)
        else:  # full attention: bytes per position times every row's positions
            kv = self.spec.kv_bytes(1, 1, self.dtype) * sum(start + n for _, n, start, _ in rows)
        pairs = sum(n * start + n * (n + 1) / 2 for _, n, start, _ in rows)
        return self.breakdown(sum(n for _, n, _, _ in rows), kv, pairs, sum(o for *_, o in rows))["seconds"]

    def blocks(self, block_size: int = 16) -> int:
        """K/V blocks of `block_size` positions in the GPU's memory: the book's budget rule (`lib.gpu.memory.kv_budget`)."""
        free = kv_budget(self.gpu, self.spec.weight_bytes(self.dtype))
        return max(int(free // self.spec.kv_bytes(block_size, 1, self.dtype)), 0)

    def free(self, key) -> None:
        """Nothing to release: the clock keeps no state."""


def gpu_clock(spec: KVSpec = LLAMA_3_8B, gpu: GPU = H100, measured: float = 1 / TORCHAO.value,
              context: int = TORCHAO.context) -> GPUClock:
    """The clock whose bandwidth share makes its batch-1 step at `context` take `measured` seconds
    (default: torchao's Llama-3.1-8B on an H100), with the stated overhead, FLOP share and tile."""
    ideal = GPUClock(spec, gpu).decode_step(1, context)  # the data sheet's step, all of it reading at batch 1
    return GPUClock(spec, gpu, min(ideal / (measured - STEP_OVERHEAD), 1.0), STEP_OVERHEAD,
                    flops_share=FLOPS_SHARE, tile=TILE)


@dataclass(frozen=True)
class BentClock(GPUClock):
    """A clock whose K/V reads take `kv_factor` times the time its bandwidth share gives them: a step
    that grows faster with the batch at long context than the fitted clock's, where the fit's one share b
    prices both the weights and the K/V reads (the page "The H100 model, compared with measurements").
    Only the step's seconds are bent; a breakdown's terms stay the fitted clock's."""
    kv_factor: float = 1.0

    def seconds(self, weight_bytes: float, product_flops: float, kv_bytes: float, attention_flops: float) -> float:
        """The fitted clock's step, its K/V bytes read `kv_factor` times slower."""
        return super().seconds(weight_bytes, product_flops, kv_bytes * self.kv_factor, attention_flops)


def _fields(clock: GPUClock) -> dict:
    """A clock's fields, by name (shallow: the same spec and GPU), to build a variant of it."""
    return {f: getattr(clock, f) for f in clock.__dataclass_fields__}


def batch_gain(clock: GPUClock, batch: int, context: int) -> float:
    """Tokens/s of a decode step of `batch` sequences over one sequence's, both at `context` positions."""
    return batch * clock.decode_step(1, context) / clock.decode_step(batch, context)


def bent_clock(record=LOGINET, clock: GPUClock = None) -> BentClock:
    """`clock` (default: `gpu_clock()`) with its K/V reads slowed until its gain from one sequence to
    `record.batch` at `record.context` is the gain the record measured within one engine (Loginet:
    45 concurrent requests at 15.5 times one request's tokens/s)."""
    clock = clock or gpu_clock()
    bend = lambda k: BentClock(**_fields(clock), kv_factor=k)
    low, high = 0.1, 100.0
    for _ in range(60):  # the gain falls as the K/V reads slow: bisect on a log scale
        mid = math.sqrt(low * high)
        low, high = (mid, high) if batch_gain(bend(mid), record.batch, record.context) > record.gain else (low, mid)
    return bend(math.sqrt(low * high))


@dataclass(frozen=True)
class SequenceCostClock(GPUClock):
    """A clock that charges `per_sequence` seconds for each sequence in a step on top of its fixed cost: an
    engine's sampling, scheduling and detokenising, which grow with the batch (the page "The H100 model,
    compared with measurements" sets it beside the bent clock as the other way to slow a large batch)."""
    per_sequence: float = 0.0

    def decode_breakdown(self, batch: int, context: int, new: int = 1) -> dict:
        """The fitted clock's breakdown, its seconds plus `per_sequence` for each of the `batch` sequences."""
        step = dict(super().decode_breakdown(batch, context, new))
        step["seconds"] += self.per_sequence * batch
        return step

    def prefill_breakdown(self, tokens: int, batch: int = 1) -> dict:
        """The fitted clock's prefill, its seconds plus `per_sequence` for each of the `batch` prompts."""
        step = dict(super().prefill_breakdown(tokens, batch))
        step["seconds"] += self.per_sequence * batch
        return step

    def __call__(self, rows) -> float:
        """A serving step: the fitted clock's, plus `per_sequence` for each row's sequence."""
        return super().__call__(rows) + self.per_sequence * len({row[0] for row in rows})


def sequence_cost_clock(record=LOGINET, clock: GPUClock = None) -> SequenceCostClock:
    """`clock` (default: `gpu_clock()`) with a cost per sequence, chosen so that its gain from one sequence to
    `record.batch` at `record.context` is the gain the record measured, its bandwidth share refitted so that
    its batch-1 step at torchao's context stays the clock's (the fit point keeps agreeing)."""
    clock = clock or gpu_clock()
    at_fit, ideal = clock.decode_step(1, TORCHAO.context), GPUClock(clock.spec, clock.gpu).decode_step(1, TORCHAO.context)
    def charged(t1):  # the bandwidth share whose batch-1 step, with t1 charged once, is the clock's own
        return SequenceCostClock(**{**_fields(clock), "bandwidth_share": ideal / (at_fit - clock.overhead - t1)}, per_sequence=t1)
    low, high = 0.0, at_fit - clock.overhead - ideal  # beyond high the share would pass 1
    for _ in range(60):  # the gain falls as the cost per sequence grows: bisect
        mid = (low + high) / 2
        low, high = (mid, high) if batch_gain(charged(mid), record.batch, record.context) > record.gain else (low, mid)
    return charged((low + high) / 2)


def kv_read_clock(rate: float, clock: GPUClock = None) -> BentClock:
    """`clock` (default: `gpu_clock()`) with its K/V read at `rate` bytes/s instead of at its fitted bandwidth
    share, its weights read as before: a step priced at a published K/V read rate (chapter 5 takes the one that
    vLLM's fp8 KV-cache blog implies, chapter 7)."""
    clock = clock or gpu_clock()
    return BentClock(**_fields(clock), kv_factor=clock.bandwidth_share * clock.gpu.bandwidth / rate)


def run_seconds(clock: GPUClock, batch: int, input_len: int, output_len: int) -> float:
    """A throughput run: `batch` prompts of `input_len` computed in one step, which gives each its first
    token, then output_len - 1 decode steps of the whole batch."""
    decodes = sum(clock.decode_step(batch, input_len + j + 1) for j in range(1, output_len))
    return clock.prefill_seconds(input_len, batch) + decodes


def implied_flops_share(record, clock: GPUClock = None) -> float:
    """The FLOP share at which `clock` (default: `gpu_clock()`) meets a published throughput run exactly."""
    clock = clock or gpu_clock()
    at = lambda f: predict(record, replace(clock, flops_share=f)) / record.value
    low, high = 0.05, 1.0
    for _ in range(40):  # the prediction grows with the share: bisect
        low, high = (low, (low + high) / 2) if at((low + high) / 2) > 1 else ((low + high) / 2, high)
    return (low + high) / 2


def memory_bound_rows(clock: GPUClock) -> int:
    """The most rows a step's weight products take before its FLOPs, not its weight reads, set their time."""
    return next(t for t in range(1, 1 << 20) if clock.breakdown(t + 1, 0.0, 0.0)["bound"] == "compute")


def predict(record, clock: GPUClock) -> float:
    """The clock's figure for a published measurement, in the record's unit."""
    if record.k:  # the largest batch whose verification step (k + 1 rows a sequence) stays memory-bound
        return float(memory_bound_rows(clock) // (record.k + 1))
    if record.input_len:
        total = record.batch * (record.input_len + record.output_len)  # vLLM's total tokens
        return total / run_seconds(clock, record.batch, record.input_len, record.output_len)
    return record.batch / clock.decode_step(record.batch, record.context)


def validation(clock: GPUClock = None) -> list:
    """The validation table: per published measurement, the clock's prediction, the figure, their
    ratio, the band it must fall in, and the source (default clock: `gpu_clock()`)."""
    clock = clock or gpu_clock()
    table = []
    for record in PUBLISHED:
        predicted = predict(record, clock)
        ratio = predicted / record.value
        table.append({"measurement": record.name, "predicted": predicted, "published": record.value,
                      "unit": record.unit, "ratio": ratio, "band": record.band,
                      "within": record.band[0] <= ratio <= record.band[1], "source": record.source, "url": record.url,
                      "setup": record.setup, "why": record.why})
    return table
