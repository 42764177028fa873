"""Numbers in a chapter's prose, shown the same in the rendered book and in JupyterLab.

A chapter's markdown writes a measured number as {eval}`name`. In the book build the project's
Sphinx extension (`_ext/prose_eval.py`) reads the role as myst-nb's `{glue:text}`, from the glue
data the notebook's run left; in JupyterLab, jupyterlab-myst evaluates `name` in the kernel when
the cell renders, and shows the value stored with the notebook (its `user_expressions`, written
by `scripts/execute_chapters.py`) before that. `prose(name=text, ...)` serves both: it glues each
value and binds the same name in the notebook's namespace. Values are short phrases, never
sentences (the frame test checks it).
"""
from myst_nb import glue


def prose(**values) -> None:
    """Glue each value (as text) under its name and bind the name in the notebook's namespace."""
    from IPython import get_ipython
    shell = get_ipython()
    for name, value in values.items():
        text = value if isinstance(value, str) else f"{value}"
        glue(name, text, display=False)
        if shell is not None:
            shell.user_ns[name] = text
