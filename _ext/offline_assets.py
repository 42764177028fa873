"""Serve the widget manager, require.js and MathJax from the built site, so the book works offline.

At set-up the three packages are fetched once from the npm registry (`npm pack`) into
assets/vendor/ (not committed), each folder stamped with the package version it holds, so a
checkout that kept an older copy fetches the pinned one again. When they are present, this extension points myst-nb's
`nb_ipywidgets_js` and Sphinx's `mathjax_path` at the copies under _static/vendor/ and copies
the widget manager's font files next to every page (they are requested relative to the page).
When they cannot be fetched, the build still works with the public CDN defaults.

It also keeps the browser console clean and the pages within their column: each inline script
is emitted once (the thebe configuration was emitted twice, a redeclared `const`), the theme gets
a default colour mode, the widget manager's MathJax 2 call (`MathJax.Hub.Queue`) is answered
with MathJax 3's `typesetPromise`, and `static/book.css` wraps long code and output lines.
"""
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from sphinx.util import logging

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "assets" / "vendor"
# npm package -> (folder inside the tarball to keep, folder under vendor/). The widget manager is
# the newest 1.0.x, whose controls (5.0.x) are the JavaScript side of ipywidgets 8.1: with 1.0.6,
# moving a slider quickly logged "Cannot read properties of null (reading 'processLuminoMessage')"
# in Chromium 156 (the Stack re-creates its child view at every index, and a resize message
# posted to a view an index before reached it after it was disposed); 1.0.15 showed no error
# in the browser test's rapid slider moves.
PACKAGES = {
    "@jupyter-widgets/html-manager@1.0.15": ("package/dist", "html-manager"),
    "requirejs@2.3.7": ("package", "requirejs"),
    "mathjax@3.2.2": ("package/es5", "mathjax"),
}
STATIC = Path(__file__).resolve().parent / "static"
# The widget manager typesets its labels with MathJax 2's `MathJax.Hub.Queue(["Typeset", Hub, el])`;
# the book loads MathJax 3, which has no Hub. This gives every MathJax object (the configuration
# Sphinx assigns, then the loaded MathJax 3, which replaces it) a Hub whose Queue typesets the
# element with MathJax 3 once it is ready, and does nothing before (MathJax typesets the page then).
MATHJAX2_HUB_SHIM = """(function () {
  function queue(command) {
    var element = command && command[2], mathjax = window.MathJax;
    if (element && mathjax && mathjax.typesetPromise) { mathjax.typesetPromise([element]).catch(function () {}); }
  }
  function withHub(value) {
    if (value && typeof value === "object" && !value.Hub) { value.Hub = {Queue: queue}; }
    return value;
  }
  var current = withHub(window.MathJax);
  Object.defineProperty(window, "MathJax", {configurable: true, enumerable: true,
    get: function () { return current; }, set: function (value) { current = withHub(value); }});
})();"""
FONT_SUFFIXES = (".woff", ".woff2", ".ttf", ".eot", ".svg")
# The manager's webpack chunks ask for fonts relative to the page, under their AMD module ids.
FONT_PATHS = ("@jupyter-widgets", "@jupyter-widgets/html-manager/dist")
SAFE_EXTRACT = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


STAMP = ".npm-package"  # in each vendor folder: the package spec it was unpacked from


def fetched(vendor: Path, spec: str, dest: str) -> bool:
    stamp = vendor / dest / STAMP
    return stamp.is_file() and stamp.read_text().strip() == spec


def fetch(vendor: Path = VENDOR) -> bool:
    """Download and unpack the pinned packages (once); False (and the CDN is used) if that fails."""
    if all(fetched(vendor, spec, dest) for spec, (_, dest) in PACKAGES.items()):
        return True
    npm = shutil.which("npm")
    if npm is None:
        logger.info("offline_assets: npm not found, the book will load widgets and MathJax from the CDN")
        return False
    with tempfile.TemporaryDirectory() as tmp:
        for spec, (inner, dest) in PACKAGES.items():
            if fetched(vendor, spec, dest):
                continue
            try:
                out = subprocess.run([npm, "pack", spec, "--silent"], cwd=tmp, capture_output=True,
                                     text=True, timeout=180, check=True).stdout.split()[-1]
            except (subprocess.SubprocessError, IndexError, OSError) as err:
                logger.info(f"offline_assets: could not fetch {spec} ({err}); using the CDN")
                return False
            with tarfile.open(Path(tmp) / out) as tar:
                tar.extractall(Path(tmp) / dest, **SAFE_EXTRACT)
            target = vendor / dest
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(Path(tmp) / dest / inner, target)
            (target / STAMP).write_text(spec + "\n")
    return True


def configure(app, config):
    if not fetch():
        return
    config.html_static_path = list(config.html_static_path) + [str(ROOT / "assets")]
    config.nb_ipywidgets_js = {
        "vendor/requirejs/require.js": {},
        "vendor/html-manager/embed-amd.js": {"data-jupyter-widgets-cdn": "vendor/"},
    }
    config.mathjax_path = "vendor/mathjax/tex-chtml.js"


def page_settings(app, config):
    """A default colour mode for the theme, and the stylesheet that keeps lines in the column."""
    config.html_context = {**config.html_context, "default_mode": config.html_context.get("default_mode", "light")}
    config.html_static_path = list(config.html_static_path) + [str(STATIC)]


def unique_scripts(app, pagename, templatename, context, doctree):
    """Emit each script once: the same file, or the same inline body, registered twice would run twice."""
    seen, unique = set(), []
    for script in context.get("script_files", []):
        key = (str(getattr(script, "filename", script) or ""),  # an inline script's filename is '' or None
               tuple(sorted((k, str(v)) for k, v in getattr(script, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"][:] = unique


def copy_fonts(app, exception):
    """Put the widget manager's font files where pages request them: <page folder>/FONT_PATHS."""
    if exception is not None or app.builder.format != "html" or not (VENDOR / "html-manager").is_dir():
        return
    fonts = [f for f in (VENDOR / "html-manager").iterdir() if f.suffix in FONT_SUFFIXES]
    out = Path(app.outdir)
    for folder in {p.parent for p in out.rglob("*.html") if "_static" not in p.parts}:
        for sub in FONT_PATHS:
            (folder / sub).mkdir(parents=True, exist_ok=True)
            for font in fonts:
                shutil.copy2(font, folder / sub / font.name)


def setup(app):
    app.connect("config-inited", configure, priority=100)  # before myst-nb reads its config
    app.connect("config-inited", page_settings)
    app.connect("html-page-context", unique_scripts, priority=900)  # after every extension added its scripts
    app.add_js_file(None, body=MATHJAX2_HUB_SHIM, priority=100)  # before MathJax's configuration and code
    app.add_css_file("book.css")
    app.connect("build-finished", copy_fonts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
