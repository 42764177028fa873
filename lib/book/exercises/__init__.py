"""The chapters' coding exercises: the reader writes a piece of the engine, a check says what is wrong.

One module per exercise (after skyzh/tiny-llm, where the reader builds the engine test by test),
each with the reference solution, a `check` and the chapter's `attempt`:

- `cache_rw`     chapter 3: write and read one layer of a preallocated K/V cache;
- `gqa_step`     chapter 5: grouped-query attention for one decode step;
- `block_table`  chapter 6: positions to (block, offset) slots; freeing a fork with reference counts;
- `int8_keys`    chapter 7: int8 per-position quantize and dequantize of K;
- `step_plan`    chapter 8: the plan of one continuous-batching step within a token budget;
- `accept_rule`  chapter 9: the accept-or-resample rule;
- `choose_k`     chapter 10: the best k from alpha, c and V(k+1).

A check runs the reader's function on real inputs and returns a verdict in plain words: CORRECT,
or the first thing found wrong (which case, which position or head, expected against got), with
the likely mistake named where the wrong answer matches a known one. It never raises for a wrong
answer, so a chapter runs whatever the reader wrote. `run` is the chapter's check cell: while the
skeleton still raises NotImplementedError it says "not attempted yet" and checks the solution
instead, which must pass (so the book's build exercises every check).
"""
import functools

CORRECT = "correct"
NOT_ATTEMPTED = "not attempted yet"


class Wrong(Exception):
    """A wrong answer: its message is the check's verdict."""


def verdict(check):
    """A check that raises Wrong at the first mistake, as a function returning its verdict."""
    @functools.wraps(check)
    def wrapped(*args, **kwargs) -> str:
        try:
            check(*args, **kwargs)
        except Wrong as wrong:
            return str(wrong)
        return CORRECT
    return wrapped


def call(fn, *args, case: str):
    """fn(*args), with the reader's own error turned into a verdict; NotImplementedError passes
    through (the skeleton as shipped: not attempted yet)."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as error:  # the reader's code failed: say where, and keep the chapter running
        name = getattr(fn, "__name__", "function")
        raise Wrong(f"{case}: your {name} raised {type(error).__name__}: {error}") from None


def run(check, yours: tuple, solution: tuple, *inputs) -> str:
    """Print and return the verdict of check(*yours, *inputs); if the reader's functions still
    raise NotImplementedError, the verdict on the solution, which must be correct."""
    try:
        message = check(*yours, *inputs)
    except NotImplementedError:
        message = check(*solution, *inputs)
        if message != CORRECT:
            raise AssertionError(f"the exercise's own solution fails its check: {message}")
        message = (f"{NOT_ATTEMPTED}: the skeleton still raises NotImplementedError. "
                   f"The solution, run through the same check: {message}")
    print(message)
    return message
