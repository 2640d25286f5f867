"""Checkpoint files: atomic writes, stale temp directories, fallback to the previous checkpoint, nothing executed on
load, corrupted / truncated / NaN files named in one `polyrl: error:` line, a torn metrics.jsonl line dropped."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil

import pytest
import torch
from checkpoint_helpers import (
    FakeActor,
    checkpoint_names,
    metrics,
    one_prompt_sampler,
    same_weights,
    step_weights,
    train_args,
)
from safetensors.torch import load_file, save_file

from polyrl.cli.main import main
from polyrl.data.prompts import PromptSampler
from polyrl.trainer import checkpoint as ck
from polyrl.trainer import disk


@pytest.fixture(scope="module")
def reference(tiny_sd3_dir, shape_prompts_file, tmp_path_factory):
    """An uninterrupted 3-step run with a checkpoint after every step (the runs below are copies of it)."""
    run = tmp_path_factory.mktemp("ref") / "run"
    assert main(train_args(tiny_sd3_dir, shape_prompts_file, run, 3)) == 0
    return run


@pytest.fixture
def run(reference, tmp_path):
    """A copy of the reference run, its step 3 removed: stopped after step 2."""
    copy = tmp_path / "run"
    shutil.copytree(reference, copy)
    shutil.rmtree(copy / "checkpoints" / "step_000003")
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    (copy / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    return copy


def _resume(tiny_sd3_dir, shape_prompts_file, run, capsys, steps=3, *extra):
    code = main(train_args(tiny_sd3_dir, shape_prompts_file, run, steps, "trainer.resume=auto", *extra))
    return code, capsys.readouterr().err


def _same_as_reference(run, reference):
    assert metrics(run) == metrics(reference)
    assert same_weights(step_weights(run, 3), step_weights(reference, 3))


def test_a_checkpoint_lists_the_checksums_of_its_files(reference):
    ckpt = reference / "checkpoints" / "step_000002"
    listing = json.loads((ckpt / "checksums.json").read_text())["files"]
    # the default recipe's DiffusionNFT keeps an EMA old policy: its weights are a file of the checkpoint too
    assert set(listing) == {"adapter_model.safetensors", "old_weights.safetensors", "weights.json", "trainer_state.pt"}
    for name in ("trainer_state.pt", "old_weights.safetensors"):
        assert listing[name]["bytes"] == (ckpt / name).stat().st_size
    assert not list((reference / "checkpoints").glob("*.tmp")) and not list((reference / "checkpoints").glob("*.old"))


def test_kill_during_a_write_leaves_a_tmp_that_resume_removes(tiny_sd3_dir, shape_prompts_file, run, reference,
                                                              capsys):
    # what kill -9 in the middle of writing step 3 leaves: a partial copy under the temp name
    partial = run / "checkpoints" / "step_000003.tmp"
    shutil.copytree(run / "checkpoints" / "step_000002", partial)
    (partial / "trainer_state.pt").write_bytes((partial / "trainer_state.pt").read_bytes()[:100])
    code, err = _resume(tiny_sd3_dir, shape_prompts_file, run, capsys)
    assert code == 0, err
    assert f"removed the incomplete {partial}" in err
    assert "resuming run" in err and "step_000002 (step 2)" in err
    assert not partial.exists()
    _same_as_reference(run, reference)


def test_kill_between_the_renames_of_a_replacement_restores_the_old_copy(tiny_sd3_dir, shape_prompts_file, run,
                                                                         reference, capsys):
    ckpt = run / "checkpoints" / "step_000002"
    ckpt.rename(ckpt.with_name("step_000002.old"))  # step_2 was being replaced when the process died
    code, err = _resume(tiny_sd3_dir, shape_prompts_file, run, capsys)
    assert code == 0, err
    assert "restored" in err and "(step 2)" in err
    _same_as_reference(run, reference)


def test_corrupted_newest_checkpoint_falls_back_to_the_previous_one(tiny_sd3_dir, shape_prompts_file, run,
                                                                    reference, capsys):
    adapter = run / "checkpoints" / "step_000002" / "adapter_model.safetensors"
    data = bytearray(adapter.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\xff" * 64  # bytes overwritten in the middle of a tensor
    adapter.write_bytes(bytes(data))
    code, err = _resume(tiny_sd3_dir, shape_prompts_file, run, capsys)
    assert code == 0, err
    assert f"checkpoint {adapter.parent} cannot be loaded: {adapter}: contents do not match their SHA-256" in err
    assert "falling back to" in err and "from step_000001 (step 1) instead" in err
    _same_as_reference(run, reference)  # steps 2 and 3 trained again, exactly


def test_nan_weights_without_checksums_are_detected(run, tiny_sd3_dir, shape_prompts_file, capsys):
    ckpt = run / "checkpoints" / "step_000002"
    (ckpt / "checksums.json").unlink()  # as in a checkpoint written before checksums existed
    state = load_file(str(ckpt / "adapter_model.safetensors"))
    key = sorted(state)[0]
    state[key][0, 0] = float("nan")
    save_file(state, str(ckpt / "adapter_model.safetensors"))
    with pytest.raises(ck.CheckpointError, match=re.escape(f"{ckpt / 'adapter_model.safetensors'}: tensor {key} "
                                                           "holds 1 non-finite values")):
        ck.read_checkpoint(ckpt)
    # trainer.resume=DIR names one checkpoint: no fallback, one error line naming the file
    code = main(train_args(tiny_sd3_dir, shape_prompts_file, run, 3, f"trainer.resume={ckpt}"))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("polyrl:")]
    assert code == 2 and errors == [f"polyrl: error: {ckpt / 'adapter_model.safetensors'}: tensor {key} holds 1 "
                                    "non-finite values (NaN/inf)"]


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "trainer_state.pt", "weights.json"])
def test_truncated_files_are_named(run, name):
    ckpt = run / "checkpoints" / "step_000002"
    path = ckpt / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ck.CheckpointError, match=re.escape(f"{path}: ") + r"\d+ bytes, \d+ expected \(truncated"):
        ck.read_checkpoint(ckpt)
    (ckpt / "checksums.json").unlink()  # without the listing the reader itself must fail on the file, by name
    if name != "weights.json":
        with pytest.raises(ck.CheckpointError, match=re.escape(f"{path}: unreadable")):
            ck.read_checkpoint(ckpt)


def test_a_planted_pickle_is_not_executed(run, tmp_path, tiny_sd3_dir, shape_prompts_file, reference, capsys):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    ckpt = run / "checkpoints" / "step_000002"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    state["sampler"] = Payload()
    torch.save(state, ckpt / "trainer_state.pt")
    # the attacker also rewrites the listing, so that the checksums do not stop it first
    sums = json.loads((ckpt / "checksums.json").read_text())
    sums["files"]["trainer_state.pt"] = {"bytes": (ckpt / "trainer_state.pt").stat().st_size,
                                         "sha256": ck.file_digest(ckpt / "trainer_state.pt")}
    (ckpt / "checksums.json").write_text(json.dumps(sums))
    with pytest.raises(ck.CheckpointError, match=re.escape(f"{ckpt / 'trainer_state.pt'}: unreadable or unsafe")):
        ck.read_checkpoint(ckpt)
    code, err = _resume(tiny_sd3_dir, shape_prompts_file, run, capsys)
    assert code == 0, err
    assert not marker.exists()
    assert "unreadable or unsafe" in err and "falling back to" in err
    _same_as_reference(run, reference)


def test_torn_last_metrics_line_is_dropped_on_resume(tiny_sd3_dir, shape_prompts_file, run, reference, capsys):
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/mean": -1.2')  # killed in the middle of a write
    code, err = _resume(tiny_sd3_dir, shape_prompts_file, run, capsys)
    assert code == 0, err
    assert f"{run / 'metrics.jsonl'}:3: dropped a torn last line" in err
    _same_as_reference(run, reference)


def test_a_malformed_metrics_line_before_the_last_is_named(tiny_sd3_dir, shape_prompts_file, run, capsys):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(["{oops", *lines]) + "\n")
    code, err = _resume(tiny_sd3_dir, shape_prompts_file, run, capsys)
    assert code == 2 and f"polyrl: error: {run / 'metrics.jsonl'}:1: malformed metrics line" in err


# ------------------------------------------------------------------------------------------- the writer alone
def test_a_full_disk_leaves_the_previous_checkpoint_and_no_temp_directory(tmp_path):
    sampler = one_prompt_sampler()
    ckpt = ck.checkpoint_dir(tmp_path, 5)
    ck.save_checkpoint(ckpt, FakeActor(), sampler, 5)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(disk.DiskFull, match=re.escape(f"disk full: could not write the checkpoint {ckpt} (needs about ")
                       + ".*" + re.escape(f"the last complete checkpoint is {ckpt}")):
        ck.save_checkpoint(ckpt, FakeActor(fail=OSError(errno.ENOSPC, "No space left on device")), sampler, 5)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert checkpoint_names(tmp_path) == ["step_000005"]


def test_the_trainer_state_round_trips_with_weights_only(tmp_path):
    import random

    import numpy as np

    actor, sampler = FakeActor(), PromptSampler([{"prompt": "a"}, {"prompt": "b"}], 0)
    sampler.next(3)
    random.seed(7)
    np.random.seed(7)
    ckpt = ck.checkpoint_dir(tmp_path, 1)
    ck.save_checkpoint(ckpt, actor, sampler, 1, {"note": "x"})
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(0)
    np.random.seed(0)
    other, sampler2 = FakeActor(), PromptSampler([{"prompt": "a"}, {"prompt": "b"}], 0)
    other.load_weights = lambda d: None
    state = ck.load_checkpoint(ckpt, other, sampler2)
    assert state["step"] == 1 and state["note"] == "x" and sampler2.state_dict() == sampler.state_dict()
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(other.optimizer.state_dict()["state"][0][key], actor.optimizer.state_dict()["state"][0][key])
    assert ck.list_checkpoints(tmp_path) == [ckpt] and ck.checkpoint_step(ckpt) == 1
