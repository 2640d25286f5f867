"""Print the docs/algorithms.md table from the runs of scripts/toy_algorithms_table.sh (runs/algos/<algo>_s<seed>)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ALGOS = ["flow_grpo", "flow_grpo_cps", "flow_dppo", "grpo_guard", "dance_grpo", "mix_grpo", "diffusion_nft",
         "diffusion_opd", "diffusion_dpo", "dgpo", "awm"]


def evals(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r}


def pm(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.pstdev(values):.3f}"


def main(root: str = "runs/algos") -> None:
    root = Path(root)
    print("| algorithm (`recipe=toy_<name>`) | base (step 0) | step 10 | step 20 | step 30 | gain | seed 0 / seed 1 at 30 | wall time per run |")
    print("|---|---|---|---|---|---|---|---|")
    for algo in ALGOS:
        runs = [root / f"{algo}_s{s}" for s in (0, 1)]
        if not all((r / "reward_curve.png").is_file() for r in runs):  # written when a run ends
            print(f"| {algo} | (missing) |")
            continue
        ev = [evals(r) for r in runs]
        last = max(ev[0])
        cols = [pm([e[s] for e in ev]) if all(s in e for e in ev) else "–" for s in (0, 10, 20, last)]
        gain = pm([e[last] - e[0] for e in ev])
        walls = [float(Path(str(r) + ".wall").read_text().split()[-1]) for r in runs]
        per_seed = " / ".join(f"{e[last]:.3f}" for e in ev)
        print(f"| {algo} | {' | '.join(cols)} | {gain} | {per_seed} | {statistics.mean(walls):.0f} s |")


if __name__ == "__main__":
    main(*sys.argv[1:])
