"""The book's one GPU step formula (lib.gpu.step): its terms as its docstring states them, and the
fitted H100 clock against published measurements (lib.gpu.published), each within its stated band."""
from dataclasses import replace

import pytest

from lib.gpu.memory import GPU, H100, from_hf_config, kv_budget
from lib.gpu.models import LLAMA_3_8B, REAL_MODELS
from lib.gpu.published import LOGINET, PUBLISHED, TORCHAO, VLLM_PREFILL, VLLM_SWEEP
from lib.gpu.step import (
    FLOPS_SHARE,
    STEP_OVERHEAD,
    TILE,
    GPUClock,
    batch_gain,
    bent_clock,
    gpu_clock,
    implied_flops_share,
    kv_read_clock,
    memory_bound_rows,
    predict,
    sequence_cost_clock,
    validation,
)

SHEET = GPUClock(LLAMA_3_8B, H100)  # the data sheet: full bandwidth and FLOP/s, no overhead, no tiles
WEIGHTS = LLAMA_3_8B.weight_bytes(batch=1)  # 15.01 GB: all but the gathered embedding rows


def test_a_data_sheet_decode_step_reads_the_weights_and_every_cache_once():
    assert SHEET.decode_step(1, 1024) == pytest.approx((WEIGHTS + 131072 * 1024) / 3.35e12)
    assert SHEET.decode_step(16, 1024) == pytest.approx((WEIGHTS + 16 * 131072 * 1024) / 3.35e12)


def test_the_weight_products_turn_compute_bound_at_the_ridge_whatever_the_cache():
    assert memory_bound_rows(SHEET) == int(H100.flops / H100.bandwidth)  # 295: 2 FLOPs per 2-byte weight per row
    short, long = SHEET.decode_breakdown(1024, 128), SHEET.decode_breakdown(1024, 8192)
    assert short["bound"] == long["bound"] == "compute" and SHEET.decode_breakdown(256, 8192)["bound"] == "memory"
    slow = GPUClock(LLAMA_3_8B, GPU("slow math", 80e9, 3.35e12, 1e12))  # K/V added to the products' compute
    step = slow.decode_breakdown(64, 16)
    products = 2 * (WEIGHTS / 2) * 64 / 1e12
    assert step["bound"] == "compute"
    assert step["seconds"] == pytest.approx(products + 64 * 131072 * 16 / 3.35e12, rel=1e-3)


def test_tiles_make_a_few_rows_cost_a_whole_tile():
    slow = GPUClock(LLAMA_3_8B, GPU("slow math", 80e9, 3.35e12, 1e11), tile=64)  # compute-bound from one row
    assert slow.breakdown(1, 0.0, 0.0)["seconds"] == slow.breakdown(64, 0.0, 0.0)["seconds"]
    assert slow.breakdown(65, 0.0, 0.0)["seconds"] == pytest.approx(2 * slow.breakdown(64, 0.0, 0.0)["seconds"])
    assert slow.breakdown(1, 0.0, 0.0)["flops"] == pytest.approx(WEIGHTS)  # MFU counts the FLOPs the step needs


def test_a_prompt_pays_the_output_head_for_its_last_token_only():
    head = 128256 * 4096  # Llama-3-8B's untied head: the input embedding's shape
    assert SHEET.head_params == head
    body = WEIGHTS / 2 - head
    prefill = SHEET.prefill_breakdown(4096, batch=2)
    assert prefill["flops"] == pytest.approx(2 * (body * 2 * 4096 + head * 2) + SHEET.flops_per_pair * 2 * 4096 * 4097 / 2)
    decode = SHEET.decode_breakdown(8, 100)  # every decode token needs its logits
    assert decode["flops"] == pytest.approx(2 * (WEIGHTS / 2) * 8 + SHEET.flops_per_pair * 8 * 100)


def test_mbu_and_mfu_are_the_needed_bytes_and_flops_over_the_data_sheet():
    clock = gpu_clock()
    step = clock.decode_breakdown(8, 2048)
    assert step["mbu"] == pytest.approx((step["weights"] + step["kv"]) / step["seconds"] / H100.bandwidth)
    assert step["mfu"] == pytest.approx(step["flops"] / step["seconds"] / H100.flops)
    assert clock.decode_breakdown(1, TORCHAO.context)["mbu"] == pytest.approx(126.90 * (WEIGHTS + 131072 * 200) / 3.35e12)


def test_the_fitted_clock():
    clock = gpu_clock()
    assert clock.decode_step(1, TORCHAO.context) == pytest.approx(1 / 126.90)  # torchao's batch-1 step
    assert 0.55 < clock.bandwidth_share < 0.65 and clock.overhead == STEP_OVERHEAD
    assert clock.flops_share == FLOPS_SHARE and clock.tile == TILE
    assert clock.decode_step(16, 200) < 1.05 * clock.decode_step(1, 200)  # weights dominate: 16 cost about 1
    assert clock([(0, 1, 199)]) == pytest.approx(clock.decode_step(1, 200))  # rows and (batch, context) agree
    assert clock([(i, 1, 99) for i in range(4)]) == pytest.approx(clock.decode_step(4, 100))
    assert clock([(i, 5, 95) for i in range(4)]) == pytest.approx(clock.decode_step(4, 100, new=5))  # a verification
    assert clock([(0, 2000, 0)]) > 2 * clock.decode_step(1, 200)  # a long prompt is compute-bound
    assert clock.prefill_seconds(2000) == pytest.approx(clock([(0, 2000, 0, 1)]))  # logits for its last token
    assert clock.prefill_seconds(2000) < clock([(0, 2000, 0)])  # a row without the field: every token's logits
    assert clock.blocks() == int(kv_budget(H100, LLAMA_3_8B.weight_bytes()) // (16 * 131072))


def test_a_step_reads_and_computes_with_what_its_tokens_use():
    """A mixture of experts at batch 1 reads and computes with its routed experts only; the
    embedding's rows are gathered, not read."""
    moe = from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "vocab_size": 100,
                          "tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2,
                          "intermediate_size": 32}, "moe", 1e6)
    experts = 2 * 8 * 3 * 64 * 32  # layers x experts x 3 matrices of hidden x intermediate
    used = 1e6 - 100 * 64 - experts * 6 / 8  # one token: 2 of 8 experts, no embedding
    clock = GPUClock(moe, H100)
    one = clock.decode_breakdown(1, 1)
    assert one["weights"] == pytest.approx(2 * used)
    assert one["flops"] == pytest.approx(2 * used + clock.flops_per_pair)
    assert clock.decode_breakdown(64, 1)["weights"] > one["weights"]  # more experts touched


@pytest.mark.parametrize("record", PUBLISHED, ids=[r.name for r in PUBLISHED])
def test_the_clock_within_its_band_of_each_published_measurement(record):
    row = next(row for row in validation() if row["measurement"] == record.name)
    low, high = record.band
    assert low <= row["ratio"] <= high, (f"{record.name}: predicted {row['predicted']:.1f} against published "
                                         f"{record.value} {record.unit} ({row['ratio']:.2f}, band {low}..{high}): "
                                         f"{record.why}")
    assert record.url.startswith("https://") and record.figure and record.setup


def test_the_sweep_is_quoted_in_order_and_its_batches_are_memory_bound_on_the_clock():
    """The H100 model page reads a throughput that stops growing over a 4x batch as a limit outside the GPU's
    step: that holds only while the clock's step stays memory-bound at every batch the sweep ran."""
    concurrency = [n for n, _, _ in VLLM_SWEEP.points]
    assert concurrency == sorted(concurrency) and VLLM_SWEEP.url.startswith("https://") and VLLM_SWEEP.figure
    clock = gpu_clock()
    assert all(clock.decode_breakdown(n, VLLM_SWEEP.context)["bound"] == "memory" for n in concurrency)


@pytest.mark.parametrize("spec", [LLAMA_3_8B] + [m for m in REAL_MODELS if any(m.windows)][:1], ids=lambda s: s.name)
def test_a_serving_step_reads_each_rows_own_cache(spec):
    """The serving clock's step (rows: key, new tokens, cached positions) reads each sequence's K/V up
    to its last new token, capped by any sliding window, and scores each new token against the
    positions up to it."""
    clock = gpu_clock(spec)
    rows = [(0, 1, 100), (1, 5, 7000), (2, 300, 0)]
    kv = sum(spec.kv_bytes(start + n) for _, n, start in rows)
    pairs = sum(n * start + n * (n + 1) / 2 for _, n, start in rows)
    assert clock(rows) == pytest.approx(clock.breakdown(306, kv, pairs)["seconds"])


def test_the_flop_share_a_throughput_run_implies_meets_it():
    f = implied_flops_share(VLLM_PREFILL)
    assert 0.3 < f < 1.0
    assert predict(VLLM_PREFILL, replace(gpu_clock(), flops_share=f)) == pytest.approx(VLLM_PREFILL.value, rel=1e-6)


def test_the_bent_clock_grows_with_the_batch_as_the_record_measured():
    fitted, bent = gpu_clock(), bent_clock(LOGINET)
    assert batch_gain(bent, LOGINET.batch, LOGINET.context) == pytest.approx(LOGINET.gain, rel=1e-6)
    assert batch_gain(fitted, LOGINET.batch, LOGINET.context) > LOGINET.gain  # the fitted clock grows less
    assert bent.kv_factor > 1  # so its K/V reads are slowed
    rows = [(0, 1, 300), (1, 2, 500)]  # only the K/V reads are bent: the weights' time is the fitted clock's
    kv = LLAMA_3_8B.kv_bytes(1, 1) * (301 + 502)
    read = fitted.bandwidth_share * H100.bandwidth
    assert bent(rows) - fitted(rows) == pytest.approx((bent.kv_factor - 1) * kv / read, rel=1e-9)


def test_a_cost_per_sequence_grows_with_the_batch_as_the_record_measured():
    fitted, charged = gpu_clock(), sequence_cost_clock(LOGINET)
    assert batch_gain(charged, LOGINET.batch, LOGINET.context) == pytest.approx(LOGINET.gain, rel=1e-6)
    assert charged.per_sequence > 0  # a cost that grows with the batch
    at = TORCHAO.context  # the fit point keeps agreeing: the share is refitted around the cost
    assert charged.decode_step(1, at) == pytest.approx(fitted.decode_step(1, at), rel=1e-9)
    assert charged.bandwidth_share > fitted.bandwidth_share
    one = replace(fitted, bandwidth_share=charged.bandwidth_share)  # the same clock without the cost
    assert charged.decode_step(8, 1024) - one.decode_step(8, 1024) == pytest.approx(8 * charged.per_sequence)
    rows = [(0, 1, 300), (0, 1, 301), (1, 2, 500)]  # two sequences: two costs
    assert charged(rows) - one(rows) == pytest.approx(2 * charged.per_sequence)


def test_a_clock_at_another_kv_read_rate_changes_only_its_kv_term():
    fitted = gpu_clock()
    own = fitted.bandwidth_share * H100.bandwidth  # bytes/s: the fitted clock's own K/V read rate
    assert kv_read_clock(own, fitted).decode_step(16, 4096) == pytest.approx(fitted.decode_step(16, 4096))
    kv_time = fitted.decode_breakdown(16, 4096)["attention"]  # memory-bound: the K/V bytes at the fitted rate
    assert fitted.decode_step(16, 4096) - kv_read_clock(2 * own, fitted).decode_step(16, 4096) == pytest.approx(kv_time / 2)
