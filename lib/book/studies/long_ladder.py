"""The serving chapter's H100 ladder where memory binds: the ladder's rungs at vLLM's default caps,
on requests of thousands of positions, through the real scheduler and block manager, every step
priced by the fitted H100 clock (`lib.gpu.step.gpu_clock`). The requests are lengths
(`lib.serve.lengths`): no model decodes their tokens.

The caps are vLLM's defaults on a GPU of 70 GiB or more other than an A100
(`EngineArgs.get_batch_defaults` in vllm/engine/arg_utils.py): `max_num_seqs` 1,024 and
`max_num_batched_tokens` 8,192 for the OpenAI-compatible server, `vllm serve` (16,384 for the offline
`LLM` class; 256 and 2,048 for the server on GPUs under 70 GiB and on A100s), with blocks of 16
positions (`CacheConfig.DEFAULT_BLOCK_SIZE` in vllm/config/cache.py, `--block-size`). The trace's lengths are chosen, not a
published distribution: long prompts behind a few shared prefixes (system prompts, documents),
answers of a few hundred tokens, as in Mooncake's published conversation traces (Qin et al. 2025).
"""
from dataclasses import replace

from lib.serve import LADDER, serve
from lib.serve.lengths import LengthsReplay, ledger_config, lengths_trace

MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, BLOCK_SIZE = 1024, 8192, 16  # `vllm serve`'s defaults on an H100 (above)
CONTEXT = 131_072  # Llama-3.1-8B's context: no request of the trace comes near it
LONG_TRACE = dict(n=150, prefixes=4, prefix_len=1024, prompt_len=(1024, 8192), n_new=(64, 1024))
LONG_RATE = 5.0  # requests/s: where max_tokens reservations fill the pool
LONG_MAX_TOKENS = 4096  # what each request asks for at most: a "max" reservation sets this much aside
LONG_SLO = dict(ttft=1.0, tpot=0.05)  # seconds: chosen targets, a chat service's
LONG_SEEDS = (0, 1, 2)
BUDGETS = (512,)  # a token budget well below vLLM's H100 default (the server's default under 70 GiB is 2,048)


def vllm_ladder() -> dict:
    """The ladder's rungs with vLLM's default caps: 1,024 sequences a step, and the token budget
    rung's budget at 8,192 tokens."""
    return {name: replace(policy, max_batch=MAX_NUM_SEQS,
                          token_budget=MAX_NUM_BATCHED_TOKENS if policy.token_budget else None)
            for name, policy in LADDER.items()}


def long_runs(clock, policies: dict, seeds=LONG_SEEDS, rate: float = LONG_RATE, trace: dict = LONG_TRACE,
              max_tokens: int = LONG_MAX_TOKENS) -> dict:
    """{name: [Report per seed]}: each policy on each seed's lengths trace, every step priced by
    `clock` (a GPUClock), in its pool of `clock.blocks(BLOCK_SIZE)` blocks."""
    engine = LengthsReplay(ledger_config(clock.spec, CONTEXT))
    wait = 4 * clock.decode_step(1, sum(trace["prompt_len"]) // 2)  # static batching's wait: four short steps
    runs = {name: [] for name in policies}
    for seed in seeds:
        requests = lengths_trace(**trace, rate=rate, seed=seed)
        for name, policy in policies.items():
            runs[name].append(serve(engine, requests, clock.blocks(BLOCK_SIZE), policy, BLOCK_SIZE, clock=clock,
                                    max_tokens=max_tokens, batch_wait=wait))
    return runs


def distinct(a: tuple, b: tuple) -> bool:
    """Whether two (median, lowest, highest) cells over seeds do not overlap: a difference the seeds support."""
    return a[1] > b[2] or b[1] > a[2]

