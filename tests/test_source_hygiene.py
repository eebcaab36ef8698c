"""The package's source says what and why, never what was measured where: measured numbers, GPU names, commit
hashes and history belong in `benchmarks/results/` and the README, where they are dated and reproducible. Also
the size limits of the house: modules of about 500 lines, classes of about 25 methods."""

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tendril"
SOURCES = sorted(SRC.rglob("*.py"))

PHRASES = {
    "a GPU model": r"\b(?:[HABV]100|H200|GH200|B200|L40S?|RTX ?\d{4})\b",
    "a commit hash": r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b",
    "history": r"(?i)\bsessions?\b|since removed|\b(?:two|three|four) runs\b|\bwas removed\b|\bpreviously\b",
    "a measured speed-up": r"\b\d+(?:\.\d+)?\s?(?:x|×)\s(?:faster|slower|eager|dedicated|dense|cuDNN|HF|over)\b",
    "a measured rate": r"\b\d+(?:\.\d+)?\s?tok/s\b",
    "a measured time": r"\b\d+\.\d+\s?(?:ms|µs|us)\b",
}
MAX_MODULE_LINES = 520
MAX_CLASS_METHODS = 26


def test_the_sources_are_found():
    assert len(SOURCES) > 50


@pytest.mark.parametrize("what, pattern", PHRASES.items(), ids=list(PHRASES))
def test_no_measurements_or_history_in_the_package(what, pattern):
    found = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()[:100]}"
        for path in SOURCES
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(pattern, line)
    ]
    assert not found, f"{what} in src/ (move it to benchmarks/results/ or the README):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line, what",
    [
        ("on the H200 it took 1.34 ms", "a GPU model"),
        ("measured at c9da173", "a commit hash"),
        ("a fresh mode, since removed", "history"),
        ("3.1x faster than cuDNN", "a measured speed-up"),
        ("3098 tok/s", "a measured rate"),
        ("took 0.27 ms", "a measured time"),
    ],
)
def test_the_phrase_patterns_catch_what_they_name(line, what):
    assert re.search(PHRASES[what], line)


def test_modules_stay_small():
    sizes = {path: len(path.read_text().splitlines()) for path in SOURCES}
    long = [f"{path.relative_to(SRC)}: {lines}" for path, lines in sizes.items() if lines > MAX_MODULE_LINES]
    assert not long, "modules over the size limit:\n" + "\n".join(long)


def test_classes_stay_small():
    large = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [item for item in node.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)]
                if len(methods) > MAX_CLASS_METHODS:
                    large.append(f"{path.relative_to(SRC)}: {node.name} has {len(methods)} methods")
    assert not large, "classes over the size limit:\n" + "\n".join(large)
