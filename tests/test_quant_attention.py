"""The fused quantized read: paged attention straight from codes and scales equals dequantizing the
cache to float32 first and then attending, for every dtype and scale granularity; a batched step
on a quantized pool equals decoding each sequence alone through the same pool's float32 read."""
import numpy as np
import pytest
from conftest import GQA, perturbed_params
from hypothesis import given, settings
from hypothesis import strategies as st

from lib.cache import quant
from lib.cache.kv_cache import DTYPES
from lib.cache.paged import PagedKVCache
from lib.fast.batch import BatchedModel
from lib.fast.lean import LeanModel
from lib.fast.paged_kernel import attend_paged
from lib.kv_scales import kv_maxima
from lib.model import attention

KINDS = [(kind, g) for kind in DTYPES for g in (quant.GRANULARITIES if kind in quant.QUANTIZED else ("position",))]
PARAMS = perturbed_params(GQA, seed=7)


def _pool(kind, granularity, num_blocks=12, block_size=4):
    maxima = kv_maxima(PARAMS, GQA, np.arange(40) % GQA.vocab_size)
    return PagedKVCache(GQA, num_blocks, block_size, dtype=kind, granularity=granularity, maxima=maxima)


@pytest.mark.parametrize("kind,granularity", KINDS)
def test_fused_read_equals_dequantize_then_attend(kind, granularity):
    rng = np.random.default_rng(0)
    pool, lengths = _pool(kind, granularity), (5, 13, 1)
    seqs = [pool.add(b, np.arange(n) % GQA.vocab_size) for b, n in enumerate(lengths)]
    Hkv, H, D = GQA.n_kv_head, GQA.n_head, GQA.head_dim
    for seq, n in zip(seqs, lengths):  # random K/V in every layer, through the pool's own quantizing write
        blocks, offsets = seq._slots(0, n)
        for layer in range(GQA.n_layer):
            pool.store(layer, blocks, offsets, *rng.standard_normal((2, n, Hkv, D)).astype(np.float32))
    width = max(len(s.block_table) for s in seqs)
    tables = np.array([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])  # (B, width)
    seq, pos = np.array([0, 1, 1, 2]), np.array([4, 11, 12, 0])  # rows: a sequence and the position each sees up to
    q = rng.standard_normal((len(seq), H, D)).astype(np.float32)  # (R, H, D)
    for layer in range(GQA.n_layer):
        fused = attend_paged(q, pool, layer, tables, seq, pos, 1 / np.sqrt(D))  # (R, H, D)
        for r, (b, p) in enumerate(zip(seq, pos)):
            k, v = pool.load(layer, seqs[b].block_table, p + 1)  # (Hkv, p+1, D) float32, dequantized
            expected = attention(q[r][:, None], k, v)[:, 0]  # (H, D)
            np.testing.assert_allclose(fused[r], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("kind,granularity", KINDS)
def test_batched_step_on_a_quantized_pool_equals_each_sequence_alone(kind, granularity):
    """From the same cached codes, one batched step (the kernel's fused read) and each sequence's
    step alone (the pool's float32 read, then lib.model's attention) give the same logits."""
    model, new = LeanModel(PARAMS, GQA), [[1], [2], [3]]
    prompts = [np.arange(n) % GQA.vocab_size for n in (7, 3, 10)]
    pool = _pool(kind, granularity, num_blocks=24)
    seqs = [pool.add(b, p) for b, p in enumerate(prompts)]
    BatchedModel(model).feed(seqs, prompts)
    batched = BatchedModel(model).feed(seqs, new)
    for seq, p in zip(seqs, prompts):
        seq.truncate(len(p))
    for seq, token, logits in zip(seqs, new, batched):
        np.testing.assert_allclose(logits, seq.feed(token, model), rtol=1e-4, atol=1e-4)


def test_filled_pools_hold_the_positions_asked_for_in_fewer_bytes():
    """lib.book.studies.cachebytes' fixtures: every sequence holds `context` written positions, each storage form's
    cache bytes are its codes and scales (int8 about a quarter of float32, int4 an eighth, plus scales),
    and a timed step leaves the sequences as they were."""
    from lib.book.studies.cachebytes import cache_bytes, filled_pools
    from lib.measure.counting import pool_call
    B, L = 3, 10
    sizes = {}
    for kind in DTYPES:
        pool, seqs = filled_pools(GQA, (kind,), B, L, block_size=4)[kind]
        assert [s.n for s in seqs] == [L] * B
        sizes[kind] = cache_bytes(pool, B, L)
    per_value = B * L * 2 * GQA.n_layer * GQA.kv_dim  # K and V values in the cache
    assert sizes["float32"] == 4 * per_value and sizes["float16"] == 2 * per_value
    scales = B * L * 2 * GQA.n_layer * GQA.n_kv_head * 4  # one float32 scale per head and position, K and V
    assert sizes["int8"] == per_value + scales and sizes["fp8"] == per_value + scales
    assert sizes["int4"] == per_value // 2 + scales
    pool_call(LeanModel(PARAMS, GQA), seqs)()
    assert [s.n for s in seqs] == [L] * B


def test_filled_pools_hold_the_same_values_in_every_form():
    """filled_pools draws K/V once: each pool, read back as float32, holds the float32 pool's
    values to its own rounding."""
    from lib.book.studies.cachebytes import filled_pools
    pools = filled_pools(GQA, DTYPES, 2, 9, block_size=4)
    exact = [pools["float32"][0].load(layer, s.block_table, 9) for layer in range(GQA.n_layer)
             for s in pools["float32"][1]]
    for kind, (pool, seqs) in pools.items():
        got = [pool.load(layer, s.block_table, 9) for layer in range(GQA.n_layer) for s in seqs]
        for (k0, v0), (k, v) in zip(exact, got):
            top = np.abs(k0).max(axis=-1, keepdims=True)  # per position: the scale's reach
            np.testing.assert_allclose(k, k0, atol=float(top.max()) * (0.15 if kind == "int4" else 0.07))


@given(st.floats(-200.0, 0.0, allow_nan=False, width=32))
@settings(max_examples=300, deadline=None)
def test_the_kernels_exponential_is_float32_exact_to_a_few_ulp(x):
    """The softmax's polynomial exponential against numpy's, for every score minus its row's
    maximum (x <= 0); below -87 it stays at e^-87, where weights are far below float32's rounding."""
    from lib.fast.paged_kernel import exp_nonpositive
    got = exp_nonpositive(np.float32(x))
    expected = np.exp(np.float64(max(x, -87.0)))
    assert abs(got - expected) <= 4 * np.spacing(np.float32(expected))


def test_partial_blocks_and_grouped_heads_in_every_form():
    """Sequences whose last block is partly filled at every offset 1..bs, read by the fused kernel,
    equal dequantize-then-attend: the tails of the four-keys-at-a-time loops."""
    rng = np.random.default_rng(3)
    Hkv, H, D = GQA.n_kv_head, GQA.n_head, GQA.head_dim
    for kind in DTYPES:
        pool = PagedKVCache(GQA, 40, 8, prefix_caching=False, dtype=kind)
        lengths = range(1, 18)
        seqs = [pool.add(b, np.arange(n) % GQA.vocab_size) for b, n in enumerate(lengths)]
        for seq, n in zip(seqs, lengths):
            blocks, offsets = seq._slots(0, n)
            pool.store(0, blocks, offsets, *rng.standard_normal((2, n, Hkv, D)).astype(np.float32))
        width = max(len(s.block_table) for s in seqs)
        tables = np.array([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])
        seq, pos = np.arange(len(seqs)), np.array(lengths) - 1
        q = rng.standard_normal((len(seqs), H, D)).astype(np.float32)
        fused = attend_paged(q, pool, 0, tables, seq, pos, 0.125)
        for r, n in enumerate(lengths):
            k, v = pool.load(0, seqs[r].block_table, n)
            expected = attention(q[r][:, None] * np.float32(0.125 * np.sqrt(D)), k, v)[:, 0]
            np.testing.assert_allclose(fused[r], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
