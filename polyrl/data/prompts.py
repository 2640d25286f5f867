"""Prompt datasets: a .txt (one prompt per line), or .jsonl / .parquet with a `prompt` column.

Other columns travel as per-prompt metadata to the reward (e.g. the shapes task's object groups; for token
policies the `answer` column, the reference the rule rewards `math_answer` / `choice` compare against, a string or
a number as the file has it). Bad rows are reported by line number; nothing is skipped silently.

Condition images (edit and image-to-video models): a .jsonl / .parquet row may carry `image`, one path or a list of
paths relative to the data file's folder. `load_prompts` makes them absolute and checks that each exists and that PIL
reads it as an image (`Image.verify`: the header, and PNG chunk checksums; pixels are not decoded); `split_row`
turns such a row's prompt into `{"text": prompt, "images": [absolute paths]}` and keeps `image` in the metadata
(the source image of edit rewards). `audio` and `video` columns (model=qwen3_omni) are resolved and checked the
same way and reach the prompt as `"audio"` / `"videos"` lists.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

FORMATS = (".txt", ".jsonl", ".parquet")


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def read_text(path: Path) -> str:
    """The text of a UTF-8 file, a leading byte-order mark removed (spreadsheet exports start with one). A binary file
    (a NUL byte), UTF-16 text or bytes that are not UTF-8 are a ValueError naming the file and line."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as e:  # no permission, a folder where a file was expected
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise ValueError(f"{path}:1: UTF-16 text (byte-order mark 0x{data[:2].hex()}); save the file as UTF-8")
    nul = data.find(b"\x00")
    if nul >= 0:
        raise ValueError(f"{path}:{_line_of(data, nul)}: binary data (a NUL byte), not a text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        column = e.start - data.rfind(b"\n", 0, e.start)
        raise ValueError(f"{path}:{_line_of(data, e.start)}: not UTF-8 text (byte 0x{data[e.start]:02x} at column "
                         f"{column}); save the file as UTF-8") from None
    return text.removeprefix("\ufeff")


def _text_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file (`read_text`), each without its line ending (LF or CRLF)."""
    out = [line.removesuffix("\r") for line in read_text(path).split("\n")]
    return out[:-1] if out and out[-1] == "" else out


def prompt_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, stripped text) of each non-blank line of a one-prompt-a-line file (`_text_lines`)."""
    return [(n, line.strip()) for n, line in enumerate(_text_lines(path), 1) if line.strip()]


def jsonl_rows(path: Path, what: str = "") -> Iterator[tuple[str, dict]]:
    """(`file:line`, row) of each non-blank line of a .jsonl prompt file; a line that is not JSON, or not an object
    with a non-empty string `prompt`, is a ValueError naming the file and line (`what`: the format, for it)."""
    for n, line in enumerate(_text_lines(path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ValueError(f"{path}:{n}: each {what + ' ' if what else ''}row needs a non-empty string 'prompt'")
        yield f"{path}:{n}", row


class MissingConditionImage(ValueError):
    """A row without `image` in a data file read for a model that needs condition images (a config error)."""


def _resolve_paths(row: dict, column: str, folder: Path, where: str, check=None) -> None:
    """`row[column]` (a path or a list of paths, relative to `folder` unless absolute) -> absolute paths, each
    checked to exist (and by `check(full, given, where)`); ValueError naming `where` (file and line), the column
    and the path. An absent column is left alone."""
    value = row.get(column)
    if value is None:
        return
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p.strip() for p in paths):
        raise ValueError(f"{where}: '{column}' must be a path or a non-empty list of paths, got {value!r}")
    resolved = []
    for p in paths:
        full = os.path.normpath(folder.absolute() / p)
        if not os.path.isfile(full):
            raise ValueError(f"{where}: {column} {p!r} does not exist (looked for {full})")
        if check is not None:
            check(full, p, where)
        resolved.append(full)
    row[column] = resolved[0] if isinstance(value, str) else resolved


def _resolve_images(row: dict, folder: Path, where: str, required: bool) -> None:
    """`row["image"]` -> absolute paths of readable images (`_resolve_paths`); a missing `image` is an error only
    when `required`."""
    if row.get("image") is None and required:
        raise MissingConditionImage(f"{where}: no 'image' (a path or a list of paths, relative to the data file)")
    _resolve_paths(row, "image", folder, where, _check_readable_image)


def _check_readable_image(full: str, given: str, where: str) -> None:
    """PIL can identify the file as an image and its structure checks out (`verify`: header, and for PNG the chunk
    checksums), without decoding the pixels; ValueError naming `where` and the path otherwise."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(full) as image:
            image.verify()
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
        reason = str(e).replace(full, "").strip(" '\"") or type(e).__name__
        raise ValueError(f"{where}: image {given!r} is not a readable image ({full}: {reason})") from None


# Condition audio and video (models that read them: model=qwen3_omni): `audio` / `video` columns, like `image`, hold a
# path or a list of paths relative to the data file's folder; they are resolved and checked the same way.
MEDIA_COLUMNS = {"audio": "audio", "video": "videos"}  # column -> the key of the prompt dict (split_row)


def _resolve_media(row: dict, folder: Path, where: str) -> None:
    """`row["audio"]` / `row["video"]` (a path or a list of paths) -> absolute paths, each checked to exist
    (`_resolve_paths`). Absent columns are fine."""
    for column in MEDIA_COLUMNS:
        _resolve_paths(row, column, folder, where)


def load_prompts(path: str | Path, require_image: bool = False) -> list[dict]:
    """Rows of a prompt file; with `require_image` every row must carry `image` (MissingConditionImage otherwise)."""
    path = Path(path)
    if path.suffix not in FORMATS:
        raise ValueError(f"data.path={str(path)!r}: unsupported format {path.suffix!r}; allowed: {', '.join(FORMATS)}")
    if not path.is_file():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist")
    rows: list[dict] = []
    if path.suffix == ".txt":
        lines = prompt_lines(path)
        rows = [{"prompt": line} for _, line in lines]
        if require_image and rows:
            raise MissingConditionImage(f"{path}:{lines[0][0]}: no 'image' (a .txt file holds prompts only; use "
                                        ".jsonl or .parquet with an `image` column)")
    elif path.suffix == ".jsonl":
        for where, row in jsonl_rows(path):
            _resolve_images(row, path.parent, where, require_image)
            _resolve_media(row, path.parent, where)
            rows.append(row)
    else:
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # ArrowInvalid, OSError: not a parquet file, or a truncated one
            raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
        if "prompt" not in table.column_names:
            raise ValueError(f"{path}: no 'prompt' column (columns: {', '.join(table.column_names)})")
        for n, row in enumerate(table.to_pylist(), 1):
            if not isinstance(row["prompt"], str) or not row["prompt"].strip():
                raise ValueError(f"{path}: row {n}: 'prompt' must be a non-empty string")
            _resolve_images(row, path.parent, f"{path}: row {n}", require_image)
            _resolve_media(row, path.parent, f"{path}: row {n}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: holds no prompts (the file is empty or only blank lines)")
    return rows


def row_location(path: str | Path, index: int) -> str:
    """Where row `index` (0-based, as `load_prompts` returns them) of a prompt file is, for messages:
    `file:line` (.txt / .jsonl: blank lines are skipped by the reader, not by the count) or `file: row n`."""
    path = Path(path)
    if path.suffix == ".parquet":
        return f"{path}: row {index + 1}"
    lines = [n for n, _ in prompt_lines(path)]
    return f"{path}:{lines[index]}" if index < len(lines) else str(path)


def split_row(row: dict) -> tuple[str | dict, dict]:
    """(prompt, metadata): the prompt is the text, or {"text", "images"} for a row with `image`; the metadata is
    every other column (`image` included)."""
    meta = {k: v for k, v in row.items() if k != "prompt"}
    image = row.get("image")
    media = {key: [row[c]] if isinstance(row[c], str) else list(row[c])
             for c, key in MEDIA_COLUMNS.items() if row.get(c) is not None}
    if image is None and not media:
        return row["prompt"], meta
    prompt = {"text": row["prompt"]}
    if image is not None:
        prompt["images"] = [image] if isinstance(image, str) else list(image)
    return prompt | media, meta


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
