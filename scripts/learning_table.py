"""Print the held-out learning table of finished runs: eval/reward_mean per evaluated step, per seed, mean ± std.

    python scripts/learning_table.py runs/s0 runs/s1 [--wall]

Each argument is a run directory (its metrics.jsonl). Rows: each run, then mean ± std (population std over runs);
columns: every step at which all runs evaluated, then the gain of the last over the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def evals(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            m = json.loads(line)
            if "eval/reward_mean" in m:
                out[int(m["step"])] = float(m["eval/reward_mean"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    a = p.parse_args()
    per_run = {r: evals(r) for r in a.runs}
    steps = sorted(set.intersection(*(set(e) for e in per_run.values())))
    if not steps:
        raise SystemExit("polyrl: error: the runs share no evaluated step")
    print("| run | " + " | ".join(f"step {s}" for s in steps) + " | gain |")
    print("|---" * (len(steps) + 2) + "|")
    for r, e in per_run.items():
        print(f"| {r.name} | " + " | ".join(f"{e[s]:.3f}" for s in steps) + f" | {e[steps[-1]] - e[steps[0]]:+.3f} |")
    if len(per_run) > 1:
        cols = [[e[s] for e in per_run.values()] for s in steps]
        gains = [e[steps[-1]] - e[steps[0]] for e in per_run.values()]
        print("| mean ± std | " + " | ".join(f"{statistics.mean(c):.3f} ± {statistics.pstdev(c):.3f}" for c in cols)
              + f" | {statistics.mean(gains):+.3f} ± {statistics.pstdev(gains):.3f} |")


if __name__ == "__main__":
    main()
