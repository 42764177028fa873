"""Run chapters top to bottom and store them with their outputs and their prose numbers.

    python scripts/execute_chapters.py book/03_kv_cache.ipynb [...]

Each notebook runs in a fresh kernel started in book/ (as the book build and nbval start it), one
BLAS thread as every chapter sets. After the run, every markdown cell that shows a number as
{eval}`name` gets the value in its `user_expressions` metadata, as jupyterlab-myst stores it after
evaluating the cell, so `jupyter lab book/` shows numbers before anything is run; and every cell
the book folds is folded in JupyterLab too.
"""
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from lib.book.prose import FOLDS_OUTPUT, FOLDS_SOURCE, glued, shown


def store_prose(nb) -> int:
    """Write each markdown cell's {eval} values into its user_expressions; the count written."""
    values, written = glued(nb), 0
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        names = shown(cell.source)
        missing = [n for n in names if n not in values]
        if missing:
            raise SystemExit(f"{', '.join(missing)}: shown in the prose but never glued")
        if names:
            cell.metadata["user_expressions"] = [
                {"expression": n, "result": {"status": "ok", "data": values[n], "metadata": {}}} for n in names]
            written += len(names)
        else:
            cell.metadata.pop("user_expressions", None)
    return written


def fold_as_the_book_does(nb) -> None:
    """Fold in JupyterLab what the book folds: JupyterLab ignores the book's tags and reads
    `metadata.jupyter.source_hidden` / `outputs_hidden`, so a reader running the notebooks walks the
    same main path as a reader of the book."""
    for cell in nb.cells:
        tags = set(cell.metadata.get("tags", ()))
        folded = {}
        if tags & FOLDS_SOURCE:
            folded["source_hidden"] = True
        if cell.cell_type == "code" and tags & FOLDS_OUTPUT:
            folded["outputs_hidden"] = True
        if folded:
            cell.metadata["jupyter"] = folded
        else:
            cell.metadata.pop("jupyter", None)


def main(paths):
    for path in map(Path, paths):
        nb = nbformat.read(path, as_version=4)
        nb.metadata.pop("widgets", None)  # the run stores the state of the widgets it makes, no others
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        count = store_prose(nb)
        fold_as_the_book_does(nb)
        nbformat.write(nb, path)
        print(f"{path}: run and stored, {count} prose numbers")


if __name__ == "__main__":
    main(sys.argv[1:])
