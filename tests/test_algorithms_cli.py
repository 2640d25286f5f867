"""Every algorithm, window strategy and rollout-correction mode through `polyrl train` on the tiny SD3 pipeline,
plus determinism: identical metrics for identical runs, and resume == uninterrupted (with the EMA copy)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from polyrl.cli.main import main


def _args(model_dir, prompts, out, steps, extra=()):
    return [
        "train", "recipe=toy_common", f"model.path={model_dir}", f"data.path={prompts}", f"data.heldout_path={prompts}",
        f"trainer.output_dir={out}", f"trainer.max_steps={steps}", "rollout.height=32", "rollout.width=32",
        "rollout.num_steps=3", "rollout.n=2", "data.prompts_per_step=2", "rollout.batch_size=4",
        "rollout.guidance_scale=2.0", "model.max_sequence_length=16", "trainer.eval_samples=2",
        "trainer.num_validation=2", "trainer.progress=false", "trainer.tensorboard=false", "trainer.eval_every=0",
        "trainer.save_every=0", "reward=jpeg_compressibility", "rollout.sde_window_size=2",
        "rollout.sde_window_range=[0,1]", *extra,
    ]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _strip_times(rows):
    """Drop wall-clock metrics (time/*, and throughput perf/achieved_*, perf/mfu derived from it)."""
    timed = ("time/", "perf/achieved", "perf/mfu")
    return [{k: v for k, v in r.items() if not k.startswith(timed)} for r in rows]


# the rollout step kinds through the CLI; every registered algorithm trains 2 steps (with its metrics checked) in
# tests/test_layouts.py
CASES = {
    "flow_grpo_cps": ["algorithm=flow_grpo", "rollout.step=cps", "algorithm.kl_beta=0.1"],
    "flow_grpo_dance": ["algorithm=flow_grpo", "rollout.step=dance", "rollout.sde_window_strategy=random"],
}
KEYS = {"flow_grpo_cps": ("clip_frac", "kl"), "flow_grpo_dance": ("clip_frac",)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_algorithm_trains_two_steps(tiny_sd3_dir, shape_prompts_file, tmp_path, case):
    out = tmp_path / "run"
    assert main(_args(tiny_sd3_dir, shape_prompts_file, out, 2, CASES[case])) == 0
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("loss", "grad_norm", *KEYS[case]):
        assert key in rows[0], (case, key)
    assert all(r["loss"] == r["loss"] for r in rows)  # finite, not NaN
    assert rows[0]["grad_norm"] > 0


def test_opd_distils_from_a_diffusers_teacher(tiny_sd3_dir, shape_prompts_file, tmp_path):
    out = tmp_path / "run"
    args = _args(tiny_sd3_dir, shape_prompts_file, out, 1,
                 ["algorithm=diffusion_opd", f"algorithm.teacher_path={tiny_sd3_dir}", "algorithm.policy_gradient=true",
                  "actor.num_minibatches=1"])
    assert main(args) == 0
    row = _metrics(out)[0]
    # The teacher is the base network and the LoRA starts as a no-op (one optimizer step, after the loss), so the
    # student's means equal the teacher's.
    assert row["distill_kl"] == pytest.approx(0.0, abs=1e-10)
    assert "clip_frac" in row


def test_opd_teacher_from_polyrl_checkpoint(tiny_sd3_dir, shape_prompts_file, tmp_path):
    teacher_run = tmp_path / "teacher"
    assert main(_args(tiny_sd3_dir, shape_prompts_file, teacher_run, 1,
                      ["trainer.save_every=1", "actor.lr=1e-2"])) == 0
    ckpt = teacher_run / "checkpoints" / "step_000001"
    out = tmp_path / "student"
    assert main(_args(tiny_sd3_dir, shape_prompts_file, out, 1,
                      ["algorithm=diffusion_opd", f"algorithm.teacher_path={ckpt}"])) == 0
    assert _metrics(out)[0]["distill_kl"] > 0  # a trained teacher differs from the untrained student
    # two teachers routed by the prompts' `teacher` column: the base (a diffusers directory) and the trained one
    prompts = tmp_path / "routed.jsonl"
    lines = shape_prompts_file.read_text().splitlines()[:2]
    prompts.write_text(f'{{"prompt": "{lines[0]}", "teacher": "base"}}\n{{"prompt": "{lines[1]}", "teacher": "trained"}}\n')
    out = tmp_path / "student2"
    teachers = f"algorithm.teachers=[{{path:{tiny_sd3_dir},key:base}},{{path:{ckpt},key:trained,weight:2.0}}]"
    assert main(_args(tiny_sd3_dir, prompts, out, 1, ["algorithm=diffusion_opd", teachers,
                                                      "actor.num_minibatches=1"])) == 0
    row = _metrics(out)[0]
    assert row["distill_kl/teacher0"] == pytest.approx(0.0, abs=1e-10)  # the base = the untrained student
    assert row["distill_kl/teacher1"] > 0
    # 2 samples per teacher of 4: mean_i Σ_j w_j·m_ji·KL_ji = (0 + 2·2·KL_1)/4 = the trained teacher's mean KL
    assert row["distill_kl"] == pytest.approx(row["distill_kl/teacher1"], rel=1e-5)


def test_bad_teacher_path_is_a_clear_error(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys):
    args = _args(tiny_sd3_dir, shape_prompts_file, tmp_path / "run", 1,
                 ["algorithm=diffusion_opd", f"algorithm.teacher_path={tmp_path}"])
    assert main(args) == 2
    assert "neither a polyrl checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["bypass", "recompute", "decoupled"])
def test_rollout_correction_modes(tiny_sd3_dir, shape_prompts_file, tmp_path, mode):
    out = tmp_path / "run"
    extra = ["algorithm=flow_dppo", f"rollout_correction.mode={mode}", "rollout_correction.log_ratio_bounds=[-1,1]"]
    assert main(_args(tiny_sd3_dir, shape_prompts_file, out, 1, extra)) == 0
    row = _metrics(out)[0]
    if mode == "bypass":
        assert row["time/old_logprob"] == 0.0 and "correction/abs_dlogp" not in row
        assert row["correction/masked_frac"] == 0.0  # current vs rollout log-ratio is tiny, inside [-1, 1]
    else:
        assert row["time/old_logprob"] > 0
        # same weights, same kernels on the CPU: the recompute reproduces the rollout's log-probs closely
        assert row["correction/abs_dlogp"] < 1e-4
    if mode == "decoupled":
        assert row["correction/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert row["correction/is_weight_max"] <= 2.0 and row["correction/masked_frac"] == 0.0


def test_correction_needs_log_probs(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys):
    args = _args(tiny_sd3_dir, shape_prompts_file, tmp_path / "run", 1,
                 ["algorithm=diffusion_nft", "rollout_correction.mode=decoupled"])
    assert main(args) == 2
    assert "rollout_correction.mode=decoupled needs log-probabilities" in capsys.readouterr().err


def test_ode_rollout_only_for_likelihood_free(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys):
    args = _args(tiny_sd3_dir, shape_prompts_file, tmp_path / "run", 1, ["rollout.noise_level=0.0"])
    assert main(args) == 2
    assert "only likelihood-free algorithms" in capsys.readouterr().err


def test_deterministic_runs_are_identical(tiny_sd3_dir, shape_prompts_file, tmp_path):
    extra = ["trainer.deterministic=true", "algorithm=flow_dppo", "rollout_correction.mode=decoupled",
             "rollout.sde_window_strategy=random", "actor.ema_decay=0.9"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(_args(tiny_sd3_dir, shape_prompts_file, a, 3, extra)) == 0
    assert main(_args(tiny_sd3_dir, shape_prompts_file, b, 3, extra)) == 0
    ra, rb = _strip_times(_metrics(a)), _strip_times(_metrics(b))
    assert len(ra) == 3 and ra == rb  # bitwise: JSON floats round-trip exactly


RESUMED = {  # the old copy moves after every update (NFT) or after every optimizer step (DGPO)
    "diffusion_nft": ["algorithm=diffusion_nft", "rollout.guidance_scale=1.0", "algorithm.ref_coef=0.1",
                      "algorithm.decay=0.5", "algorithm.decay_slope=0.1"],
    "dgpo": ["algorithm=dgpo", "algorithm.kl_beta=0.1", "algorithm.num_timesteps=2", "algorithm.ema_ramp_rate=0.2"],
}
KEYS |= {"diffusion_nft": ("nft/err_pos", "ref_mse"), "dgpo": ("clip_frac", "dgpo/group_weight", "kl")}


@pytest.mark.parametrize("algo", sorted(RESUMED))
def test_resume_with_old_copy_matches_uninterrupted_run(tiny_sd3_dir, shape_prompts_file, tmp_path, algo):
    """The EMA (old) copy and its update count are checkpointed: 2 + 1 steps == 3 steps, weights bitwise. The
    uninterrupted run is also these algorithms' training check (test_algorithm_trains_two_steps's asserts)."""
    extra = ["trainer.deterministic=true", "trainer.save_every=1", "rollout.noise_level=0.0", *RESUMED[algo]]
    full, split = tmp_path / "full", tmp_path / "split"
    assert main(_args(tiny_sd3_dir, shape_prompts_file, full, 3, extra)) == 0
    rows = _metrics(full)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("loss", "grad_norm", *KEYS[algo]):
        assert key in rows[0], (algo, key)
    assert all(r["loss"] == r["loss"] for r in rows) and rows[0]["grad_norm"] > 0
    assert main(_args(tiny_sd3_dir, shape_prompts_file, split, 2, extra)) == 0
    assert main(_args(tiny_sd3_dir, shape_prompts_file, split, 3, extra + ["trainer.resume=auto"])) == 0
    assert _strip_times(_metrics(full)) == _strip_times(_metrics(split))
    for name in ("adapter_model.safetensors", "old_weights.safetensors"):
        wa = load_file(str(full / "checkpoints" / "step_000003" / name))
        wb = load_file(str(split / "checkpoints" / "step_000003" / name))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_bypass_rejection_masks_steps_outside_tight_bounds(tiny_sd3_dir, shape_prompts_file, tmp_path):
    """After the first optimizer step the current policy differs from the rollout's: with bounds of ±1e-9 on the
    log-ratio the second mini-batch's sample-steps are all rejected (weight 0); the first mini-batch runs the
    rollout's weights (log-ratio 0 on the CPU) and keeps all of its steps: masked fraction exactly 1/2."""
    out = tmp_path / "run"
    extra = ["rollout_correction.log_ratio_bounds=[-1e-9,1e-9]", "actor.num_minibatches=2", "actor.lr=1e-2"]
    assert main(_args(tiny_sd3_dir, shape_prompts_file, out, 1, extra)) == 0
    row = _metrics(out)[0]
    assert row["correction/masked_frac"] == 0.5
