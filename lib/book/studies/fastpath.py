"""What the lean engine's one-token fast path is worth to verification (chapters 10 and 12).

A one-token call of `lib.fast.lean.LeanModel` takes two shortcuts a call over several tokens cannot:
LayerNorm in Python floats (two numpy calls instead of four) and no causal mask (one addition a
layer fewer). V(2), a two-token call over a one-token call, pays both. `fast_path_share` counts the
calls each shortcut saves (with numpy's products, `lib.measure.costmodel.lean_builder`, so the count is
the same on every machine) and prices each kind once, by timing that kind alone (`norm_call_seconds`,
`mask_seconds`), since a LayerNorm call and a mask addition cost differently: the result is the fast
path's share of V(2)'s excess over 1. Chapter 12's ablation quotes the same LayerNorm price.
"""
import numpy as np

from lib.fast.lean import LeanModel
from lib.measure.costmodel import lean_builder
from lib.measure.counting import cached_call, step_counts
from lib.timing import median_time, paired_times


class MatrixNorm(LeanModel):
    """One token's LayerNorm through the several-token path (`LeanModel._normalize_rows`)."""

    def _normalize(self, x, b):
        return self._normalize_rows(x, b)


def mask_seconds(model, position: int) -> float:
    """Seconds of one mask addition of a two-token call at `position`, as `LeanModel._forward` makes it
    (the attention scores, (Hkv, G, 2, S), plus the causal rows, (2, S)), the median of timed loops."""
    cfg, S = model.cfg, position + 2
    att = np.zeros((cfg.n_kv_head, cfg.group_size, 2, S), np.float32)
    mask = model.causal[position:S, :S]

    def add():
        att[...] += mask  # -inf stays -inf, 0 stays 0: every loop adds the same
    return median_time(add, repeats=7, min_seconds=0.01)


def norm_call_seconds(model, added_calls: int, repeats: int = 15) -> float:
    """Seconds of one numpy call that one token's LayerNorm adds off the fast path: the several-token
    LayerNorm (`_normalize_rows`) against the one-token one (`_normalize`) on one row of the model's own
    buffers, timed alone in `repeats` back-to-back pairs of loops, the median added time over the
    `added_calls` calls it adds (two: four numpy calls against two)."""
    b = model._buffers(1)
    x = np.random.default_rng(0).standard_normal((1, model.cfg.n_embd)).astype(np.float32)  # (1, C)
    pairs = paired_times(lambda: model._normalize(x, b), lambda: model._normalize_rows(x, b), repeats, 0.005)
    return float(np.median(pairs[:, 1] - pairs[:, 0])) / added_calls


def fast_path_share(model, params, position: int = 64, excess: float | None = None, repeats: int = 15) -> dict:
    """The one-token fast path's share of V(2)'s excess, each of its shortcuts priced on its own.

    model: a LeanModel (its own products) whose V(2) is split; params: its weights, for the counts;
    excess: the seconds a two-token call takes beyond a one-token one, as the caller's table prints it
    ((V(2) - 1) times its one-token call), or None to time it here (the median of `repeats` pairs).
    Returns {"norm_calls", "mask_calls": numpy calls a two-token call adds for each shortcut;
    "norm_us", "mask_us": microseconds per added call of each kind (`norm_call_seconds`,
    `mask_seconds`: each kind timed alone); "fast_us": both kinds' calls at their prices;
    "excess_us": the excess; "share": fast_us / excess_us}."""
    cfg = model.cfg
    counts = step_counts(lean_builder(cfg), params, cfg, position, sizes=(2, 1, 2))  # (2, 1, 2): buffers made
    one_norm = step_counts(lambda p: MatrixNorm(p, cfg, "numpy"), params, cfg, position)[1].numpy_calls
    norm_calls = one_norm - counts[1].numpy_calls
    mask_calls = counts[2].numpy_calls - counts[1].numpy_calls - norm_calls
    norm_s = norm_call_seconds(model, norm_calls // (2 * cfg.n_layer + 1), repeats)  # 2L + 1 LayerNorms a step
    mask_s = mask_seconds(model, position)
    if excess is None:
        v2_pairs = paired_times(cached_call(model, cfg, position), cached_call(model, cfg, position, 2), repeats, 0.01)
        excess = float(np.median(v2_pairs[:, 1] - v2_pairs[:, 0]))
    fast = norm_calls * norm_s + mask_calls * mask_s
    return {"norm_calls": norm_calls, "mask_calls": mask_calls, "norm_us": norm_s * 1e6, "mask_us": mask_s * 1e6,
            "fast_us": fast * 1e6, "excess_us": excess * 1e6, "share": fast / max(excess, 1e-9)}
