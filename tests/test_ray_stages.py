"""trainer.launcher=ray on a local Ray cluster (one per module, 4 logical CPUs on the 2-core machine): rollout
replicas and a reward worker equal the single-process run; a rollout replica killed mid-step is restarted and
the step completes with every sample scored once; one-step-off-policy rollout is logged and corrected; a weight
sync that does not bind stops the run before it trains."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

ray = pytest.importorskip("ray")

from polyrl.config import load_config  # noqa: E402
from polyrl.distributed.ray_stages import least_loaded  # noqa: E402
from polyrl.distributed.weight_sync import WeightSyncError  # noqa: E402
from polyrl.trainer import remote  # noqa: E402
from polyrl.trainer.loop import Trainer  # noqa: E402

RAY_ONLY = ("time/", "perf/", "rollout/staleness", "weight_sync/")


def overrides(model_dir, prompts, out, *extra) -> list[str]:
    # Flow-GRPO (recipe=toy_flow_grpo; the default recipe is DiffusionNFT): its log-probs carry the off-policy
    # correction these tests check
    return ["recipe=toy_flow_grpo", f"model.path={model_dir}", f"data.path={prompts}", "model.max_sequence_length=16",
            "reward=jpeg_compressibility", "rollout.height=32", "rollout.width=32", "rollout.num_steps=4",
            "rollout.n=4", "data.prompts_per_step=2", "rollout.batch_size=4", "rollout.sde_window_size=2",
            "rollout.sde_window_range=[0,2]", "actor.lora_rank=4", "actor.lora_alpha=4", "actor.lr=1e-3",
            "actor.num_minibatches=2", "algorithm.kl_beta=0.01", "trainer.eval_every=0", "trainer.save_every=0",
            "trainer.progress=false", "trainer.tensorboard=false", "trainer.device=cpu", "trainer.max_steps=2",
            "model.dtype=float64", f"trainer.output_dir={out}", *extra]


def train(args: list[str], before_fit=None):
    """(metrics per step, trainable weights after the run, the trainer's Ray stages' diagnostics)."""
    trainer = Trainer(load_config(args))
    try:
        if before_fit is not None:
            before_fit(trainer)
        history = trainer.fit()
        weights = {k: v.clone() for k, v in trainer.actor.trainable_state().items()}
        info = {}
        if trainer.remote is not None:
            if trainer.remote.reward_stage is not None:
                info["scored"] = [e for log in trainer.remote.reward_stage.pool.call_all("scored") for e in log]
            if trainer.remote.rollout is not None:
                pool = trainer.remote.rollout.pool
                info.update(pids=pool.pids(), losses=list(pool.losses), submitted=dict(pool.submitted),
                            resends=trainer.remote.rollout.resends, syncs=list(trainer.remote.rollout.sync_log))
        return history, weights, info
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_sd3_dir, shape_prompts_file, tmp_path_factory):
    """The single-process run (trainer.launcher=local)."""
    return train(overrides(tiny_sd3_dir, shape_prompts_file, tmp_path_factory.mktemp("local") / "run"))


def assert_same_run(run, reference, atol=1e-12):
    """Equal up to float64 rounding (the networks run in float64: another CPU's float32 kernels would move a
    float32 run by more than its rounding; the remaining float32 parts, the stored trajectories and the VAE decode
    behind the reward, see the same inputs in both layouts)."""
    (h1, w1, _), (h0, w0, _) = run, reference
    assert [m["step"] for m in h1] == [m["step"] for m in h0] == [1, 2]
    for a, b in zip(h0, h1, strict=True):
        keys = {k for k in a if not k.startswith(RAY_ONLY)}
        assert keys == {k for k in b if not k.startswith(RAY_ONLY)}
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-9, abs=1e-12), (a["step"], k, a[k], b[k])
    assert w1.keys() == w0.keys() and any("lora_A" in k for k in w0)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], rtol=1e-9, atol=atol)
    assert h0[0]["grad_norm"] > 0 and h0[0]["reward/std"] > 0  # the runs learned something to compare


def assert_scored_once(scored, steps: int, samples: int):
    """Every sample of every step scored by exactly one reward call."""
    for tag in range(1, steps + 1):
        covered = sorted((start, end) for t, start, end in scored if t == tag)
        assert [i for start, end in covered for i in range(start, end)] == list(range(samples)), (tag, covered)


def test_least_loaded_routing():
    assert least_loaded([2, 0, 1], [True, True, True]) == 1
    assert least_loaded([2, 0, 1], [True, False, True]) == 2
    assert least_loaded([1, 1], [True, True]) == 0
    with pytest.raises(RuntimeError, match="every replica of the pool died"):
        least_loaded([0], [False])


def test_rollout_replicas_and_a_reward_worker_equal_the_single_process_run(cluster, reference, tiny_sd3_dir,
                                                                           shape_prompts_file, tmp_path):
    run = train(overrides(tiny_sd3_dir, shape_prompts_file, tmp_path / "run", "trainer.launcher=ray",
                          "rollout.workers=2", "ray.reward_workers=1"))
    assert_same_run(run, reference)
    history, _, info = run
    # each step's two chunks went to different replicas (least-loaded), and each was scored once
    assert info["submitted"][0, "sample"] == info["submitted"][1, "sample"] == 2
    assert_scored_once(info["scored"], steps=2, samples=8)
    # each replica: one full sync, then after each update the LoRA tensors only
    syncs = info["syncs"]
    assert [(s["replica"], s["full"], s["version"]) for s in syncs] == [
        (0, True, 0), (1, True, 0), (0, False, 1), (1, False, 1), (0, False, 2), (1, False, 2)]
    lora = sum("lora_" in k for k in run[1])
    assert all(s["tensors"] == lora for s in syncs if not s["full"]) and syncs[0]["tensors"] > 3 * lora
    assert [m["rollout/staleness"] for m in history] == [0.0, 0.0]
    assert history[0]["weight_sync/bytes"] == 2 * syncs[2]["bytes"]


def test_a_killed_rollout_replica_restarts_and_the_step_completes(cluster, reference, tiny_sd3_dir,
                                                                  shape_prompts_file, tmp_path, monkeypatch):
    killed = []

    def kill_in_step_two(trainer):
        pool = trainer.remote.rollout.pool
        [pid] = pool.pids()
        submit = pool.submit

        def submit_then_kill(method, *args, **kwargs):
            call = submit(method, *args, **kwargs)
            if method == "sample" and pool.submitted[0, "sample"] == 3 and not killed:  # step 2's first chunk
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            return call

        monkeypatch.setattr(pool, "submit", submit_then_kill)

    run = train(overrides(tiny_sd3_dir, shape_prompts_file, tmp_path / "run", "trainer.launcher=ray",
                          "rollout.workers=1"), before_fit=kill_in_step_two)
    _, _, info = run
    assert killed and info["losses"] == [1] and info["resends"] >= 1
    assert info["pids"][0] != killed[0]  # a new process
    # the restarted replica got a full sync again before it sampled step 2's chunks
    assert [(s["full"], s["version"]) for s in info["syncs"]] == [(True, 0), (False, 1), (True, 1), (False, 2)]
    assert_scored_once(info["scored"], steps=2, samples=8)
    assert_same_run(run, reference)  # the lost chunks were sampled again from the same noise and weights


def test_one_step_off_policy_rollout_is_logged_and_corrected(cluster, reference, tiny_sd3_dir, shape_prompts_file,
                                                             tmp_path):
    history, _, info = train(overrides(tiny_sd3_dir, shape_prompts_file, tmp_path / "run", "trainer.launcher=ray",
                                       "rollout.workers=1", "rollout.max_staleness=1", "actor.lr=2e-2"))
    assert [m["rollout/staleness"] for m in history] == [0.0, 1.0]
    # step 2 was sampled with step 1's weights, before step 1's update: the recomputed old log-probs (decoupled
    # correction, the default here) differ from the rollout's by that update; step 1's agree to rounding
    # (measured: 0.0 and 2.9e-4)
    assert history[0]["correction/abs_dlogp"] < 1e-6 and history[1]["correction/abs_dlogp"] > 1e-4
    assert history[0]["correction/is_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert history[1]["correction/is_weight_mean"] != pytest.approx(1.0, abs=1e-6)
    # the replica sampled step 2 before it received the update (the sync after step 1 came after that rollout)
    assert [(s["full"], s["version"]) for s in info["syncs"]] == [(True, 0), (False, 1), (False, 2)]
    assert_scored_once(info["scored"], steps=2, samples=8)
    assert history[0]["reward/mean"] == pytest.approx(reference[0][0]["reward/mean"], rel=1e-6)  # same first rollout


def test_a_weight_sync_that_binds_to_nothing_stops_the_run(cluster, tiny_sd3_dir, shape_prompts_file, tmp_path,
                                                           monkeypatch):
    # replicas built without the actor's LoRA layers: the adapter tensors have nowhere to go
    build = remote.rollout_policy
    monkeypatch.setattr(remote, "rollout_policy", lambda model_cfg, lora, *rest: build(model_cfg, None, *rest))
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the replica runs the lambda above
    try:
        with pytest.raises(WeightSyncError, match=r"name\(s\) are not in the rollout replica's networks.*lora_A"):
            Trainer(load_config(overrides(tiny_sd3_dir, shape_prompts_file, tmp_path / "run", "trainer.launcher=ray",
                                          "rollout.workers=1", "ray.reward_workers=0")))
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
