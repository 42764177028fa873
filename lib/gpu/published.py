"""Published measurements of Llama-3.1-8B on one H100 (bf16, but Loginet's fp16; vLLM's speculation
example names no GPU), each as its source states it (the figure quoted exactly, its setup, the page),
and the band within which `lib.gpu.step.validation` holds the book's one step formula to it, with why
that band. The bands were set knowing each source's setup, not blind.

Kinds: a batch-1 decode (two engines), decode throughput at a large batch (two engines), a
prefill, and a speculative-decoding switch point. The clock takes its bandwidth share from the
first (`TORCHAO`), so that one agrees by construction; the others are checks. Apart from them, one
engine's concurrency sweep (`VLLM_SWEEP`), shown point by point beside the clock.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """Where a published figure comes from, as its source gives it."""
    name: str
    source: str  # title, and where in it
    url: str
    date: str
    setup: str  # GPU, model, dtype, engine, batch or workload, lengths, client, as the source gives them
    figure: str  # the source's figure or table, quoted


@dataclass(frozen=True)
class Published(Source):
    value: float
    unit: str
    band: tuple  # (low, high) for predicted / published
    why: str  # why that band
    batch: int = 1  # sequences decoding at once
    context: int = 0  # positions each sequence holds (a decode measured at one context)
    input_len: int = 0  # prompt tokens per request (a throughput run)
    output_len: int = 0  # generated tokens per request
    k: int = 0  # draft tokens per step (speculative decoding)
    gain: float = 0.0  # the source's throughput at `batch` over one request's, where it states one


TORCHAO = Published(
    "torchao, batch 1", "torchao quantization README, 'CUDA backend | NVIDIA-H100 GPU' table, Base (bfloat16)",
    "https://github.com/pytorch/ao/blob/886ac8e90e14592b2afc3a8fc62af9a71996954a/torchao/quantization/README.md", "2024-10",
    "one H100, Llama-3.1-8B, bfloat16, torch.compile (gpt-fast's generate.py), batch 1, 200 new tokens after a short prompt",
    "126.90 tokens/s (1904.75 GB/s, peak memory 16.75 GB)", 126.90, "tokens/s",
    (0.99, 1.01), "the clock's bandwidth share is fitted to it: it agrees by construction",
    context=200)  # positions: the 200 generated tokens after a short prompt
# The README dropped this row on 2026-01-05 (pytorch/ao pull request 3551, "deleting the old outdated
# benchmarks"); its current H100 table has no batch-1 row, so the pinned commit above stays the fit point.

SGLANG = Published(
    "SGLang, batch unstated", "SGLang docs, Speculative Decoding, 'Performance Highlights' table (its EAGLE-3 rows after "
    "Li et al. 2025, arXiv 2503.01840; the page states no batch size or dtype)",
    "https://docs.sglang.io/advanced_features/speculative_decoding.html", "2025",
    "1x H100, LLaMA-Instruct 3.1 8B, SGLang without speculation, MT-bench prompts (batch not stated; taken as 1)",
    "SGLang (w/o speculative, 1x H100): 158.34 tokens/s", 158.34, "tokens/s",
    (0.7, 1.0), "another engine, taken at batch 1 (CUDA graphs, other kernels), faster than torchao's step: the "
    "torchao-fitted clock should be slower, within 30%; MT-bench's prompts are not given: taken at torchao's "
    "200 positions", context=200)

VLLM_DECODE = Published(
    "vLLM decode, batch 128", "torchao docs, Quantized Inference, 'Performance benchmarks: NVIDIA H100', bfloat16 row",
    "https://docs.pytorch.org/ao/main/workflows/inference.html", "2026-02",
    "H100, meta-llama/Llama-3.1-8B, bfloat16, torch 2.9.0, vllm 0.13.0: vllm bench throughput --num_prompts 128 "
    "--input_len 32 --output_len 2048 (all 128 at once); the figure is vLLM's total (input + output) tokens/s",
    "decode toks/s 6612", 6612.0, "tokens/s",
    (0.8, 1.35), "a large batch whose K/V reads grow to 2,080 positions: attention kernels and the scheduler "
    "are not the products the clock was fitted on; within 35%", batch=128, input_len=32, output_len=2048)

VLLM_PREFILL = Published(
    "vLLM prefill, 32 x 4,096", "torchao docs, Quantized Inference, 'Performance benchmarks: NVIDIA H100', bfloat16 row",
    "https://docs.pytorch.org/ao/main/workflows/inference.html", "2026-02",
    "H100, meta-llama/Llama-3.1-8B, bfloat16, torch 2.9.0, vllm 0.13.0: vllm bench throughput --num_prompts 32 "
    "--input_len 4096 --output_len 32; the figure is vLLM's total (input + output) tokens/s",
    "prefill toks/s 30946.5", 30946.5, "tokens/s",
    (0.8, 1.25), "the FLOP share is stated (0.6) with this figure in view, so the check is loose; at vLLM's default "
    "token budget on an H100 (16,384 per step) the prompts fill about eight compute-bound steps, the budget's edge "
    "splitting some once decodes join them, where the clock prices one step of 32 (under 0.1% apart); within 25%", batch=32, input_len=4096, output_len=32)

LOGINET = Published(
    "SGLang, 45 concurrent", "Loginet, The impact of concurrent requests on LLM inference performance: a case study "
    "with Llama-3.1-8B", "https://loginet.com/blog/llm-inference-performance-ai-applications", "2025-01-17",
    "NVIDIA H100 SXM5 80GB, Llama-3.1-8B-Instruct, FP16, sglang, a fixed 3000-token system prompt and 100-500 "
    "tokens of user input per request, streamed",
    "maximum throughput of 1,724 tokens/second at 45 concurrent requests; '15.5 times improvement over "
    "single-request'", 1724.0, "tokens/s",
    (0.9, 1.7), "measured at a client, through a 51 ms network: its tokens/s include each request's wait for its "
    "first token and the engine's work per sequence (scheduling, sampling, streaming each token), which the clock's "
    "pure decode steps do not charge; the prefills are short (SGLang's radix cache, on by default, keeps the fixed "
    "system prompt, so each arrival computes only its own 100-500 tokens): the clock should be faster, by up to 70%",
    batch=45, context=3300, gain=15.5)  # 3,000 + about 300 prompt tokens per sequence

VLLM_DYNAMIC_SD = Published(
    "vLLM dynamic speculation", "vLLM docs, Dynamic Speculative Decoding, the Llama-3.1-8B EAGLE example",
    "https://docs.vllm.ai/en/latest/features/speculative_decoding/dynamic_speculative_decoding/", "2026",
    "meta-llama/Llama-3.1-8B-Instruct with the EAGLE head yuhuili/EAGLE-LLaMA3.1-Instruct-8B, "
    "num_speculative_tokens 3; the GPU is not stated",
    "[1, 64, 3], [65, 128, 1], [129, 512, 0]: K=3 up to 64 sequences, K=1 from 65 to 128, none from 129", 64.0,
    "sequences (the largest batch verifying 3 drafts)",
    (0.5, 2.0), "an example configuration, not a measured crossover, on an unstated GPU; the clock predicts "
    "only where a step of batch x (K + 1) rows turns compute-bound, not the draft's cost or acceptance: "
    "within a factor of 2. The same page's EAGLE-3 example for this model sets K=5 only up to 16 sequences "
    "and K=4 up to 32: the rule puts K=4's turn inside the band and K=5's outside it (chapters 9 and 11 "
    "print both)", k=3)

PUBLISHED = (TORCHAO, SGLANG, VLLM_DECODE, LOGINET, VLLM_PREFILL, VLLM_DYNAMIC_SD)


@dataclass(frozen=True)
class Sweep(Source):
    """One engine's decode measured at several concurrencies, as its source gives it: the H100 model page sets
    each point beside the clock's step, as a check of how the step grows with the batch, not a fit. Not in
    `PUBLISHED` (whose rows carry bands)."""
    points: tuple  # (concurrency, throughput in tokens/s, TPOT p50 in ms), in the source's order
    context: int  # positions a sequence holds mid-answer (prompt and half the longest answer)


VLLM_SWEEP = Sweep(
    "vLLM 0.21 concurrency sweep", "InferenceBench docs, 'Recipe: concurrency sweep', its summary table (the "
    "repository's docs/recipes/concurrency-sweep.md, commit 1a865f62a7e51f3d8f133b46452a5b18a2f2bd7e)",
    "https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/", "2026-05-16",
    "one H100-80GB-HBM3, meta-llama/Llama-3.1-8B-Instruct, fp16, vLLM 0.21.0 (OpenAI server); suite "
    "llm.inference.chatbot-short: a closed loop of 1, 4, 16 or 64 workers, each a Python thread sending ten short "
    "built-in questions in turn, streamed through LiteLLM, max_tokens 128; TPOT = (total - TTFT) / (tokens - 1) "
    "at the client",
    "conc 1: 122.2 tok/s, tpot_p50_ms 6.48; 4: 580.3, 6.59; 16: 1,384.2, 10.94; 64: 1,312.3, 46.91",
    ((1, 122.2, 6.48), (4, 580.3, 6.59), (16, 1384.2, 10.94), (64, 1312.3, 46.91)),
    context=100)  # a templated one-line question (about 40 tokens) and half of at most 128 generated


@dataclass(frozen=True)
class MemoryLog:
    """An engine's start-up log of the memory it keeps for the KV cache on one GPU, as its source gives
    it (GiB as the log prints them): chapter 4 holds the KV formula and the book's budget rule to it. A
    memory record, not a timing: the clock's checks (`PUBLISHED`) do not use it."""
    name: str
    source: str  # title, and where in it
    url: str
    date: str
    setup: str  # model, GPU, TP, share, as the source gives them ("" parts: not stated)
    figure: str  # the source's figure, quoted
    kv_gib: float  # GiB per GPU for the cache
    tokens: int = 0  # the cache's capacity in tokens, where logged
    tp: int = 1  # GPUs under tensor parallelism
    gpu: str = ""  # the GPU, where the source names it
    total_gib: float = 0.0  # the CUDA runtime's total memory, where logged
    weights_gib: float = 0.0  # the weights, where logged
    non_torch_gib: float = 0.0  # memory allocated outside PyTorch (the CUDA context, NCCL's buffers)
    activations_gib: float = 0.0  # the profiling pass's activation peak


LMCACHE_FAQ = "https://github.com/LMCache/LMCache/pull/1769/files"
LMCACHE_SOURCE = ("LMCache docs, FAQ, table 'KV Cache Sizes for Popular Models' (added in LMCache PR 1769; the "
                  "current FAQ no longer holds it; it names no engine, its 16-token multiples and GiB units "
                  "suggest vLLM's log)")

LMCACHE_QWEN3_8B = MemoryLog(
    "Qwen3-8B, one GPU", LMCACHE_SOURCE, LMCACHE_FAQ, "2025",
    "Qwen3-8B, bf16, TP 1; the GPU, the engine's version and its memory share not stated",
    "Qwen3-8B: 50.32 GiB, 366,400 tokens", 50.32, 366_400)

LMCACHE_QWEN3_32B = MemoryLog(
    "Qwen3-32B, TP 2", LMCACHE_SOURCE, LMCACHE_FAQ, "2025",
    "Qwen3-32B, bf16, TP 2 on H100s; the engine's version and its memory share not stated",
    "Qwen3-32B (TP 2, H100): 33.66 GiB, 275,760 tokens", 33.66, 275_760, tp=2, gpu="H100")

LMCACHE_LLAMA_70B = MemoryLog(
    "Llama-3.1-70B, TP 4", LMCACHE_SOURCE, LMCACHE_FAQ, "2025",
    "Llama-3.1-70B, bf16, TP 4 on H100s; the engine's version and its memory share not stated",
    "Llama-3.1-70B (TP 4, H100): 32.06 GiB, 420,208 tokens", 32.06, 420_208, tp=4, gpu="H100")

VLLM_PROFILE = MemoryLog(
    "vLLM's memory profile, Llama-3-8B", "vLLM PR 10511 ('[core] overhaul memory profiling and fix backward "
    "compatibility'), youkaichao's sanity-check comment, `vllm serve meta-llama/Meta-Llama-3-8B`",
    "https://github.com/vllm-project/vllm/pull/10511", "2024-12-13",
    "Meta-Llama-3-8B, bf16, TP 1, gpu_memory_utilization 0.90; the GPU not named (the total is an 80 GB "
    "H100's: vLLM PR 12126 logs the same total on one); before v0.21, so no CUDA graphs counted",
    "total_gpu_memory 79.22GiB, model weights take 14.96GiB, non_torch_memory 1.79GiB, PyTorch activation "
    "peak memory 1.26GiB, available_kv_cache_memory 53.29GiB (non_torch_memory 3.58GiB at -tp 2)",
    53.29, total_gib=79.22, weights_gib=14.96, non_torch_gib=1.79, activations_gib=1.26)

MEMORY_LOGS = (LMCACHE_QWEN3_8B, LMCACHE_QWEN3_32B, LMCACHE_LLAMA_70B)  # the capacities: GiB and tokens


@dataclass(frozen=True)
class GraphTiming:
    """An engine's published decode rate at batch 1 without and with CUDA graphs, as its source gives it: chapters 11
    and 12 quote it. Another model and GPU than the records above: the clock's checks (`PUBLISHED`) do not use it."""
    name: str
    source: str  # title, and where in it
    url: str
    date: str
    setup: str  # GPU, model, quantization, engine, batch, as the source gives them
    figure: str  # the source's figure, quoted
    eager: float  # tokens/s without CUDA graphs
    graphs: float  # tokens/s with them

    @property
    def speedup(self) -> float:
        """Seconds per token without graphs over with them."""
        return self.graphs / self.eager


LLAMA_CPP_GRAPHS_H100 = GraphTiming(
    "llama.cpp CUDA graphs, H100-PCIe", "llama.cpp issue 6763, 'New optimization from NVIDIA to use CUDA Graphs in "
    "llama.cpp' (Alan Gray, NVIDIA)", "https://github.com/ggml-org/llama.cpp/issues/6763", "2024-04-19",
    "H100-PCIe, llama-2-7b.Q4_K_M (4-bit), llama.cpp with --n-gpu-layers 100 -n 128, batch 1",
    "inference for llama-2-7b.Q4_K_M on H100-PCIe (with --n-gpu-layers 100 -n 128) the performance goes from "
    "143.35 to 163.83 tokens per second (14% speedup)", 143.35, 163.83)


# Published K/V read rates of decode attention on an H100 (chapter 5 sets them beside the fitted clock's).
FLASHINFER_BLOG = "https://flashinfer.ai/2024/02/02/introduce-flashinfer.html"
# "Accelerating Self-Attentions for LLM Serving with FlashInfer" (February 2024), Figure 9, "Batch GQA decode
# performance": H100 SXM 80GB, Llama 2 70B at tensor parallelism 2 (4 K/V heads, 32 query heads of 128 per GPU),
# batch 64; bandwidth utilisation = bytes the kernel reads / its latency / 3,352 GB/s, L2 flushed before each
# launch. Read off the plot at 4,096 positions per request, to about two points:
FLASHINFER_GQA_H100 = {"FlashInfer, tensor cores": 0.82, "FlashInfer, CUDA cores": 0.49, "vLLM v0.2.6": 0.28}
FLASHINFER_GQA_BATCH, FLASHINFER_GQA_CONTEXT, FLASHINFER_GQA_GROUP = 64, 4096, 8
FLASHINFER_GQA_SPEEDUP = 3  # the blog's own text: "FlashInfer w/ Tensor Cores is 3x faster than vLLM PagaAttention when `batch_size=64`"


@dataclass(frozen=True)
class CacheLines:
    """Lines a source fitted to decode time against context for bf16 and fp8 KV caches, one request at a
    time, as it gives them: chapter 11 prices the fp8 cache at its measured cost per cached token. Chapters 5, 7
    and 8 quote the same lines. Not a clock check (`PUBLISHED`)."""
    name: str
    source: str  # title, and where in it
    url: str
    date: str
    setup: str  # GPU, model, engine, batch, as the source gives them
    figure: str  # the source's figures, quoted
    slope_ratio: float  # fp8's time per cached token over bf16's
    bf16_slope: float  # seconds the bf16 step grows per token of context (the fitted line's slope)
    bf16_ms: float  # the step at zero context, bf16 cache
    fp8_ms: float  # the same, fp8 cache: the fp8 path's fixed work is the difference

    def kv_read_rate(self, model) -> float:
        """Bytes per second the bf16 line reads K/V at: one more position's K/V in every layer of `model`
        (a lib.gpu.models spec, one sequence) per `bf16_slope` seconds."""
        return model.kv_bytes(1, 1) / self.bf16_slope


FP8_KV_BLOG = CacheLines(
    "vLLM fp8 KV cache, H100", "vLLM blog, 'The State of FP8 KV-Cache and Attention Quantization in vLLM', its "
    "inter-token latency lines against context", "https://vllm.ai/blog/fp8-kvcache", "2026-04",
    "one H100, Llama-3.1-8B, vLLM with FlashAttention 3, one request at a time",
    "fp8's slope 54% of bf16's; intercepts 6.44 ms (bf16) and 6.58 ms (fp8); break-even near 7k tokens",
    0.54, 4.37e-8, 6.44, 6.58)
