"""Prompt datasets: a .txt (one prompt per line), or .jsonl / .parquet with a `prompt` column.

Other columns travel as per-prompt metadata to the reward (e.g. the shapes task's object groups). Bad rows are
reported by line number; nothing is skipped silently.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FORMATS = (".txt", ".jsonl", ".parquet")


def load_prompts(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.suffix not in FORMATS:
        raise ValueError(f"data.path={str(path)!r}: unsupported format {path.suffix!r}; allowed: {', '.join(FORMATS)}")
    if not path.is_file():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist")
    rows: list[dict] = []
    if path.suffix == ".txt":
        rows = [{"prompt": line.strip()} for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix == ".jsonl":
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                raise ValueError(f"{path}:{n}: each row needs a non-empty string 'prompt'")
            rows.append(row)
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if "prompt" not in table.column_names:
            raise ValueError(f"{path}: no 'prompt' column (columns: {', '.join(table.column_names)})")
        for n, row in enumerate(table.to_pylist(), 1):
            if not isinstance(row["prompt"], str) or not row["prompt"].strip():
                raise ValueError(f"{path}: row {n}: 'prompt' must be a non-empty string")
            rows.append(row)
    if not rows:
        raise ValueError(f"data.path={str(path)!r} holds no prompts")
    return rows


def split_row(row: dict) -> tuple[str, dict]:
    meta = {k: v for k, v in row.items() if k != "prompt"}
    return row["prompt"], meta


class PromptSampler:
    """Draws prompts epoch by epoch in a seeded shuffled order; its state is two ints, so resume is exact."""

    def __init__(self, rows: list[dict], seed: int, shuffle: bool = True):
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.rows)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.rows), generator=g).tolist()

    def next(self, k: int) -> list[dict]:
        out = []
        while len(out) < k:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            out.append(self.rows[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._make_order()
