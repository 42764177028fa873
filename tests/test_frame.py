"""The chapter frame (book/CONVENTIONS.md): every chapter's main path keeps its budget and has
its boxes, its prose numbers are short phrases, and it reads in JupyterLab as in the book.

The main path is the markdown outside collapsed blocks (MyST dropdowns, toggles, admonitions with
`:class: dropdown`) and outside the exercise box, which has its own budget. Words are counted as a
reader sees them, a prose number as one word; a prose number is an {eval} role (or, in chapters not
yet on the frame, a {glue} role)."""
import ast
import json
import re
from pathlib import Path

import pytest

from lib.book.prose import FOLDS_OUTPUT, FOLDS_SOURCE, compared, glued, shown

BOOK = Path(__file__).resolve().parent.parent / "book"
CHAPTERS = sorted(BOOK.glob("[0-9][0-9]_*.ipynb"))
WORDS, NUMBERS = 1500, 30  # the main path's budget
LONGER = {"09_speculative_proof": 2500}  # the proof, its worked example and its slider stay on the main path
PHRASE = 40  # characters: the longest prose value, a number with its unit or a short phrase
CORE = ("03_kv_cache", "05_gqa", "06_paging", "07_quantization", "08_serving", "09_speculative_proof", "10_k_sweep")
EXERCISE_WORDS = 120  # the exercise box's own budget (its code cells and solution aside)

OPEN = re.compile(r"^(?P<fence>`{3,}|:{3,})\{(?P<name>[a-zA-Z:_-]+)\}(?P<rest>.*)$")
ROLE = re.compile(r"\{(?:glue(?::[a-z]+)?|eval)\}`[^`]+`")


def exercise_box(opening) -> bool:
    return opening["name"] == "admonition" and opening["rest"].strip().startswith("Exercise")


def main_path(md: str, apart=lambda opening: False) -> str:
    """The markdown outside collapsed directives (their titles too), nested fences tracked, and
    outside directives set apart (the exercise box)."""
    lines, out, stack = md.split("\n"), [], []  # stack of (fence, collapsed)
    i = 0
    while i < len(lines):
        m = OPEN.match(lines[i].strip())
        if m:
            j, options = i + 1, []
            while j < len(lines) and lines[j].strip().startswith(":") and not OPEN.match(lines[j].strip()):
                options.append(lines[j].strip())
                j += 1
            collapsed = m["name"] in ("dropdown", "toggle") or apart(m) or any(
                o.startswith(":class:") and "dropdown" in o for o in options)
            stack.append((m["fence"], collapsed or (bool(stack) and stack[-1][1])))
            if not stack[-1][1]:
                out.append(m["rest"])
            i = j
            continue
        if stack and lines[i].strip() == stack[-1][0]:
            stack.pop()
        elif not (stack and stack[-1][1]):
            out.append(lines[i])
        i += 1
    return "\n".join(out)


def words(text: str) -> int:
    text = re.sub(r"\{term\}`([^`]+)`", r"\1", text)  # a glossary link reads as its term
    return len(re.findall(r"[A-Za-z0-9][\w'.,-]*", ROLE.sub(" N ", text)))


def markdown(nb: dict) -> list:
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]


def frame(path: Path) -> dict:
    nb = json.loads(path.read_text())
    cells = markdown(nb)
    full, main = "\n".join(cells), "\n".join(main_path(c, exercise_box) for c in cells)
    boxes = [c for c in cells if c.startswith(":::{admonition} Exercise")]
    low = full.lower()
    return dict(
        words=words(main), numbers=len(ROLE.findall(main)), exercises=len(boxes),
        exercise_words=max((words(b) for b in boxes), default=0),
        solution=bool(re.search(r"^:::\{dropdown\} Solution", full, re.M)),
        opening="questions" in main_path(cells[0]).lower() if cells else False,
        stack="in your stack" in low, problem=bool(re.search(r"worked problem", low)),
        remember="three things to remember" in low, next=bool(re.search(r"^#+\s*next\b", low, re.M)),
        measured=bool(re.search(r"\{dropdown\}\s*measured in this build", low)))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_main_path_keeps_its_budget_and_has_every_box(path):
    f = frame(path)
    print(f"{path.stem}: main path {f['words']} words, {f['numbers']} prose numbers")
    assert f["words"] <= LONGER.get(path.stem, WORDS) and f["numbers"] <= NUMBERS, f
    missing = [box for box in ("opening", "stack", "problem", "remember", "next", "measured") if not f[box]]
    assert not missing, f"{path.stem} lacks: {', '.join(missing)}"
    if path.stem in CORE:  # one coding exercise: its box (its own budget) and its solution, collapsed
        assert f["exercises"] == 1 and f["solution"], f"{path.stem} lacks its exercise box or its solution dropdown"
        assert f["exercise_words"] <= EXERCISE_WORDS, f


PRINTED = 60  # lines of printed output a chapter shows unfolded: tables beyond that go into its deep dives
PRINTED_LESS = {"07_quantization": 40}  # its fresh read counted 101 lines of tables before its figures took their place


def printed_lines(nb) -> int:
    """Lines of text output (stdout and plain-text results) of code cells whose output the book shows."""
    count = 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "code" or FOLDS_OUTPUT & set(cell.get("metadata", {}).get("tags", [])):
            continue
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if out.get("name") == "stdout":
                count += "".join(out["text"]).count("\n")
            elif "text/plain" in data and not any(k.startswith(("image/", "application/")) for k in data):
                count += "".join(data["text/plain"]).count("\n") + 1
    return count


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_main_path_prints_few_lines(path):
    lines = printed_lines(json.loads(path.read_text()))
    print(f"{path.stem}: {lines} printed lines on the main path")
    assert lines <= PRINTED_LESS.get(path.stem, PRINTED), f"{path.stem} shows {lines} lines of printed output unfolded"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_prose_numbers_are_short_phrases_and_read_in_jupyterlab(path):
    nb = json.loads(path.read_text())
    values = {k: "".join(v.get("text/plain", "")) for k, v in glued(nb).items()}
    long = {k: v for k, v in values.items() if len(v.strip("'\"")) > PHRASE or re.search(r"[.;:] [a-z]", v)}
    assert not long, f"glued values that are sentences, not phrases: {long}"
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        source = "".join(cell["source"])
        assert "{glue" not in source, "a {glue} role shows as markup in JupyterLab: use {eval} (lib.book.prose)"
        names = shown(source)
        stored = {e["expression"]: e["result"]["data"]["text/plain"] for e in cell["metadata"].get("user_expressions", [])}
        assert stored == {n: values.get(n) for n in names}, \
            f"stored prose values differ from the run's (re-run scripts/execute_chapters.py): {source[:80]!r}"


VERDICTS = ("longer than", "about as long as", "shorter than")


@pytest.mark.parametrize("a, b, word", [(1.06, 1.0, "longer than"), (1.04, 1.0, "about as long as"),
                                        (1.0, 1.04, "about as long as"), (1.0, 1.06, "shorter than"),
                                        (0.0, 0.0, "about as long as")])
def test_a_measured_comparison_is_worded_with_its_margin(a, b, word):
    assert compared(a, b, 0.05, VERDICTS) == word


@pytest.mark.parametrize("margin, words", [(-0.1, VERDICTS), (float("nan"), VERDICTS), (0.05, VERDICTS[:2])])
def test_a_comparison_without_a_margin_or_three_words_is_refused(margin, words):
    with pytest.raises(ValueError, match="margin >= 0 and three words"):
        compared(1.0, 1.0, margin, words)


def test_regimes_page_keeps_the_budget():
    f = frame(BOOK / "regimes.ipynb")
    print(f"regimes: main path {f['words']} words, {f['numbers']} prose numbers")
    assert f["words"] <= WORDS and f["numbers"] <= NUMBERS, f


CARD = re.compile(r"^.*, one BLAS thread: a numpy call .* products peak at .*$", re.M)  # lib.measure.costmodel.Machine.card


def stored_cards(path: Path) -> set:
    """The machine cards a stored chapter printed (each chapter prints the card it read)."""
    texts = ["".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
             for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    return {m.group(0).strip() for text in texts for m in CARD.finditer(text)}


def test_every_stored_chapter_printed_one_card():
    """One card per build: the stored outputs of every chapter come from one measurement of one machine,
    so "this machine" is the same machine on every page (book/CONVENTIONS.md, "This machine")."""
    cards = {path.name: stored_cards(path) for path in [BOOK / "regimes.ipynb", *CHAPTERS]}
    printed = {name: c for name, c in cards.items() if c}
    assert len(printed) >= 8, f"only {sorted(printed)} print the machine card"
    distinct = set().union(*printed.values())
    assert len(distinct) == 1, "chapters stored with different cards (re-execute them all with one card):\n" + "\n".join(
        f"{name}: {sorted(c)}" for name, c in printed.items())


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_harness_is_out_of_sight_in_the_book_and_in_jupyterlab(path):
    """The machine line is folded (the regimes page shows it); prose(...) calls stay in folded cells; every
    cell the book folds is folded in JupyterLab too (its metadata.jupyter, written by
    scripts/execute_chapters.py), so a reader running the notebooks walks the same main path."""
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        source, tags = "".join(cell["source"]), set(cell["metadata"].get("tags", ()))
        lab = cell["metadata"].get("jupyter", {})
        where = f"{path.name}, code cell {i}"
        if "setup()" in source:
            assert tags & FOLDS_OUTPUT, f"{where}: the machine line is shown (tag the cell hide-output)"
        if re.search(r"^\s*prose\(", source, re.M):
            assert tags & FOLDS_SOURCE, f"{where}: a prose(...) call in a visible cell (hide its input)"
        assert lab.get("source_hidden", False) == bool(tags & FOLDS_SOURCE), f"{where}: folded in the book, not in JupyterLab"
        assert lab.get("outputs_hidden", False) == bool(tags & FOLDS_OUTPUT), f"{where}: outputs folded in one, not the other"


def printed_objects(path: Path) -> list:
    """(label, source) of every lib object the chapter prints with show_source or show_loop: the
    chapter's own imports are run, then each call's arguments evaluated against them."""
    from lib.book.source import loop_source, source
    cells = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    trees = [ast.parse(re.sub(r"^[%!].*$", "", cell, flags=re.M)) for cell in cells]
    namespace = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    found = []
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("show_source", "show_loop"):
                for arg in node.args:
                    label = ast.unparse(arg)
                    obj = eval(compile(ast.Expression(arg), str(path), "eval"), namespace)
                    text = loop_source(obj) if node.func.id == "show_loop" else source(obj)
                    found.append((label, text))
    return found


def checks_in(code: str) -> list:
    """The lines of code that check arguments: a raise, or a call to check*/_check*/validate*. A
    decorator naming the boundary's rule (`@entry_point(check_forward)`) is the one line a listing of
    an entry point may keep: the rule runs before the body, which stays the algorithm."""
    out, tree = [], ast.parse(code)
    decorators = {id(n) for f in ast.walk(tree) for d in getattr(f, "decorator_list", []) for n in ast.walk(d)}
    for node in ast.walk(tree):
        if id(node) in decorators:
            continue
        if isinstance(node, ast.Raise):
            out.append(ast.unparse(node))
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", "")
            if name.lstrip("_").startswith(("check", "validate")):
                out.append(ast.unparse(node))
    return out


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_printed_code_is_the_algorithm(path):
    """A function a chapter prints holds no argument check: the checks live at the boundary
    (lib.checks.BOUNDARY), and a listing shows the idea it teaches."""
    printed = printed_objects(path)
    bad = {label: found for label, text in printed if (found := checks_in(text))}
    assert not bad, f"{path.name} prints argument checks: {bad}"


BADGE = re.compile(r"⟨[^⟩]*⟩")


def defined_badges() -> set:
    """The badges the regimes page's clock table defines (rows opening with a bold badge)."""
    nb = json.loads((BOOK / "regimes.ipynb").read_text())
    text = "\n".join(markdown(nb))
    return {m for line in text.splitlines() if line.startswith("| **⟨") for m in BADGE.findall(line)[:1]}


def test_every_badge_used_is_defined_on_the_regimes_page():
    """A badge names the clock that produced a result; the regimes page's table defines each one."""
    defined = defined_badges()
    assert len(defined) >= 3, f"the regimes page's clock table lost its rows: {defined}"
    pages = [*BOOK.glob("*.ipynb"), *BOOK.glob("*.md")]
    used = {}
    for page in pages:
        text = "\n".join(markdown(json.loads(page.read_text()))) if page.suffix == ".ipynb" else page.read_text()
        for badge in BADGE.findall(text):
            used.setdefault(badge, set()).add(page.name)
    undefined = {b: sorted(p) for b, p in used.items() if b not in defined}
    assert not undefined, f"badges not defined in the regimes page's table: {undefined}"


LINKED_TERMS = ["TTFT", "TPOT", "ITL", "goodput", "KL", "TVD", "nats", "MBU", "MFU", "roofline",
                "arithmetic intensity", "noise floor", "machine card", "stand-in device", "bits per character", "α"]
# the glossary's single letters (c, k, E, G, V(T)) are too common as plain letters to find mechanically
HIDDEN = re.compile(r"\{[a-z:]+\}`[^`]*`|`[^`]*`|\$[^$]*\$|\]\([^)]*\)|^#.*$|<[^>]*>|:::.*$", re.M)


def glossary_terms() -> set:
    text = (BOOK / "glossary.md").read_text()
    block = text[text.index("```{glossary}"):]
    return {line.strip() for line in block.splitlines()[1:] if line and not line.startswith((" ", "`"))}


@pytest.mark.parametrize("path", [*CHAPTERS, BOOK / "regimes.ipynb"], ids=lambda p: p.stem)
def test_a_glossary_term_is_linked_at_its_first_use(path):
    """The first time a chapter uses a symbol or metric of the glossary, it links it ({term}`TTFT`)."""
    assert set(LINKED_TERMS) <= glossary_terms(), f"not in book/glossary.md: {set(LINKED_TERMS) - glossary_terms()}"
    text = "\n".join(markdown(json.loads(path.read_text())))
    plain = HIDDEN.sub(lambda m: "\0" * len(m.group(0)), text)
    unlinked = []
    for term in LINKED_TERMS:
        found = re.search(rf"(?<![\w\-]){re.escape(term)}(?![\w\-])", plain)
        link = text.find(f"{{term}}`{term}`")
        if found and (link < 0 or link > found.start()):
            unlinked.append(term)
    assert not unlinked, f"{path.name} uses {unlinked} before linking them to the glossary"
