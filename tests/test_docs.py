"""The user-facing docs point only at files that exist, name checkpoints as they are on disk, and the LICENSE file
is the Apache-2.0 text pyproject.toml declares."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from polyrl.trainer.checkpoint import checkpoint_dir

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPO_PATH = re.compile(r"`((?:polyrl|docs|tests|scripts)/[\w./-]+\.(?:py|md|yaml|json|sh|png))`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_docs_reference_only_files_in_the_repo():
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for name in ("BENCHMARK.md", "ALGORITHMS.md"):  # formula sheet and benchmark live in docs/ now
            if name in text:
                missing.append(f"{doc.name}: {name}")
        for path in REPO_PATH.findall(text):
            if "*" not in path and "<" not in path and not (ROOT / path).exists():
                missing.append(f"{doc.name}: {path}")
        for link in LINK.findall(text):
            if not link.startswith(("http://", "https://")) and not (doc.parent / link).exists():
                missing.append(f"{doc.name}: ({link})")
    assert not missing, missing


def test_checkpoint_names_in_the_docs_are_the_names_on_disk(tmp_path):
    readme = (ROOT / "docs" / "usage.md").read_text()
    name = checkpoint_dir(tmp_path, 20).name
    assert f"checkpoints/{name}/" in readme and "step_N/" not in readme
    for file in ("adapter_model.safetensors", "weights.json", "trainer_state.pt", "checksums.json"):
        assert file in readme


def test_license_is_the_apache_text_pyproject_declares():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    text = (ROOT / "LICENSE").read_text()
    assert declared == "Apache-2.0"
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) == 202


def test_code_cites_the_formula_sheet_in_docs():
    """Docstrings cite `docs/algorithms.md §N`; every cited section exists there, and no file outside the repo is cited."""
    sections = set(re.findall(r"^### (§\d+)", (ROOT / "docs" / "algorithms.md").read_text(), re.M))
    bad = []
    for path in [*(ROOT / "polyrl").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]:
        text = path.read_text()
        bad += [f"{path.name}: {name}" for name in ("BENCHMARK.md", "ALGORITHMS.md", "MODELS.md") if name in text]
        bad += [f"{path.name}: {s}" for s in re.findall(r"docs/algorithms\.md (§\d+)", text) if s not in sections]
    assert not bad, bad


def test_readme_is_a_newcomers_page():
    """About 200 lines; the two quickstart commands are the ones CI runs (.ci/run runs the second verbatim)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install torch==2.13.0 -e ".[test]" && python -m pytest' in readme and \
        'pip install torch==2.13.0 -e ".[test]" && python -m pytest' in ci
    assert "pip install torch==2.13.0 -e . && polyrl train" in readme


def test_the_docs_index_names_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert not {p for p in pages if f"({p})" not in index}, "docs/README.md must link every page"
