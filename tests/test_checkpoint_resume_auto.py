"""`trainer.resume=auto` without trainer.output_dir: it says which run and step it continues, and refuses when the
newest run of the recipe has no checkpoint but an older one has (naming both)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyrl.cli.main import main


def _args(model_dir, prompts, steps, *extra):
    return ["train", "name=t", f"model.path={model_dir}", f"data.path={prompts}", f"trainer.max_steps={steps}",
            "rollout.height=32", "rollout.width=32", "rollout.num_steps=2", "rollout.n=2", "data.prompts_per_step=2",
            "rollout.batch_size=4", "model.max_sequence_length=16", "trainer.progress=false",
            "trainer.tensorboard=false", "trainer.eval_every=0", "trainer.save_every=1", "reward=jpeg_compressibility",
            "rollout.sde_window_size=1", "rollout.sde_window_range=[0,1]", *extra]


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_auto_names_the_run_and_step_and_refuses_when_ambiguous(tiny_sd3_dir, shape_prompts_file, tmp_path,
                                                                      monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    root = Path("runs") / "t"
    # nothing to resume yet: a new run, said so
    assert main(_args(tiny_sd3_dir, shape_prompts_file, 1, "trainer.resume=auto")) == 0
    err = capsys.readouterr().err
    assert f"trainer.resume=auto: no run of t under {root} has a checkpoint; starting a new run" in err
    (first,) = list(root.iterdir())
    older, newer = root / "20000101-000000", root / "20000102-000000"
    first.rename(older)  # (step 1)
    assert main(_args(tiny_sd3_dir, shape_prompts_file, 2, f"trainer.output_dir={newer}")) == 0
    capsys.readouterr()

    # the newest run with a checkpoint is the newest run: it is continued, and the message says so
    assert main(_args(tiny_sd3_dir, shape_prompts_file, 3, "trainer.resume=auto")) == 0
    assert f"polyrl: resuming run {newer} from step_000002 (step 2)" in capsys.readouterr().err
    assert _steps(newer) == [1, 2, 3] and _steps(older) == [1]

    # a newer run without a checkpoint (it stopped before its first save): which one is meant is ambiguous
    newest = root / "20000103-000000"
    newest.mkdir()
    (newest / "config.yaml").write_text("name: t\n")
    assert main(_args(tiny_sd3_dir, shape_prompts_file, 4, "trainer.resume=auto")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"polyrl: error: trainer.resume=auto is ambiguous: the newest run of t, {newest}, has "
                          "no checkpoint")
    assert f"older runs have: {newer} (step 3), {older} (step 1)" in err
    assert _steps(newer) == [1, 2, 3]  # nothing was touched


def test_the_resume_command_repeats_the_launcher():
    from polyrl.trainer.run_dir import launch_command, resume_command

    train = ["train", "--import", "x.py", "recipe=toy_shapes"]
    assert launch_command(1, ["polyrl", *train], []) == ["polyrl"]
    # torchrun's console script runs through its interpreter (the shebang line): said as typed, `torchrun ...`
    parent = ["/usr/bin/python3.12", "/usr/local/bin/torchrun", "--standalone", "--nproc-per-node=2",
              "--max-restarts=3", "-m", "polyrl", *train]
    prefix = launch_command(2, ["/src/polyrl/__main__.py", *train], parent)
    assert prefix == ["torchrun", "--standalone", "--nproc-per-node=2", "--max-restarts=3", "-m", "polyrl"]
    parent = ["python", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=8", "--rdzv-endpoint=h:29500",
              "--no-python", "polyrl", *train]
    assert launch_command(16, ["/bin/polyrl", *train], parent) == parent[:-len(train)]
    # a parent that is not the launcher (another launcher, or no /proc): a torchrun line from the environment
    assert launch_command(4, ["/bin/polyrl", *train], ["srun", "bash", "job.sh"]) == [
        "torchrun", "--nproc-per-node=4", "-m", "polyrl"]
    assert resume_command(["trainer.resume=auto", "a=b c", "trainer.output_dir=old"], "runs/x", prefix) == (
        "torchrun --standalone --nproc-per-node=2 --max-restarts=3 -m polyrl train 'a=b c' trainer.output_dir=runs/x "
        "trainer.resume=auto")


def test_a_torchrun_restart_continues_its_own_run_without_a_checkpoint_yet(tmp_path, monkeypatch):
    """`torchrun --max-restarts` without trainer.output_dir: the newest run is the one torchrun restarts, even when it
    stopped before its first checkpoint and an older run has one (which outside a restart is ambiguous)."""
    from omegaconf import OmegaConf

    from polyrl.errors import UserError
    from polyrl.trainer.run_dir import resolve_run_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "toy" / "20261201-000000" / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "runs" / "toy" / "20261201-000000" / "checkpoints" / "step_000002" / "trainer_state.pt").touch()
    (tmp_path / "runs" / "toy" / "20261205-000000").mkdir()
    cfg = OmegaConf.create({"name": "toy", "trainer": {"resume": "auto", "output_dir": None}})
    with pytest.raises(UserError, match="trainer.resume=auto is ambiguous"):
        resolve_run_dir(cfg)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resolve_run_dir(cfg)[:2] == (Path("runs/toy/20261205-000000"), [])
