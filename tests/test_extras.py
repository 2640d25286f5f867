"""The core install leaves out what only some commands need (pyproject.toml extras: `ocr`, `serve`); without them
the default run still trains, and a command that needs one says which, in one `polyrl: error:` line. The absence is
simulated: a module set to None in sys.modules cannot be imported."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from polyrl.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
OCR_MODULES = ("rapidocr_onnxruntime", "onnxruntime", "cv2")
SERVE_MODULES = ("fastapi", "starlette", "uvicorn")


def _without(monkeypatch, modules):
    """Make `modules` unimportable, and forget polyrl's serving modules so that they import them again."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [m for m in sys.modules if m.startswith("polyrl.serving.")]:
        monkeypatch.delitem(sys.modules, name)


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("polyrl:")]


def test_extras_are_declared_and_the_test_extra_installs_them():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for package in ("rapidocr", "opencv", "onnxruntime", "fastapi", "uvicorn"):
        assert package not in core, package
    extras = project["optional-dependencies"]
    assert any(r.startswith("rapidocr-onnxruntime") for r in extras["ocr"])
    assert {r.split(">")[0] for r in extras["serve"]} == {"fastapi", "uvicorn"}
    assert "polyrl[ocr,serve]" in extras["test"]  # CI: pip install torch==2.13.0 -e ".[test]" && python -m pytest


def test_reward_ocr_without_its_extra_names_it(monkeypatch, capsys, tmp_path):
    _without(monkeypatch, OCR_MODULES)
    # an engine setting no other test loads: the lru-cached engine of another test would skip the import
    args = ["train", "reward=ocr", "reward.det_limit_side_len=961", f"trainer.output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    assert _errors(capsys) == [
        "polyrl: error: reward=ocr needs polyrl's `ocr` extra (rapidocr-onnxruntime, which pulls onnxruntime and "
        "opencv-python), which is not installed: pip install 'polyrl[ocr]' (from a clone: pip install -e '.[ocr]')"]


def test_serve_reward_without_its_extra_names_it(monkeypatch, capsys):
    _without(monkeypatch, SERVE_MODULES)
    assert main(["serve-reward", "reward=jpeg_compressibility", "--port", "0"]) == 2
    assert _errors(capsys) == [
        "polyrl: error: polyrl serve-reward needs polyrl's `serve` extra (fastapi, uvicorn), which is not installed: "
        "pip install 'polyrl[serve]' (from a clone: pip install -e '.[serve]')"]


@pytest.mark.slow
def test_the_default_run_needs_no_extra(monkeypatch, tmp_path):
    """`pip install torch==2.13.0 -e . && polyrl train`: the default recipe (toy model, shapes reward, TensorBoard)
    trains, evaluates and checkpoints with neither extra importable (one short step of it here)."""
    import json

    _without(monkeypatch, OCR_MODULES + SERVE_MODULES)
    out = tmp_path / "run"
    assert main(["train", f"trainer.output_dir={out}", "trainer.max_steps=1", "rollout.num_steps=2", "rollout.n=2",
                 "data.prompts_per_step=2", "rollout.batch_size=4", "trainer.eval_every=1", "trainer.eval_samples=2",
                 "trainer.num_validation=2", "trainer.save_every=1", "trainer.progress=false",
                 "rollout.sde_window_size=1", "rollout.sde_window_range=[0,1]"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "eval/reward_mean" in rows[-1] and (out / "checkpoints" / "step_000001").is_dir()
    assert any((out / "tensorboard").iterdir())
