"""Where a quantized KV cache pays: batched decode steps at batch x context where the cache's
bytes reach and pass the weights', timed for each storage form and predicted beforehand.

A decode step reads every weight once for the whole batch, and every sequence's K and V once
for itself: at batch B and context L the cache's share of the bytes is B x L x (bytes per
position) against the weights (Pope et al. 2022). Storing it in fewer bits (KIVI, Liu et al.
2024; vLLM's fp8 cache) can only shorten a step when those bytes are a large part of what it
reads, and only if attention reads the codes where they lie: the paged kernel of `lib.fast.batch`
does (`attend_paged`). The sequences' K and V are random values of the model's shapes, written
through the pool's own quantizing store: attention's cost depends on the shapes, not the values.

The stand-in here is the 12x768 one with GPT-2 small's own context of 1,024 positions
(`LONG_STANDIN`), so the cache can reach about four times the weights' bytes at a batch of 16.

The prediction adds two parts: the step without its attention, from `lib.measure.costmodel` (the
counted numpy work of a call over B new rows), and attention, as the larger of its bytes at the
read bandwidth of the step's working set and its values at the kernel's own rate per value,
measured on one layer of a few sequences (`kernel_seconds_per_value`).
"""
import dataclasses

import numpy as np

from lib.cache.kv_cache import DTYPES
from lib.cache.paged import PagedKVCache
from lib.fast.paged_kernel import attend_paged
from lib.fast.lean import LeanModel
from lib.measure.costmodel import lean_builder, predict_calls
from lib.measure.counting import pool_call
from lib.measure.standins import STANDINS, weight_bytes
from lib.model import init_params
from lib.timing import median_time

LONG_STANDIN = dataclasses.replace(STANDINS["12x768"], block_size=1024)  # GPT-2 small: 12 x 768, 1,024 positions


def long_standin() -> LeanModel:
    """The lean model of LONG_STANDIN, GPT-2's initialisation of its shape (random weights, for timing only)."""
    return LeanModel(init_params(LONG_STANDIN), LONG_STANDIN)


def filled_pools(cfg, dtypes, batch: int, context: int, block_size: int = 16, seed: int = 0) -> dict:
    """{dtype: (pool, sequences)}: a paged pool of each dtype with `batch` sequences of `context`
    written positions, all holding the same random K/V (standard normal values, as a trained
    model's are in scale), drawn once and written through each pool's own quantizing store."""
    rng = np.random.default_rng(seed)
    blocks = batch * -(-(context + 1) // block_size)
    pools = {d: PagedKVCache(cfg, blocks, block_size, prefix_caching=False, dtype=d) for d in dtypes}
    seqs = {d: [pool.add(b, np.zeros(context, np.int64)) for b in range(batch)] for d, pool in pools.items()}
    Hkv, D = cfg.n_kv_head, cfg.head_dim
    for b in range(batch):
        kv = [rng.standard_normal((2, Hkv, context, D), dtype=np.float32) for _ in range(cfg.n_layer)]

        def write(tokens, cache):  # a step that writes this sequence's K/V in every layer
            for layer in range(cfg.n_layer):
                cache.write(layer, *kv[layer])
            cache.advance(len(tokens))
        for d in dtypes:
            seqs[d][b].feed(np.zeros(context, np.int64), write)
    return {d: (pools[d], seqs[d]) for d in dtypes}


def kernel_seconds_per_value(cfg, dtypes=DTYPES, batch: int = 4, context: int = 511) -> dict:
    """{dtype: seconds the paged kernel spends per cached K or V value it reads}, over one layer of
    `batch` sequences of `context` positions (larger than the L2 cache, so it streams): the
    kernel's own rate, bytes and arithmetic together (`context` capped at the model's)."""
    context = min(context, cfg.block_size - 1)
    rates = {}
    for dtype, (pool, seqs) in filled_pools(cfg, dtypes, batch, context).items():
        width = max(len(s.block_table) for s in seqs)
        tables = np.array([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])  # (B, width)
        q = np.random.default_rng(1).standard_normal((batch, cfg.n_head, cfg.head_dim)).astype(np.float32)  # (R, H, D)
        rows, pos = np.arange(batch), np.full(batch, context - 1)
        run = lambda: attend_paged(q, pool, 0, tables, rows, pos, 1.0)
        rates[dtype] = median_time(run, repeats=7, min_seconds=0.05) / (2 * cfg.n_head * batch * context * cfg.head_dim)
    return rates


def cache_bytes(pool, batch: int, context: int) -> int:
    """Bytes of K/V codes and per-slot scales that a step over `batch` x `context` positions reads."""
    per_position = pool.nbytes / (pool.manager.num_blocks * pool.manager.block_size)
    return int(per_position * batch * context)


def predict_other_work(machine, model, params, batch: int) -> float:
    """Seconds of a batched decode step's work other than attention over the cache, from the cost
    model: the model's work for `batch` new rows, counted as one call over `batch` tokens, less
    its attention products. The same for every storage form."""
    cfg = model.cfg
    call = predict_calls(machine, lean_builder(cfg), params, cfg, 0, (batch,), model.products)[batch]
    return call.seconds - call.parts["attention products"]


def predict_attention(machine, model, batch: int, context: int, kv_bytes: int, per_value: float) -> float:
    """Seconds of attention over `kv_bytes` of cache at the read bandwidth of the step's working
    set, or at `per_value` seconds per cached value read if that is slower."""
    cfg = model.cfg
    values = 2 * cfg.n_layer * cfg.n_head * batch * context * cfg.head_dim
    return max(kv_bytes / machine.bandwidth(weight_bytes(model) + kv_bytes), values * per_value)


def storage_sweep(machine, model, params, points, dtypes=DTYPES, rounds: int = 5) -> dict:
    """{(batch, context, dtype): dict(seconds, predicted, attention, kv_bytes, per_value, ratios)} for
    every point and storage form, each predicted before it is timed. At each point the forms'
    steps are timed in turn, `rounds` times, so a drift of the machine's speed reaches them all;
    `ratios` are each round's time over the first form's (float32) in the same round."""
    rates = kernel_seconds_per_value(model.cfg, dtypes)
    rows = {}
    for batch, context in points:
        other = predict_other_work(machine, model, params, batch)
        pools = filled_pools(model.cfg, dtypes, batch, context)
        for dtype, (pool, _) in pools.items():
            kv = cache_bytes(pool, batch, context)
            attention = predict_attention(machine, model, batch, context, kv, rates[dtype])
            rows[batch, context, dtype] = dict(predicted=other + attention, attention=attention, kv_bytes=kv,
                                               per_value=rates[dtype])
        steps = {dtype: pool_call(model, seqs) for dtype, (_, seqs) in pools.items()}
        for step in steps.values():
            step()  # warm-up
        times = np.array([[median_time(steps[d], repeats=1, warmup=0) for d in dtypes] for _ in range(rounds)])
        for j, dtype in enumerate(dtypes):
            rows[batch, context, dtype].update(seconds=float(np.median(times[:, j])), ratios=times[:, j] / times[:, 0])
        del pools, steps
    return rows
