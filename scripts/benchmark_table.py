"""Read the benchmarks' own prompt files as `polyrl eval` reads them and print what was read, as a markdown table.

    python scripts/benchmark_table.py DIR [--source NAME=OWNER/REPO@COMMIT ...]

Every prompt file under DIR (.jsonl, .csv, .tsv, .json, .txt) and every folder that holds .txt lists is read with
the format detected from it (polyrl/data/benchmarks.py, as `polyrl eval data.path=...` without `eval.format=`): one
row each with the format, the path under DIR, the prompts and the categories with their prompt counts, or the one line
`polyrl eval` refuses it with. `--source geneval=djghosh13/geneval@af4902f` names where the files under DIR/geneval
came from (docs/evaluation.md's table says which repository and commit each file is). polyrl ships none of these
files: fetch them from their repositories.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from polyrl.data.benchmarks import read_benchmark

SUFFIXES = (".jsonl", ".csv", ".tsv", ".json", ".txt")


def candidates(root: Path) -> list[Path]:
    """The files with a prompt-file suffix, and the folders holding .txt files, under `root`, in path order."""
    out = []
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix.lower() in SUFFIXES:
            out.append(path)
        elif path.is_dir() and any(p.is_file() and p.suffix.lower() == ".txt" for p in path.iterdir()):
            out.append(path)
    return out


def categories_cell(counts: dict[str, int]) -> str:
    if not counts:
        return "—"
    return f"{len(counts)}: " + ", ".join(f"{name!r} {n}" for name, n in counts.items()).replace("|", "\\|")


def table(root: Path, sources: dict[str, str]) -> str:
    lines = ["| format | file | source | prompts | categories |", "|---|---|---|---|---|"]
    for path in candidates(root):
        rel = path.relative_to(root)
        source = sources.get(rel.parts[0], "")
        name = f"`{rel}{'/' if path.is_dir() else ''}`"
        try:
            bench = read_benchmark(path)
        except (ValueError, FileNotFoundError) as e:
            message = str(e).replace(str(root) + "/", "").replace("|", "\\|")
            lines.append(f"| refused | {name} | {source} | — | {message} |")
            continue
        lines.append(f"| {bench.format} | {name} | {source} | {len(bench.rows)} | "
                     f"{categories_cell(bench.categories())} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="a folder holding the benchmarks' files (e.g. one folder each)")
    parser.add_argument("--source", action="append", default=[], metavar="NAME=OWNER/REPO@COMMIT",
                        help="where the files under DIR/NAME came from (repeatable)")
    args = parser.parse_args()
    sources = {}
    for item in args.source:
        name, sep, where = item.partition("=")
        if not sep:
            parser.error(f"--source {item!r}: expected NAME=OWNER/REPO@COMMIT")
        sources[name] = where
    if not args.dir.is_dir():
        parser.error(f"{args.dir} is not a folder")
    print(table(args.dir.resolve(), sources))


if __name__ == "__main__":
    main()
