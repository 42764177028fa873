"""Chapter 8's exercise: the plan of one continuous-batching step within a token budget.

The reader writes `plan_step`: given the running sequences in the scheduler's order, each with the
prompt tokens it still has to compute (0 for a sequence that is decoding), and the step's token
budget, the rows of the step: decode rows first, one token each, then prompt chunks, oldest first,
each cut to what the budget has left (vLLM v1; Sarathi-Serve's chunked prefill). The check serves
the chapter's trace under the token-budget policy, records the scheduler's state and
`Scheduler.plan`'s answer at every step, and asks the reader's function the same.
"""
from lib.book.exercises import Wrong, call, run, verdict
from lib.serve.policy import LADDER
from lib.serve.server import Server

POLICY = LADDER["+ token budget (v1)"]  # continuous batching, paged blocks, prefix caching, 64 tokens a step


def plan_step(running, budget):
    """[(rid, tokens)] of one step, from running [(rid, pending)] (0: decoding) and the budget."""
    plan = []
    for rid, pending in running:  # decode rows first: one token each
        if not pending and budget >= 1:
            plan.append((rid, 1))
            budget -= 1
    for rid, pending in running:  # then prompt chunks, oldest first, within what is left
        if pending and budget >= 1:
            chunk = min(pending, budget)
            plan.append((rid, chunk))
            budget -= chunk
    return plan


def plan_cases(replay, trace, num_blocks: int, clock, policy=POLICY) -> list:
    """Serve `trace` (a Replay of its answers, on `clock`) and record each step's
    (running [(rid, pending)], budget, Scheduler.plan's [(rid, tokens)])."""
    server = Server(replay, trace, num_blocks, policy, 16, 0.0, 0.0, None, clock, None, 1, None)
    scheduler, cases = server.scheduler, []
    plan = scheduler.plan

    def recording_plan():
        batch, feeds = plan()
        running = [(live.rid, len(live.pending)) for live in scheduler.running]
        rows = [(live.rid, 1 if feed is None else len(feed)) for live, feed in zip(batch, feeds)]
        cases.append((running, policy.token_budget, rows))
        return batch, feeds
    scheduler.plan = recording_plan  # this server's scheduler only
    server.run()
    return cases


def _state(running, budget) -> str:
    decoding = sum(1 for _, pending in running if not pending)
    prompts = "; ".join(f"request {rid}: {pending}" for rid, pending in running if pending) or "none"
    return f"{decoding} decoding; prompt tokens left: {prompts}; budget {budget}"


def _first_difference(running, budget, expected, got) -> str:
    """The first row where the reader's plan parts from the scheduler's, in words."""
    pending = dict(running)
    total = sum(n for _, n in got)
    if total > budget:
        decode = sum(n for rid, n in got if not pending.get(rid))
        hint = " (the decode rows' tokens count against the budget too)" if decode and total - decode <= budget else ""
        return f"your plan computes {total} tokens, over the budget of {budget}{hint}"
    for i, (row, theirs) in enumerate(zip(expected, got + [None] * len(expected))):
        if row == theirs:
            continue
        rid, n = row
        theirs = "no row" if theirs is None else f"request {theirs[0]} with {theirs[1]} tokens"
        if not pending[rid]:
            return f"row {i} is request {rid}, decoding, with its 1 token (decode rows come first), got {theirs}"
        left = budget - sum(m for _, m in expected[:i])
        return (f"row {i} is request {rid}'s prompt chunk: {pending[rid]} tokens left, {left} left in the budget "
                f"after the rows before it, so min({pending[rid]}, {left}) = {n} tokens; got {theirs}")
    return f"your plan has rows the scheduler's does not: {got[len(expected):]}"


@verdict
def check(fn, replay, trace, num_blocks, clock):
    """Verdict on the reader's plan_step against Scheduler.plan at every step of the trace."""
    cases = plan_cases(replay, trace, num_blocks, clock)
    for step, (running, budget, expected) in enumerate(cases):
        case = f"step {step} ({_state(running, budget)})"
        got = call(fn, list(running), budget, case=case)
        got = list(got) if isinstance(got, (list, tuple)) else got
        if not (isinstance(got, list) and all(isinstance(r, tuple) and len(r) == 2 for r in got)):
            raise Wrong(f"{case}: plan_step must return a list of (rid, tokens) pairs, got {got!r:.80}")
        got = [(rid, int(n)) for rid, n in got]
        if got != expected:
            raise Wrong(f"{case}: {_first_difference(running, budget, expected, got)}; "
                        f"the scheduler's plan: {expected}")


def attempt(fn, replay, trace, num_blocks, clock) -> None:
    """Chapter 8's check cell."""
    run(check, (fn,), (plan_step,), replay, trace, num_blocks, clock)
