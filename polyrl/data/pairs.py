"""Offline preference pairs for Diffusion-DPO (docs/algorithms.md §3), from JSONL or parquet.

Format: one pair per line (JSONL) or row (parquet) with three string fields

    {"prompt": "two red circles", "chosen": "img/0001_a.png", "rejected": "img/0001_b.png"}

`chosen` / `rejected` are image paths, absolute or relative to the pairs file's directory (any format PIL reads).
Other fields are kept as metadata. `load_pairs` checks every row before training starts and reports all bad rows
at once by line number (JSONL lines and parquet rows are both numbered from 1).

A batch of pairs becomes a `Rollout` whose `final` / `pair_final` are the VAE latents of the chosen / rejected
images (`adapter.encode_images`), so the online DPO loss trains on it unchanged. Such a batch has no trajectory:
its window holds the one clean state (`latents` (B, 1, C, h, w)) and no log-probs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..batch import Rollout
from ..registry import Registry

# policy kind (models/base.py policy_kind) -> its offline pair format: load(path) -> rows, batch(adapter, rows)
PAIR_FORMATS = Registry("pair format")

PAIR_FIELDS = ("prompt", "chosen", "rejected")


def _read_rows(path: Path) -> list[tuple[int, object]]:
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                rows.append((n, ValueError(f"not valid JSON ({e.msg})")))
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(path).to_pylist(), 1))
    raise ValueError(f"data.pairs_path={str(path)!r}: use a .jsonl or .parquet file with fields {', '.join(PAIR_FIELDS)}")


def pair_fields(row) -> tuple[dict | None, str | None]:
    """(a copy of `row`, None) when it is an object whose prompt, chosen and rejected are non-empty strings, else
    (None, what is wrong); a row that did not parse arrives as its exception."""
    if isinstance(row, Exception):
        return None, str(row)
    if not isinstance(row, dict):
        return None, "not an object with fields prompt, chosen, rejected"
    missing = [f for f in PAIR_FIELDS if not isinstance(row.get(f), str) or not row.get(f).strip()]
    if missing:
        return None, f"missing, empty or non-string {', '.join(missing)}"
    return dict(row), None


def _check_row(row, base: Path) -> tuple[dict | None, str | None]:
    out, error = pair_fields(row)
    if error:
        return None, error
    for key in ("chosen", "rejected"):
        p = Path(row[key])
        p = p if p.is_absolute() else base / p
        if not p.is_file():
            return None, f"{key} image not found: {p}"
        out[key] = str(p)
    return out, None


def load_pairs(path: str | Path) -> list[dict]:
    """Rows {prompt, chosen, rejected (absolute paths), line, ...metadata}; ValueError listing every bad row."""
    path = Path(path)
    return checked_rows(path, lambda row: _check_row(row, path.parent))


def checked_rows(path: Path, check) -> list[dict]:
    """The rows of pairs file `path` that `check(row) -> (row, None) | (None, error)` accepts, each with its
    `line`; a ValueError listing every bad row (the first 20) when any is bad, or when none is left."""
    if not path.is_file():
        raise FileNotFoundError(f"data.pairs_path={str(path)!r} does not exist")
    good, bad = [], []
    for n, row in _read_rows(path):
        checked, error = check(row)
        if error:
            bad.append(f"line {n}: {error}")
        else:
            good.append({**checked, "line": n})
    if bad:
        shown = "\n  ".join(bad[:20]) + (f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else "")
        raise ValueError(f"{path}: {len(bad)} bad pair row(s):\n  {shown}")
    if not good:
        raise ValueError(f"{path}: no pairs")
    return good


def load_image(path: str, height: int, width: int) -> torch.Tensor:
    """(3, height, width) float32 in [0, 1], bicubic-resized RGB."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB").resize((width, height), Image.BICUBIC)
        return torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1)


@torch.no_grad()
def pair_batch(adapter, rows: list[dict], height: int, width: int) -> Rollout:
    """Encode a list of pair rows into a DPO training batch (chosen → `final`, rejected → `extras["pair_final"]`)."""
    prompts = [r["prompt"] for r in rows]
    chosen = torch.stack([load_image(r["chosen"], height, width) for r in rows])
    rejected = torch.stack([load_image(r["rejected"], height, width) for r in rows])
    final = {k: v.float().cpu() for k, v in adapter.encode_media({"images": chosen}).items()}
    pair_final = {k: v.float().cpu() for k, v in adapter.encode_media({"images": rejected}).items()}
    b = len(rows)
    cond = adapter.encode_prompts(prompts)
    return Rollout(
        prompts=prompts, metadata=[{k: v for k, v in r.items() if k not in PAIR_FIELDS} for r in rows],
        group_ids=torch.arange(b), cond={k: v.cpu() for k, v in cond.items()}, shared={},
        latents={k: v[:, None] for k, v in final.items()}, log_probs=torch.zeros(b, 0), sigmas=torch.zeros(b, 1),
        noise_levels=torch.zeros(b, 0), final=final, extras={"pair_final": pair_final},
    )


@PAIR_FORMATS.register("diffusion")
class ImagePairs:
    """The offline pair format of diffusion policies: images encoded at the run's rollout size."""

    def __init__(self, rollout_cfg):
        self.height, self.width = rollout_cfg.height, rollout_cfg.width

    load = staticmethod(load_pairs)

    def batch(self, adapter, rows: list[dict]) -> Rollout:
        return pair_batch(adapter, rows, self.height, self.width)
