"""No number is typed into the book's prose unless it says where it comes from.

A number a reader sees in a chapter's text is either inserted by the chapter's code (a myst-nb
`{glue:text}` role, removed before scanning), or one of the few constants and quoted figures
listed below, each with its source. A quoted figure must also name its source in the same
paragraph (its attribution), so that a figure from the article or a paper cannot pass as a
measurement of this machine. Anything else fails the test: glue it, or add it here with its
source.

What is not prose and not scanned: code (fenced blocks and inline code), link targets, math,
HTML, cross-references ("chapter 7", "Theorem 3.8"), list numbers, years (1990-2029), words
with a digit in them (fp8, GPT-2, Qwen3-8B, 128-position), and small whole numbers (0 to 10,
without %), which read as words ("2 KV heads", "8 prompts").
"""
import json
import re
from pathlib import Path

import pytest
from conftest import recorded_seconds

BOOK = Path(__file__).parents[1] / "book"

# The pages this test covers. The other chapters are edited in parallel; add each one here
# once it passes. The references page is not scanned: its numbers are bibliographic (volumes,
# issue and pull-request numbers, arXiv ids, years, versions), each beside the source it names.
CHECKED = ["intro.md", "01_model.ipynb", "02_prefill_decode.ipynb", "03_kv_cache.ipynb",
           "04_memory.ipynb", "05_gqa.ipynb", "06_paging.ipynb", "07_quantization.ipynb",
           "08_serving.ipynb", "09_speculative_proof.ipynb", "10_k_sweep.ipynb", "11_choosing.ipynb",
           "12_lean_engine.ipynb", "summary.md"]

# Constants of the setup, allowed anywhere.
CONSTANTS = {
    "512": "the context of both models and the training window (lib.config, lib.train)",
    "96": "the vocabulary: newline plus 95 printable ASCII characters (lib.tokenizer)",
    "95": "printable ASCII characters (lib.tokenizer)",
    "513,600": "the target's parameter count (lib.config, asserted in chapter 1)",
    "61,968": "the draft's parameter count (lib.config, asserted in chapter 1)",
    "48": "the draft's width (lib.config)",
    "131,072": "the 128k context of the models in chapter 4 (their config.json / model cards)",
    "32,768": "32k tokens: Mistral-7B-v0.1's context (config.json) and chapter 4's example length",
    "16": "chapter 4's example batch (16 sequences)",
}

# Quoted figures, per page: number -> the words that attribute it (or a tuple of alternatives,
# when the page quotes the same figure from two sources), which must appear in the same paragraph.
QUOTED = {
    "intro.md": {},
    "01_model.ipynb": {
        "5.4": "the source article", "33": "the source article",
        "2.254": "the source article", "2.341": "the source article",
        "1.3": "temperature",  # a slider value
        "989": "data sheet", "3.35": "data sheet",  # NVIDIA's H100 SXM data sheet, dense BF16
        "8,030,261,248": "safetensors",  # Llama-3.1-8B's parameter count on the Hugging Face Hub
        "126.90": "torchao",  # tokens/s, pytorch/ao quantization README
    },
    "02_prefill_decode.ipynb": {
        "3.35": ("data sheet", "on an H100"), "989": ("data sheet", "on an H100"),  # NVIDIA's H100 SXM data sheet
        "8.03": "model card",  # Llama 3 8B's parameter count
        "126.90": "torchao",  # tokens/s, pytorch/ao quantization README
        "81,559": "driver reports",  # nvidia-smi on an H100 80GB HBM3
        "64": "Little's law",  # a cache line's bytes
        "12": "registers",  # the kernel's 4 x 3 accumulators
        "2048": "n_batch",  # llama.cpp's default -b
        "256": "Try this", "65,536": "Try this", "4,096": ("Try this", "tokens of context each"),  # slider ends; the problem's context
        "32": "query heads", "128": ("K/V head", "size 128"),  # Llama-3.1-8B's config.json, in the worked problem
    },
    "03_kv_cache.ipynb": {
        "107": "The article", "1.16": "The article", "92": "The article",  # the source article's figures
        "499": "500th token", "64": "first 64 positions",  # the question and the demo's own sizes
        "272": "positions 16 to",  # the generation's positions: the 16-token prompt plus 256 tokens
        "3.35": "H100's", "80": "data sheet's",  # NVIDIA's H100 SXM data sheet
        "81,559": "driver reports", "0.9": "gpu_memory_utilization",  # nvidia-smi; vLLM's default
        "32": "layers", "128": "KV heads", "4,096": "requests of",  # Llama-3.1-8B's config; the problem's length
    },
    "04_memory.ipynb": {
        "12.8": "model card", "4.25": "model card",  # gpt-oss-20b's model card: checkpoint GiB, MXFP4 bits
        # configs (config.json): gpt-oss-20b's experts and layers; Gemma-3-27B's, Mistral-7B-v0.1's window;
        # DeepSeek-V3's heads, latent and experts; Llama-3-8B's layers and head size (worked problem)
        "2,880": "config", "24": "config", "32": "config", "62": "config", "4,096": "config",
        "128": "config", "576": "config", "256": "config", "58": "config", "61": "config",
        "3.35": "data sheet", "80": "data sheet", "81,559": "driver reports",  # H100 SXM; nvidia-smi
        "0.9": "vLLM", "0.92": "vLLM",  # gpu_memory_utilization's defaults, old and recent
        "32.06": "vLLM's log", "420,208": "vLLM's log",  # Llama-3.1-70B on 4 H100s (LMCache's FAQ)
        "0.1373": "vLLM", "1,000": "vLLM",  # the FAQ's "GB" per 1,000 Qwen3-8B tokens
        "64": "Try this",  # the slider's batch
    },
    "05_gqa.ipynb": {
        "63": "LLMs-from-scratch", "72": "LLMs-from-scratch",
        "5.95": "the article", "2.06": "the article", "1.18": "the article",
        "5": "Ainslie",  # their uptraining share, 5% of the pre-training steps
        # Llama 2 7B's / Llama 3 8B's config.json (layers, query heads, head size, Llama 2's context),
        # DeepSeek-V2/V3's heads; the slider's multi-head end; nvidia-smi on an H100 (worked problem)
        "32": ("config.json", "Try this"), "128": "config.json", "4,096": "config.json",
        "81,559": "driver reports",
        "0.9": "vLLM",  # vLLM's default gpu_memory_utilization, which chapter 4 keeps (worked problem)
        "19.5": "data sheet", "2.04": "data sheet", "1.555": "data sheet",  # NVIDIA's A100 data sheet: FP32, 80/40 GB bandwidth
        "12.5": "data sheet",  # 19.5 TFLOP/s over 1.555 TB/s, the A100 40 GB's FP32 ridge
    },
    "06_paging.ipynb": {
        "47.2": "the article", "0.7": "the article", "1.4": "the article",
        "32": ("the article", "layers"),  # the article's block sizes, 16 and 32; Llama-3.1-8B's layers
        "128": "KV heads",  # Llama-3.1-8B's head size (config.json), in the worked problem
        "81,559": "driver reports", "8.03": "model card",  # nvidia-smi on an H100; Llama-3.1-8B's parameters
        "90": "FlashInfer",  # its README: vector-sparse attention at 90% of the dense kernels' bandwidth
        "1024": "spread evenly from", "8192": ("spread evenly from", "longest request's"),  # the worked problem's lengths
    },
    "07_quantization.ipynb": {
        "0.000739": "the source article", "0.00885": "the source article",
        "1.0": "vLLM", "0.11": "vLLM",  # vLLM's default fp8 scale, and its docs' version
        "32": ("KIVI", "config.json"),  # KIVI's README: "2/4 bit KIVI with 32 full precision tokens"; Llama-3.1-8B's layers
        "128": "config.json",  # Llama-3.1-8B's head size (config.json), in the worked problem
        "3.35": "data sheet",  # NVIDIA's H100 SXM data sheet, in the worked problem
        "127": ("over 127", "/ 127"),  # int8's largest symmetric code, in the exercise and its solution
    },
    "08_serving.ipynb": {
        "0.01": "vLLM",  # vLLM v0's default watermark share
        "2-4": "vLLM",  # the vLLM paper's throughput over Orca
        "1.5-2.8": "vLLM", "1.4-1.8": "vLLM",  # vLLM's blog on speculative decoding under load
        "126.90": "torchao",  # tokens/s, pytorch/ao quantization README (Llama-3.1-8B, H100, batch 1)
        "3.35": "data sheet",  # NVIDIA's H100 SXM data sheet
        "1,724": "Loginet", "45": "Loginet", "100-500": "Loginet",  # its case study: tokens/s, requests, prompt tokens
        "0.9": "vLLM", "0.08": "vLLM", "0.92": "vLLM",  # gpu_memory_utilization's defaults; 0.08 kept aside
        "64": "sequences with", "2,048": "tokens of context each",  # the worked problem's question (WP_B, WP_CTX)
        "15.5": "Loginet",  # its 45 concurrent requests' tokens/s over one request's
        "989": "data sheet",  # NVIDIA's H100 SXM data sheet, dense BF16
        "0.6": "assumed",  # a prefill share of the FLOP peak, stated as an assumption
        "90": "DistServe",  # the attainment share in DistServe's goodput
        "8,192": "vLLM",  # max_num_batched_tokens for the server on an H100-class GPU (engine arguments)
    },
    "09_speculative_proof.ipynb": {
        "0.005-0.007": "the article", "0.0045-0.0058": "the article", "0.10-0.14": "the article",
        "32-256": "MagicDec",  # the batch sizes its speed-up holds at, long context (arXiv:2408.11049)
        "40,000": "The check drafts",  # the exercise check's draws per prefix (lib.book.exercises.accept_rule)
        "1968": "Hope",  # the Monte Carlo test's year (Hope 1968, JRSS B 30: 582-598)
        "1952": "Rosenblatt",  # the probability integral transform's year (Ann. Math. Statist. 23: 470-472)
        "95": "one-sided",  # 95%: the power's confidence level, a constant of the bound (beta.ppf(0.05, ...))
    },
    "10_k_sweep.ipynb": {
        "1.2-1.3": "the article",  # the source article's CPU speed-up, at k = 2-3
        "2-3": ("the article", "Leviathan"),  # the article's best k; the paper's speed-up (abstract)
        # vLLM's dynamic speculative decoding page: its EAGLE example's concurrency ranges for k
        "65": "dynamic speculative", "129": "dynamic speculative",
        "0.05": "Try this", "0.95": "Try this", "0.3": "Try this", "0.7": "Try this",  # the explorer's slider positions
    },
    "11_choosing.ipynb": {
        "5": "Ainslie",  # their uptraining share, 5% of the pre-training steps
        # settings named in the glued key the number stands beside (chapters 2 and 9 glue
        # them under these names; the lead adds those chapters to this test)
        "256": "one_call_256", "0.7": "_07",  # e.g. best_speedup_07, big_07_speedup
        # vLLM's defaults in the knob table (vllm/engine/arg_utils.py, the `vllm serve` reference)
        "8,192": "max_num_batched_tokens", "2,048": "max_num_batched_tokens",
        "0.92": "gpu_memory_utilization", "0.9": "gpu_memory_utilization",
        "80": "config.json", "128": "config.json",  # Qwen2.5-72B-Instruct's layers and head size
        # EAGLE-3 on Llama-3.1-8B, one H100, MT-bench: SGLang's speculative decoding docs, citing the EAGLE-3 paper
        "158.34": "EAGLE-3", "373.25": "EAGLE-3",
    },
    "12_lean_engine.ipynb": {
        "1,905": "torchao",  # the bandwidth its benchmark achieved (pytorch/ao quantization README)
    },
    "summary.md": {
        "256": "one_call_256", "0.7": "_07",  # as in chapter 11
        "129": "dynamic speculative decoding",  # vLLM's documented example, as in chapter 10
    },
}

TOKEN = re.compile(r"[^\s()\[\]{};:\"'*_]+")
# a number, a range of two, a percentage, or a ratio ("6.5x")
NUMBER = re.compile(r"(\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?%?)x?")
NOT_PROSE = [
    re.compile(r"<style>.*?</style>", re.S),
    re.compile(r"```.*?```", re.S),
    re.compile(r"\$\$.*?\$\$", re.S),
    re.compile(r"\$[^$\n]+\$"),
    re.compile(r"\{[\w:-]+\}`[^`]*`"),  # roles: {glue:text}`key`, {doc}`...`
    re.compile(r"`[^`]*`"),  # inline code
    re.compile(r"\]\([^)]*\)"),  # link targets
    re.compile(r"https?://\S+"),
    re.compile(r"<[^>]+>"),
    re.compile(r"\b(?:[Cc]hapters?|Theorem|Corollary|Lemma|Table|Figure|[Ss]ection|Algorithm|Eq\.)\s+\d+(?:\.\d+)?"
               r"(?:(?:,\s*|\s+(?:and|to|or)\s+|-)\d+(?:\.\d+)?)*"),
    re.compile(r"^\s*\d+\.\s", re.M),  # numbered list items
    re.compile(r"\[\d+\.\s"),  # numbered links: "[11. Serving](...)"
    re.compile(r"\b(?:issue|PR|pull request)\s+#?\d+|arXiv:\s*\d{4}\.\d{4,5}"),  # names of reports, papers
    re.compile(r"\b(?:199\d|20[0-2]\d)\b"),  # years
]


def markdown_of(page: str) -> list[str]:
    path = BOOK / page
    if path.suffix == ".md":
        return [path.read_text()]
    cells = json.loads(path.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


def prose_numbers(text: str):
    """(number, paragraph) for every number in the prose of one markdown text."""
    for paragraph in re.split(r"\n\s*\n", NOT_PROSE[1].sub(" ", text)):  # code blocks first: they hold blank lines
        prose = paragraph
        for pattern in NOT_PROSE:
            prose = pattern.sub(" ", prose)
        for token in TOKEN.findall(prose):
            match = NUMBER.fullmatch(token.rstrip(".,!?"))
            if match:  # tokens with letters in them are names (fp8, Qwen3-8B, e4m3)
                yield match.group(1).rstrip(","), paragraph


def is_word(number: str) -> bool:
    return re.fullmatch(r"\d+", number) is not None and int(number) <= 10


def unexplained(page: str) -> list[str]:
    quoted = QUOTED.get(page, {})
    problems = []
    for text in markdown_of(page):
        for number, paragraph in prose_numbers(text):
            bare = number.rstrip("%")
            if number == bare and (is_word(bare) or bare in CONSTANTS):
                continue
            sources = quoted.get(bare, ())
            sources = (sources,) if isinstance(sources, str) else sources
            if any(source.lower() in paragraph.lower() for source in sources):
                continue
            context = " ".join(paragraph.split())
            at = context.find(bare)
            problems.append(f"{number!r} in: ...{context[max(0, at - 60):at + 40]}...")
    return problems


@pytest.mark.parametrize("page", CHECKED)
def test_every_number_in_the_prose_is_glued_or_attributed(page):
    problems = unexplained(page)
    assert not problems, f"{page}: numbers neither glued nor attributed:\n" + "\n".join(problems)


def test_the_scanner_catches_a_typed_number_and_accepts_glue_and_attribution():
    typed = "The cache made decoding 6.5x faster."
    assert [n for n, _ in prose_numbers(typed)] == ["6.5"]
    assert list(prose_numbers("It was {glue:text}`ratio`x faster (chapter 3, Theorem 3.8).")) == []
    assert [n for n, _ in prose_numbers("Qwen3-8B in fp8 uses 5% of 4,096 positions")] == ["5%", "4,096"]
    assert not is_word("12") and is_word("4")
    names = "[issue 32867](u), [PR 197](u), [11. Serving](u), their Lemma 3.3, section 3.4, arXiv:2401.10774"
    assert list(prose_numbers(names)) == []
    assert [n for n, _ in prose_numbers("[a 6.5x speed-up](u) at 0.7")] == ["6.5", "0.7"]


# The chapters whose stored run time is checked (the others are being re-executed in parallel;
# add each one here once its stored outputs come from a timed run).
TIMED = ["01_model.ipynb", "02_prefill_decode.ipynb", "03_kv_cache.ipynb", "04_memory.ipynb",
         "05_gqa.ipynb", "06_paging.ipynb", "07_quantization.ipynb", "08_serving.ipynb",
         "09_speculative_proof.ipynb", "10_k_sweep.ipynb", "11_choosing.ipynb", "12_lean_engine.ipynb"]


@pytest.mark.parametrize("notebook", TIMED)
def test_each_stored_chapter_ran_in_under_two_minutes(notebook):
    """The introduction's promise, checked on the run that produced the stored outputs."""
    assert recorded_seconds(BOOK / notebook) < 120


@pytest.mark.parametrize("notebook", TIMED + ["regimes.ipynb"])
def test_no_name_is_glued_twice(notebook):
    """A name glued by two cells is a warning that fails the book's build (-W), and the prose shows
    whichever ran last: each name is glued once in the stored run."""
    cells = json.loads((BOOK / notebook).read_text())["cells"]
    names = [out.get("metadata", {}).get("scrapbook", {}).get("name") for cell in cells
             for out in cell.get("outputs", [])]
    twice = sorted({n for n in names if n and names.count(n) > 1})
    assert not twice, f"{notebook}: glued more than once: {twice}"


GLUE_REF = re.compile(r"\{glue(?::[a-z]+)?\}`([\w.-]+\.ipynb)::(\w+)")


@pytest.mark.parametrize("page", sorted(p.name for p in BOOK.glob("*.md")) + sorted(p.name for p in BOOK.glob("*.ipynb")))
def test_every_glue_reference_names_a_name_its_notebook_glued(page):
    """A {glue:text}`nb::name` whose name the stored notebook no longer glues is a warning that fails
    the book's build (-W): each cross-page reference names a glued name of the stored run."""
    glued = {}
    for notebook, name in GLUE_REF.findall((BOOK / page).read_text()):
        if notebook not in glued:
            cells = json.loads((BOOK / notebook).read_text())["cells"]
            glued[notebook] = {out.get("metadata", {}).get("scrapbook", {}).get("name") for cell in cells
                               for out in cell.get("outputs", [])}
        assert name in glued[notebook], f"{page}: {notebook} does not glue {name!r}"
