"""Sliders that work in Jupyter and in the static HTML of the book, where no kernel runs.

An `interact` callback needs a kernel. Here every slider position is computed when the cell
runs, each result rendered once (a PNG for a figure, <pre> text otherwise) into an ipywidgets
`Stack`; the slider's index is tied to the stack's `selected_index` with `jslink`, which runs
in the browser (ipywidgets 8, embedded widget state). Two sliders nest two stacks.
"""
import html
import io

import ipywidgets as W
import matplotlib.pyplot as plt


def _render(result) -> W.Widget:
    """A matplotlib Figure becomes an Image widget; anything else is shown as preformatted text."""
    if isinstance(result, plt.Figure):
        buf = io.BytesIO()
        result.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        plt.close(result)
        return W.Image(value=buf.getvalue(), format="png", layout=W.Layout(max_width="100%"))
    return W.HTML(f"<pre style='line-height:1.3'>{html.escape(str(result))}</pre>")


def _slider(name, values, label):
    return W.SelectionSlider(options=[(str(v), v) for v in values], value=values[0],
                             description=label or name, continuous_update=True,
                             style={"description_width": "initial"}, layout=W.Layout(width="480px"))


def slider_plot(fn, grid: dict, labels: dict | None = None, initial: dict | None = None) -> W.VBox:
    """Sliders over one or two parameters that switch between precomputed results of fn(**values).

    fn: maps keyword values to a matplotlib Figure (or text); grid: {name: [values, ...]} with one
    or two names; labels: slider captions; initial: the values shown first.
    """
    grid = {name: list(values) for name, values in grid.items()}  # a generator's values too
    labels, initial = labels or {}, initial or {}
    names = list(grid)
    sliders = [_slider(n, grid[n], labels.get(n)) for n in names]
    if len(names) == 1:
        stack = W.Stack([_render(fn(**{names[0]: v})) for v in grid[names[0]]])
        W.jslink((sliders[0], "index"), (stack, "selected_index"))
        inner = [stack]
    else:
        a, b = names
        inner = [W.Stack([_render(fn(**{a: va, b: vb})) for vb in grid[b]]) for va in grid[a]]
        stack = W.Stack(inner)
        W.jslink((sliders[0], "index"), (stack, "selected_index"))
        for s in inner:
            W.jslink((sliders[1], "index"), (s, "selected_index"))
    for slider, name in zip(sliders, names):
        slider.value = initial.get(name, grid[name][0])
    stack.selected_index = sliders[0].index
    for s in inner:
        s.selected_index = sliders[-1].index
    return W.VBox([*sliders, stack])

