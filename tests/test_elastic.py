"""A rank killed with kill -9 under `torchrun --max-restarts=1 ... trainer.resume=auto` (issue 52): the surviving
rank prints one line naming the dead rank, its pid and signal, and what it saved; torchrun restarts the group, which
resumes from a checkpoint complete on every rank and ends as an uninterrupted run: every step logged once, the same
final weights. gloo on CPU, two ranks.

Killed: rank 1 in the middle of step 3's rollout (its reward call), with the local backend (rank 0 holds every
weight and saves step 2 alone); and rank 1 right after writing its shards of step 2's sharded checkpoint
(`actor.backend=fsdp2`: rank 0 cannot finish that checkpoint, which stays a `.tmp`, and the restart resumes from
step 1's, complete on every rank).
"""

from __future__ import annotations

import glob
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import logged_steps, metrics, step_weights, train_args
from conftest import Background, train_in_process

from polyrl.rewards import RewardOutput, register_reward
from polyrl.rewards.jpeg import jpeg_kilobytes


def _first_attempt_of_rank(rank: int) -> bool:
    return os.environ.get("RANK") == str(rank) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


@register_reward("test_rank_kill")
class RankKill:
    """−JPEG kB (jpeg_compressibility); rank `rank` kills itself (SIGKILL) at its call number `at` (0: never), in
    torchrun's first attempt only."""

    def __init__(self, at: int = 0, rank: int = 1):
        self.at, self.rank, self.calls = at, rank, 0

    def __call__(self, images, prompts, metadata) -> RewardOutput:
        self.calls += 1
        if self.calls == self.at and _first_attempt_of_rank(self.rank):
            os.kill(os.getpid(), signal.SIGKILL)
        return RewardOutput(-jpeg_kilobytes(images, 95))


if os.environ.get("POLYRL_TEST_KILL_SHARDS"):  # rank 1 dies once its shards of this checkpoint are written
    from polyrl.actor.fsdp2 import FSDP2Actor

    _save_weights = FSDP2Actor.save_weights

    def _save_then_die(self, directory):
        _save_weights(self, directory)
        if Path(directory).name == os.environ["POLYRL_TEST_KILL_SHARDS"] and _first_attempt_of_rank(1):
            os.kill(os.getpid(), signal.SIGKILL)

    FSDP2Actor.save_weights = _save_then_die


STEPS = 3
# Flow-GRPO: its update draws nothing, so 2 ranks train as 1 process does (DiffusionNFT's update noise is drawn per
# rank, which a 1-process run does not repeat)
COMMON = ["recipe=toy_flow_grpo", "actor.num_minibatches=2", "trainer.device=cpu"]


@pytest.fixture(scope="module")
def reference(tiny_sd3_dir, shape_prompts_file, tmp_path_factory):
    """The uninterrupted run both cases end as: one process, the local backend."""
    run = tmp_path_factory.mktemp("elastic_reference") / "reference"
    train_in_process(train_args(tiny_sd3_dir, shape_prompts_file, run, STEPS, *COMMON, reward="test_rank_kill")[1:])
    return run


@pytest.mark.parametrize("backend", ["local", "fsdp2"])
def test_a_killed_rank_is_one_line_and_torchrun_restarts_the_run_exactly(tiny_sd3_dir, shape_prompts_file, tmp_path,
                                                                           request, backend):
    steps, common = STEPS, COMMON
    layout = ["trainer.save_every=10"] if backend == "local" else [
        "trainer.save_every=1", "actor.backend=fsdp2", "parallel.dp_shard=2"]
    run = tmp_path / "run"
    kill = ["reward.at=3"] if backend == "local" else []  # calls 1, 2: steps 1, 2 (one per rank and step)
    args = train_args(tiny_sd3_dir, shape_prompts_file, run, steps, *common, *layout, "trainer.resume=auto", *kill,
                      reward="test_rank_kill")
    logs = tmp_path / "logs"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
                "--monitor-interval=0.1", f"--log-dir={logs}", "--redirects=3", "-m", "polyrl"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",  # tests/ on the path: checkpoint_helpers
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    if backend == "fsdp2":
        env["POLYRL_TEST_KILL_SHARDS"] = "step_000002.tmp"
    # the first case's launch runs while this process trains the reference (one thread each)
    with Background(launcher + [args[0], "--import", __file__, *args[1:]], cwd=tmp_path, env=env) as launch:
        reference = request.getfixturevalue("reference")
        out = launch.wait(timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]

    def rank_err(attempt: int, rank: int) -> str:
        (path,) = glob.glob(str(logs / "*" / f"attempt_{attempt}" / str(rank) / "stderr.log"))
        return Path(path).read_text()

    first, second = rank_err(0, 0), rank_err(1, 0)
    assert "Traceback" not in first + rank_err(0, 1) + second + rank_err(1, 1), first
    stops = [line for line in first.splitlines() if line.startswith("polyrl: stopped")]
    last = 2 if backend == "local" else 1
    saved = (f"saved checkpoint {run / 'checkpoints' / 'step_000002'} (step 2)" if backend == "local"
             else f"the last complete checkpoint is {run / 'checkpoints' / 'step_000001'}")
    assert len(stops) == 1 and re.fullmatch(
        rf"polyrl: stopped: rank 1 \(pid \d+\) exited \(signal 9\) at step 2 of {steps}; {re.escape(saved)}",
        stops[0]), first
    assert "torchrun restarts the run from there (restart 1 of 1)" in first
    assert f"resuming run {run} from step_{last:06d} (step {last})" in second
    assert logged_steps(run) == list(range(1, steps + 1))
    # every logged number and the final weights: the 2-rank run sums its gradients over ranks, which differs from the
    # 1-process sum by float32 rounding only (tests/test_distributed.py: 1e-6); a step skipped, repeated, or resumed
    # with other prompts, noise or optimizer state moves these LoRA weights by more than 1e-4 (asserted below)
    for a, b in zip(metrics(run), metrics(reference), strict=True):
        keys = {k for k in a if not k.startswith("perf/")}
        assert keys == {k for k in b if not k.startswith("perf/")}
        bad = [(a["step"], k, a[k], b[k]) for k in sorted(keys) if a[k] != pytest.approx(b[k], rel=1e-5, abs=1e-6)]
        assert not bad, bad
    final, expected, before = step_weights(run, steps), step_weights(reference, steps), step_weights(reference, 2)
    assert final.keys() == expected.keys()
    for k in final:
        torch.testing.assert_close(final[k].double(), expected[k].double(), rtol=0, atol=1e-6)
    assert max((expected[k].double() - before[k].double()).abs().max().item() for k in final) > 1e-4
