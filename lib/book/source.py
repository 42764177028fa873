"""The engine's code as the chapters print it: syntax-highlighted listings of lib's functions
(pygments), whose long lines scroll rather than wrap. What a chapter prints is the algorithm
(`tests/test_frame.py` holds every printed function free of argument checks)."""
import inspect
import textwrap

from IPython.display import HTML
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

STYLE = "white-space: pre; overflow-x: auto; font-size: 0.78em; padding: 0.6em"


def listing(code: str) -> HTML:
    """Syntax-highlighted code; long lines scroll, never wrap."""
    html = highlight(code, PythonLexer(), HtmlFormatter(noclasses=True, nowrap=True))
    return HTML(f'<pre class="scroll-listing" style="{STYLE}">{html}</pre>')


def source(obj) -> str:
    """An object's source, dedented (a property's getter for a property)."""
    return textwrap.dedent(inspect.getsource(obj.fget if isinstance(obj, property) else obj))


def loop_source(function) -> str:
    """The body of the function's `while` loop, from its source: the round a loop repeats."""
    lines = inspect.getsource(function).splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("while "))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) <= indent), len(lines))
    return "\n".join(line[indent:] for line in lines[start:end])


def show_source(*objects) -> HTML:
    """The source of lib's functions, classes or properties, as one listing."""
    return listing("\n\n".join(source(o) for o in objects))


def show_loop(function) -> HTML:
    """The `while` loop of a lib function, as a listing."""
    return listing(loop_source(function))
