"""Checkpoints and disk space: a full disk is DiskFull (one line: path, bytes needed, free, last checkpoint), whatever
library hit it; rotation keeps the newest N (and the best) and deletes nothing when the new write fails; the
checkpoint-size estimate and the free-space warning."""

from __future__ import annotations

import errno
import os
import re

import pytest
from checkpoint_helpers import (
    FakeActor,
    checkpoint_names,
    logged_steps,
    one_prompt_sampler,
    same_weights,
    step_weights,
    train_args,
)

from polyrl.trainer import checkpoint as ck
from polyrl.trainer import disk


# ------------------------------------------------------------------------------------------- a full disk
@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EDQUOT, "Disk quota exceeded"),
    RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors' text
])
def test_a_full_disk_is_disk_full_naming_path_size_and_last_checkpoint(tmp_path, error):
    first = ck.checkpoint_dir(tmp_path, 5)
    ck.save_checkpoint(first, FakeActor(), one_prompt_sampler(), 5)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    target = ck.checkpoint_dir(tmp_path, 6)
    with pytest.raises(disk.DiskFull) as info:
        ck.save_checkpoint(target, FakeActor(fail=error), one_prompt_sampler(), 6, keep=1)
    e = info.value
    assert e.path == target and e.last == first and e.needed == disk.checkpoint_bytes(first)
    assert str(e) == (f"disk full: could not write the checkpoint {target} (needs about "
                      f"{disk.human_bytes(disk.checkpoint_bytes(first))}, {disk.human_bytes(e.free)} free); the last "
                      f"complete checkpoint is {first}; free space and run again")
    assert "\n" not in str(e) and isinstance(e, ck.UserError) and e.__cause__ is error
    assert str(e.with_resume("polyrl train x=1")).endswith("; free space, then resume with: polyrl train x=1")
    # the previous checkpoint is untouched (not rotated away either: keep=1 applies only after a complete write)
    assert checkpoint_names(tmp_path) == ["step_000005"]
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    ck.read_checkpoint(first)


def test_torch_saves_short_write_is_a_full_disk_too(tmp_path, monkeypatch):
    def short_write(obj, path):  # what torch.save's zip writer raises when the disk fills under it
        open(path, "wb").write(b"PK")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(ck.torch, "save", short_write)
    target = ck.checkpoint_dir(tmp_path, 1)
    with pytest.raises(disk.DiskFull, match=re.escape(f"could not write the checkpoint {target} (needs about ")
                       + r".*no checkpoint has been written yet") as info:
        ck.save_checkpoint(target, FakeActor(), one_prompt_sampler(), 1)
    assert info.value.needed == disk.estimate_checkpoint_bytes(FakeActor())  # nothing on disk yet: the estimate
    assert checkpoint_names(tmp_path) == []


def test_other_failures_keep_their_type_and_leave_no_temp_directory(tmp_path):
    target = ck.checkpoint_dir(tmp_path, 1)
    with pytest.raises(ValueError, match="a bug"):
        ck.save_checkpoint(target, FakeActor(fail=ValueError("a bug")), one_prompt_sampler(), 1)
    with pytest.raises(ck.CheckpointError, match=re.escape(f"could not write checkpoint {target}: ")
                       + ".*Permission denied") as info:
        ck.save_checkpoint(target, FakeActor(fail=PermissionError(errno.EACCES, "Permission denied")), one_prompt_sampler(), 1)
    assert not isinstance(info.value, disk.DiskFull)
    assert checkpoint_names(tmp_path) == []


def test_is_disk_full_reads_causes_and_not_unrelated_errors():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise ValueError("while writing metrics") from inner
    except ValueError as e:
        assert disk.is_disk_full(e)
    assert disk.is_disk_full(RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"))
    assert not disk.is_disk_full(RuntimeError("shape mismatch: unexpected size 3"))
    assert not disk.is_disk_full(ValueError("unexpected pos"))  # torch's text counts only on a RuntimeError
    assert not disk.is_disk_full(OSError(errno.EACCES, "Permission denied"))


# ------------------------------------------------------------------------------------------- rotation
def test_checkpoints_to_delete():
    steps = [2, 4, 6, 8, 10]
    assert ck.checkpoints_to_delete(steps, 10, None) == []
    assert ck.checkpoints_to_delete(steps, 10, 2) == [2, 4, 6]
    assert ck.checkpoints_to_delete(steps, 10, 1, {2: 0.1, 4: 0.9, 6: 0.9, 8: 0.3, 10: 0.2}) == [2, 6, 8]  # ties: earliest
    assert ck.checkpoints_to_delete(steps, 10, 2, {10: 0.9, 4: float("nan")}) == [2, 4, 6]  # best is among the newest
    # resumed at step 4 after the newer ones failed to load: those are left alone, step 4 is kept
    assert ck.checkpoints_to_delete(steps, 4, 1) == [2]
    with pytest.raises(ValueError, match="keep=0 must be >= 1"):
        ck.checkpoints_to_delete(steps, 10, 0)


def test_rotation_keeps_the_newest_and_the_best_and_deletes_nothing_on_a_failed_write(tmp_path):
    scores = {1: 0.5, 2: 0.9, 3: 0.1, 4: 0.2, 5: 0.3}
    deleted = []
    for step in range(1, 6):
        deleted += ck.save_checkpoint(ck.checkpoint_dir(tmp_path, step), FakeActor(), one_prompt_sampler(), step, keep=2,
                                      scores={s: r for s, r in scores.items() if s <= step})
    assert checkpoint_names(tmp_path) == ["step_000002", "step_000004", "step_000005"]  # newest two + the best (step 2)
    assert [ck.checkpoint_step(p) for p in deleted] == [1, 3]
    # without scores (keep_best=false) only the newest two
    for step in (6, 7):
        ck.save_checkpoint(ck.checkpoint_dir(tmp_path, step), FakeActor(), one_prompt_sampler(), step, keep=2)
    assert checkpoint_names(tmp_path) == ["step_000006", "step_000007"]
    # a failing write rotates nothing away
    with pytest.raises(disk.DiskFull):
        ck.save_checkpoint(ck.checkpoint_dir(tmp_path, 8), FakeActor(fail=OSError(errno.ENOSPC, "full")), one_prompt_sampler(),
                           8, keep=1)
    assert checkpoint_names(tmp_path) == ["step_000006", "step_000007"]


def test_a_kill_in_the_middle_of_a_rotation_leaves_a_del_that_resume_removes(tmp_path):
    for step in (1, 2):
        ck.save_checkpoint(ck.checkpoint_dir(tmp_path, step), FakeActor(), one_prompt_sampler(), step)
    doomed = ck.checkpoint_dir(tmp_path, 1)
    doomed.rename(doomed.with_name("step_000001.del"))  # renamed, then killed before the removal
    (doomed.with_name("step_000001.del") / "weights.json").unlink()  # ... partly removed
    assert ck.list_checkpoints(tmp_path) == [ck.checkpoint_dir(tmp_path, 2)]
    assert ck.clean_stale(tmp_path) == [f"removed {doomed}.del (a rotated-out checkpoint whose deletion was "
                                        "interrupted)"]
    assert checkpoint_names(tmp_path) == ["step_000002"]


def test_a_failed_deletion_is_reported_and_skipped(tmp_path, monkeypatch):
    for step in (1, 2, 3):
        ck.save_checkpoint(ck.checkpoint_dir(tmp_path, step), FakeActor(), one_prompt_sampler(), step)
    real = ck.Path.rename

    def refuse(self, target):
        if self.name == "step_000001":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, target)

    monkeypatch.setattr(ck.Path, "rename", refuse)
    said = []
    deleted = ck.rotate_checkpoints(tmp_path, 3, 1, say=said.append)
    assert deleted == [ck.checkpoint_dir(tmp_path, 2)]
    assert said == [f"polyrl: warning: could not delete the old checkpoint {ck.checkpoint_dir(tmp_path, 1)} "
                    f"([Errno 13] Permission denied: '{ck.checkpoint_dir(tmp_path, 1)}')"]
    assert checkpoint_names(tmp_path) == ["step_000001", "step_000003"]


# ------------------------------------------------------------------------------------------- free space
def test_the_estimate_is_close_to_a_written_checkpoint(tmp_path):
    for old in (False, True):
        actor = FakeActor(n=50_000, old=old)
        ckpt = ck.checkpoint_dir(tmp_path / str(old), 1)
        ck.save_checkpoint(ckpt, actor, one_prompt_sampler(), 1)
        written = disk.checkpoint_bytes(ckpt)
        expected = 50_000 * 4 * (3 + old)  # fp32 weights (+ the old copy) + AdamW's exp_avg and exp_avg_sq
        assert disk.estimate_checkpoint_bytes(actor) == expected + 32 * 1024
        assert expected < written <= disk.estimate_checkpoint_bytes(actor)  # + headers, RNG states, checksums.json


def test_checkpoints_the_run_writes_and_holds():
    assert disk.checkpoints_to_write(0, 100, 10) == 10
    assert disk.checkpoints_to_write(0, 25, 10) == 3  # 10, 20 and the last, 25
    assert disk.checkpoints_to_write(20, 25, 10) == 1
    assert disk.checkpoints_to_write(25, 25, 10) == 0
    assert disk.checkpoints_to_write(0, 100, 0) == 0
    assert disk.checkpoints_held(10, None) == 10
    assert disk.checkpoints_held(10, 2) == 3  # the newest two and the one being written
    assert disk.checkpoints_held(10, 2, keep_best=True) == 4
    assert disk.checkpoints_held(2, 5) == 2


def test_the_free_space_warning_from_a_patched_probe(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "x"  # not created yet: the probe asks the nearest existing folder
    asked = []

    def probe(path):
        asked.append(path)
        return type("Usage", (), {"free": 3 * 2**20})()

    monkeypatch.setattr(ck.shutil, "disk_usage", probe)
    assert disk.free_bytes(run) == 3 * 2**20 and asked == [tmp_path]
    warning = disk.space_warning(run, 2**20, 4)
    assert warning == (f"polyrl: warning: {run} has 3.0 MiB free, but the run will hold 4 checkpoint(s) of about "
                       "1.0 MiB each (4.0 MiB): free space, lower trainer.keep_checkpoints, or point "
                       "trainer.output_dir at a larger disk")
    assert disk.space_warning(run, 2**20, 3) is None
    assert disk.space_warning(run, 2**20, 0) is None


def test_human_bytes():
    assert [disk.human_bytes(n) for n in (0, 1023, 1536, 5 * 2**30, 3 * 2**40)] == \
        ["0 B", "1023 B", "1.5 KiB", "5.0 GiB", "3.0 TiB"]


# ------------------------------------------------------------------------------------------- the CLI, end to end
def _train(tiny_sd3_dir, shape_prompts_file, out, steps, *extra):
    return train_args(tiny_sd3_dir, shape_prompts_file, out, steps, "trainer.resume=auto", *extra)


def test_disk_full_during_a_checkpoint_is_one_line_and_resume_continues(tiny_sd3_dir, shape_prompts_file, tmp_path,
                                                                        monkeypatch, capsys):
    from polyrl.cli.main import main

    reference, run = tmp_path / "reference", tmp_path / "run"
    assert main(_train(tiny_sd3_dir, shape_prompts_file, reference, 4)) == 0
    real_save, writes = ck.torch.save, []

    def full_at_step_3(obj, f, *args, **kwargs):  # the disk fills while step 3's trainer state is written
        if isinstance(obj, dict) and obj.get("step") == 3:
            writes.append(f)
            open(f, "wb").write(b"PK\x03\x04")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ck.torch, "save", full_at_step_3)
    capsys.readouterr()
    code = main(_train(tiny_sd3_dir, shape_prompts_file, run, 4))
    err = capsys.readouterr().err
    last = ck.checkpoint_dir(run, 2)
    lines = [line for line in err.splitlines()
             if line.startswith(("polyrl: error", "polyrl: warning", "polyrl: the run failed", "polyrl: stopped"))]
    assert code == 2 and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith(
        f"polyrl: error: disk full: could not write the checkpoint {ck.checkpoint_dir(run, 3)} (needs about "), err
    assert f"the last complete checkpoint is {last}; free space, then resume with: polyrl train " in lines[0]
    assert f"trainer.output_dir={run} trainer.resume=auto" in lines[0]
    assert len(writes) == 1  # no second checkpoint attempted on the full disk
    assert ck.list_checkpoints(run) == [last, ck.checkpoint_dir(run, 1)] and not list((run / "checkpoints").glob("*.*"))
    ck.read_checkpoint(last)
    monkeypatch.setattr(ck.torch, "save", real_save)  # space freed
    assert main(_train(tiny_sd3_dir, shape_prompts_file, run, 4)) == 0
    assert logged_steps(run) == [1, 2, 3, 4] == logged_steps(reference)
    assert same_weights(step_weights(run, 4), step_weights(reference, 4))


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (root only; skipped where it cannot be mounted)."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_disk_that_fills_around_an_evaluations_samples_is_one_line(tiny_sd3_dir, shape_prompts_file, small_disk,
                                                                     monkeypatch, capsys, when):
    """On a real full disk (tmpfs), filled before or after step 3's evaluation writes its samples: the samples are
    part of the step (issue 52), and so are metrics.jsonl and TensorBoard's events: one error line naming what could
    not be written, no traceback (not even of TensorBoard's writer thread), no torn sample file; freed, the run
    resumes from step 2 and writes what was lost, every step once. (Filled after the samples, the next write that
    needs a new page fails: step 3's log line and TensorBoard events may still fit in their files' last pages, and
    step 4's samples then fail.)"""
    from polyrl.cli.main import main
    from polyrl.trainer.evaluation import SampleFiles

    run, filler = small_disk / "run", small_disk / "filler"
    real_write = SampleFiles.write

    def fill():
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass

    def fill_around_step_3(self, batch, step):
        if step == 3 and when == "before" and not filler.exists():
            fill()
        real_write(self, batch, step)
        if step == 3 and when == "after" and not filler.exists():
            fill()

    monkeypatch.setattr(SampleFiles, "write", fill_around_step_3)
    extra = ("trainer.tensorboard=true", "trainer.eval_every=1", "trainer.eval_samples=2", "trainer.save_every=2",
             "trainer.keep_checkpoints=1")
    code = main(_train(tiny_sd3_dir, shape_prompts_file, run, 4, *extra))
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("polyrl:") and ("warning" in line or "error" in line)]
    assert code == 2 and "Traceback" not in err, err
    assert len(said) == 1, said
    if when == "before":
        assert said[0].startswith(f"polyrl: error: disk full: could not write the samples of step 3 under "
                                  f"{run / 'samples'} (0 B free); "), said
        assert logged_steps(run) == [0, 1, 2]
    else:  # metrics.jsonl, TensorBoard's events, or step 4's samples: the first write that needs a new page
        assert re.match(re.escape("polyrl: error: disk full: could not write the ")
                        + f"(metrics log {re.escape(str(run / 'metrics.jsonl'))} \\(needs about .*, |tensorboard logs "
                        + f"{re.escape(str(run / 'tensorboard'))} \\(|samples of step 4 under "
                        + f"{re.escape(str(run / 'samples'))} \\()0 B free\\);", said[0]), said[0]
    assert f"the last complete checkpoint is {ck.checkpoint_dir(run, 2)}; free space, then resume with: " in said[0]
    assert not [p.name for p in (run / "samples").iterdir() if p.name.startswith(".")]  # no torn temporary file
    filler.unlink()
    monkeypatch.setattr(SampleFiles, "write", real_write)
    assert main(_train(tiny_sd3_dir, shape_prompts_file, run, 4, *extra)) == 0
    assert logged_steps(run) == [0, 1, 2, 3, 4]
    assert (run / "samples" / "step_000003.png").is_file()
    assert ck.list_checkpoints(run) == [ck.checkpoint_dir(run, 4)]  # keep_checkpoints=1 rotated step 2 away


def test_the_run_warns_before_its_first_checkpoint_when_the_disk_is_small(tiny_sd3_dir, shape_prompts_file, tmp_path,
                                                                         monkeypatch, capsys):
    from polyrl.cli.main import main

    monkeypatch.setattr(disk, "free_bytes", lambda path: 1024)  # 1 KiB free: the tiny LoRA's checkpoints need more
    assert main(_train(tiny_sd3_dir, shape_prompts_file, tmp_path / "run", 2, "trainer.keep_checkpoints=1")) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("polyrl: warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(f"polyrl: warning: {tmp_path / 'run'} has 1.0 KiB free, but "
                                                         "the run will hold 2 checkpoint(s) of about ")


def test_a_run_that_fails_before_its_first_checkpoint_logs_step_0_once_after_resuming(
        tiny_sd3_dir, shape_prompts_file, tmp_path, monkeypatch, capsys):
    """Found by scripts/soak.py: a disk full at the first checkpoint, then trainer.resume=auto from no checkpoint,
    logged the step-0 evaluation twice."""
    from polyrl.cli.main import main

    run, real_save = tmp_path / "run", ck.torch.save

    def full(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(f))

    extra = ("trainer.eval_every=1", "trainer.eval_samples=2", "trainer.num_validation=0")
    monkeypatch.setattr(ck.torch, "save", full)
    assert main(_train(tiny_sd3_dir, shape_prompts_file, run, 2, *extra)) == 2
    assert logged_steps(run) == [0, 1] and ck.list_checkpoints(run) == []
    assert "no checkpoint has been written yet; free space, then resume with: " in capsys.readouterr().err
    monkeypatch.setattr(ck.torch, "save", real_save)
    assert main(_train(tiny_sd3_dir, shape_prompts_file, run, 2, *extra)) == 0
    assert logged_steps(run) == [0, 1, 2]
