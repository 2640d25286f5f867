"""reward.async: scoring of chunk i overlaps sampling of chunk i+1, with the same numbers as sync; the decode is
queued by the sampling thread, which hands the stage media only (a compiled decoder must not compile in a worker,
see rewards/stage.py)."""

import threading
import time

import pytest
import torch

from polyrl.batch import Rollout
from polyrl.cli.main import main
from polyrl.media import cat_media
from polyrl.rewards import RewardOutput
from polyrl.rewards.stage import RewardStage, merge_extras
from polyrl.sampling.diffusion import MediaChunk, decode_chunk


class FakeAdapter:
    """decode = mean over latent channels, broadcast to RGB; records the thread it ran on."""

    device = torch.device("cpu")

    def __init__(self):
        self.decode_threads = set()

    def decode(self, latents):
        self.decode_threads.add(threading.current_thread().name)
        return {"images": latents["x"].mean(1, keepdim=True).expand(-1, 3, -1, -1).sigmoid()}


class SleepyReward:
    def __init__(self, seconds_per_sample=0.0, fail_on=None):
        self.seconds, self.fail_on, self.calls = seconds_per_sample, fail_on, []

    def __call__(self, images, prompts, metadata):
        time.sleep(self.seconds * len(prompts))
        self.calls.append(len(prompts))
        if self.fail_on is not None and self.fail_on in prompts:
            raise RuntimeError(f"bad prompt {self.fail_on}")
        extras = {"first_pixel": images[:, 0, 0, 0].tolist()}
        if prompts[0] == "p0":  # only the first chunk reports this one
            extras["only_first"] = [1.0] * len(prompts)
        return RewardOutput(images.mean(dim=(1, 2, 3)), extras)


def _batch(final):
    b = final.shape[0]
    return Rollout(prompts=[f"p{i}" for i in range(b)], metadata=[{} for _ in range(b)],
                   group_ids=torch.arange(b) // 2, cond={"x": torch.zeros(b, 1)}, shared={},
                   latents={"x": torch.zeros(b, 2, 1, 1, 1)}, log_probs=torch.zeros(b, 1), sigmas=torch.zeros(b, 2),
                   noise_levels=torch.zeros(b, 1), final={"x": final})


def _run(stage, adapter, final, chunk, sample_seconds=0.0):
    """What the rollout and the trainer do: per sampled chunk (the sleep stands for sampling) decode it on this
    thread and `put` it into the stage, then `finish`."""
    batch = _batch(final)
    scoring = stage.begin(batch.prompts, batch.metadata)
    media = []
    for i in range(0, len(batch), chunk):
        time.sleep(sample_seconds)
        part = {"x": final[i : i + chunk]}
        decoded, ready = decode_chunk(adapter, part)
        media.append(decoded)
        scoring.put(MediaChunk(slice(i, min(len(batch), i + chunk)), part, decoded, ready))
    batch.media = cat_media(media)
    times = scoring.finish(batch)
    return batch, times


def test_overlapped_equals_sync():
    final = torch.randn(10, 4, 3, 3, generator=torch.Generator().manual_seed(0))
    sync_adapter, async_adapter = FakeAdapter(), FakeAdapter()
    sync, _ = _run(RewardStage(SleepyReward(), "r"), sync_adapter, final, 4)
    over, times = _run(RewardStage(SleepyReward(), "r", overlap=True), async_adapter, final, 4)
    assert torch.equal(sync.rewards, over.rewards)
    assert over.reward_extras["first_pixel"] == sync.reward_extras["first_pixel"]
    assert over.reward_extras["only_first"] == [1.0] * 4 + [None] * 6  # missing in later chunks: None, not 0
    assert set(times) == {"time/reward", "time/reward_wait"}
    assert async_adapter.decode_threads == {"MainThread"}


def test_overlap_hides_the_reward_behind_sampling():
    """4 chunks of 2, 0.1 s of 'sampling' and 0.1 s of reward each: sync ≈ 0.8 s, overlapped ≈ 0.5 s."""
    final = torch.randn(8, 4, 2, 2)
    t0 = time.perf_counter()
    _run(RewardStage(SleepyReward(0.05), "r"), FakeAdapter(), final, 2, sample_seconds=0.1)
    sync = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, times = _run(RewardStage(SleepyReward(0.05), "r", overlap=True), FakeAdapter(), final, 2, sample_seconds=0.1)
    over = time.perf_counter() - t0
    assert sync >= 0.8 and over < 0.7, (sync, over)
    assert times["time/reward"] >= 0.4 and times["time/reward_wait"] < 0.2  # only the last chunk is waited for


def test_a_failing_chunk_fails_the_step():
    final = torch.randn(6, 4, 2, 2)
    stage = RewardStage(SleepyReward(fail_on="p3"), "r", overlap=True)
    with pytest.raises(RuntimeError, match="bad prompt p3"):
        _run(stage, FakeAdapter(), final, 2)
    bad = RewardStage(lambda i, p, m: RewardOutput(torch.full((len(p),), float("nan"))), "nan", overlap=True)
    with pytest.raises(RuntimeError, match=r"reward 'nan' returned 2 scores for 2 images \(non-finite: 2\)"):
        _run(bad, FakeAdapter(), final, 2)


def test_missing_chunks_are_detected():
    final = torch.randn(4, 4, 2, 2)
    batch = _batch(final)
    stage = RewardStage(SleepyReward(), "r", overlap=True)
    scoring = stage.begin(batch.prompts, batch.metadata)
    part = {"x": final[:2]}
    scoring.put(MediaChunk(slice(0, 2), part, *decode_chunk(FakeAdapter(), part)))
    with pytest.raises(RuntimeError, match="scored 2 of 4 samples"):
        scoring.finish(batch)


def test_merge_extras():
    merged = merge_extras([(2, {"a": [1, 2], "b": torch.tensor([0.5, 1.5])}), (1, {"a": [3], "c": 9})])
    assert merged == {"a": [1, 2, 3], "b": [0.5, 1.5, None], "c": [None, None, 9]}
    with pytest.raises(ValueError, match="an extra of length 3 for a chunk of 2 samples"):
        merge_extras([(2, {"a": [1, 2, 3]})])


def _train_args(model_dir, prompts, out, steps, extra=()):
    return [
        "train", f"model.path={model_dir}", f"data.path={prompts}", f"trainer.output_dir={out}",
        f"trainer.max_steps={steps}", "rollout.height=32", "rollout.width=32", "rollout.num_steps=3", "rollout.n=2",
        "model.max_sequence_length=16", "trainer.progress=false", "trainer.tensorboard=false",
        "reward=jpeg_compressibility", *extra,
    ]


# The overlapped stage training bit-for-bit like the sync one is checked end to end in test_reward_http_train.py.
def test_reward_async_must_be_a_bool(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys):
    assert main(_train_args(tiny_sd3_dir, shape_prompts_file, tmp_path / "x", 1, ["reward.async=sometimes"])) == 2
    assert "reward.async='sometimes' must be true or false" in capsys.readouterr().err
