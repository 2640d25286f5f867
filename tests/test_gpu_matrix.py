"""scripts/gpu_matrix.py --tiny (issue 47 item 1): the validation matrix's stages — train 2 steps, resume to 3, export
and load into diffusers, evaluate 4 prompts — through the CLI on tiny random checkpoints, on a subset of the rows in
CI (an image LoRA row and a token row; the whole matrix is docs/gpu_matrix.md's CPU table), and every real recipe has
a row."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_matrix.py"


@pytest.fixture(scope="module")
def matrix():
    spec = importlib.util.spec_from_file_location("gpu_matrix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_matrix"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_real_recipe_has_a_row(matrix):
    assert matrix.real_recipes() == sorted(matrix.BY_NAME)
    assert {name for name, _ in matrix.DETERMINISTIC.values()} <= set(matrix.BY_NAME)


def test_tiny_matrix_rows_pass_every_stage(matrix, tmp_path):
    out = tmp_path / "results.json"
    code = matrix.main(["--tiny", "--in-process", "--only", "sd35_flowgrpo,causal_lm_grpo", "--out", str(tmp_path),
                        "--json", str(out)])
    report = json.loads(out.read_text())
    rows = {r["recipe"]: r for r in report["rows"]}
    assert code == 0 and set(rows) == {"sd35_flowgrpo", "causal_lm_grpo"}
    for name, row in rows.items():
        assert row["size"] == "tiny" and row["device"] == "cpu"
        assert [s for s in row["stages"]] == ["build", "train", "resume", "export", "eval"], name
        assert all(s["status"] == "pass" for k, s in row["stages"].items() if k != "export"), row["stages"]
        assert row["s_per_step_2"] > 0 and "peak_memory_gib" not in row  # no GPU here
        assert row["ratio_absdev"] < 1e-4  # rollout and training agree before any update
    assert rows["sd35_flowgrpo"]["stages"]["export"]["status"] == "pass"
    assert "with adapters" in rows["sd35_flowgrpo"]["stages"]["export"]["detail"]
    assert rows["causal_lm_grpo"]["stages"]["export"]["status"] == "n/a"
    table = (tmp_path / "gpu_matrix.md").read_text()
    assert "| `sd35_flowgrpo` | tiny | pass | pass | pass | pass |" in table


def test_deadline_and_stage_timeout(matrix, tmp_path):
    """A device call keeps its results: a stage past its limit is stopped with its process group (exit 124), and
    with no time left before --deadline no row starts, each says so, and --results holds the JSON and the table."""
    import subprocess
    import time

    child = tmp_path / "child.pid"
    t0 = time.perf_counter()
    code, text = matrix.run_subprocess([sys.executable, "-c", "import subprocess, sys, time; p = subprocess.Popen("
                                        "[sys.executable, '-c', 'import time; time.sleep(60)']); "
                                        f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(60)"], 2.0)
    assert code == matrix.TIMED_OUT and "ran past its 2 s limit" in text and time.perf_counter() - t0 < 30
    pid = int(child.read_text())
    time.sleep(0.5)
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    assert state == "" or state.startswith("Z"), state  # the grandchild was stopped with its group

    results = tmp_path / "results"
    code = matrix.main(["--tiny", "--only", "sd35_flowgrpo", "--out", str(tmp_path / "work"), "--results",
                        str(results), "--deadline", "0"])
    report = json.loads((results / "gpu_matrix.json").read_text())
    assert code == 0 and report["rows"][0]["not_run"].startswith("the call's deadline")
    assert "| `sd35_flowgrpo` | tiny | not run: the call's deadline" in (results / "gpu_matrix.md").read_text()
