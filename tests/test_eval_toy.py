"""`polyrl eval` paired against the base on the shipped toy model: a checkpoint trained two steps on the toy task,
the paired report's fields against a hand computation from its per-sample scores, and a constant scorer whose delta
is exactly 0.

Whether a few steps make the checkpoint better is not asserted: measured on this CPU, 2-4 Flow-GRPO steps moved the
paired held-out shapes delta by -0.06 to +0.05 with ci95 spanning 0 (docs/evaluation.md, "Toy numbers")."""

import json

import numpy as np
import pytest
import torch

from polyrl.cli.main import main
from polyrl.config import ASSETS
from polyrl.rewards import REWARDS, RewardOutput

TOY_PROMPTS = ASSETS / "prompts" / "shapes_heldout.jsonl"
TOY_ROWS = (0, 2, 5, 15)  # four held-out prompts the shipped base gets partly wrong


class Constant:
    """A scorer that cannot tell samples apart."""

    def __call__(self, images, prompts, metadata=None):
        return RewardOutput(torch.full((len(images),), 0.25))


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy_eval")
    lines = TOY_PROMPTS.read_text().splitlines()
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(lines[i] + "\n" for i in TOY_ROWS))
    out = root / "run"
    # 5 sampling steps instead of the recipe's 10 (training and the eval, which reads the run's config): half the time
    assert main(["train", f"data.path={prompts}", "data.heldout_path=null", "data.prompts_per_step=2", "rollout.n=4",
                 "rollout.num_steps=5", "rollout.sde_window_size=2", "rollout.sde_window_range=[0,2]",
                 "trainer.max_steps=2", "trainer.eval_every=0", "trainer.save_every=2", f"trainer.output_dir={out}",
                 "trainer.progress=false", "trainer.loggers=[]"]) == 0
    return out / "checkpoints" / "step_000002", prompts


def test_paired_report_of_a_toy_checkpoint(toy_run, monkeypatch, tmp_path):
    monkeypatch.setitem(REWARDS, "constant", Constant)
    ckpt, prompts = toy_run
    out = tmp_path / "eval"
    assert main(["eval", f"checkpoint={ckpt}", f"data.path={prompts}", "eval.scorers=[shapes,constant]",
                 "eval.compare_base=true", "eval.samples_per_prompt=2", f"eval.output_dir={out}",
                 "eval.progress=false", "eval.grid=2", "eval.chunk_prompts=2", "eval.resamples=200"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["prompts"] == 4 and report["samples"] == 8 and report["samples_per_prompt"] == 2
    assert report["checkpoint"] == str(ckpt) and report["compare_base"] is True and report["format"] == "polyrl"
    shapes, constant = report["scorers"]["shapes"], report["scorers"]["constant"]
    for key in ("mean", "ci95", "base_mean", "base_ci95", "delta", "delta_ci95", "win_rate", "prompts", "samples"):
        assert key in shapes, key
    assert constant["delta"] == 0.0 and constant["delta_ci95"] == [0.0, 0.0] and constant["win_rate"] == 0.5
    assert constant["mean"] == constant["base_mean"] == 0.25

    # the report against a hand computation from the per-sample scores (float64, prompts as units)
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    a = np.array([r["scores"]["shapes"] for r in records], dtype=np.float64)
    b = np.array([r["base"]["shapes"] for r in records], dtype=np.float64)
    assert shapes["mean"] == pytest.approx(a.mean(axis=1).mean(), abs=1e-12)
    assert shapes["base_mean"] == pytest.approx(b.mean(axis=1).mean(), abs=1e-12)
    assert shapes["delta"] == pytest.approx((a - b).mean(), abs=1e-12)
    assert shapes["win_rate"] == pytest.approx(((a > b).sum() + (a == b).sum() / 2) / 8, abs=1e-12)
    d = (a - b).mean(axis=1)
    idx = np.random.default_rng(0).integers(0, 4, size=(200, 4))
    boot = sorted(float(sum(d[i] for i in row) / 4) for row in idx.tolist())
    rank = 0.975 * 199
    hi = boot[int(rank)] + (boot[int(rank) + 1] - boot[int(rank)]) * (rank - int(rank))
    assert shapes["delta_ci95"][1] == pytest.approx(hi, abs=1e-12)
    assert (out / "report.md").read_text().count("| shapes |") == 1
    # the base was sampled from the same noise: with a checkpoint this close to it, most paired samples score alike
    assert (a == b).mean() >= 0.5
