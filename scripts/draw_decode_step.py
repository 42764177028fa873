"""Draw the summary's figure: the anatomy of one decode step, with each technique of the book
attached to the cost it acts on. A diagram, no measurement: `python scripts/draw_decode_step.py`
writes book/figures/decode_step.svg."""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "decode_step"  # fixed clip-path ids: the same file every run
import matplotlib.pyplot as plt  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "book" / "figures" / "decode_step.svg"
COSTS = [  # (cost, what sets it, colour, techniques acting on it with their chapters)
    ("per-call overhead", "calls x the cost of a call\n(numpy calls; kernel launches)", "#e8e8e8",
     ["fewer, fused calls: the lean path (12)", "on a GPU, CUDA graphs: one launch per step (12)"]),
    ("weights' bytes", "every weight, read once per step,\nshared by every row of the step", "#cfe0f3",
     ["batching: more sequences per read (8)", "speculative decoding: more tokens per read (9, 10)",
      "prefill in one call: one read of the weights\nfor all prompt tokens (2)"]),
    ("K/V bytes", "each sequence's cache at its\ncontext, read at every step", "#fbe3c8",
     ["fewer K/V heads: GQA, MQA (5)", "fewer bits per value: KV quantization (7)"]),
    ("FLOPs", "2 per weight per row, plus attention;\nnearly free on a GPU below the ridge", "#dcefd9",
     ["the KV cache: no recomputation of the past (3)", "chunked prefill: a prompt's FLOPs spread over steps (8)"]),
]
CAPACITY = ["the KV memory formula on real models (4)", "paged blocks: no reserved waste (6)",
            "prefix sharing: one copy of a shared prompt (3, 6)", "GQA and quantization: more positions per byte (5, 7)"]
SCHEDULER = ["continuous batching, a token budget,", "chunked prefill, preemption (8);", "which lever for which symptom (11)"]


def draw():
    fig, ax = plt.subplots(figsize=(12.5, 7.2))
    ax.set_axis_off()
    ax.set_xlim(0, 12.5)
    ax.set_ylim(0, 7.2)
    ax.add_patch(plt.Rectangle((0.15, 0.15), 12.2, 6.9, facecolor="#fafafa", edgecolor="0.55", ls="--"))
    ax.text(0.35, 6.75, "the scheduler around the step: " + " ".join(SCHEDULER), fontsize=9.5, color="0.25")
    ax.text(0.6, 6.2, "one decode step: one new token for each sequence in the batch", fontsize=11, weight="bold")
    ax.text(0.6, 5.85, "simplified: time ≈ calls x overhead + max(bytes / bandwidth, FLOPs / peak FLOP/s)",
            fontsize=9.5, color="0.25")
    for i, (name, why, colour, fixes) in enumerate(COSTS):
        y = 4.85 - i * 1.12
        ax.add_patch(plt.Rectangle((0.6, y), 3.2, 0.9, facecolor=colour, edgecolor="0.35"))
        ax.text(0.75, y + 0.62, name, fontsize=10, weight="bold")
        ax.text(0.75, y + 0.12, why, fontsize=7.8, color="0.2")
        slots = [0.15 * (fix.count("\n") + 2) for fix in fixes]  # a line of text and a gap, per fix
        top = y + 0.45 + sum(slots) / 2  # the fixes stacked, centred on their box
        for j, fix in enumerate(fixes):
            ax.annotate(fix, xy=(3.8, y + 0.45), xytext=(4.5, top - sum(slots[:j]) - slots[j] / 2), fontsize=9,
                        va="center", arrowprops=dict(arrowstyle="->", color="0.45", lw=0.8, relpos=(0, 0.5)))
    x0 = 8.55
    ax.add_patch(plt.Rectangle((x0, 0.55), 3.5, 5.2, facecolor="white", edgecolor="0.35"))
    ax.text(x0 + 0.15, 5.45, "memory capacity", fontsize=10, weight="bold")
    ax.text(x0 + 0.15, 5.1, "GPU memory = weights + KV pool:\nthe pool decides how many\nsequences fit in a step",
            fontsize=7.8, color="0.2", va="top")
    ax.add_patch(plt.Rectangle((x0 + 0.25, 3.05), 0.9, 1.05, facecolor="#cfe0f3", edgecolor="0.4"))
    ax.text(x0 + 0.7, 3.57, "weights", fontsize=7.8, ha="center", va="center")
    for k in range(6):
        ax.add_patch(plt.Rectangle((x0 + 1.3 + 0.33 * k, 3.05), 0.3, 1.05,
                                   facecolor="#fbe3c8" if k % 3 != 2 else "white", edgecolor="0.4"))
    ax.text(x0 + 2.3, 2.85, "KV pool in blocks", fontsize=7.8, ha="center", va="top")
    for x, fill, label in [(x0 + 1.3, "#fbe3c8", "blocks in use"), (x0 + 2.45, "white", "free blocks")]:  # legend
        ax.add_patch(plt.Rectangle((x, 2.38), 0.14, 0.16, facecolor=fill, edgecolor="0.4"))
        ax.text(x + 0.2, 2.46, label, fontsize=7.4, va="center", color="0.2")
    for j, fix in enumerate(CAPACITY):
        ax.text(x0 + 0.15, 2.1 - 0.22 * j, "• " + fix, fontsize=7.6, va="top")
    ax.text(x0 + 1.75, 1.05, "the pool decides the batch, and the batch\nshares the weights' bytes (8)",
            fontsize=8, color="0.3", ha="center", va="top")
    ax.text(0.6, 0.35, "numbers in brackets: the chapter that treats it", fontsize=8, color="0.4")
    fig.tight_layout()
    OUT.parent.mkdir(exist_ok=True)
    fig.savefig(OUT, metadata={"Date": None})  # no timestamp: the same figure every run


if __name__ == "__main__":
    draw()
