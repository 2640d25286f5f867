"""Offline preference pairs of text responses for token-policy DPO / IPO (docs/tokens.md), from JSONL or parquet.

Format: one pair per line (JSONL) or row (parquet) with three non-empty strings

    {"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5. The answer is 5.", "rejected": "The answer is 6."}

Other fields are kept as metadata. Like `pairs.py` (image pairs), every row is checked before training starts and
all bad rows are reported at once by line number (JSONL lines and parquet rows both numbered from 1).
"""

from __future__ import annotations

from pathlib import Path

from .pairs import checked_rows, pair_fields


def load_text_pairs(path: str | Path) -> list[dict]:
    """Rows {prompt, chosen, rejected, line, ...metadata}; ValueError listing every bad row."""
    return checked_rows(Path(path), pair_fields)
