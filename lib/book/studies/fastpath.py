"""What the lean engine's one-token fast path is worth to verification (chapters 10 and 12).

A one-token call of `lib.fast.lean.LeanModel` takes two shortcuts a call over several tokens cannot:
LayerNorm in Python floats (two numpy calls instead of four) and no causal mask (one addition a
layer fewer). V(2), a two-token call over a one-token call, pays both. `fast_path_share` counts the
calls each shortcut saves (with numpy's products, `lib.measure.costmodel.lean_builder`, so the count is
the same on every machine) and prices each kind by its own timing, since a LayerNorm call and a
mask addition cost differently: the result is the fast path's share of V(2)'s excess over 1.
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


def _mask_seconds(model, position: int) -> float:
    """Seconds of one mask addition of a two-token call at `position`, as `LeanModel._forward` makes it
    (the attention scores, (Hkv, G, 2, S), plus the causal rows, (2, S)), the median of timed loops."""
    cfg, S = model.cfg, position + 2
    att = np.zeros((cfg.n_kv_head, cfg.group_size, 2, S), np.float32)
    mask = model.causal[position:S, :S]

    def add():
        att[...] += mask  # -inf stays -inf, 0 stays 0: every loop adds the same
    return median_time(add, repeats=7, min_seconds=0.01)


def fast_path_share(model, params, position: int = 64, repeats: int = 15) -> dict:
    """The one-token fast path's share of V(2)'s excess, each of its shortcuts priced on its own.

    model: a LeanModel (its own products) whose V(2) is split; params: its weights, for the counts.
    Returns {"norm_calls", "mask_calls": numpy calls a two-token call adds for each shortcut;
    "norm_us", "mask_us": microseconds per added call of each kind (LayerNorm: a one-token call
    through the several-token LayerNorm over the lean one, the median of `repeats` back-to-back
    pairs' added time over the added calls; mask: one addition timed alone); "fast_us": both kinds'
    calls at their prices; "excess_us": a two-token call's time beyond a one-token call's, the median
    of `repeats` pairs; "share": fast_us / excess_us}."""
    cfg = model.cfg
    counts = step_counts(lean_builder(cfg), params, cfg, position, sizes=(2, 1, 2))  # (2, 1, 2): buffers made
    one_norm = step_counts(lambda p: MatrixNorm(p, cfg, "numpy"), params, cfg, position)[1].numpy_calls
    norm_calls = one_norm - counts[1].numpy_calls
    mask_calls = counts[2].numpy_calls - counts[1].numpy_calls - norm_calls
    lean = cached_call(LeanModel(params, cfg, "numpy"), cfg, position)
    norm_pairs = paired_times(lean, cached_call(MatrixNorm(params, cfg, "numpy"), cfg, position), repeats, 0.01)
    norm_s = float(np.median(norm_pairs[:, 1] - norm_pairs[:, 0])) / norm_calls
    mask_s = _mask_seconds(model, position)
    v2_pairs = paired_times(cached_call(model, cfg, position), cached_call(model, cfg, position, 2), repeats, 0.01)
    excess = float(np.median(v2_pairs[:, 1] - v2_pairs[:, 0]))
    fast = norm_calls * norm_s + mask_calls * mask_s
    return {"norm_calls": norm_calls, "mask_calls": mask_calls, "norm_us": norm_s * 1e6, "mask_us": mask_s * 1e6,
            "fast_us": fast * 1e6, "excess_us": excess * 1e6, "share": fast / max(excess, 1e-9)}
