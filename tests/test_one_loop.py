"""One step for every policy kind (trainer/step.py): the toy diffusion, token and offline-pairs runs give their
recorded metrics, and dynamic sampling works for a diffusion algorithm too.

The runs below (3 deterministic steps each) run their networks in float64 (`model.dtype=float64`): one CPU's float32
rounding is not a contract (oneDNN, MKL and ATen pick kernels per instruction set and batch shape; on an AVX-512
machine float32 records moved by up to 1.5e-4 relative where a loss cancels). `one_loop_golden.json` was recorded
with `python tests/test_one_loop.py --record` on 2026-12-06 (a 2-core AMD EPYC, AVX2) at the sizes in RUNS (the
2026-12-05 recording at the recipes' 64 px / 10 steps is in git history; the code of this recording passed it). What
the tolerance covers: the parts that stay float32 in a float64 run — diffusers' sinusoidal timestep embedding
(float32 exp / sin / cos, whose vectorised and scalar kernels differ by an ulp), the float32 VAE that encodes offline
pairs and decodes for the rewards, stored float32 trajectories. With `ATEN_CPU_CAPABILITY=default
ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2` (no AVX at all) against the AVX2 records the largest
difference was 3.9e-6 relative (Flow-GRPO's policy loss; ≤ 8e-7 for the other diffusion runs, ≤ 3e-15 for the token
runs), and 2.4e-11 absolute on `ratio_absdev/first_minibatch` (numerical noise around 1e-10): at most 0.08 of
rel 1e-5 / abs 1e-9, while a changed draw, order or formula moves these numbers by far more. The first recording
(float32, before the loop was unified, e688569) is in git history as one_loop_before.json."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from polyrl.cli.main import main

GOLDEN_PATH = Path(__file__).parent / "one_loop_golden.json"
COMMON = ["trainer.max_steps=3", "trainer.eval_every=0", "trainer.save_every=0", "trainer.deterministic=true",
          "trainer.progress=false", "trainer.seed=0", "model.dtype=float64"]
# the toy recipes at a test's size: 32 px (the recipes' 64 px / 48 px would only make the same code paths slower) and
# 5 denoising steps; toy_motion 5 frames. Flow-GRPO keeps the recipe's 10 steps: at 5 its step-1 policy loss (a sum
# that cancels) moved by 2.9e-5 relative without AVX, past the tolerance; at 10 steps, 1.5e-6 (what each run moves
# without AVX, as a fraction of its tolerance: ≤ 0.08)
SMALL = ["rollout.height=32", "rollout.width=32", "rollout.num_steps=5", "rollout.sde_window_range=[0,2]"]
RUNS = {
    "toy_shapes_nft": ["data.prompts_per_step=2", "rollout.n=4", *SMALL],  # the default recipe (DiffusionNFT)
    "toy_shapes_flow_grpo": ["recipe=toy_flow_grpo", "data.prompts_per_step=2", "rollout.n=4", "rollout.height=32",
                             "rollout.width=32"],
    "toy_count_grpo": ["recipe=toy_count", "data.prompts_per_step=4"],
    "toy_count_dapo": ["recipe=toy_count", "algorithm=dapo", "data.prompts_per_step=4"],
    "toy_motion": ["recipe=toy_motion", "data.prompts_per_step=2", "rollout.n=4", *SMALL, "rollout.num_frames=5"],
    "toy_shapes_offline_dpo": ["recipe=toy_diffusion_dpo", "data.prompts_per_step=2", *SMALL],  # + data.pairs_path
}
SKIP = ("time/", "perf/")  # wall-clock numbers


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _image_pairs(root: Path) -> Path:
    """Four offline pairs of flat-colour 64x64 images (the recorder's)."""
    root.mkdir()
    rows = []
    for i, (prompt, a, b) in enumerate([("a red circle", (220, 30, 30), (30, 30, 220)),
                                        ("a green triangle", (30, 200, 30), (90, 90, 90)),
                                        ("two blue squares", (30, 30, 220), (200, 200, 30)),
                                        ("a yellow circle", (230, 230, 30), (10, 10, 10))]):
        Image.fromarray(np.full((64, 64, 3), a, np.uint8)).save(root / f"{i}a.png")
        Image.fromarray(np.full((64, 64, 3), b, np.uint8)).save(root / f"{i}b.png")
        rows.append({"prompt": prompt, "chosen": f"{i}a.png", "rejected": f"{i}b.png"})
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "pairs.jsonl"


def _run(name: str, tmp_path: Path) -> list[dict]:
    args = RUNS[name] + (["data.pairs_path=" + str(_image_pairs(tmp_path / "pairs"))] if "offline" in name else [])
    run = tmp_path / "run"
    assert main(["train", *args, *COMMON, f"trainer.output_dir={run}"]) == 0
    return [{k: v for k, v in m.items() if not k.startswith(SKIP)} for m in _metrics(run)]


@pytest.mark.parametrize("name", list(RUNS))
def test_every_kind_gives_its_recorded_metrics(name, tmp_path):
    golden = json.loads(GOLDEN_PATH.read_text())[name]
    after = _run(name, tmp_path)
    assert [m["step"] for m in after] == [1, 2, 3]
    for before, now in zip(golden, after, strict=True):
        assert set(now) == set(before), (name, now["step"])
        for key, value in before.items():
            assert now[key] == pytest.approx(value, rel=1e-5, abs=1e-9), (name, now["step"], key)


class FlatForCircles:
    """A reward that is constant for prompts with "circle" (their groups are flat) and the image's mean
    brightness otherwise; it records every prompt it scored."""

    seen: list[str] = []

    def __init__(self, **unused):
        pass

    def __call__(self, images, prompts, metadata):
        import torch

        from polyrl.rewards import RewardOutput

        FlatForCircles.seen += list(prompts)
        means = images.mean(dim=(1, 2, 3))
        flat = torch.tensor(["circle" in p for p in prompts])
        return RewardOutput(torch.where(flat, torch.full_like(means, 0.5), means))


def _diffusion_args(model_dir, prompts, out, extra=()):
    """Flow-GRPO (recipe=toy_flow_grpo; the default recipe is DiffusionNFT): the `flow_grpo/*` step metrics."""
    return ["train", "recipe=toy_flow_grpo", f"model.path={model_dir}", f"data.path={prompts}", "data.heldout_path=null",
            f"trainer.output_dir={out}", "trainer.max_steps=2", "rollout.height=32", "rollout.width=32",
            "rollout.num_steps=3", "rollout.n=2", "data.prompts_per_step=2", "rollout.batch_size=4",
            "model.max_sequence_length=16", "trainer.progress=false", "trainer.tensorboard=false",
            "trainer.eval_every=0", "trainer.save_every=0", "reward.name=test_flat_for_circles",
            "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]", "trainer.deterministic=true", *extra]


def test_dynamic_sampling_refills_flat_groups_for_a_diffusion_algorithm(tiny_sd3_dir, tmp_path):
    from polyrl.rewards import REWARDS

    REWARDS.setdefault("test_flat_for_circles", FlatForCircles)
    prompts = tmp_path / "prompts.txt"  # two of four prompts give flat groups
    prompts.write_text("a blue circle\na green triangle\nthree yellow squares\ntwo red circles above a blue square\n")
    FlatForCircles.seen = []
    out = tmp_path / "dynamic"
    assert main(_diffusion_args(tiny_sd3_dir, prompts, out, ["algorithm.dynamic_sampling=true",
                                                             "algorithm.max_refills=4"])) == 0
    rows = _metrics(out)
    for row in rows:  # every step ends with its 2 groups with a signal, 4 samples, after as many refills as it took
        assert row["flow_grpo/kept_groups"] == 2 and row["train/samples"] == 4
    attempts = sum(r["flow_grpo/refills"] + 1 for r in rows)
    assert len(FlatForCircles.seen) == attempts * 2 * 2  # every rollout drew 2 fresh groups of 2 samples
    assert any("circle" in p for p in FlatForCircles.seen) and attempts > len(rows)  # flat groups were refilled

    # without dynamic sampling the same run trains on the flat groups too, and logs no refill
    plain = tmp_path / "plain"
    assert main(_diffusion_args(tiny_sd3_dir, prompts, plain)) == 0
    assert all("flow_grpo/refills" not in r and r["train/samples"] == 4 for r in _metrics(plain))


def test_a_step_that_ends_short_trains_on_what_it_has_and_says_so(tiny_sd3_dir, tmp_path):
    from polyrl.rewards import REWARDS

    REWARDS.setdefault("test_flat_for_circles", FlatForCircles)
    prompts = tmp_path / "prompts.txt"  # every group is flat: nothing to keep
    prompts.write_text("a blue circle\ntwo red circles\n")
    out = tmp_path / "run"
    assert main(_diffusion_args(tiny_sd3_dir, prompts, out, ["algorithm.dynamic_sampling=true",
                                                             "algorithm.max_refills=2", "trainer.max_steps=1"])) == 0
    (row,) = _metrics(out)
    assert row["flow_grpo/refills"] == 2 and row["flow_grpo/kept_groups"] == 0 and row["train/samples"] == 0


def test_a_step_option_with_a_bad_value_is_a_config_error(tiny_sd3_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a blue circle\n")
    assert main(_diffusion_args(tiny_sd3_dir, prompts, tmp_path / "run", ["algorithm.max_refills=-1"])) == 2
    assert "polyrl: config error: algorithm.max_refills=-1 must be an integer >= 0" in capsys.readouterr().err


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile
    import time

    golden = {}
    for name in RUNS:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            golden[name] = _run(name, Path(tmp))
            print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    GOLDEN_PATH.write_text(json.dumps(golden, indent=1) + "\n")
