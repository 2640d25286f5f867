"""The field's prompt sets in their published formats, read from local files (polyrl ships none of them).

Every reader returns rows as `load_prompts` does (`{"prompt": str, ...metadata}`; `split_row` hands the metadata
to the reward), plus `category` where the set has categories (the evaluation reports per category), and where each
row is (`file:line`). A prompt is read as the file holds it: a csv / tsv cell keeps its quotes, line breaks and
surrounding spaces (a one-prompt-a-line .txt line drops its surrounding spaces, as `load_prompts` does; no published
list has any); a leading byte-order mark is removed; a line that repeats another is read again (the published lists
repeat prompts on purpose: Flow-GRPO's GenEval list holds each of GenEval's 553 four times). A malformed row, a
binary, empty, truncated or non-UTF-8 file is a ValueError naming the file and line; nothing is skipped silently.

| format          | file (as published)                                        | category            | other metadata |
|-----------------|------------------------------------------------------------|---------------------|----------------|
| `geneval`       | GenEval `prompts/evaluation_metadata.jsonl` (also Flow-GRPO `dataset/geneval*/test_metadata.jsonl`): one JSON object a line, `tag`, `include` (list of `{class, count[, color][, position: [relation, index]]}`), optional `exclude` (`{class, count}`), `prompt` | `tag` | `tag`, `include`, `exclude` (what `reward=geneval` checks) |
| `drawbench`     | DrawBench `.csv` (Imagen's sheet): a header naming `Prompts` (or `Prompt`) and `Category`; the csv dialect of spreadsheets (a cell holding a comma, quote or line break is quoted, its quotes doubled) | `Category` | the other columns |
| `parti`         | PartiPrompts `PartiPrompts.tsv`: tab-separated `Prompt`, `Category`, `Challenge`, `Note`, no quoting (a quote is part of the prompt) | `Category` | `challenge`, `note` |
| `t2i_compbench` | T2I-CompBench `examples/dataset/<category>[_train|_val|_val_seen|_val_unseen|...].txt`, one prompt a line; or that folder: each category's `_val` list (the benchmark's test set), the other lists (which overlap it or are other splits) not read | the file's category (`color`, `shape`, `texture`, `spatial`, `non_spatial`, `complex`, `numeracy`, `3d_spatial`) | `split` (`val`, `train`, `val_seen`, ... from the file name) |
| `ocr`           | Flow-GRPO `dataset/ocr/{train,test}.txt`, one prompt a line, each with the text to render in double quotes | — | `text` (the first quoted text, what `reward=ocr` reads) |
| `pickscore`     | Flow-GRPO `dataset/pickscore/{train,test}.txt`, one prompt a line | — | |
| `vbench`        | VBench `prompts/prompts_per_dimension/<dimension>.txt` or `prompts_per_category/<category>.txt` (one prompt a line), either folder, `all_dimension.txt` / `all_category.txt`, `VBench_full_info.json` (a list of `{prompt_en, dimension: [...], auxiliary_info}`) or `prompts/metadata/<dimension>.json` (a list of `{prompt_en, ...}`) | the dimension (the first, for a prompt of several) or the content category | `dimension` (every dimension that scores the prompt), `auxiliary_info` / the metadata file's other keys |
| `polyrl`        | any polyrl prompt file: `.txt`, `.jsonl` / `.parquet` with `prompt` (a `category` column is used) | `category` | every other column |

`detect` tells the format from what the file says (its type, header, first row, the lists a folder holds, whether
every line quotes a text) and why; a file it cannot tell apart (T2I-CompBench's and VBench's `color.txt` with no
sibling lists that decide, a folder holding both benchmarks' lists, a .jsonl whose first row has some of GenEval's
keys but not `tag` and `include`) is a ValueError naming `eval.format=`. `eval.format=` forces a format; a file the
forced format does not read (another file type, a name that is not one of its lists) is a ValueError, never another
parse.
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .prompts import (
    FORMATS,
    MissingConditionImage,
    _text_lines,
    jsonl_rows,
    load_prompts,
    prompt_lines,
    read_text,
    row_location,
)

BENCHMARK_FORMATS = ("polyrl", "geneval", "drawbench", "parti", "t2i_compbench", "ocr", "pickscore", "vbench")
# the file types each format reads ("/": a folder)
FORMAT_FILES = {"polyrl": FORMATS, "geneval": (".jsonl",), "drawbench": (".csv",), "parti": (".tsv",),
                "t2i_compbench": (".txt", "/"), "ocr": (".txt",), "pickscore": (".txt",),
                "vbench": (".txt", ".json", "/")}

# T2I-CompBench's categories (examples/dataset/<category>[_split].txt; split: train, val, val_seen, val_unseen, and
# complex's train_action, val_spatial, ...)
T2I_COMPBENCH_CATEGORIES = ("color", "shape", "texture", "spatial", "non_spatial", "complex", "numeracy", "3d_spatial")
_COMPBENCH_FILE = re.compile(rf"^({'|'.join(T2I_COMPBENCH_CATEGORIES)})(?:_((?:train|val)(?:_[a-z]+)?))?$")
# VBench's 16 dimensions, and the dimensions that score each per-dimension list (prompts_per_dimension/<name>.txt;
# as VBench_full_info.json gives them: the three lists that serve several dimensions, the others their own)
VBENCH_DIMENSIONS = ("subject_consistency", "background_consistency", "temporal_flickering", "motion_smoothness",
                     "dynamic_degree", "aesthetic_quality", "imaging_quality", "object_class", "multiple_objects",
                     "human_action", "color", "spatial_relationship", "scene", "temporal_style", "appearance_style",
                     "overall_consistency")
VBENCH_LIST_DIMENSIONS = {"subject_consistency": ("subject_consistency", "dynamic_degree", "motion_smoothness"),
                          "scene": ("scene", "background_consistency"),
                          "overall_consistency": ("overall_consistency", "aesthetic_quality", "imaging_quality")}
# VBench's content categories (prompts_per_category/<category>.txt) and its complete lists (prompts/all_*.txt)
VBENCH_CATEGORIES = ("animal", "architecture", "food", "human", "lifestyle", "plant", "scenery", "vehicles")
VBENCH_ALL = ("all_dimension", "all_category", "all_dimension_cn")
GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
GENEVAL_POSITIONS = ("left of", "right of", "above", "below")
GENEVAL_KEYS = ("tag", "include", "exclude", "prompt")
_CLAUSE_KEYS = {"include": ("class", "count", "color", "position"), "exclude": ("class", "count")}
_QUOTED = re.compile(r'"([^"]*)"')


@dataclass
class Benchmark:
    """A prompt file or folder as read: the rows, where each is, the format and how it was chosen."""

    path: Path
    format: str
    why: str  # how the format was chosen: what detection saw, or `eval.format=...`
    rows: list[dict] = field(default_factory=list)
    locations: list[str] | None = field(default_factory=list)  # `file:line` of each row; None: `row_location`
    read: list[str] = field(default_factory=list)  # a folder: the files read
    skipped: list[str] = field(default_factory=list)  # a folder: each file not read, and why

    def add(self, where: str, row: dict) -> None:
        self.rows.append(row)
        self.locations.append(where)

    def location(self, index: int) -> str:
        return self.locations[index] if self.locations is not None else row_location(self.path, index)

    def categories(self) -> dict[str, int]:
        """Prompts per category, in the order the categories first appear (rows without one are not counted)."""
        return dict(Counter(r["category"] for r in self.rows if r.get("category") is not None))

    def describe(self, key: str = "data.path") -> str:
        """What was read, for the user: format and why, prompt count, categories; a folder's files read and not."""
        cats = self.categories()
        shown = ", ".join(f"{c!r} {n}" for c, n in list(cats.items())[:16])
        more = f", and {len(cats) - 16} more" if len(cats) > 16 else ""
        counted = f"{len(cats)} categor{'y' if len(cats) == 1 else 'ies'}: {shown}{more}" if cats else "no categories"
        text = f"polyrl: {key}={self.path} read as {self.format} ({self.why}): {len(self.rows)} prompts, {counted}"
        if self.read:
            text += f"\npolyrl:   read: {', '.join(self.read)}"
        if self.skipped:
            text += f"\npolyrl:   not read: {'; '.join(self.skipped)}"
        return text


# ------------------------------------------------------------------------------------------------ detection
def _compbench_name(stem: str) -> tuple[str, str | None] | None:
    """(category, split or None) of a T2I-CompBench list's file name, or None."""
    m = _COMPBENCH_FILE.match(stem)
    return (m.group(1), m.group(2)) if m else None


def _vbench_name(stem: str) -> bool:
    return stem in VBENCH_DIMENSIONS or stem in VBENCH_CATEGORIES or stem in VBENCH_ALL


def _list_kinds(stem: str) -> set[str]:
    """The benchmarks whose published one-prompt-a-line lists have this file name (color: both)."""
    return ({"t2i_compbench"} if _compbench_name(stem) else set()) | ({"vbench"} if _vbench_name(stem) else set())


def _txt_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() == ".txt")


def _names(paths, limit: int = 4) -> str:
    names = [p.name for p in paths]
    return ", ".join(names[:limit]) + (f", ... ({len(names)} files)" if len(names) > limit else "")


def _by_kind(paths) -> dict[str, list[Path]]:
    """The files whose names only one benchmark publishes, by benchmark."""
    out = {"t2i_compbench": [], "vbench": []}
    for p in paths:
        kinds = _list_kinds(p.stem)
        if len(kinds) == 1:
            out[kinds.pop()].append(p)
    return out


def _all_lines_quote(path: Path) -> bool:
    lines = prompt_lines(path)
    return bool(lines) and all(any(t.strip() for t in _QUOTED.findall(line)) for _, line in lines)


def detect(path: str | Path) -> tuple[str, str]:
    """(format, what decided it) of a prompt file or folder (module docstring); a file no format reads, or one that
    two formats read differently with nothing in it to decide, is a ValueError (the latter naming `eval.format=`)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist")
    if path.is_dir():
        return _detect_folder(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "drawbench", "a .csv file: DrawBench's sheet"
    if suffix == ".tsv":
        return "parti", "a .tsv file: PartiPrompts' table"
    if suffix == ".json":
        return "vbench", "a .json file: VBench's prompt information"
    if suffix == ".parquet":
        return "polyrl", "a .parquet file with a prompt column"
    if suffix == ".jsonl":
        return _detect_jsonl(path)
    if suffix == ".txt":
        return _detect_txt(path)
    raise ValueError(f"data.path={str(path)!r}: a {suffix or 'suffix-less'} file is no prompt format; prompt files are "
                     ".txt, .jsonl, .parquet, .csv (DrawBench), .tsv (PartiPrompts), .json (VBench), or a folder of "
                     "T2I-CompBench's or VBench's .txt lists")


def _detect_jsonl(path: Path) -> tuple[str, str]:
    for n, line in enumerate(_text_lines(path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            return "polyrl", "a .jsonl file"  # its reader names the line
        if not isinstance(row, dict):
            return "polyrl", "a .jsonl file"
        if "tag" in row and "include" in row:
            return "geneval", f"a .jsonl file whose line {n} has GenEval's 'tag' and 'include'"
        has = [k for k in ("tag", "include", "exclude") if k in row]
        near = {k: m[0] for k in row if k not in GENEVAL_KEYS
                for m in [difflib.get_close_matches(k, GENEVAL_KEYS, n=1, cutoff=0.75)] if m}
        if has or near:
            said = ", ".join([repr(k) for k in has] + [f"{k!r} (GenEval's {v!r}?)" for k, v in near.items()])
            raise ValueError(f"{path}:{n}: has {said} but not both 'tag' and 'include': not a GenEval metadata row "
                             f"(GenEval's keys: tag, include, exclude, prompt); fix the key, or set eval.format=polyrl "
                             f"to read the file as plain prompts")
        return "polyrl", "a .jsonl file"
    return "polyrl", "a .jsonl file"


def _detect_txt(path: Path) -> tuple[str, str]:
    kinds = _list_kinds(path.stem)
    if len(kinds) == 2:  # color.txt: T2I-CompBench's and VBench's; the lists beside it decide
        beside = _by_kind(p for p in _txt_files(path.parent) if p != path)
        found = [k for k, v in beside.items() if v]
        if len(found) == 1:
            return found[0], (f"{path.name} beside {len(beside[found[0]])} "
                              f"{'T2I-CompBench' if found[0] == 't2i_compbench' else 'VBench'} lists")
        raise ValueError(f"{path}: {path.name} is both T2I-CompBench's and VBench's list name and the files beside it "
                         "do not tell which; set eval.format=t2i_compbench or eval.format=vbench")
    if kinds:
        kind = kinds.pop()
        return kind, f"{path.name} is one of {'T2I-CompBench' if kind == 't2i_compbench' else 'VBench'}'s lists"
    if _all_lines_quote(path):
        return "ocr", "every line quotes the text to render: Flow-GRPO's OCR list"
    if path.parent.name == "pickscore":
        return "pickscore", "a one-prompt-a-line .txt in a folder named pickscore: Flow-GRPO's PickScore list"
    return "polyrl", "a .txt file: one prompt a line"


def _detect_folder(path: Path) -> tuple[str, str]:
    files = _txt_files(path)
    kinds = _by_kind(files)  # the names only one benchmark publishes decide; color.txt counts for either
    t2i, vb = kinds["t2i_compbench"], kinds["vbench"]
    if t2i and vb:
        raise ValueError(f"{path}: holds T2I-CompBench's lists ({_names(t2i, 2)}) and VBench's ({_names(vb, 2)}); "
                         "set eval.format=t2i_compbench or eval.format=vbench to read one benchmark's")
    if t2i:
        n = sum("t2i_compbench" in _list_kinds(p.stem) for p in files)
        return "t2i_compbench", f"a folder of {n} T2I-CompBench category lists"
    if vb:
        return "vbench", f"a folder of {sum('vbench' in _list_kinds(p.stem) for p in files)} VBench lists"
    if any(len(_list_kinds(p.stem)) == 2 for p in files):
        raise ValueError(f"{path}: holds only color.txt of the benchmarks' lists, T2I-CompBench's and VBench's name; "
                         "set eval.format=t2i_compbench or eval.format=vbench")
    raise ValueError(f"{path}: a folder, but it holds neither T2I-CompBench's category lists (<category>_val.txt) nor "
                     "VBench's lists (<dimension>.txt); give a prompt file as data.path")


def detect_format(path: str | Path) -> str:
    """The format `detect` decides."""
    return detect(path)[0]


def _check_fits(path: Path, fmt: str) -> None:
    """A forced format reads the file as that format or fails; it never reads another file type."""
    kinds = FORMAT_FILES[fmt]
    if path.is_dir():
        if "/" not in kinds:
            raise ValueError(f"eval.format={fmt} reads a {' / '.join(kinds)} file; data.path={str(path)!r} is a folder")
        return
    suffix = path.suffix.lower()
    if suffix not in kinds:
        files = " / ".join(k for k in kinds if k != "/") + (" file or a folder" if "/" in kinds else " file")
        raise ValueError(f"eval.format={fmt} reads a {files}; data.path={str(path)!r} is a {suffix or 'suffix-less'} "
                         "file")
    if fmt == "t2i_compbench" and not _compbench_name(path.stem):
        raise ValueError(f"eval.format=t2i_compbench: {path.name} is not named as a T2I-CompBench list "
                         f"(<category>[_split].txt, category one of {', '.join(T2I_COMPBENCH_CATEGORIES)}): its "
                         "category is the file's name")
    if fmt == "vbench" and suffix == ".txt" and not _vbench_name(path.stem):
        raise ValueError(f"eval.format=vbench: {path.name} is not named as a VBench list (<dimension>.txt, "
                         f"<category>.txt or {' / '.join(a + '.txt' for a in VBENCH_ALL)}): its dimension is the "
                         "file's name")


# ------------------------------------------------------------------------------------------------ reading
def read_benchmark(path: str | Path, fmt: str | None = None) -> Benchmark:
    """A prompt file or folder read as `fmt` (`eval.format=`; checked to fit the file) or as `detect` decides."""
    path = Path(path)
    if fmt is not None and fmt not in BENCHMARK_FORMATS:
        close = difflib.get_close_matches(str(fmt), BENCHMARK_FORMATS, n=1)
        raise ValueError(f"eval.format={fmt!r} is not a format{f' (did you mean {close[0]}?)' if close else ''}; "
                         f"allowed: {', '.join(BENCHMARK_FORMATS)}")
    if not path.exists():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist")
    if fmt is None:
        fmt, why = detect(path)
    else:
        _check_fits(path, fmt)
        why = f"eval.format={fmt}"
    bench = Benchmark(path, fmt, why)
    READERS[fmt](path, bench)
    if not bench.rows:
        raise ValueError(f"{path}: holds no prompts (read as {fmt}: the file is empty or only blank lines)")
    return bench


def load_benchmark(path: str | Path, fmt: str | None = None) -> tuple[list[dict], str]:
    """(rows, format) of `read_benchmark`."""
    bench = read_benchmark(path, fmt)
    return bench.rows, bench.format


def read_prompt_data(path: str | Path, require_image: bool = False) -> Benchmark:
    """A training prompt file (`data.path`, `data.heldout_path`): a polyrl file (.txt, .jsonl, .parquet) as
    `load_prompts` reads it, anything else (a benchmark's .csv, .tsv, .json or folder) as `read_benchmark` does."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist")
    if path.is_file() and path.suffix in FORMATS:
        return Benchmark(path, "polyrl", "a polyrl prompt file", load_prompts(path, require_image), None)
    bench = read_benchmark(path)
    if require_image:
        raise MissingConditionImage(f"{path}: no 'image' (read as {bench.format}, a prompt set of text only; use "
                                    ".jsonl or .parquet with an `image` column)")
    return bench


def read_polyrl(path: Path, bench: Benchmark) -> None:
    bench.rows, bench.locations = load_prompts(path), None
    for row in bench.rows:
        if "category" in row and row["category"] is not None:
            row["category"] = str(row["category"])


def _check_clause(clause, where: str, what: str, n_before: int) -> None:
    if not isinstance(clause, dict):
        raise ValueError(f"{where}: each '{what}' entry must be an object with 'class' and 'count', got {clause!r}")
    unknown = [k for k in clause if k not in _CLAUSE_KEYS[what]]
    if unknown:  # the reward would not check it: a misnamed key changes the task without a word
        raise ValueError(f"{where}: '{what}' entry has key {unknown[0]!r}; GenEval's {what} entries have "
                         f"{', '.join(_CLAUSE_KEYS[what])}")
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


def read_geneval(path: Path, bench: Benchmark) -> None:
    """GenEval's evaluation_metadata.jsonl (module docstring): rows keep `tag`, `include`, `exclude`."""
    for where, row in jsonl_rows(path, "GenEval"):
        near = {k: m[0] for k in row if k not in GENEVAL_KEYS
                for m in [difflib.get_close_matches(k, GENEVAL_KEYS, n=1, cutoff=0.75)] if m}
        if near:
            k, v = next(iter(near.items()))
            raise ValueError(f"{where}: key {k!r} (GenEval's {v!r}?); GenEval's keys: {', '.join(GENEVAL_KEYS)}")
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
        bench.add(where, {**row, "exclude": exclude, "category": row["tag"]})


def _header(path: Path, cells: list[str], names: tuple[str, ...], what: str, line: int) -> tuple[list[str], str]:
    """(column names, the prompt column) of a table's header: it names one of `names` and `Category`, once each;
    the other named columns become metadata keys (lower-cased: distinct, and none `prompt` or `category`)."""
    header = [h.strip() for h in cells]
    prompt_cols = [h for h in header if h in names]
    others = [h.lower() for h in header if h and h not in names and h != "Category"]
    if (len(prompt_cols) != 1 or header.count("Category") != 1 or len(set(others)) != len(others)
            or {"prompt", "prompts", "category"} & set(others)):
        wanted = " (or ".join(names) + ")" * (len(names) - 1)
        raise ValueError(f"{path}:{line}: the {what} header names {wanted} and Category, once each; this one has "
                         f"{header}")
    return header, prompt_cols[0]


def _table_row(path: Path, where: str, header: list[str], prompt_col: str, fields: list[str]) -> dict:
    if len(fields) != len(header):
        raise ValueError(f"{where}: {len(fields)} fields, the header has {len(header)} ({', '.join(header)})")
    record = dict(zip(header, fields, strict=True))
    prompt, category = record.pop(prompt_col), record.pop("Category")
    if not prompt.strip():
        raise ValueError(f"{where}: empty {prompt_col}")
    if not category.strip():
        raise ValueError(f"{where}: empty Category")
    row = {"prompt": prompt, "category": category}
    for name, value in record.items():
        if not name and value.strip():
            raise ValueError(f"{where}: a value ({value!r}) in a column the header does not name")
        if name:
            row[name.lower()] = value
    return row


def read_drawbench(path: Path, bench: Benchmark) -> None:
    """DrawBench's csv: the spreadsheet dialect (a quoted cell keeps its commas, doubled quotes and line breaks;
    nothing is stripped); a malformed quote or a file that ends inside a quoted cell names the row's first line."""
    reader = csv.reader(io.StringIO(read_text(path), newline=""), strict=True)
    line = 0
    try:
        cells = next(reader, None)
        if cells is None:
            raise ValueError(f"{path}: empty (a DrawBench .csv starts with a header naming Prompts and Category)")
        header, prompt_col = _header(path, cells, ("Prompts", "Prompt"), "DrawBench", 1)
        line = reader.line_num
        for fields in reader:
            start, line = line + 1, reader.line_num
            if not any(f.strip() for f in fields):  # a blank line, or a row of empty cells
                continue
            where = f"{path}:{start}"
            bench.add(where, _table_row(path, where, header, prompt_col, fields))
    except csv.Error as e:
        raise ValueError(f"{path}:{line + 1}: not valid csv ({e}; a cell holding a comma, a quote or a line break is "
                         'quoted, its quotes doubled: "a ""quoted"" word")') from None


def read_parti(path: Path, bench: Benchmark) -> None:
    """PartiPrompts' tsv: tab-separated, no quoting: every cell as the line holds it."""
    lines = _text_lines(path)
    if not lines:
        raise ValueError(f"{path}: empty (PartiPrompts.tsv starts with a header naming Prompt and Category)")
    header, prompt_col = _header(path, lines[0].split("\t"), ("Prompt",), "PartiPrompts", 1)
    for n, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        bench.add(where, _table_row(path, where, header, prompt_col, line.split("\t")))


def _read_lines(bench: Benchmark, file: Path, **meta) -> None:
    for n, prompt in prompt_lines(file):
        bench.add(f"{file}:{n}", {"prompt": prompt, **meta})


def _compbench_meta(file: Path) -> dict:
    category, split = _compbench_name(file.stem)
    return {"category": category} | ({"split": split} if split else {})


def read_t2i_compbench(path: Path, bench: Benchmark) -> None:
    """One prompt a line; the category (and split) from the file name (color_val.txt -> color, val). A folder: each
    category's `_val` list (T2I-CompBench's test set), or its only list; the folder's other lists (the full list,
    train, and the seen / unseen or action / spatial parts of val, which overlap it) are said and not read."""
    if path.is_file():
        _read_lines(bench, path, **_compbench_meta(path))
        return
    files = _txt_files(path)
    lists = [p for p in files if _compbench_name(p.stem)]
    if not lists:
        raise ValueError(f"{path}: no T2I-CompBench lists (<category>[_split].txt) in this folder")
    by_category: dict[str, list[Path]] = {}
    for p in lists:
        by_category.setdefault(_compbench_name(p.stem)[0], []).append(p)
    chosen, others = [], []
    for category, group in by_category.items():
        val = [p for p in group if p.stem == f"{category}_val"]
        if not val and len(group) > 1:
            raise ValueError(f"{path}: several lists of category {category} ({_names(group)}) and no "
                             f"{category}_val.txt: give one of them as data.path")
        pick = (val or group)[0]
        chosen.append(pick)
        others += [p for p in group if p != pick]
    for file in chosen:
        _read_lines(bench, file, **_compbench_meta(file))
    bench.read = [p.name for p in chosen]
    if others:
        bench.skipped.append(f"{_names(others, 6)} (the other splits of the same categories; T2I-CompBench tests on "
                             "the _val lists: give one file as data.path to read another)")
    rest = [p for p in files if p not in lists]
    if rest:
        bench.skipped.append(f"{_names(rest)} (not T2I-CompBench category lists)")


def _vbench_meta(stem: str) -> dict:
    if stem in VBENCH_DIMENSIONS:
        return {"category": stem, "dimension": list(VBENCH_LIST_DIMENSIONS.get(stem, (stem,)))}
    if stem in VBENCH_CATEGORIES:
        return {"category": stem}
    return {}


def _json_list(path: Path) -> list[tuple[str, object]]:
    """(`file:line`, item) of each item of a JSON list: where each item starts, for messages."""
    text = read_text(path)
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); VBench's prompt information is a JSON list "
                         "of {prompt_en, ...} objects") from None
    if not isinstance(items, list):
        raise ValueError(f"{path}:1: VBench's prompt information is a JSON list of {{prompt_en, ...}} objects, not a "
                         f"JSON {type(items).__name__}")
    decoder, space = json.JSONDecoder(), re.compile(r"[ \t\n\r]*,?[ \t\n\r]*")
    out, pos, line, counted = [], text.index("[") + 1, 1, 0
    for item in items:
        pos = space.match(text, pos).end()
        line, counted = line + text.count("\n", counted, pos), pos
        out.append((f"{path}:{line}", item))
        pos = decoder.raw_decode(text, pos)[1]
    return out


def _read_vbench_json(path: Path, bench: Benchmark) -> None:
    """VBench_full_info.json (entries with `dimension`), or prompts/metadata/<dimension>.json (entries of one
    dimension, named by the file)."""
    for where, e in _json_list(path):
        if not isinstance(e, dict) or not isinstance(e.get("prompt_en"), str) or not e["prompt_en"].strip():
            raise ValueError(f"{where}: each entry needs a non-empty string 'prompt_en'")
        rest = {k: v for k, v in e.items() if k not in ("prompt_en", "dimension")}
        if "dimension" in e:
            dims = e["dimension"]
            if not isinstance(dims, list) or not dims or not all(d in VBENCH_DIMENSIONS for d in dims):
                raise ValueError(f"{where}: 'dimension' must be a non-empty list of VBench dimensions "
                                 f"({', '.join(VBENCH_DIMENSIONS)}); got {dims!r}")
            row = {"prompt": e["prompt_en"], "category": dims[0], "dimension": dims}
        elif path.stem in VBENCH_DIMENSIONS:
            row = {"prompt": e["prompt_en"], **_vbench_meta(path.stem)}
        else:
            raise ValueError(f"{where}: no 'dimension', and {path.name} is not named by a VBench dimension "
                             "(VBench_full_info.json lists each prompt's; prompts/metadata/<dimension>.json is one's)")
        bench.add(where, row | rest)


def read_vbench(path: Path, bench: Benchmark) -> None:
    """VBench_full_info.json or a metadata .json, one list (a dimension's, a content category's or a complete one),
    or a folder of lists: its per-dimension lists (every dimension's, each line once: a prompt of two dimensions'
    lists is in both, as in VBench_full_info.json) or its per-category lists, with the complete lists beside them
    said and not read."""
    if path.is_file():
        if path.suffix.lower() == ".json":
            _read_vbench_json(path, bench)
        else:
            _read_lines(bench, path, **_vbench_meta(path.stem))
        return
    files = _txt_files(path)
    dims = [p for p in files if p.stem in VBENCH_DIMENSIONS]
    cats = [p for p in files if p.stem in VBENCH_CATEGORIES]
    alls = [p for p in files if p.stem in VBENCH_ALL]
    if dims and cats:
        raise ValueError(f"{path}: holds VBench's per-dimension lists ({_names(dims, 2)}) and per-category lists "
                         f"({_names(cats, 2)}), two prompt suites: give the folder of one of them")
    chosen = dims or cats
    if not chosen:
        if len(alls) != 1:
            raise ValueError(f"{path}: holds VBench's complete lists {_names(alls)}, different prompt sets: give one "
                             "of them, or the prompts_per_dimension folder, as data.path")
        chosen = alls
    for file in chosen:
        _read_lines(bench, file, **_vbench_meta(file.stem))
    bench.read = [p.name for p in chosen]
    read_prompts = Counter(r["prompt"] for r in bench.rows)
    for p in (alls if chosen is not alls else []):
        same = Counter(line for _, line in prompt_lines(p)) == read_prompts
        bench.skipped.append(f"{p.name} ({'the same prompts as the lists read' if same else 'another prompt set'}: "
                             "give it as data.path to read it)")
    rest = [p for p in files if p not in chosen and p not in alls]
    if rest:
        bench.skipped.append(f"{_names(rest)} (not VBench {'per-dimension' if dims else 'per-category'} lists)")


def read_ocr(path: Path, bench: Benchmark) -> None:
    """Flow-GRPO's OCR prompts: each line holds the text to render between double quotes (kept as `text`)."""
    for n, prompt in prompt_lines(path):
        m = _QUOTED.search(prompt)
        if m is None or not m.group(1).strip():
            raise ValueError(f"{path}:{n}: no text in double quotes (an OCR prompt names the text to render, "
                             f'e.g. a sign that says "OPEN")')
        bench.add(f"{path}:{n}", {"prompt": prompt, "text": m.group(1)})


def read_pickscore(path: Path, bench: Benchmark) -> None:
    _read_lines(bench, path)


READERS = {"polyrl": read_polyrl, "geneval": read_geneval, "drawbench": read_drawbench, "parti": read_parti,
           "t2i_compbench": read_t2i_compbench, "ocr": read_ocr, "pickscore": read_pickscore, "vbench": read_vbench}
