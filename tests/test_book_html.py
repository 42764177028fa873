"""The rendered book: sliders switch plots in a real browser without a kernel, no page loads a
script, style, font or image from another host, logs a console error, or has an element wider
than its content column (at 1280 px)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
EXTERNAL = re.compile(r"""<(?:script|link|img|iframe|source)\b[^>]*?\b(?:src|href)\s*=\s*["']((?:https?:)?//[^"']+)""", re.I)
CSS_EXTERNAL = re.compile(r"""url\(\s*["']?((?:https?:)?//[^)"']+)""", re.I)

SLIDER_CELL = '''
import matplotlib.pyplot as plt
from lib.book.widgets import slider_plot

def figure(k):
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar(range(k), range(1, k + 1))
    ax.set_title(f"k = {k}")
    return fig

slider_plot(figure, {"k": [1, 2, 3, 4, 5]})
'''
LONG_LINES_CELL = '''
print("a long output line " * 12)  # a reader must see all of it: it wraps
raise ValueError("a long error message that a reader needs to read in full, " * 4)
'''
# Elements (visible, not zero-sized) whose box reaches past the article column's right edge, or
# whose content is wider than their box (cut off, or hidden behind a scroll bar).
OVERFLOW_JS = """
() => {
  const column = document.querySelector("article.bd-article").getBoundingClientRect();
  const wide = [];
  for (const el of document.querySelectorAll("article.bd-article *")) {
    const box = el.getBoundingClientRect();
    if (box.width === 0 || box.height === 0 || el.closest("mjx-assistive-mml")) continue;
    // a code listing that scrolls sideways, by design: its lines never wrap (book/CONVENTIONS.md)
    if (el.closest("pre.scroll-listing, .scroll-listing pre")) continue;
    // a few pixels of overhang (italic math) are not hidden content
    const style = getComputedStyle(el), clips = style.overflowX !== "visible";
    const past = box.right > column.right + 1;
    // MathJax's hidden copy for screen readers (mjx-assistive-mml) inflates scrollWidth: for math,
    // the rendered mjx-math boxes are checked against the column instead
    const inside = el.clientWidth > 0 && el.scrollWidth > el.clientWidth + 8 && !el.querySelector("mjx-assistive-mml")
                   && (clips || box.left + el.scrollWidth > column.right + 1);  // cut off, or spilling past the column
    if (past || inside) {
      const what = past ? `ends at ${Math.round(box.right)} px, column at ${Math.round(column.right)}`
                        : `content ${el.scrollWidth} px wide in a ${el.clientWidth} px box`;
      wide.push(`${el.tagName}.${el.className} ${what}: ${(el.textContent || "").slice(0, 60)}`);
    }
  }
  return wide;
}
"""


def external_urls(html_dir: Path):
    """(file, url) for every script/link/img/iframe and CSS url() that points at another host."""
    found = []
    for path in html_dir.rglob("*.html"):
        found += [(path.name, url) for url in EXTERNAL.findall(path.read_text(errors="replace"))]
    for path in html_dir.rglob("*.css"):
        found += [(path.name, url) for url in CSS_EXTERNAL.findall(path.read_text(errors="replace"))]
    return found


@pytest.fixture(scope="module")
def slider_site(tmp_path_factory):
    """A one-page book with a slider and some math, built with the project's own configuration."""
    src = tmp_path_factory.mktemp("slider_book")
    config = (ROOT / "_config.yml").read_text().replace("./_ext", str(ROOT / "_ext"))
    (src / "_config.yml").write_text(config)
    (src / "_toc.yml").write_text("format: jb-book\nroot: slider\n")
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# A slider\n\nMath renders offline: $e^{i\\pi} + 1 = 0$."),
        nbformat.v4.new_code_cell(SLIDER_CELL),
        nbformat.v4.new_code_cell(LONG_LINES_CELL, metadata={"tags": ["raises-exception"]})])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, src / "slider.ipynb")
    cli = Path(sys.executable).parent / "jupyter-book"  # the one installed with this Python
    build = subprocess.run([str(cli if cli.exists() else "jupyter-book"), "build", "--all", "-W", "--keep-going", str(src)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return src / "_build" / "html"


def test_slider_page_loads_nothing_from_other_hosts(slider_site):
    assert external_urls(slider_site) == []


def test_built_book_loads_nothing_from_other_hosts():
    site = ROOT / "_build" / "html"
    if not (site / "index.html").exists():
        pytest.skip("the book has not been built (jupyter-book build --all -W --keep-going .)")
    assert external_urls(site) == []


def test_external_url_scan_finds_cdn_scripts(tmp_path):
    (tmp_path / "a.html").write_text('<script src="https://cdn.example.org/x.js"></script><a href="https://ok.example">x</a>')
    (tmp_path / "b.css").write_text("@font-face { src: url('//fonts.example/f.woff') }")
    assert external_urls(tmp_path) == [("a.html", "https://cdn.example.org/x.js"), ("b.css", "//fonts.example/f.woff")]


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def need_chromium():
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("Chromium is required in CI (apt-get install chromium)")
        pytest.skip("Chromium not installed (apt-get install chromium)")


def open_page(browser, path: Path):
    """The page at 1280 px, loaded, with its console errors and failed requests collected."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.errors, page.failed = [], []
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on("requestfailed", lambda r: page.failed.append(r.url))
    return page


# The visible plot (or text) of the slider figure that holds a slider, as the page shows it.
FIGURE_OF = "(handle) => handle.closest('.widget-vbox')"


def move_every_slider(page) -> list:
    """Sweep each slider of the page to both ends with no pause between keys (as a reader drags
    it), then step it from its first value and back; returns a problem per slider whose readout
    or plot did not follow."""
    problems = []
    handles = page.locator(".noUi-handle")
    for i in range(handles.count()):
        handle, readout = handles.nth(i), page.locator(".widget-readout").nth(i)
        figure = handle.evaluate_handle(FIGURE_OF).as_element()
        shown = lambda: figure.query_selector(".widget-image:visible, .widget-html:visible").screenshot()
        handle.focus()
        for key in ["ArrowRight"] * 12 + ["ArrowLeft"] * 24:  # past both ends: at the first value
            handle.press(key)
        page.wait_for_timeout(300)
        first, first_plot = readout.inner_text(), shown()
        handle.press("ArrowRight")
        page.wait_for_timeout(300)
        second = readout.inner_text()
        if second == first:
            problems.append(f"slider {i}: the readout did not move from {first!r}")
        elif shown() == first_plot:
            problems.append(f"slider {i}: at {second!r} it shows the plot of {first!r}")
        handle.press("ArrowLeft")
        page.wait_for_timeout(300)
        if readout.inner_text() != first or shown() != first_plot:
            problems.append(f"slider {i}: back at {first!r} it reads {readout.inner_text()!r} or shows another plot")
    return problems


def test_every_built_page_loads_offline_and_every_slider_moves():
    """Every page of the built book: nothing fetched from another host or failed, nothing wider than
    the column, every slider moves its plot, and the console stays clean throughout."""
    site = ROOT / "_build" / "html"
    if not (site / "index.html").exists():
        pytest.skip("the book has not been built (jupyter-book build --all -W --keep-going .)")
    need_chromium()
    from playwright.sync_api import sync_playwright

    problems, moved = [], 0
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for path in sorted((site / "book").glob("*.html")):
            page = open_page(browser, path)
            outside = []
            page.on("request", lambda r: None if r.url.startswith(("file:", "data:", "blob:")) else outside.append(r.url))
            page.goto(path.as_uri())
            page.wait_for_load_state("load")
            has_widgets = "application/vnd.jupyter.widget-state+json" in path.read_text()
            if has_widgets:
                page.locator(".widget-slider").first.wait_for(timeout=30_000)
            page.wait_for_timeout(1000)  # MathJax and the widgets finish rendering
            wide = page.evaluate(OVERFLOW_JS)
            sliders = move_every_slider(page) if has_widgets else []
            moved += page.locator(".noUi-handle").count()
            if page.failed or outside or page.errors or wide or sliders:
                problems.append((path.name, page.failed, outside, page.errors, wide[:5], sliders))
            page.close()
        browser.close()
    assert problems == [], "\n".join(map(str, problems))
    assert moved >= 10, f"only {moved} sliders found in the built book"


def test_slider_switches_the_plot_in_a_browser(slider_site):
    need_chromium()
    from playwright.sync_api import sync_playwright

    requests = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = open_page(browser, slider_site / "slider.html")
        page.on("request", lambda r: requests.append(r.url))
        page.goto((slider_site / "slider.html").as_uri())
        image = page.locator(".widget-image:visible").first
        image.wait_for(timeout=30_000)
        before = image.screenshot()
        assert page.locator(".widget-readout").first.inner_text() == "1"
        handle = page.locator(".noUi-handle").first
        handle.focus()
        for _ in range(3):
            handle.press("ArrowRight")
        page.wait_for_timeout(500)
        assert page.locator(".widget-readout").first.inner_text() == "4"
        after = page.locator(".widget-image:visible").first.screenshot()
        math = page.locator("mjx-container").count()
        wide = page.evaluate(OVERFLOW_JS)
        errors, failed = page.errors, page.failed
        browser.close()
    assert before != after, "moving the slider did not change the image"
    assert math >= 1, "MathJax did not render the formula"
    assert failed == [], f"requests failed: {failed}"
    assert errors == [], f"console errors: {errors}"
    assert wide == [], f"elements wider than the column: {wide}"
    assert all(url.startswith(("file:", "data:", "blob:")) for url in requests), \
        [u for u in requests if not u.startswith(("file:", "data:", "blob:"))]


def test_overflow_check_finds_an_element_wider_than_the_column(tmp_path):
    need_chromium()
    from playwright.sync_api import sync_playwright

    page_file = tmp_path / "wide.html"
    page_file.write_text('<body style="width:1280px"><article class="bd-article" style="width:700px">'
                         '<pre style="white-space:pre">' + "x" * 300 + '</pre><p>fits</p></article></body>')
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = open_page(browser, page_file)
        page.goto(page_file.as_uri())
        wide = page.evaluate(OVERFLOW_JS)
        page.evaluate("console.error('boom')")
        errors = page.errors
        browser.close()
    assert len(wide) == 1 and wide[0].startswith("PRE")
    assert errors == ["boom"]
