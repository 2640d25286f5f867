"""`polyrl train reward=http` on the tiny SD3 pipeline against a loopback reward server."""

import json

import pytest

from polyrl.cli.main import main
from polyrl.rewards import build_reward
from polyrl.serving.server import BackgroundServer, create_app


def _train_args(model_dir, prompts, out, steps, reward_args):
    return [
        "train", f"model.path={model_dir}", f"data.path={prompts}", f"trainer.output_dir={out}",
        f"trainer.max_steps={steps}", "rollout.height=32", "rollout.width=32", "rollout.num_steps=3", "rollout.n=2",
        "data.prompts_per_step=2", "rollout.batch_size=2", "rollout.guidance_scale=2.0", "model.max_sequence_length=16",
        "trainer.progress=false", "trainer.tensorboard=false", "trainer.eval_every=0", "trainer.save_every=0",
        "trainer.deterministic=true", "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]", *reward_args,
    ]


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


class Breakable:
    """The jpeg_compressibility scorer, until `broken` is set: then every call raises (the server answers 500)."""

    def __init__(self):
        self.inner, self.broken, self.calls = build_reward({"name": "jpeg_compressibility"}), False, 0
        self.break_after = None

    def __call__(self, images, prompts, metadata):
        self.calls += 1
        if self.broken or (self.break_after is not None and self.calls > self.break_after):
            self.broken = True
            raise RuntimeError("CUDA error: device lost")
        return self.inner(images, prompts, metadata)


@pytest.fixture(scope="module")
def local_run(tiny_sd3_dir, shape_prompts_file, tmp_path_factory):
    """3 steps with the scorer in-process (sync), the reference for the served runs."""
    out = tmp_path_factory.mktemp("local") / "run"
    assert main(_train_args(tiny_sd3_dir, shape_prompts_file, out, 3, ["reward=jpeg_compressibility"])) == 0
    return _metrics(out)


def test_http_reward_trains_like_the_local_scorer(tiny_sd3_dir, shape_prompts_file, tmp_path, local_run):
    """Served scores are the local ones (PNG is lossless), and the overlapped stage (reward.async) trains
    exactly as the sync one: same metrics, bit for bit (deterministic CPU run)."""
    with BackgroundServer(create_app(build_reward({"name": "jpeg_compressibility"}), "jpeg")) as srv:
        remote = tmp_path / "remote"
        args = ["reward=http", f"reward.url={srv.url}", "reward.chunk_size=1", "reward.async=true"]
        assert main(_train_args(tiny_sd3_dir, shape_prompts_file, remote, 2, args)) == 0
    b = _metrics(remote)
    assert [r["step"] for r in b] == [1, 2]
    assert [r["reward/mean"] for r in local_run[:2]] == [r["reward/mean"] for r in b]
    assert local_run[:2] == b
    raw = json.loads((remote / "metrics.jsonl").read_text().splitlines()[0])
    assert raw["time/reward_wait"] <= raw["time/reward"] + raw["time/decode"] + 1e-3


def test_retry_budget_spent_saves_a_checkpoint_and_stops(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys,
                                                         local_run):
    reward = Breakable()
    reward.break_after = 2  # step 1 scores (2 chunks of 2 samples), step 2 fails
    out = tmp_path / "run"
    with BackgroundServer(create_app(reward, "breakable")) as srv:
        args = ["reward=http", f"reward.url={srv.url}", "reward.chunk_size=4", "reward.max_retries=2",
                "reward.backoff=0.01", "reward.async=true"]
        assert main(_train_args(tiny_sd3_dir, shape_prompts_file, out, 3, args)) == 3
        err = capsys.readouterr().err
        ckpt = out / "checkpoints" / "step_000001"
        assert f"polyrl: stopped: reward server {srv.url}/score failed 3 attempts (reward.max_retries=2); last error: " \
               "HTTP 500: the scorer raised RuntimeError: CUDA error: device lost" in err
        assert f"saved checkpoint {ckpt} (step 1)\nresume with: polyrl train " in err
        assert (ckpt / "trainer_state.pt").is_file()
        assert [r["step"] for r in _metrics(out)] == [1]
        # the server is fixed; the run resumes where it stopped and ends as an uninterrupted run does
        reward.broken, reward.break_after = False, None
        assert main(_train_args(tiny_sd3_dir, shape_prompts_file, out, 3, args + ["trainer.resume=auto"])) == 0
    resumed, uninterrupted = _metrics(out), local_run
    assert [r["step"] for r in resumed] == [1, 2, 3]
    # the failed step was dropped whole: step 2 draws the same prompts and noise as in the uninterrupted run
    assert resumed[:2] == uninterrupted[:2]
    # (step 3 matches only to float32 rounding: the adapter's per-prompt text cache is filled in a different
    # batch composition after a resume; the same happens for any resume from step 1)
    assert resumed[2]["reward/mean"] == uninterrupted[2]["reward/mean"]


def test_unreachable_server_before_any_step(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys):
    args = ["reward=http", "reward.url=http://127.0.0.1:9", "reward.max_retries=1", "reward.backoff=0.01"]
    # the /health pre-check refuses it before the model loads (a failure after step 0 is in test_checkpoint_signals)
    assert main(_train_args(tiny_sd3_dir, shape_prompts_file, tmp_path / "run", 2, args)) == 2
    err = capsys.readouterr().err
    assert "polyrl: error: reward.url=http://127.0.0.1:9: GET http://127.0.0.1:9/health failed" in err
    assert "ConnectError" in err and not (tmp_path / "run").exists()


def test_an_outage_during_an_evaluation_is_redone_once_on_resume(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys):
    """Found by scripts/soak.py (issue 52): a reward outage in the held-out evaluation right after a training step
    saved that step and the resumed run went on at the next one, so the step's evaluation was never logged. Now the
    step is saved with its evaluation due, and the resumed run evaluates it first: the log equals an uninterrupted
    run's, every step once."""
    evals = ["trainer.eval_every=2", "trainer.eval_samples=2", "trainer.num_validation=2", "trainer.save_every=1"]
    reference = tmp_path / "reference"
    assert main(_train_args(tiny_sd3_dir, shape_prompts_file, reference, 3, ["reward=jpeg_compressibility", *evals])) == 0
    reward, out = Breakable(), tmp_path / "run"
    reward.break_after = 3  # calls: the step-0 evaluation, steps 1 and 2 (one chunk each); step 2's evaluation fails
    with BackgroundServer(create_app(reward, "breakable")) as srv:
        args = ["reward=http", f"reward.url={srv.url}", "reward.chunk_size=4", "reward.max_retries=1",
                "reward.backoff=0.01", *evals]
        assert main(_train_args(tiny_sd3_dir, shape_prompts_file, out, 3, args)) == 3
        err = capsys.readouterr().err
        ckpt = out / "checkpoints" / "step_000002"
        assert f"saved checkpoint {ckpt} (step 2; its evaluation runs again on resume)\nresume with: " in err, err
        assert [r["step"] for r in _metrics(out)] == [0, 1]  # step 2 is logged once its evaluation is done
        reward.broken, reward.break_after = False, None
        assert main(_train_args(tiny_sd3_dir, shape_prompts_file, out, 3, args + ["trainer.resume=auto"])) == 0
        assert "from step_000002 (step 2, at its evaluation)" in capsys.readouterr().err
    assert _metrics(out) == _metrics(reference)
    assert "eval/reward_mean" in _metrics(out)[2]
    assert sorted(p.name for p in (out / "samples").glob("step_*.png")) == ["step_000000.png", "step_000002.png",
                                                                             "step_000003.png"]
