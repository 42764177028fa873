"""The book's prose numbers: {eval}`name` rendered from the notebook's glue data.

Chapters write a measured number in their markdown as {eval}`name` (see `lib/book/prose.py`), which
jupyterlab-myst evaluates in a live kernel. The book is built with myst-nb's standard execution,
which has no kernel left when a page renders, so here the role reads the value glued under the
same name, exactly as `{glue:text}` would; a name never glued fails the build.
"""
from myst_nb.ext.glue.roles import PasteTextRole


def setup(app):
    app.setup_extension("myst_nb")  # first, so that this role replaces myst-nb's own `eval`
    app.add_role("eval", PasteTextRole(), override=True)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
