"""The project's docs stand alone: every repository path named in the docs, the README, the code, the configs and the
build files exists, every relative markdown link resolves, and nothing cites notes that are not in the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# files whose text names repository paths
SOURCES = [
    *ROOT.glob("docs/*.md"),
    ROOT / "README.md",
    *ROOT.glob("logra_rl/**/*.py"),
    *ROOT.glob("scripts/**/*.py"),
    ROOT / "scripts/README.md",
    *ROOT.glob("tests/**/*.py"),
    *ROOT.glob("configs/**/*.yaml"),
    ROOT / "docker/Dockerfile",
    ROOT / "Makefile",
    ROOT / "pyproject.toml",
]
# a path of ours: under one of the repository's own folders (bench_results/ holds generated output: not checked)
PATH = re.compile(r"(?<![\w./-])((?:docs|scripts|logra_rl|configs|tests|docker)/[\w./-]*\w)")
# other projects' files named in the benchmarks (the peers' grader test suites)
OTHER_PROJECTS = {"tests/test_all.py", "tests/test_math_equal.py", "tests/unit/metrics/test_extractive_match.py"}
LINK = re.compile(r"\]\((?!https?://|#)([^)\s]+)\)")
OUTSIDE_NOTES = re.compile(r"DESIGN\.md|reference §|\.\./shared")


def test_every_repository_path_named_in_docs_code_and_configs_exists():
    missing = {}
    for source in SOURCES:
        for found in PATH.finditer(source.read_text()):
            path = found.group(1)
            if path in OTHER_PROJECTS or "*" in path:
                continue
            if not (ROOT / path).exists() and not list(ROOT.glob(f"{path}*")):  # a stem: `scripts/bench/bench_`
                missing.setdefault(path, source.relative_to(ROOT).as_posix())
    assert not missing, missing


def test_relative_markdown_links_resolve():
    broken = [
        (doc.relative_to(ROOT).as_posix(), link)
        for doc in [*ROOT.glob("docs/*.md"), ROOT / "README.md"]
        for link in LINK.findall(doc.read_text())
        if not (doc.parent / link.split("#")[0]).exists()
    ]
    assert not broken, broken


def test_nothing_cites_notes_outside_the_repository():
    citing = [
        s.relative_to(ROOT).as_posix() for s in SOURCES if s != Path(__file__) and OUTSIDE_NOTES.search(s.read_text())
    ]
    assert not citing, citing
