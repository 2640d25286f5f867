"""The field's prompt sets in their published formats, read from local files (polyrl ships none of them).

Every reader returns rows as `load_prompts` does (`{"prompt": str, ...metadata}`; `split_row` hands the metadata
to the reward), plus `category` where the set has categories (the evaluation reports per category). A malformed row
is a ValueError naming the file and line; nothing is skipped silently.

| format          | file (as published)                                        | category            | other metadata |
|-----------------|------------------------------------------------------------|---------------------|----------------|
| `geneval`       | GenEval `prompts/evaluation_metadata.jsonl` (also Flow-GRPO `dataset/geneval/*_metadata.jsonl`): one JSON object a line, `tag`, `include` (list of `{class, count[, color][, position: [relation, index]]}`), optional `exclude` (`{class, count}`), `prompt` | `tag` | `tag`, `include`, `exclude` (what `reward=geneval` checks) |
| `drawbench`     | DrawBench `.csv` with a header naming `Prompts` and `Category` (Imagen's sheet)   | `Category`  | the other columns |
| `parti`         | PartiPrompts `PartiPrompts.tsv`: tab-separated `Prompt`, `Category`, `Challenge`, `Note` | `Category` | `challenge`, `note` |
| `t2i_compbench` | T2I-CompBench `examples/dataset/<category>[_train|_val|_val_seen|_val_unseen].txt`, one prompt a line; or that folder (every such file) | the file's category (`color`, `shape`, `texture`, `spatial`, `non_spatial`, `complex`, `numeracy`, `3d_spatial`) | |
| `ocr`           | Flow-GRPO `dataset/ocr/{train,test}.txt`, one prompt a line, each with the text to render in double quotes | — | `text` (the quoted text, what `reward=ocr` reads) |
| `pickscore`     | Flow-GRPO `dataset/pickscore/{train,test}.txt`, one prompt a line | — | |
| `vbench`        | VBench `prompts/prompts_per_dimension/<dimension>.txt` (one prompt a line), or that folder, or `VBench_full_info.json` (a list of `{prompt_en, dimension: [...], auxiliary_info}`) | the dimension (the first, for a prompt of several) | `dimension` (all of them), `auxiliary_info` |
| `polyrl`        | any polyrl prompt file: `.txt`, `.jsonl` / `.parquet` with `prompt` (a `category` column is used) | `category` | every other column |

`detect_format` tells the format from the file (extension, header, first row, published file name); `eval.format=`
forces one.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from .prompts import _text_lines, jsonl_rows, load_prompts, prompt_lines

BENCHMARK_FORMATS = ("polyrl", "geneval", "drawbench", "parti", "t2i_compbench", "ocr", "pickscore", "vbench")

# T2I-CompBench's categories (examples/dataset/<category>[_split].txt)
T2I_COMPBENCH_CATEGORIES = ("color", "shape", "texture", "spatial", "non_spatial", "complex", "numeracy", "3d_spatial")
_COMPBENCH_FILE = re.compile(rf"^({'|'.join(T2I_COMPBENCH_CATEGORIES)})(_(train|val|val_seen|val_unseen|"
                             r"train_\w+|val_\w+))?$")
# VBench's 16 dimensions (prompts/prompts_per_dimension/<dimension>.txt) and its all-dimension list
VBENCH_DIMENSIONS = ("subject_consistency", "background_consistency", "temporal_flickering", "motion_smoothness",
                     "dynamic_degree", "aesthetic_quality", "imaging_quality", "object_class", "multiple_objects",
                     "human_action", "color", "spatial_relationship", "scene", "temporal_style", "appearance_style",
                     "overall_consistency")
_VBENCH_FILES = VBENCH_DIMENSIONS + ("all_dimension", "overall")
GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
GENEVAL_POSITIONS = ("left of", "right of", "above", "below")
_QUOTED = re.compile(r'"([^"]*)"')


def _compbench_category(path: Path) -> str | None:
    m = _COMPBENCH_FILE.match(path.stem)
    return m.group(1) if m else None


def detect_format(path: str | Path) -> str:
    """The format of a prompt file or folder (module docstring), from its extension, header, first row or published
    file name; a file of none of them is a ValueError saying what was looked for."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist")
    if path.is_dir():
        txts = sorted(path.glob("*.txt"))
        if any(p.stem in _VBENCH_FILES for p in txts):
            return "vbench"
        if any(_compbench_category(p) for p in txts):
            return "t2i_compbench"
        raise ValueError(f"data.path={str(path)!r} is a folder, but holds neither VBench's per-dimension lists "
                         f"(<dimension>.txt) nor T2I-CompBench's per-category lists (<category>_val.txt); give a file, "
                         f"or eval.format=vbench|t2i_compbench")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "drawbench"
    if suffix == ".tsv":
        return "parti"
    if suffix == ".json":
        return "vbench"
    if suffix == ".jsonl":
        for line in _text_lines(path):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return "polyrl"  # its reader names the line
                return "geneval" if isinstance(row, dict) and "include" in row and "tag" in row else "polyrl"
        return "polyrl"
    if suffix == ".txt":
        if path.stem in _VBENCH_FILES:
            return "vbench"
        if _compbench_category(path):
            return "t2i_compbench"
        if path.parent.name in ("ocr", "pickscore") and path.stem in ("train", "test"):
            return path.parent.name
    return "polyrl"


def load_benchmark(path: str | Path, fmt: str | None = None) -> tuple[list[dict], str]:
    """(rows, format) of a prompt file or folder; `fmt` forces the format (`eval.format=`), else `detect_format`."""
    path = Path(path)
    if fmt is not None and fmt not in BENCHMARK_FORMATS:
        raise ValueError(f"eval.format={fmt!r} is not valid; allowed: {', '.join(BENCHMARK_FORMATS)}")
    fmt = fmt or detect_format(path)
    if not path.exists():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist")
    rows = READERS[fmt](path)
    if not rows:
        raise ValueError(f"{path}: holds no prompts (read as {fmt})")
    return rows, fmt


def read_polyrl(path: Path) -> list[dict]:
    rows = load_prompts(path)
    for row in rows:
        if "category" in row and row["category"] is not None:
            row["category"] = str(row["category"])
    return rows


def _check_clause(clause, where: str, what: str, n_before: int) -> None:
    if not isinstance(clause, dict):
        raise ValueError(f"{where}: each '{what}' entry must be an object with 'class' and 'count', got {clause!r}")
    if not isinstance(clause.get("class"), str) or not clause["class"]:
        raise ValueError(f"{where}: an '{what}' entry has no 'class' (a COCO class name)")
    count = clause.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"{where}: '{what}' entry {clause['class']!r} needs an integer 'count' >= 1, got {count!r}")
    if what == "exclude":
        return
    if "color" in clause and not isinstance(clause["color"], str):
        raise ValueError(f"{where}: 'color' of {clause['class']!r} must be a string, got {clause['color']!r}")
    if "position" in clause:
        pos = clause["position"]
        if (not isinstance(pos, list) or len(pos) != 2 or pos[0] not in GENEVAL_POSITIONS
                or not isinstance(pos[1], int) or not 0 <= pos[1] < n_before):
            raise ValueError(f"{where}: 'position' of {clause['class']!r} must be [relation, index of an earlier "
                             f"include entry] with relation one of {', '.join(GENEVAL_POSITIONS)}; got {pos!r}")


def read_geneval(path: Path) -> list[dict]:
    """GenEval's evaluation_metadata.jsonl (module docstring): rows keep `tag`, `include`, `exclude`."""
    rows = []
    for where, row in jsonl_rows(path, "GenEval"):
        if not isinstance(row.get("tag"), str) or not row["tag"]:
            raise ValueError(f"{where}: no 'tag' (GenEval's tags: {', '.join(GENEVAL_TAGS)})")
        include, exclude = row.get("include"), row.get("exclude", [])
        if not isinstance(include, list) or not include:
            raise ValueError(f"{where}: 'include' must be a non-empty list of {{class, count}} objects")
        if not isinstance(exclude, list):
            raise ValueError(f"{where}: 'exclude' must be a list of {{class, count}} objects")
        for i, clause in enumerate(include):
            _check_clause(clause, where, "include", i)
        for clause in exclude:
            _check_clause(clause, where, "exclude", 0)
        rows.append({**row, "exclude": exclude, "category": row["tag"]})
    return rows


def _read_table(path: Path, delimiter: str, prompt_col: str, what: str) -> list[dict]:
    """Rows of a csv / tsv with a header naming `prompt_col` and `Category`; the other columns become lower-case
    metadata keys."""
    text = "\n".join(_text_lines(path))
    reader = csv.reader(text.splitlines(), delimiter=delimiter)
    try:
        header = next(reader)
    except StopIteration:
        raise ValueError(f"{path}: empty (a {what} file starts with a header naming {prompt_col} and Category)") \
            from None
    header = [h.strip() for h in header]
    if prompt_col not in header or "Category" not in header:
        raise ValueError(f"{path}:1: the header must name {prompt_col!r} and 'Category' (the {what} format); got "
                         f"{header}")
    rows, last = [], 1
    for fields in reader:
        n = reader.line_num
        if not any(f.strip() for f in fields):
            last = n
            continue
        where = f"{path}:{last + 1}"
        if len(fields) > len(header) or len(fields) < header.index("Category") + 1:
            raise ValueError(f"{where}: {len(fields)} fields, the header has {len(header)} ({', '.join(header)})")
        record = dict(zip(header, fields, strict=False))
        prompt = record.pop(prompt_col).strip()
        if not prompt:
            raise ValueError(f"{where}: empty {prompt_col}")
        category = record.pop("Category").strip()
        if not category:
            raise ValueError(f"{where}: empty Category")
        row = {"prompt": prompt, "category": category}
        row.update({k.lower(): v for k, v in record.items() if k})
        rows.append(row)
        last = n
    return rows


def read_drawbench(path: Path) -> list[dict]:
    return _read_table(path, ",", "Prompts", "DrawBench")


def read_parti(path: Path) -> list[dict]:
    return _read_table(path, "\t", "Prompt", "PartiPrompts")


def _per_category_files(path: Path, category_of, what: str) -> list[tuple[Path, str]]:
    if path.is_file():
        return [(path, category_of(path) or path.stem)]
    files = [(p, category_of(p)) for p in sorted(path.glob("*.txt"))]
    files = [(p, c) for p, c in files if c]
    if not files:
        raise ValueError(f"{path}: no {what} prompt lists in this folder")
    return files


def read_t2i_compbench(path: Path) -> list[dict]:
    """One prompt a line; the category from the file name (color_val.txt -> color). A folder: every file whose
    name is a T2I-CompBench category list (the train/val splits of one category both count)."""
    rows = []
    for file, category in _per_category_files(path, _compbench_category, "T2I-CompBench"):
        rows += [{"prompt": p, "category": category} for _, p in prompt_lines(file)]
    return rows


def _vbench_dimension(path: Path) -> str | None:
    return path.stem if path.stem in VBENCH_DIMENSIONS else None


def read_vbench(path: Path) -> list[dict]:
    """VBench_full_info.json, one per-dimension list, or the prompts_per_dimension folder (each dimension file)."""
    if path.is_file() and path.suffix.lower() == ".json":
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(entries, list):
            raise ValueError(f"{path}: VBench's full info is a JSON list of {{prompt_en, dimension}} objects")
        rows = []
        for i, e in enumerate(entries, 1):
            where = f"{path}: entry {i}"
            if not isinstance(e, dict) or not isinstance(e.get("prompt_en"), str) or not e["prompt_en"].strip():
                raise ValueError(f"{where}: needs a non-empty string 'prompt_en'")
            dims = e.get("dimension")
            if not isinstance(dims, list) or not dims or not all(isinstance(d, str) for d in dims):
                raise ValueError(f"{where}: 'dimension' must be a non-empty list of VBench dimensions")
            row = {"prompt": e["prompt_en"].strip(), "category": dims[0], "dimension": dims}
            if "auxiliary_info" in e:
                row["auxiliary_info"] = e["auxiliary_info"]
            rows.append(row)
        return rows
    rows = []
    for file, dimension in _per_category_files(path, _vbench_dimension, "VBench per-dimension"):
        category = dimension if dimension in VBENCH_DIMENSIONS else None
        rows += [{"prompt": p, "category": category, "dimension": [category] if category else []}
                 for _, p in prompt_lines(file)]
    return rows


def read_ocr(path: Path) -> list[dict]:
    """Flow-GRPO's OCR prompts: each line holds the text to render between double quotes (kept as `text`)."""
    rows = []
    for n, prompt in prompt_lines(path):
        m = _QUOTED.search(prompt)
        if m is None or not m.group(1).strip():
            raise ValueError(f"{path}:{n}: no text in double quotes (an OCR prompt names the text to render, "
                             f'e.g. a sign that says "OPEN")')
        rows.append({"prompt": prompt, "text": m.group(1)})
    return rows


def read_pickscore(path: Path) -> list[dict]:
    return [{"prompt": p} for _, p in prompt_lines(path)]


READERS = {"polyrl": read_polyrl, "geneval": read_geneval, "drawbench": read_drawbench, "parti": read_parti,
           "t2i_compbench": read_t2i_compbench, "ocr": read_ocr, "pickscore": read_pickscore, "vbench": read_vbench}
