"""`polyrl eval`'s output directory: samples.jsonl (each prompt's scores, read back on resume), eval.json (what is
evaluated: a resumed evaluation must be the same one), report.json (evaluation/stats.py's statistics per scorer and
category) and report.md."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from .plan import EvalOptions


def read_done(path: Path) -> dict[int, dict]:
    """The prompts samples.jsonl already holds, by index; a torn last line (a kill mid-write) is dropped."""
    done = {}
    if not path.is_file():
        return done
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                break
            raise UserError(f"{path}:{n}: not valid JSON (the file was edited?); remove it to start afresh") from None
        done[int(record["index"])] = record
    # rewrite without the torn line, so appends start on a line of their own
    path.write_text("".join(json.dumps(done[i]) + "\n" for i in sorted(done)))
    return done

def check_same_run(path: Path, spec: dict) -> None:
    """Resuming into `path` (eval.json) is only allowed for the same evaluation."""
    if not path.is_file():
        path.write_text(json.dumps(spec, indent=2) + "\n")
        return
    old = json.loads(path.read_text())
    differ = [k for k in sorted(set(old) | set(spec)) if old.get(k) != spec.get(k)]
    if differ:
        k = differ[0]
        raise UserError(f"{path.parent} holds another evaluation ({k}: {old.get(k)!r} there, {spec.get(k)!r} now); "
                        "choose another eval.output_dir")

def build_report(spec: dict, records: list[dict], rows: list[dict], opts: EvalOptions) -> dict:
    """report.json: what was evaluated, counts, and per scorer the statistics of evaluation/stats.py (per category
    where the prompt set has categories)."""
    from .stats import summarize_by_category

    categories = [rows[r["index"]].get("category") for r in records]
    report = {**spec, "prompts": len(records), "samples": len(records) * opts.samples_per_prompt, "scorers": {}}
    for name in spec["scorers"]:
        scores = [r["scores"][name] for r in records]
        base = [r["base"][name] for r in records] if opts.compare_base else None
        report["scorers"][name] = summarize_by_category(scores, categories, opts.seed, opts.resamples, base)
    return report


def fmt_ci(ci) -> str:
    return f"[{ci[0]:.4f}, {ci[1]:.4f}]"


def report_markdown(report: dict) -> str:
    paired = report["compare_base"]
    head = ("| scorer | mean | ci95 | base | delta | delta ci95 | win rate |\n|---|---|---|---|---|---|---|"
            if paired else "| scorer | mean | ci95 |\n|---|---|---|")

    def row(label: str, s: dict) -> str:
        cells = [label, f"{s['mean']:.4f}", fmt_ci(s["ci95"])]
        if paired:
            cells += [f"{s['base_mean']:.4f}", f"{s['delta']:+.4f}", fmt_ci(s["delta_ci95"]), f"{s['win_rate']:.3f}"]
        return "| " + " | ".join(cells) + " |"

    what = report["checkpoint"] or report["model_path"]
    lines = [f"# polyrl eval: {what}", "",
             f"{report['prompts']} prompts × {report['samples_per_prompt']} samples = {report['samples']} samples of "
             f"`{report['data_path']}` ({report['format']}), seed {report['seed']}, {_sampling_words(report)}"
             + (f"; paired against the base `{report['model_path']}` from the same noise" if paired else "") + ".",
             "", head]
    lines += [row(name, s) for name, s in report["scorers"].items()]
    for name, s in report["scorers"].items():
        if "categories" not in s:
            continue
        lines += ["", f"## {name} per category", "", head.replace("| scorer |", "| category |")]
        lines += [row(c, cs) for c, cs in s["categories"].items()]
        mean_line = f"mean over categories: {s['category_mean']:.4f}"
        if paired:
            mean_line += f" (base {s['base_category_mean']:.4f}, delta {s['category_delta']:+.4f})"
        lines += ["", mean_line]
    lines += ["", "ci95: bootstrap over prompts (docs/evaluation.md); win rate: (wins + ties/2) / paired samples."]
    return "\n".join(lines) + "\n"

def _sampling_words(report: dict) -> str:
    level = report["noise_level"]
    if report.get("policy") == "tokens":
        return (("greedy decoding" if level == 0 else f"sampling at temperature {level}")
                + f", at most {report['max_new_tokens']} new tokens")
    return f"{'ODE' if level == 0 else 'SDE noise level ' + str(level)} sampling, {report['num_steps']} steps"
