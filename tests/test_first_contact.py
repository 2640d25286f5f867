"""What a user sees (issue 34): every step logged once after any resume, one line per evaluation, a console without
library noise, and `polyrl sample` writing beside the run rather than inside a checkpoint."""

import json

from polyrl.cli.main import main


def _args(model_dir, prompts, out, steps, *extra):
    return ["train", f"model.path={model_dir}", f"data.path={prompts}", f"data.heldout_path={prompts}",
            f"trainer.output_dir={out}", f"trainer.max_steps={steps}", "rollout.height=32", "rollout.width=32",
            "rollout.num_steps=3", "rollout.n=2", "data.prompts_per_step=2", "rollout.batch_size=4",
            "model.max_sequence_length=16", "trainer.progress=false", "trainer.eval_samples=2",
            "trainer.num_validation=2", "reward=jpeg_compressibility", "rollout.sde_window_size=2",
            "rollout.sde_window_range=[0,1]", "trainer.deterministic=true", *extra]


def _steps(run):
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _tensorboard_steps(run, tag="reward/mean"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_a_resume_without_any_checkpoint_logs_every_step_once(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys):
    """A run stopped before its first checkpoint (here: one that saves none) leaves rows for steps it cannot resume
    from; `trainer.resume=auto` starts at step 0 and drops them, in metrics.jsonl and in TensorBoard."""
    run = tmp_path / "run"
    args = _args(tiny_sd3_dir, shape_prompts_file, run, 2, "trainer.save_every=0", "trainer.eval_every=0",
                 "trainer.tensorboard=true")
    assert main(args) == 0
    assert _steps(run) == [1, 2] and _tensorboard_steps(run) == [1, 2]
    assert main(args + ["trainer.resume=auto"]) == 0
    assert "has no checkpoint yet; starting at step 0" in capsys.readouterr().err
    assert _steps(run) == [1, 2]
    assert _tensorboard_steps(run) == [1, 2]  # the stopped run's events are purged, not shown twice


def test_a_resume_from_a_checkpoint_drops_the_later_rows(tiny_sd3_dir, shape_prompts_file, tmp_path):
    run = tmp_path / "run"
    args = _args(tiny_sd3_dir, shape_prompts_file, run, 3, "trainer.save_every=2", "trainer.eval_every=0")
    assert main(args) == 0
    (run / "checkpoints" / "step_000003").rename(run / "step_3_moved")  # as if the run died before saving step 3
    assert main(args + ["trainer.resume=auto"]) == 0
    assert _steps(run) == [1, 2, 3]


def test_each_evaluation_prints_one_line_and_the_console_has_no_library_noise(tiny_sd3_dir, shape_prompts_file,
                                                                                tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_args(tiny_sd3_dir, shape_prompts_file, run, 2, "trainer.save_every=2", "trainer.eval_every=1")) == 0
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if ": held-out reward " in x and x.startswith("polyrl: step ")]
    assert [x.split(":")[1].strip() for x in lines] == ["step 0/2", "step 1/2", "step 2/2"]
    assert "(step 0: " in lines[1] and "(step 0: " not in lines[0]
    assert "Loading weights" not in err and "zero-element" not in err and "Traceback" not in err

    # polyrl sample writes under the run, never inside the checkpoint
    ckpt = run / "checkpoints" / "step_000002"
    before = sorted(p.name for p in ckpt.iterdir())
    assert main(["sample", f"checkpoint={ckpt}", "n=2"]) == 0
    assert sorted(p.name for p in ckpt.iterdir()) == before
    assert (run / "samples" / "sample_step_000002.png").is_file()


def test_models_loaded_by_polyrl_never_fetch_hub_kernels(tmp_path, monkeypatch, capsys):
    """transformers 5 turns Hub kernels on for every from_pretrained model when the `kernels` package is installed
    (it is a transformers dependency); its .train() / .eval() on a GPU then downloads them and fails offline. The
    CLI turns them off before any model loads."""
    from transformers import CLIPTextConfig, CLIPTextModel

    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    assert main(["--help"]) == 0
    CLIPTextModel(CLIPTextConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 vocab_size=32, max_position_embeddings=8)).save_pretrained(tmp_path)
    assert CLIPTextModel.from_pretrained(tmp_path).use_kernels is False
