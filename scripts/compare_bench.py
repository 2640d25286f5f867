"""Print the logged numbers of two `polyrl bench` runs step by step, with their differences: a run on N GPUs
against the one-GPU run of the same global batch (the numbers should agree within the network precision).

    python scripts/compare_bench.py runs/one/bench.json runs/two/bench.json
"""

from __future__ import annotations

import json
import sys


def compare(a: dict, b: dict) -> list[tuple[int, str, float, float]]:
    """(step, key, a, b) for every number both runs logged at a step (timings and FLOP rates left out)."""
    rows = []
    for ma, mb in zip(a["history"], b["history"], strict=False):
        for key, value in sorted(ma.items()):
            if key.startswith(("time/", "perf/")) or not isinstance(value, float) or key not in mb:
                continue
            rows.append((ma["step"], key, value, mb[key]))
    return rows


def main(paths: list[str]) -> int:
    a, b = (json.load(open(p)) for p in paths)
    print(f"| step | key | {a.get('world_size', 1)} GPU | {b.get('world_size', 1)} GPUs | abs diff | rel diff |")
    print("|---|---|---|---|---|---|")
    for step, key, x, y in compare(a, b):
        rel = abs(x - y) / max(abs(x), 1e-12)
        print(f"| {step} | {key} | {x:.6g} | {y:.6g} | {abs(x - y):.2e} | {rel:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
