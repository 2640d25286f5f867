"""The slow marker (tests/conftest.py SLOW, pyproject.toml): every name it lists is a test file or test that exists,
so a rename cannot silently move a slow test into the quick subset."""

from pathlib import Path

from conftest import SLOW

TESTS = Path(__file__).resolve().parent


def test_every_slow_entry_names_an_existing_test():
    for entry in SLOW:
        name, _, test = entry.partition("::")
        path = TESTS / name
        assert path.is_file(), entry
        assert not test or f"def {test}(" in path.read_text(), entry


def test_the_marker_is_registered():
    text = (TESTS.parent / "pyproject.toml").read_text()
    assert 'markers = ["slow:' in text
