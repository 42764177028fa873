"""The live path of `jupyter lab book/`: JupyterLab serves a notebook, a real kernel runs it, and
its slider switches the plot in headless Chromium (1280 px), with no error in an output and none
in the browser console."""
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest
from test_book_html import CHROMIUM, CHROMIUM_ARGS, SLIDER_CELL, need_chromium, open_page

NOTEBOOK = "live.ipynb"
CHAPTER = Path(__file__).resolve().parent.parent / "book" / "03_kv_cache.ipynb"  # a chapter on the book's frame
START_TIMEOUT = 60  # s for the server to answer /api/status
LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 never through a proxy
# JupyterLab's own settings, written to the run's empty settings folder: never fetch the Jupyter
# news feed, and so never show the toast that asks whether to (it would cover part of the page).
# Every cell is rendered, not only those in view (the chapter test reads cells far down the page).
LAB_SETTINGS = {"@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
                "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(server: subprocess.Popen):
    """SIGTERM (the server then shuts its kernel down), SIGKILL if it has not exited in 15 s."""
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=15)


def tail(log, n=4000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-n:]


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1 (a free port, no token, no password, no browser) whose
    root folder holds one notebook with a slider and a copy of a chapter; yields its URL and always
    stops it."""
    need_chromium()  # before starting a server the test could not use
    root = tmp_path / "root"
    root.mkdir()
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# A slider in a live kernel"),
        nbformat.v4.new_code_cell(SLIDER_CELL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, root / NOTEBOOK)
    (root / CHAPTER.name).write_bytes(CHAPTER.read_bytes())  # as stored, never run here
    # The user's Jupyter config, data (kernels, lab extensions), runtime files, IPython profile and
    # JupyterLab settings and workspaces stay out: every run starts from JupyterLab's defaults in
    # fresh folders and leaves no state behind. The venv's own config and data still apply (the
    # python3 kernel, the widgets extension).
    env = dict(os.environ)
    for var, sub in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                     ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython"),
                     ("JUPYTERLAB_SETTINGS_DIR", "lab-settings"), ("JUPYTERLAB_WORKSPACES_DIR", "lab-workspaces")]:
        (tmp_path / sub).mkdir()
        env[var] = str(tmp_path / sub)
    for name, settings in LAB_SETTINGS.items():
        (tmp_path / "lab-settings" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "lab-settings" / name).write_text(json.dumps(settings))
    port = free_port()
    log = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}",
         "--IdentityProvider.token=", "--PasswordIdentityProvider.hashed_password=",
         "--allow-root",  # containers (CI) often run as root, which the server refuses without it
         "--LabApp.news_url=None"],  # the server fetches no announcements, whatever the settings say
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert server.poll() is None, f"the server exited:\n{tail(log)}"
            try:
                with LOCAL.open(f"{url}/api/status", timeout=2) as answer:
                    json.load(answer)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                assert time.monotonic() < deadline, f"no answer from {url} in {START_TIMEOUT} s:\n{tail(log)}"
                time.sleep(0.25)
        yield url
    finally:
        stop(server)
        print(f"server log:\n{tail(log)}")  # shown by pytest if the test failed
        log.close()


def test_slider_switches_the_plot_in_jupyterlab(lab):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = open_page(browser, lab)
            page.set_default_timeout(30_000)  # starting the kernel, running the cell on a busy machine
            expect.set_options(timeout=30_000)
            page.goto(f"{lab}/lab/tree/{NOTEBOOK}")
            notebook = page.locator(".jp-NotebookPanel")
            # the kernel has started and its websocket is connected: the status bar names the kernel
            # and shows it idle (the toolbar's indicator says idle already while there is no kernel)
            page.locator(".jp-StatusBar-TextItem", has_text="Python 3 (ipykernel) | Idle").wait_for()
            page.get_by_role("menuitem", name="Run", exact=True).click()  # the menu bar's Run menu
            page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()  # Run All Cells
            expect(notebook.locator(".jp-CodeCell .jp-InputPrompt")).to_have_text(["[1]:"])  # it ran, once
            tracebacks = notebook.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]',
                                          has_text="Traceback").all_inner_texts()
            error_texts = notebook.locator(".jp-RenderedText", has_text="Error").all_inner_texts()
            assert tracebacks == [] and error_texts == [], tracebacks + error_texts
            image, readout = notebook.locator(".widget-image:visible"), notebook.locator(".widget-readout")
            expect(image).to_have_count(1)  # one of the stack's five plots is shown
            expect(readout).to_have_text("1")
            src, before = image.get_attribute("src"), image.screenshot()
            handle = notebook.locator(".noUi-handle")
            handle.focus()
            handle.press("ArrowRight")
            expect(readout).to_have_text("2")
            expect(image).not_to_have_attribute("src", src)  # the stack shows another plot
            after = image.screenshot()
            errors, failed = list(page.errors), list(page.failed)
        finally:
            expect.set_options(timeout=None)  # back to Playwright's default for other tests
            browser.close()
    assert before != after, "moving the slider did not change the plot"
    assert errors == [], f"console errors: {errors}"
    assert failed == [], f"requests failed: {failed}"


# A glossary link ({term}`TTFT`) points into the book's glossary page, which a notebook opened on its own
# does not have: jupyterlab-myst shows the term's text and logs that its target is missing. Nothing else
# may reach the console.
GLOSSARY_LINK = re.compile(r"(Cross reference target was not found: term-[^\n]+\n?)+")


def test_a_chapter_reads_in_jupyterlab_as_in_the_book(lab):
    """Opened, not run: the prose shows the stored numbers, not role markup, and a dropdown is
    rendered collapsed (jupyterlab-myst), as in the built book."""
    from playwright.sync_api import expect, sync_playwright

    chapter = nbformat.read(CHAPTER, as_version=4)
    cell = next(c for c in chapter.cells if c.cell_type == "markdown" and "speedup_511" in c.source)
    stored = {e["expression"]: e["result"]["data"]["text/plain"].strip("'") for e in cell.metadata["user_expressions"]}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = open_page(browser, lab)
            page.set_default_timeout(30_000)
            expect.set_options(timeout=30_000)
            page.goto(f"{lab}/lab/tree/{CHAPTER.name}")
            notebook = page.locator(".jp-NotebookPanel")
            prose = notebook.locator(".jp-MarkdownCell", has_text="the cache made a token")
            expect(prose).to_have_count(1)
            expect(prose).to_contain_text(f"At position {stored['last_position']} the cache made a token "
                                          f"{stored['speedup_511']} times faster")
            text = " ".join(notebook.locator(".jp-MarkdownCell").all_inner_texts())
            assert "{eval}" not in text and "{glue" not in text and "{term}" not in text and ":::" not in text, \
                "MyST markup shown as text"
            summary = notebook.get_by_text(re.compile(r"^Deep dive: the cache.s own code$"))  # ' may render as ’
            expect(summary).to_be_visible()
            body = notebook.locator(".jp-MarkdownCell p", has_text="returns a view of the first")
            expect(body).to_be_hidden()  # collapsed until opened
            summary.click()
            expect(body).to_be_visible()
            errors = [e for e in page.errors if not GLOSSARY_LINK.fullmatch(str(e).strip())]
        finally:
            expect.set_options(timeout=None)
            browser.close()
    assert errors == [], f"console errors: {errors}"
