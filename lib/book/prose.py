"""Numbers in a chapter's prose, shown the same in the rendered book and in JupyterLab.

A chapter's markdown writes a measured number as {eval}`name`. In the book build the project's
Sphinx extension (`_ext/prose_eval.py`) reads the role as myst-nb's `{glue:text}`, from the glue
data the notebook's run left; in JupyterLab, jupyterlab-myst evaluates `name` in the kernel when
the cell renders, and shows the value stored with the notebook (its `user_expressions`, written
by `scripts/execute_chapters.py`) before that. `prose(name=text, ...)` serves both: it glues each
value and binds the same name in the notebook's namespace. Values are short phrases, never
sentences (the frame test checks it).
"""
import re

from myst_nb import glue

EVAL = re.compile(r"\{eval\}`([^`]+)`")  # a prose number in a chapter's markdown
# cell tags with which the book folds or drops a code cell's source, or its outputs; JupyterLab, which
# ignores them, folds the same cells by their metadata.jupyter (scripts/execute_chapters.py writes it)
FOLDS_SOURCE = {"hide-input", "hide-cell", "remove-input", "remove-cell"}
FOLDS_OUTPUT = {"hide-output", "hide-cell", "remove-output", "remove-cell"}
RECORD = "application/papermill.record/"  # the mime prefix of myst-nb's glue outputs


def prose(**values) -> None:
    """Glue each value (as text) under its name and bind the name in the notebook's namespace."""
    from IPython import get_ipython
    shell = get_ipython()
    for name, value in values.items():
        text = str(value)
        glue(name, text, display=False)
        if shell is not None:
            shell.user_ns[name] = text


def compared(a: float, b: float, margin: float, words: tuple) -> str:
    """How a compares with b, in words: words[0] if a exceeds b by more than the margin (a fraction), words[2] if
    b exceeds a by more than it, words[1] between; e.g. compared(t_a, t_b, 0.05, ("longer than", "about as long
    as", "shorter than")). A measured comparison is worded from the run, never typed."""
    if not margin >= 0 or len(words) != 3:
        raise ValueError(f"compared needs a margin >= 0 and three words, got margin={margin!r}, words={words!r}")
    return words[0] if a > (1 + margin) * b else words[2] if b > (1 + margin) * a else words[1]


def glued(nb) -> dict:
    """{name: mime bundle} of every value a notebook's stored run glued (nb: a notebook as a dict)."""
    values = {}
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            name = out.get("metadata", {}).get("scrapbook", {}).get("name")
            if name:
                values[name] = {k[len(RECORD):]: v for k, v in out["data"].items() if k.startswith(RECORD)}
    return values


def shown(source: str) -> list:
    """The names a markdown cell shows as prose numbers, in order, each once."""
    return list(dict.fromkeys(EVAL.findall(source)))
