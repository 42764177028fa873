"""The training text: top-level modules of the Python standard library on this machine.

No download: the corpus is read from the running interpreter's own `Lib/` folder. The module
list is fixed (about 2.1 million characters on Python 3.11), so every machine trains on the
same files where they exist; a module that is missing or not pure printable ASCII on another
Python version is skipped, and the corpus hash (over names and contents) records it.
"""
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lib.tokenizer import VOCAB, decode, encode

MODULES = tuple("""
abc ast base64 bdb bisect bz2 cProfile calendar cmd code codecs codeop colorsys compileall
configparser contextlib contextvars copy copyreg csv dataclasses decimal dis filecmp fileinput
fnmatch genericpath getpass gettext glob graphlib gzip hashlib hmac imaplib io keyword linecache
lzma mimetypes modulefinder netrc ntpath nturl2path numbers opcode operator optparse os pathlib
pdb pickle pkgutil platform plistlib poplib posixpath pprint profile pstats pty py_compile pyclbr
queue quopri random reprlib rlcompleter sched secrets selectors shelve shutil signal site smtplib
socket socketserver ssl stat string stringprep struct symtable sysconfig tabnanny tempfile
textwrap threading timeit token tokenize trace traceback tracemalloc tty types uuid warnings wave
weakref webbrowser zipapp zipimport
""".split())
HELD_OUT_EVERY = 10  # modules 5, 15, 25, ... of the sorted list are held out


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # (N_train,) int64 token ids, files joined by a blank line
    held_out: np.ndarray  # (N_held,) int64
    train_modules: tuple
    held_out_modules: tuple
    skipped: tuple  # modules absent here or not pure printable ASCII
    sha256: str  # of the module names and contents actually used

    def summary_line(self) -> str:
        return (f"{len(self.train_modules)} training modules ({len(self.train):,} characters), "
                f"{len(self.held_out_modules)} held-out ({len(self.held_out):,}), "
                f"{len(self.skipped)} skipped, sha256 {self.sha256[:12]}")


def _read_module(name: str, stdlib: Path):
    path = stdlib / f"{name}.py"
    if not path.is_file():
        return None
    text = path.read_bytes().decode("latin-1")
    return text if set(text) <= set(VOCAB) else None


def load_corpus() -> Corpus:
    """Read the fixed module list from this interpreter's standard library."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha256()
    parts = {"train": [], "held_out": []}
    names = {"train": [], "held_out": []}
    skipped = []
    for i, name in enumerate(MODULES):
        text = _read_module(name, stdlib)
        if text is None:
            skipped.append(name)
            continue
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
        split = "held_out" if i % HELD_OUT_EVERY == HELD_OUT_EVERY // 2 else "train"
        parts[split].append(text)
        names[split].append(name)
    return Corpus(train=encode("\n\n".join(parts["train"])),
                  held_out=encode("\n\n".join(parts["held_out"])),
                  train_modules=tuple(names["train"]), held_out_modules=tuple(names["held_out"]),
                  skipped=tuple(skipped), sha256=digest.hexdigest())


def held_out_prompts(count: int = 4, length: int = 16):
    """`count` line starts of `length` characters, spread evenly over the held-out text (lines
    whose start holds at least 12 non-blank characters)."""
    lines = [l for l in decode(load_corpus().held_out).split("\n") if len(l[:length].strip()) >= 12]
    return [encode(lines[i * len(lines) // count][:length]) for i in range(count)]


def held_out_spans(count: int = 4, length: int = 16):
    """`count` spans of `length` tokens of the held-out text, each from a line start spread evenly
    over it (lines whose start holds at least 12 non-blank characters); a span runs on across lines,
    so prompts may be longer than any line."""
    text = decode(load_corpus().held_out)
    starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]
    starts = [s for s in starts if len(text[s:s + 12].split("\n")[0].strip()) >= 12 and s + length <= len(text)]
    return [encode(text[starts[i * len(starts) // count]:][:length]) for i in range(count)]
