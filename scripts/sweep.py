"""Run several `polyrl train` variants at once and print their held-out reward per evaluated step.

    python scripts/sweep.py --out /tmp/sweep --deadline 480 --base "recipe=toy_motion trainer.device=cuda" \
        base: \
        lr1e-3:actor.lr=1e-3 \
        noise1:rollout.noise_level=1.0

Each variant is NAME:OVERRIDES (space-separated Hydra overrides added to --base) and runs as its own process with
OMP_NUM_THREADS=1, its output in OUT/NAME. Variants still running at the deadline are stopped; the table shows
what they evaluated by then (a hyperparameter search: the learning table itself comes from scripts/learning_table.py
on full runs).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from learning_table import evals  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+", help="NAME:OVERRIDES")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--base", default="", help="overrides every variant gets")
    p.add_argument("--deadline", type=float, default=480.0, help="seconds before unfinished variants are stopped")
    a = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = {}
    for variant in a.variants:
        name, _, overrides = variant.partition(":")
        run = a.out / name
        run.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "polyrl", "train", *a.base.split(), *overrides.split(), f"trainer.output_dir={run}"]
        procs[name] = (subprocess.Popen(cmd, env=env, stdout=open(run / "log.txt", "w"), stderr=subprocess.STDOUT),
                       overrides)
    start = time.time()
    while time.time() - start < a.deadline and any(proc.poll() is None for proc, _ in procs.values()):
        time.sleep(5)
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
    print(f"sweep: {time.time() - start:.0f} s, base: {a.base}")
    for name, (proc, overrides) in procs.items():
        metrics = a.out / name / "metrics.jsonl"
        curve = evals(a.out / name) if metrics.is_file() else {}
        status = "done" if proc.returncode == 0 else f"rc={proc.returncode}"
        print(f"{name:14s} {status:7s} " + " ".join(f"{s}:{r:.3f}" for s, r in sorted(curve.items()))
              + f"   [{overrides}]")


if __name__ == "__main__":
    main()
