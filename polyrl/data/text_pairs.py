"""Offline preference pairs of text responses for token-policy DPO / IPO (docs/tokens.md), from JSONL or parquet.

Format: one pair per line (JSONL) or row (parquet) with three non-empty strings

    {"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5. The answer is 5.", "rejected": "The answer is 6."}

Other fields are kept as metadata. Like `pairs.py` (image pairs), every row is checked before training starts and
all bad rows are reported at once by line number (JSONL lines and parquet rows both numbered from 1).
"""

from __future__ import annotations

from pathlib import Path

from .pairs import PAIR_FIELDS, checked_rows


def _check_row(row) -> tuple[dict | None, str | None]:
    if isinstance(row, Exception):
        return None, str(row)
    if not isinstance(row, dict):
        return None, "not an object with fields prompt, chosen, rejected"
    missing = [f for f in PAIR_FIELDS if not isinstance(row.get(f), str) or not row.get(f).strip()]
    if missing:
        return None, f"missing, empty or non-string {', '.join(missing)}"
    return dict(row), None


def load_text_pairs(path: str | Path) -> list[dict]:
    """Rows {prompt, chosen, rejected, line, ...metadata}; ValueError listing every bad row."""
    return checked_rows(Path(path), _check_row)
