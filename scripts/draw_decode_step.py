"""Draw the summary's figure: the anatomy of one decode step, with each technique of the book
attached to the cost it acts on. A diagram, no measurement: `python scripts/draw_decode_step.py`
writes book/figures/decode_step.svg.

It is drawn at the width the book's column shows it (about 7 inches at 1280 px), so its type is
read at its own size: at least 9.5 points, one column of cost boxes above the memory panel."""
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "decode_step"  # fixed clip-path ids: the same file every run
import matplotlib.pyplot as plt  # noqa: E402

from lib.gpu.memory import H100  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "book" / "figures" / "decode_step.svg"
WIDTH = 7.0  # inches: the book's column at 1280 px shows it at about its own size
LINE = 0.19  # inches per line of 9.5-point text
FIX_CHARS = 44  # characters per line of a technique beside its box
PANEL = 2.9  # inches: the memory panel
HEAD = 1.95  # inches above the first cost box: the scheduler note, the title and the three-line formula
SMALL, BODY, NAME, TITLE = 9.5, 10.5, 12, 13  # points
RIDGE = round(H100.flops / H100.bandwidth, -2)  # FLOP per byte: a bf16 batch of B does B, so the batch it turns at
COSTS = [  # (cost, what sets it, colour, techniques acting on it with their chapters)
    ("per-call overhead", "calls x the cost of a call\n(numpy calls; kernel launches)", "#e8e8e8",
     ["fewer, fused calls: the lean path (12)", "CUDA graphs on a GPU: a step replayed in one launch or a few (12)"]),
    ("weights' bytes", "every weight, read once per step,\nshared by every token in the step", "#cfe0f3",
     ["batching: more sequences per read (8)", "speculative decoding: more tokens per read (9, 10)",
      "prefill in one call: one read of the weights for all prompt tokens (2)",
      "fewer bits per weight: 4-bit or fp8 weights, fewer bytes per read (11)"]),
    ("K/V bytes", "each sequence's cache at its\ncurrent length, read at every step", "#fbe3c8",
     ["fewer K/V heads: GQA, MQA (5)", "fewer bits per value: KV quantization (7)"]),
    ("FLOPs", f"2 per weight per token, plus attention;\nnearly free on a GPU below a\nbf16 batch of ~{RIDGE:.0f} (data sheet)",
     "#dcefd9", ["the KV cache: the past is not recomputed; without it, every step is a prefill of all "
                 "the tokens so far (3)",
                 "prefix caching: a shared prompt is computed once (3, 8)"]),
]
CAPACITY = ["the KV memory formula on real models (4)", "paged blocks: no reserved waste (6)",
            "prefix caching: one copy of a shared prompt (3, 6, 8)", "GQA and quantization: more positions per byte (5, 7)",
            "quantized weights: more memory left for the pool (11)"]
SCHEDULER = ("dashed frame: the scheduler, which picks each step's sequences: continuous batching, "
             "a token budget, chunked prefill, preemption (8); which lever for which symptom (11)")


def wrap(text: str, width: int) -> str:
    """Text broken into lines of at most `width` characters."""
    return "\n".join(textwrap.wrap(text, width))


def slots(fixes: list) -> list:
    """Inches each technique takes beside its box: its lines and a gap."""
    return [LINE * (wrap(fix, FIX_CHARS).count("\n") + 1) + 0.12 for fix in fixes]


def row_height(fixes: list) -> float:
    """Inches of one cost's row: its box, or its techniques if they are taller."""
    return max(1.05, sum(slots(fixes)) + 0.1)


def cost_row(ax, top: float, name: str, why: str, colour: str, fixes: list) -> float:
    """One cost's box and the techniques pointing at it, from `top` down; returns the row's height."""
    height, gaps = row_height(fixes), slots(fixes)
    box_h, mid = 1.0, top - height / 2
    ax.add_patch(plt.Rectangle((0.3, mid - box_h / 2), 3.0, box_h, facecolor=colour, edgecolor="0.35"))
    ax.text(0.42, mid + box_h / 2 - 0.1, name, fontsize=NAME, weight="bold", va="top")
    ax.text(0.42, mid - box_h / 2 + 0.1, why, fontsize=SMALL, color="0.2", va="bottom")
    y = mid + sum(gaps) / 2
    for fix, slot in zip(fixes, gaps):
        ax.annotate(wrap(fix, FIX_CHARS), xy=(3.3, mid), xytext=(3.6, y - slot / 2), fontsize=SMALL, va="center",
                    arrowprops=dict(arrowstyle="->", color="0.45", lw=0.8, relpos=(0, 0.5)))
        y -= slot
    return height


def memory_panel(ax, top: float) -> float:
    """The memory panel: weights and a pool of K/V blocks, and the techniques that fit more sequences."""
    height = PANEL
    ax.add_patch(plt.Rectangle((0.3, top - height), WIDTH - 0.6, height, facecolor="white", edgecolor="0.35"))
    ax.text(0.42, top - 0.12, "memory capacity", fontsize=NAME, weight="bold", va="top")
    ax.text(0.42, top - 0.45, "GPU memory = weights + KV pool:\nthe pool decides how many\nsequences fit in a step",
            fontsize=SMALL, color="0.2", va="top")
    base = top - 2.0
    ax.add_patch(plt.Rectangle((0.42, base), 0.9, 0.8, facecolor="#cfe0f3", edgecolor="0.4"))
    ax.text(0.87, base + 0.4, "weights", fontsize=SMALL, ha="center", va="center")
    for k in range(6):
        ax.add_patch(plt.Rectangle((1.45 + 0.28 * k, base), 0.25, 0.8,
                                   facecolor="#fbe3c8" if k % 3 != 2 else "white", edgecolor="0.4"))
    ax.text(2.27, base - 0.08, "KV pool in blocks", fontsize=SMALL, ha="center", va="top")
    for x, fill, label in [(0.42, "#fbe3c8", "in use"), (1.8, "white", "free")]:  # the pool's legend
        ax.add_patch(plt.Rectangle((x, base - 0.6), 0.15, 0.15, facecolor=fill, edgecolor="0.4"))
        ax.text(x + 0.22, base - 0.525, label + " blocks", fontsize=SMALL, va="center", color="0.2")
    y = top - 0.5
    for fix in CAPACITY:
        fix = wrap(fix, 42)
        ax.text(3.35, y, "• " + fix.replace("\n", "\n   "), fontsize=SMALL, va="top")
        y -= LINE * (fix.count("\n") + 1) + 0.1
    ax.text(3.35, y - 0.05, "the pool decides the batch, and the\nbatch shares the weights' bytes (8)",
            fontsize=SMALL, color="0.3", va="top", style="italic")
    return height


def draw():
    total = HEAD + sum(row_height(fixes) for *_, fixes in COSTS) + 0.15 * len(COSTS) + PANEL + 0.55
    fig = plt.figure(figsize=(WIDTH, total))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_axis_off()
    ax.set_xlim(0, WIDTH)
    ax.set_ylim(0, total)
    ax.add_patch(plt.Rectangle((0.08, 0.08), WIDTH - 0.16, total - 0.16, facecolor="#fafafa", edgecolor="0.55", ls="--"))
    ax.text(0.2, total - 0.2, wrap(SCHEDULER, 86), fontsize=SMALL, color="0.25", va="top", style="italic")
    ax.text(0.3, total - 0.78, "one decode step: one new token for each sequence", fontsize=TITLE, weight="bold", va="top")
    ax.text(0.3, total - 1.15, "simplified: time ≈ calls x overhead\n"
            "                   + max(weight bytes / bandwidth, weight FLOPs / peak FLOP/s)\n"
            "                   + max(K/V bytes / bandwidth, attention FLOPs / peak FLOP/s)",
            fontsize=BODY, color="0.25", va="top")
    top = total - HEAD
    for cost in COSTS:
        top -= cost_row(ax, top, *cost) + 0.15
    top -= memory_panel(ax, top)
    ax.text(0.3, 0.2, "numbers in brackets: the chapter that treats it", fontsize=SMALL, color="0.4")
    OUT.parent.mkdir(exist_ok=True)
    fig.savefig(OUT, metadata={"Date": None})  # no timestamp: the same figure every run


if __name__ == "__main__":
    draw()
