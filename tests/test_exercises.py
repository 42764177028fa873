"""The chapters' coding exercises (lib.book.exercises): each check passes its solution and rejects
plausible wrong versions with a message that names the mistake; a chapter's check cell says "not
attempted yet" for the skeleton and runs the check on the solution; and each core chapter holds
its exercise: the box, a skeleton that raises NotImplementedError, the check cell, and a collapsed
solution whose code is the solution's source in lib."""
import inspect
import json
import re
from pathlib import Path

import numpy as np
import pytest

import lib
from lib.book.exercises import (
    CORRECT,
    NOT_ATTEMPTED,
    accept_rule,
    block_table,
    cache_rw,
    choose_k,
    gqa_step,
    int8_keys,
    run,
    step_plan,
)
from lib.book.studies.load_study import LOAD_TRACE
from lib.corpus import load_corpus
from lib.gpu.step import gpu_clock
from lib.serve import make_trace
from lib.serve.replay import Replay

BOOK = Path(__file__).resolve().parent.parent / "book"


@pytest.fixture(scope="module")
def target():
    return lib.load("target")


@pytest.fixture(scope="module")
def tokens():
    return load_corpus().held_out[:512]


def rejects(message: str, *words):
    """A verdict that is not CORRECT and names the mistake (every word in it, case-insensitive)."""
    assert message != CORRECT
    missing = [w for w in words if w.lower() not in message.lower()]
    assert not missing, f"the verdict does not name {missing}: {message}"


# ----------------------------------------------------------------------------- chapter 3: the cache

def write_late(k_cache, v_cache, n, k, v):
    T = k.shape[1]
    k_cache[:, n + 1:n + 1 + T], v_cache[:, n + 1:n + 1 + T] = k, v  # off by one position


def write_at_zero(k_cache, v_cache, n, k, v):
    T = k.shape[1]
    k_cache[:, :T], v_cache[:, :T] = k, v  # forgets n


def read_one_short(k_cache, v_cache, end):
    return k_cache[:, :end - 1], v_cache[:, :end - 1]


def read_shifted(k_cache, v_cache, end):
    return k_cache[:, 1:end + 1], v_cache[:, 1:end + 1]


def test_cache_check(target, tokens):
    params, cfg = target
    check = lambda write, read: cache_rw.check(write, read, params, cfg, tokens)
    assert check(cache_rw.cache_write, cache_rw.cache_read) == CORRECT
    rejects(check(write_late, cache_rw.cache_read), "position 0", "at position 1", "one late")
    rejects(check(write_at_zero, cache_rw.cache_read), "position 0", "holds the K of position 48", "not at n")
    rejects(check(cache_rw.cache_write, read_one_short), "end=48", "(4, 47, 24)")
    rejects(check(cache_rw.cache_write, read_shifted), "logits", "bit-identical", "cache_read")


# ----------------------------------------------------------------------------- chapter 5: GQA

def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def gqa_interleaved(q, k, v):
    H, _, D = q.shape
    return np.stack([softmax(q[h] @ k[h % k.shape[0]].T / np.sqrt(D)) @ v[h % k.shape[0]] for h in range(H)])


def gqa_unscaled(q, k, v):
    G = q.shape[0] // k.shape[0]
    return np.stack([softmax(q[h] @ k[h // G].T) @ v[h // G] for h in range(q.shape[0])])


def gqa_softmax_over_heads(q, k, v):
    Hkv, D = k.shape[0], q.shape[2]
    scores = q.reshape(Hkv, -1, D) @ k.transpose(0, 2, 1) / np.sqrt(D)  # (Hkv, G, S)
    e = np.exp(scores - scores.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True) @ v).reshape(q.shape)


def test_gqa_check(tokens):
    prompt = tokens[:200]
    assert gqa_step.check(gqa_step.gqa_decode, prompt) == CORRECT
    rejects(gqa_step.check(gqa_interleaved, prompt), "G = 2", "query head 1 reads K/V head 1", "expected K/V head 0")
    rejects(gqa_step.check(gqa_unscaled, prompt), "right K/V head", "without the 1/sqrt(D) scale")
    rejects(gqa_step.check(gqa_softmax_over_heads, prompt), "matches no K/V head", "softmax", "last axis")
    rejects(gqa_step.check(lambda q, k, v: gqa_step.gqa_decode(q, k, v)[:, 0], prompt), "(H, 1, D)")


# ----------------------------------------------------------------------------- chapter 6: blocks

def slots_logical(block_table, positions, block_size):
    positions = np.asarray(positions)
    return positions // block_size, positions % block_size  # the table never consulted


def slots_one_off(block_table, positions, block_size):
    positions = np.asarray(positions) + 1
    return np.asarray(block_table)[np.minimum(positions // block_size, len(block_table) - 1)], positions % block_size


def free_every_block(block_table, ref, free):
    for block in block_table:  # reference counts forgotten
        ref[block] = 0
        free.append(block)


def free_none(block_table, ref, free):
    for block in block_table:
        ref[block] -= 1


def free_without_counting_down(block_table, ref, free):
    for block in block_table:
        if ref[block] == 1:
            free.append(block)


def test_block_check(target, tokens):
    params, cfg = target
    check = lambda slots, free: block_table.check(slots, free, params, cfg, tokens)
    assert check(block_table.slots, block_table.free_blocks) == CORRECT
    rejects(check(slots_logical, block_table.free_blocks), "position 0 is in block 2", "logical block", "table")
    rejects(check(slots_one_off, block_table.free_blocks), "got block 2 at offset 1", "K of position 1", "one position off")
    rejects(check(block_table.slots, free_every_block), "block 0 went to the free list", "A and C still use it",
            "reference count reaches 0")
    rejects(check(block_table.slots, free_none), "block 3", "used by B alone", "return to the free list")
    rejects(check(block_table.slots, free_without_counting_down), "block 0's reference count should be 2", "got 3")


# ----------------------------------------------------------------------------- chapter 7: int8 K

def quantize_unscaled(k):
    scale = np.abs(k).max(axis=-1, keepdims=True)  # max |k|, not over 127
    return np.rint(k / scale).astype(np.int8), scale


def quantize_per_channel(k):
    scale = np.abs(k).max(axis=1, keepdims=True) / 127  # the max over positions
    return np.rint(k / scale).astype(np.int8), scale


def quantize_truncating(k):
    scale = np.abs(k).max(axis=-1, keepdims=True) / 127
    return (k / scale).astype(np.int8), scale


def dequantize_codes_only(codes, scale):
    return codes.astype(np.float32)


def test_int8_check(target, tokens):
    params, cfg = target
    check = lambda quantize, dequantize: int8_keys.check(quantize, dequantize, params, cfg, tokens[:256])
    assert check(int8_keys.quantize_k, int8_keys.dequantize_k) == CORRECT
    rejects(check(quantize_unscaled, int8_keys.dequantize_k), "127 times", "divide max |k| by 127")
    rejects(check(quantize_per_channel, int8_keys.dequantize_k), "one per channel", "(Hkv, T, 1)", "last axis")
    rejects(check(quantize_truncating, int8_keys.dequantize_k), "round(k / scale)", "truncates")
    rejects(check(int8_keys.quantize_k, dequantize_codes_only), "code x scale", "multiply each code by its scale")


# ----------------------------------------------------------------------------- chapter 8: a step's plan

def plan_prompts_first(running, budget):
    plan = []
    for rid, pending in sorted(running, key=lambda r: not r[1]):
        n = min(pending, budget) if pending else 1
        if budget >= n >= 1:
            plan.append((rid, n))
            budget -= n
    return plan


def plan_whole_prompts(running, budget):
    plan = [(rid, 1) for rid, pending in running if not pending]
    budget -= len(plan)
    for rid, pending in running:
        if pending and budget >= 1:
            plan.append((rid, pending))  # the chunk can exceed the budget
            budget -= pending
    return plan


def plan_decode_for_free(running, budget):
    plan = [(rid, 1) for rid, pending in running if not pending]  # decode tokens not counted
    for rid, pending in running:
        if pending and budget >= 1:
            plan.append((rid, min(pending, budget)))
            budget -= min(pending, budget)
    return plan


def plan_no_chunks(running, budget):
    plan = [(rid, 1) for rid, pending in running if not pending]
    budget -= len(plan)
    for rid, pending in running:
        if pending and pending <= budget:  # a prompt that does not fit waits whole
            plan.append((rid, pending))
            budget -= pending
    return plan


@pytest.fixture(scope="module")
def served():
    """A burst of the chapter's requests (answers replayed as zeros: a plan never reads tokens) on the H100 clock."""
    cfg = lib.load("target")[1]
    trace = make_trace(**{**LOAD_TRACE, "n": 200, "rate": 500.0, "system": load_corpus().held_out[2000:2032]})
    replay = Replay(cfg, trace, {r.rid: np.zeros(r.n_new, np.int64) for r in trace})
    return replay, trace, 96, gpu_clock()


def test_plan_check(served):
    assert step_plan.check(step_plan.plan_step, *served) == CORRECT
    cases = step_plan.plan_cases(*served)
    assert any(sum(n for _, n in rows) == budget for _, budget, rows in cases), "no step filled its budget"
    rejects(step_plan.check(plan_prompts_first, *served), "decoding", "decode rows come first")
    rejects(step_plan.check(plan_whole_prompts, *served), "over the budget of 64")
    rejects(step_plan.check(plan_decode_for_free, *served), "over the budget", "decode rows' tokens count")
    rejects(step_plan.check(plan_no_chunks, *served), "prompt chunk", "left in the budget", "min(", "got request")


# ----------------------------------------------------------------------------- chapter 9: the rule

def accept_upside_down(p, q, x, rng):
    if rng.random() < min(1.0, q[x] / p[x]):
        return True, x
    residual = np.maximum(p - q, 0)
    return False, int(rng.choice(len(p), p=residual / residual.sum()))


def resample_from_p(p, q, x, rng):
    if rng.random() < min(1.0, p[x] / q[x]):
        return True, x
    return False, int(rng.choice(len(p), p=p))


def accept_all(p, q, x, rng):
    return True, x


def accept_inverted(p, q, x, rng):
    if rng.random() > min(1.0, p[x] / q[x]):
        return True, x
    residual = np.maximum(p - q, 0)
    return False, int(rng.choice(len(p), p=residual / residual.sum()))


def resample_unnormalised(p, q, x, rng):
    if rng.random() < min(1.0, p[x] / q[x]):
        return True, x
    return False, int(np.searchsorted(np.cumsum(np.maximum(p - q, 0)), rng.random()))  # can run past the last token


def test_accept_check():
    pair = lib.load("target"), lib.load("draft")
    assert accept_rule.check(accept_rule.accept_draft, *pair) == CORRECT
    rejects(accept_rule.check(accept_upside_down, *pair), "accepted", "sum min(p, q)", "upside down")
    rejects(accept_rule.check(resample_from_p, *pair), "after a rejection", "noise floor", "follow p", "residual")
    rejects(accept_rule.check(accept_all, *pair), "100.0% of drafts", "every draft accepted")
    rejects(accept_rule.check(accept_inverted, *pair), "of drafts were accepted", "inverted")
    rejects(accept_rule.check(resample_unnormalised, *pair), "tokens are integers 0..95", "normalised")


# ----------------------------------------------------------------------------- chapter 10: the best k

def best_k_v1(alpha, c, V, ks):
    return max(ks, key=lambda k: (1 - alpha ** (k + 1)) / (1 - alpha) / (k * c + 1))


def best_k_free_draft(alpha, c, V, ks):
    return max(ks, key=lambda k: (1 - alpha ** (k + 1)) / (1 - alpha) / V[k + 1])


def best_k_tokens(alpha, c, V, ks):
    return max(ks, key=lambda k: (1 - alpha ** (k + 1)) / (1 - alpha))


def best_k_exponent(alpha, c, V, ks):
    return max(ks, key=lambda k: (1 - alpha ** k) / (1 - alpha) / (k * c + V[k + 1]))


MEASURED = [("a CPU-sized pair", 0.62, 0.31, {T: 1 + 0.12 * (T - 1) for T in range(2, 10)})]


def test_best_k_check():
    assert choose_k.check(choose_k.best_k, MEASURED) == CORRECT
    rejects(choose_k.check(best_k_v1, MEASURED), "the best k is 1", "got k = 2", "priced as one token")
    rejects(choose_k.check(best_k_free_draft, MEASURED), "the best k", "draft's calls left out")
    rejects(choose_k.check(best_k_tokens, MEASURED), "got k = 8", "tokens per call alone")
    rejects(choose_k.check(best_k_exponent, MEASURED), "alpha^k for alpha^(k+1)")


# ----------------------------------------------------------------------------- the check cell

def test_the_check_cell_runs_the_solution_until_the_reader_has_written_one(capsys):
    def skeleton(*args):
        raise NotImplementedError

    def wrong(*args):
        return 8

    message = run(choose_k.check, (skeleton,), (choose_k.best_k,), MEASURED)
    assert message.startswith(NOT_ATTEMPTED) and message.endswith(CORRECT) and message in capsys.readouterr().out
    rejects(run(choose_k.check, (wrong,), (choose_k.best_k,), MEASURED), "got k = 8")  # printed, not raised
    with pytest.raises(AssertionError, match="own solution fails"):
        run(choose_k.check, (skeleton,), (wrong,), MEASURED)
    rejects(choose_k.check(lambda *args: 1 / 0, MEASURED), "raised ZeroDivisionError")


# ----------------------------------------------------------------------------- the chapters

def solution_source(solutions) -> str:
    """The code a chapter's solution dropdown shows: the solutions' source in lib."""
    return "\n\n".join(inspect.getsource(fn) for fn in solutions)


CHAPTERS = {  # chapter: (its check module, the solutions its dropdown shows)
    "03_kv_cache": (cache_rw, (cache_rw.cache_write, cache_rw.cache_read)),
    "05_gqa": (gqa_step, (gqa_step.gqa_decode,)),
    "06_paging": (block_table, (block_table.slots, block_table.free_blocks)),
    "07_quantization": (int8_keys, (int8_keys.quantize_k, int8_keys.dequantize_k)),
    "08_serving": (step_plan, (step_plan.plan_step,)),
    "09_speculative_proof": (accept_rule, (accept_rule.accept_draft,)),
    "10_k_sweep": (choose_k, (choose_k.best_k,)),
}


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_each_core_chapter_holds_its_exercise(chapter):
    module, solutions = CHAPTERS[chapter]
    cells = json.loads((BOOK / f"{chapter}.ipynb").read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells]
    box = next(i for i, s in enumerate(sources) if s.startswith(":::{admonition} Exercise"))
    skeleton, check, solution = sources[box + 1:box + 4]
    for fn in solutions:
        assert re.search(rf"^def {fn.__name__}\(", skeleton, re.M), f"the skeleton defines {fn.__name__}"
    assert skeleton.count("raise NotImplementedError") == len(solutions)
    assert f"{module.__name__.rsplit('.', 1)[1]}.attempt(" in check
    assert solution.startswith(":::{dropdown} Solution")
    shown = re.search(r"```\{code-block\} python\n:class: scroll-listing\n\n(.*?)```", solution, re.S)[1]
    assert shown == solution_source(solutions), "the dropdown shows the solution's source in lib"
