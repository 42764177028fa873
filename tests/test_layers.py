"""The engine's floors: every import in lib goes to its own floor or one below, there is no
import circle, modules and functions stay small, and the README's Layout lists the tree.

The floor order is written once, here (FLOORS); the README describes it."""
import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "lib"

FLOORS = [  # lowest first: a module may import its own floor and any floor below it
    ("ground", ["lib.config", "lib.tokenizer", "lib.timing"]),
    ("checks", ["lib.checks"]),
    ("storage", ["lib.cache"]),
    ("gpu pricing", ["lib.gpu"]),
    ("reference", ["lib.model", "lib.sampling", "lib.corpus", "lib.generation", "lib.speculative", "lib.gqa",
                   "lib.kv_scales", "lib.train"]),
    ("fast paths", ["lib.fast"]),
    ("serving", ["lib.serve"]),
    ("measuring", ["lib.measure"]),
    ("report and book", ["lib.bench", "lib.book", "lib"]),  # `lib` itself: the package's re-exports
]
WRONG_WAY = [  # arrows that once ran downward-to-upward; the floors must forbid each
    ("lib.cache.quant", "lib.model"),  # storage ran the model (K/V calibration)
    ("lib.cache.paged", "lib.model"),  # storage took check helpers from the model
    ("lib.serve.server", "lib.measure.standins"),  # the scheduler imported the studies
    ("lib.serve.server", "lib.book.studies.sweep"),
    ("lib.generation", "lib.fast.lean"),  # the reference imported a fast path
    ("lib.timing", "lib.cache.kv_cache"),  # the timers imported a cache
]
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 350, 80
LONG_FUNCTIONS = {}  # "module:function" -> why it may be longer


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(LIB.rglob("*.py"))}


def floor(module: str) -> int:
    """The floor of a module: the longest prefix listed in FLOORS."""
    best = max(((len(prefix), i) for i, (_, prefixes) in enumerate(FLOORS) for prefix in prefixes
                if module == prefix or (prefix != "lib" and module.startswith(prefix + "."))), default=None)
    if best is None:
        raise AssertionError(f"{module} is on no floor: add it to FLOORS in tests/test_layers.py")
    return best[1]


def imports(path: Path) -> set:
    """The lib modules a file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "lib"}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; lib imports by absolute name"
            if node.module and node.module.split(".")[0] == "lib":
                for a in node.names:  # `from lib.cache import quant` imports the module lib.cache.quant
                    sub = f"{node.module}.{a.name}"
                    found.add(sub if sub in MODULES else node.module)
    return found


GRAPH = {m: imports(p) - {m} for m, p in MODULES.items()}


def allowed(importer: str, imported: str) -> bool:
    return floor(imported) <= floor(importer)


def test_every_module_is_on_a_floor():
    for module in MODULES:
        floor(module)
    with pytest.raises(AssertionError, match="on no floor"):
        floor("lib.a_new_module")  # `lib` itself is a floor entry; its prefix is not


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_only_downward(module):
    upward = sorted(m for m in GRAPH[module] if not allowed(module, m))
    assert not upward, f"{module} ({FLOORS[floor(module)][0]}) imports upward: " + ", ".join(
        f"{m} ({FLOORS[floor(m)][0]})" for m in upward)


@pytest.mark.parametrize("importer, imported", WRONG_WAY)
def test_the_arrows_that_once_ran_upward_are_forbidden(importer, imported):
    assert not allowed(importer, imported)
    assert imported not in GRAPH.get(importer, set())


def test_no_import_circle():
    """Modules (the package inits aside: importing lib.x runs lib/__init__ first, by Python's rule)."""
    graph = {m: {d for d in deps if MODULES[d].name != "__init__.py"} for m, deps in GRAPH.items()
             if MODULES[m].name != "__init__.py"}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for d in sorted(graph.get(m, ())):
            visit(d)
        path.pop()
        done.add(m)
    for m in sorted(graph):
        visit(m)


def test_modules_and_functions_stay_small():
    long_modules = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
    long_functions = {}
    for m, p in MODULES.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and f"{m}:{node.name}" not in LONG_FUNCTIONS:
                    long_functions[f"{m}:{node.name}"] = n
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def layout_entries() -> set:
    """The paths the README's Layout lists under lib/, from its indentation."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("## Layout"):]
    block = block[block.index("```\n") + 4:]
    block = block[:block.index("```")]
    entries, stack = set(), []
    for line in block.splitlines():
        match = re.match(r"( *)(\S+)", line)
        if not match:
            continue
        depth, name = len(match[1]) // 2, match[2]
        stack = stack[:depth] + [name]
        if stack[0] == "lib/" and depth:
            entries.add("".join(stack[1:]))
    return entries


def test_the_readme_layout_lists_the_tree():
    tree = {str(p.relative_to(LIB)) for p in LIB.rglob("*.py") if p.name != "__init__.py"}
    tree |= {str(p.relative_to(LIB)) + "/" for p in LIB.rglob("*") if p.is_dir() and "__pycache__" not in p.parts}
    listed = layout_entries()
    assert not tree - listed, f"in lib/ but not in the README's Layout: {sorted(tree - listed)}"
    assert not listed - tree, f"in the README's Layout but not in lib/: {sorted(listed - tree)}"


def code_lines(source: str) -> set:
    """Line numbers holding code: not blank, not a comment, not a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings |= set(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            lines |= set(range(tok.start[0], tok.end[0] + 1))
    return lines - docstrings


def check_lines(source: str) -> set:
    """Lines that check arguments, by the rule the design review applied to every codebase it compared:
    an `if` whose body only raises, an assert, a statement calling check*/validate*/is_*, and the
    bodies of functions so named."""
    def checking(name: str) -> bool:
        return name.lstrip("_").startswith(("check", "validate", "is_"))

    found = set()
    for node in ast.walk(ast.parse(source)):
        span = set(range(node.lineno, node.end_lineno + 1)) if hasattr(node, "lineno") else set()
        if isinstance(node, ast.If) and not node.orelse and all(isinstance(b, ast.Raise) for b in node.body):
            found |= span
        elif isinstance(node, ast.Assert):
            found |= span
        elif isinstance(node, (ast.Expr, ast.Assign)) and isinstance(node.value, ast.Call):
            func = node.value.func
            if checking(getattr(func, "id", None) or getattr(func, "attr", "")):
                found |= span
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and checking(node.name):
            found |= span
    return found


EXERCISES = LIB / "book" / "exercises"  # aside: an exercise's check of the reader's function is its content
MAX_CHECK_SHARE = 0.06  # 14.2% before the boundary was declared, 7.2% with 35 entry points, 6.4% with 30 and shared
# rules, 6.0% with one message per rule (check_count, check_option) and no checks behind the boundary (trace makers)


def test_argument_checks_are_a_small_share_of_the_engine():
    """Checks live at the declared boundary (lib.checks.BOUNDARY), so they stay a small share of the
    code: the review measured 1.3-4.5% in picoGPT, nanoGPT, nano-vllm and gpt-fast by this rule."""
    per_module, code, checks = {}, 0, 0
    for path in sorted(LIB.rglob("*.py")):
        if EXERCISES in path.parents:
            continue
        source = path.read_text()
        lines = code_lines(source)
        found = check_lines(source) & lines
        code, checks = code + len(lines), checks + len(found)
        per_module[module_name(path)] = len(found)
    share = checks / code
    print(f"argument checks: {checks} of {code} code lines ({share:.1%}); most:",
          sorted(per_module.items(), key=lambda kv: -kv[1])[:5])
    assert share <= MAX_CHECK_SHARE, f"checks are {share:.1%} of lib's code lines, over {MAX_CHECK_SHARE:.0%}"


def test_every_package_is_installed():
    """pyproject.toml lists the packages explicitly: a new folder under lib/ must join the list."""
    listed = set(re.findall(r'"(lib[\w.]*)"', re.search(r"packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text())[1]))
    folders = {module_name(p) for p in LIB.rglob("__init__.py")}
    assert folders == listed, f"packages missing from pyproject.toml: {sorted(folders - listed)}; listed, no folder: {sorted(listed - folders)}"
