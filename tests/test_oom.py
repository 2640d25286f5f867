"""An out-of-memory on the device is one `polyrl: error:` line naming the stage, the sizes and the keys to change, the
exit code is 2, nothing prints a traceback, and the last completed step's checkpoint loads (issue 47 item 3).

No GPU here: torch.OutOfMemoryError (what the CUDA caching allocator raises) is injected into a stage with the
allocator's own message."""

from __future__ import annotations

import re

import pytest
import torch
from checkpoint_helpers import train_args

from polyrl.cli.main import main
from polyrl.perf.memory import is_out_of_memory, oom_sizes
from polyrl.trainer.checkpoint import read_checkpoint

MESSAGE = ("CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
           "1.25 GiB is free. Including non-PyTorch memory, this process has 77.93 GiB memory in use.")


def _raise_on_call(monkeypatch, owner, name: str, call: int):
    """Make `owner.name` raise the allocator's out-of-memory at its `call`-th call (1-based)."""
    original, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise torch.OutOfMemoryError(MESSAGE)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


def test_the_allocators_message_is_read():
    assert oom_sizes(MESSAGE) == (3.0, 1.25)
    assert oom_sizes("CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 ... of which 20.00 MiB is free") == (
        0.5, 20 / 1024)
    assert oom_sizes("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)") == (None, None)
    assert is_out_of_memory(torch.OutOfMemoryError(MESSAGE))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_an_oom_in_the_update_is_one_line_after_saving_the_last_step(tiny_sd3_dir, shape_prompts_file, tmp_path,
                                                                      monkeypatch, capsys):
    from polyrl.actor.local import LocalActor

    run = tmp_path / "run"
    _raise_on_call(monkeypatch, LocalActor, "update", 2)
    code = main(train_args(tiny_sd3_dir, shape_prompts_file, run, 3, "actor.micro_batch_size=4"))
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err and "OutOfMemoryError" not in err
    lines = [line for line in err.splitlines() if line.startswith("polyrl: error:")]
    assert len(lines) == 1
    assert re.fullmatch(r"polyrl: error: out of GPU memory in train \(asked 3\.00 GiB, free 1\.25 GiB\); try "
                        r"actor\.micro_batch_size=2 or actor\.gradient_checkpointing=true or .*", lines[0]), lines[0]
    assert "saved checkpoint" in err and "(step 1)" in err and "resume with:" in err
    ckpt = run / "checkpoints" / "step_000001"
    state = read_checkpoint(ckpt)  # every file there, its checksum right, its weights finite, nothing executed
    assert state["step"] == 1 and state["optimizer"]["state"]
    assert not (run / "checkpoints" / "step_000002").exists()


def test_an_oom_in_the_rollout_names_the_rollout_and_its_batch(tiny_sd3_dir, shape_prompts_file, tmp_path,
                                                                monkeypatch, capsys):
    from polyrl.sampling import diffusion

    _raise_on_call(monkeypatch, diffusion, "sample_latents", 1)
    code = main(train_args(tiny_sd3_dir, shape_prompts_file, tmp_path / "run", 1))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    first = next(line for line in err.splitlines() if line.startswith("polyrl: error:"))
    assert first.startswith("polyrl: error: out of GPU memory in rollout (asked 3.00 GiB, free 1.25 GiB); try "
                            "rollout.batch_size=2"), first
    assert "no training step had completed" in err


def test_an_oom_while_loading_is_one_line(tiny_sd3_dir, shape_prompts_file, tmp_path, monkeypatch, capsys):
    from polyrl.trainer import build

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError(MESSAGE)

    monkeypatch.setattr(build, "build_model", no_room)
    code = main(train_args(tiny_sd3_dir, shape_prompts_file, tmp_path / "run", 1))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith("polyrl: error: out of GPU memory in polyrl train (loading the model) (asked 3.00 GiB, "
                          "free 1.25 GiB)"), err


@pytest.mark.parametrize("phase, tag, stage", [("eval", "rollout", "evaluation (rollout)"), ("save", None, "checkpoint save"),
                                                ("update", None, "train"), ("step", "decode", "decode")])
def test_the_stage_named(phase, tag, stage):
    from polyrl.trainer.oom import oom_stage

    error = torch.OutOfMemoryError(MESSAGE)
    if tag:
        error.polyrl_stage = tag
    assert oom_stage(error, phase) == stage
    assert oom_stage(ValueError("x"), phase) is None


def test_on_a_gpu_the_keys_are_the_plans_change_that_fits(tiny_sd3_dir, shape_prompts_file, monkeypatch):
    from polyrl.config import load_config
    from polyrl.trainer.memory_plan import estimate_config
    from polyrl.trainer.oom import out_of_memory

    args = [f"model.path={tiny_sd3_dir}", f"data.path={shape_prompts_file}", "rollout.height=512", "rollout.width=512",
            "actor.micro_batch_size=32", "rollout.guidance_scale=4.5"]
    cfg = load_config(args)
    card = (estimate_config(cfg).peak_gib + estimate_config(load_config([*args, "actor.micro_batch_size=16"])).peak_gib) / 2
    monkeypatch.setattr("polyrl.trainer.oom.free_memory_gib", lambda device=None: (0.25, card))
    line = str(out_of_memory(torch.OutOfMemoryError(MESSAGE), "train", cfg))
    assert line == "out of GPU memory in train (asked 3.00 GiB, free 1.25 GiB); try actor.micro_batch_size=16"
