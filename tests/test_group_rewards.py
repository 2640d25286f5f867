"""Group rewards (docs/rewards.md, "Group rewards"): a group reward gets every member of its group and no other,
in-process (sync and overlapped stage, chunks that cut groups), inside reward=mix, through the reward server, and in
a 2-rank gloo run; group_diversity against a float64 reference; vlm_judge's groupwise ranking."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import httpx
import numpy as np
import pytest
import torch

from polyrl.batch import Rollout
from polyrl.rewards import REWARDS, GroupReward, RewardOutput, build_reward, call_reward, is_groupwise
from polyrl.rewards.base import group_chunks, media_take
from polyrl.rewards.group_diversity import mean_feature_distance
from polyrl.rewards.stage import RewardStage
from polyrl.rewards.vlm_judge import parse_ranking, rank_scores
from polyrl.sampling.diffusion import MediaChunk
from polyrl.serving.server import BackgroundServer, ServerLimits, create_app


class Recorder(GroupReward):
    """Scores member k of a group by k + 10 * (the group's first pixel mean); records each group it was given
    as the sorted list of sample tags (metadata["tag"]) and the prompt."""

    def __init__(self):
        self.calls: list[list[list[int]]] = []  # per __call__: the groups' tags
        self._call: list | None = None

    def __call__(self, media, prompts, metadata, group_ids=None):
        self._call = []
        out = super().__call__(media, prompts, metadata, group_ids)
        self.calls.append(self._call)
        return out

    def score_group(self, media, prompt, metadata):
        tags = [m["tag"] for m in metadata]
        assert len({m["prompt"] for m in metadata}) == 1 and metadata[0]["prompt"] == prompt
        self._call.append(sorted(tags))
        return RewardOutput(torch.tensor([t + 0.5 * len(tags) for t in tags], dtype=torch.float32),
                            {"group_size": float(len(tags)), "tag": tags})


def _batch(groups: int, n: int, seed: int = 0):
    """Images, prompts, metadata and group ids of `groups` prompts x `n` samples (samples of a group contiguous);
    each sample's metadata carries its index as `tag`."""
    b = groups * n
    images = torch.rand(b, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
    prompts = [f"prompt {i // n}" for i in range(b)]
    metadata = [{"tag": i, "prompt": prompts[i]} for i in range(b)]
    return images, prompts, metadata, torch.arange(groups).repeat_interleave(n)


def _expected(group_ids: torch.Tensor) -> torch.Tensor:
    sizes = torch.bincount(group_ids)[group_ids]
    return torch.arange(len(group_ids)).float() + 0.5 * sizes.float()


def test_group_reward_call_gets_whole_groups_in_any_order():
    rec = Recorder()
    images, prompts, metadata, _ = _batch(3, 4)
    group_ids = torch.tensor([2, 0, 1, 0, 2, 2, 1, 0, 1, 0, 1, 2])  # interleaved groups
    out = call_reward(rec, images, prompts[:0] + [f"p{g}" for g in group_ids.tolist()],
                      [{"tag": i, "prompt": f"p{g}"} for i, g in enumerate(group_ids.tolist())], group_ids=group_ids)
    assert rec.calls == [[[0, 4, 5, 11], [1, 3, 7, 9], [2, 6, 8, 10]]]
    assert out.scores.tolist() == (torch.arange(12).float() + 2.0).tolist()
    assert out.extras["tag"] == list(range(12)) and out.extras["group_size"] == [4.0] * 12
    with pytest.raises(ValueError, match="scores whole prompt groups, so it needs the samples' group ids"):
        call_reward(rec, images, prompts, metadata)
    assert is_groupwise(rec) and is_groupwise(Recorder) and not is_groupwise(REWARDS["jpeg_compressibility"])


def _chunks(images, sizes):
    out, start = [], 0
    for s in sizes:
        out.append(MediaChunk(slice(start, start + s), {}, {"images": images[start:start + s]}))
        start += s
    return out


@pytest.mark.parametrize("chunking", [[3, 3, 3, 3], [5, 7], [1] * 12, [12]])
def test_overlapped_stage_scores_only_whole_groups(chunking):
    images, prompts, metadata, group_ids = _batch(3, 4)
    rec = Recorder()
    stage = RewardStage(rec, "recorder", overlap=True)
    try:
        scoring = stage.begin(prompts, metadata, group_ids)
        for c in _chunks(images, chunking):
            scoring.put(c)
        batch = Rollout(prompts, metadata, group_ids, {}, {}, {}, torch.zeros(12, 0), torch.zeros(12, 1),
                        torch.zeros(12, 0), {}, media={"images": images})
        scoring.finish(batch)
    finally:
        stage.close()
    groups = [g for call in rec.calls for g in call]
    assert sorted(groups) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # each whole, each once
    # the first call comes as soon as the first group is complete
    ends = np.cumsum(chunking)
    assert rec.calls[0][0] == [0, 1, 2, 3] and len(rec.calls) == len({min(int(e), 12) // 4 for e in ends} - {0})
    assert batch.rewards.tolist() == _expected(group_ids).tolist()
    assert batch.reward_extras["tag"] == list(range(12))

    sync, rec2 = RewardStage(Recorder(), "recorder"), None  # the sync schedule: one call of the whole batch
    rec2 = sync.reward
    scoring = sync.begin(prompts, metadata)
    batch2 = Rollout(prompts, metadata, group_ids, {}, {}, {}, torch.zeros(12, 0), torch.zeros(12, 1),
                     torch.zeros(12, 0), {}, media={"images": images})
    scoring.finish(batch2)
    assert rec2.calls == [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]]
    assert torch.equal(batch2.rewards, batch.rewards)


def test_overlapped_stage_without_group_ids_scores_at_finish():
    images, prompts, metadata, group_ids = _batch(2, 3)
    stage = RewardStage(Recorder(), "recorder", overlap=True)
    try:
        scoring = stage.begin(prompts, metadata)  # a caller that does not pass the group ids
        for c in _chunks(images, [4, 2]):
            scoring.put(c)
        assert stage.reward.calls == []
        batch = Rollout(prompts, metadata, group_ids, {}, {}, {}, torch.zeros(6, 0), torch.zeros(6, 1),
                        torch.zeros(6, 0), {}, media={"images": images})
        scoring.finish(batch)
    finally:
        stage.close()
    assert stage.reward.calls == [[[0, 1, 2], [3, 4, 5]]]
    assert batch.rewards.tolist() == _expected(group_ids).tolist()


def test_group_reward_in_a_mix_and_on_video_frames():
    REWARDS.setdefault("test_group_recorder", Recorder)
    mix = build_reward({"name": "mix", "mix": {"test_group_recorder": 1.0, "jpeg_compressibility": 0.5}})
    assert mix.groupwise
    images, prompts, metadata, group_ids = _batch(2, 3)
    out = call_reward(mix, images, prompts, metadata, group_ids=group_ids)
    assert mix.rewards["test_group_recorder"].calls == [[[0, 1, 2], [3, 4, 5]]]
    jpeg = torch.tensor(out.extras["reward/jpeg_compressibility"], dtype=torch.float64)
    torch.testing.assert_close(out.scores.double(), _expected(group_ids).double() + 0.5 * jpeg, rtol=0, atol=1e-5)
    assert not build_reward({"name": "mix", "mix": {"jpeg_compressibility": 1.0}}).groupwise

    # video: frame j of the members of one group is one group; the frame scores are averaged per sample
    rec = Recorder()
    video = torch.rand(4, 2, 3, 8, 8)
    seen = []
    rec.score_group = lambda media, prompt, meta: (seen.append(media.shape[0]), RewardOutput(media.mean((1, 2, 3))))[1]
    out = call_reward(rec, video, ["a", "a", "b", "b"], None, group_ids=torch.tensor([5, 5, 9, 9]))
    assert seen == [2, 2, 2, 2]  # 2 groups x 2 frames, 2 members each
    torch.testing.assert_close(out.scores, video.mean((2, 3, 4)).mean(1))


def test_group_chunks_keep_groups_whole():
    assert group_chunks([0, 0, 1, 1, 1, 2, 2], 4) == [[0, 1], [2, 3, 4], [5, 6]]
    assert group_chunks([0, 0, 1, 1, 1, 2, 2], 5) == [[0, 1, 2, 3, 4], [5, 6]]
    assert group_chunks([3, 1, 3, 1], 1) == [[0, 2], [1, 3]]  # a group over the size is its own chunk
    assert media_take(["a", "b", "c"], [2, 0]) == ["c", "a"]


# ---------------------------------------------------------------------------------------------- server
def test_group_reward_through_the_server():
    rec = Recorder()
    app = create_app(rec, "recorder", ServerLimits(max_batch=3, max_wait_ms=20.0))
    images, prompts, metadata, _ = _batch(4, 2)
    group_ids = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3])  # groups of 2, 3, 2, 1
    metadata = [{"tag": i, "prompt": f"p{g}"} for i, g in enumerate(group_ids.tolist())]
    prompts = [m["prompt"] for m in metadata]
    with BackgroundServer(app) as srv:
        health = httpx.get(srv.url + "/health").json()
        assert health["groupwise"] is True
        client = build_reward({"name": "http", "url": srv.url, "chunk_size": 4, "token_env": None})
        assert not client.groupwise
        client.preflight()  # the server says it is a group reward
        assert client.groupwise
        out = call_reward(client, images, prompts, metadata, group_ids=group_ids)
        groups = sorted(g for call in rec.calls for g in call)
        mix = build_reward({"name": "mix", "mix": {"http": {"weight": 2.0, "url": srv.url, "token_env": None}}})
        assert not mix.groupwise
        mix.preflight()  # runs the component's: the server's reward is a group reward, so the mix is one
        assert mix.groupwise
        rec.calls.clear()
        mixed = call_reward(mix, images, prompts, metadata, group_ids=group_ids)
        assert sorted(g for call in rec.calls for g in call) == [[0, 1], [2, 3, 4], [5, 6], [7]]
        assert mixed.scores.tolist() == (2 * _expected(group_ids)).tolist()
        mix.rewards["http"].close()
        # without groups, or with a group cut apart, the server refuses
        body = {"images": ["x"], "prompts": ["p"]}
        r = httpx.post(srv.url + "/score", json=body)
        assert r.status_code == 422 and "send 'groups'" in r.json()["detail"]
        from polyrl.rewards.codec import encode_images
        body = {"images": encode_images(images[:3]), "prompts": ["a"] * 3, "groups": [1, 2, 1]}
        r = httpx.post(srv.url + "/score", json=body)
        assert r.status_code == 422 and "group 1 are not next to each other" in r.json()["detail"]
        client.close()
    assert groups == [[0, 1], [2, 3, 4], [5, 6], [7]]  # whole, each once, never merged with another request's
    assert out.scores.tolist() == _expected(group_ids).tolist()
    assert out.extras["tag"] == list(range(8))


# ---------------------------------------------------------------------------------------------- built-ins
@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from polyrl.models.tiny import word_tokenizer

    torch.manual_seed(0)
    tok = word_tokenizer(["a", "b"], 8, add_bos=True)
    cfg = CLIPConfig(text_config=dict(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=8),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, image_size=32, patch_size=8), projection_dim=16)
    path = tmp_path_factory.mktemp("tiny_clip_div")
    CLIPModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    return path


def test_group_diversity_matches_float64_reference(clip_dir):
    from PIL import Image
    from transformers import CLIPImageProcessor, CLIPModel

    reward = build_reward({"name": "group_diversity", "path": str(clip_dir), "device": "cpu"})
    images = torch.rand(5, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    images[1] = images[0]  # a duplicate: its distance to sample 0 is 0
    group_ids = torch.tensor([7, 7, 7, 3, 3])
    out = call_reward(reward, images, ["x"] * 5, None, group_ids=group_ids)

    model = CLIPModel.from_pretrained(clip_dir).double().eval()
    pil = [Image.fromarray(np.rint(im.permute(1, 2, 0).numpy() * 255).astype(np.uint8)) for im in images]
    pv = CLIPImageProcessor.from_pretrained(clip_dir)(images=pil, return_tensors="pt")["pixel_values"].double()
    with torch.no_grad():
        f = model.visual_projection(model.vision_model(pixel_values=pv).pooler_output).numpy()
    f /= np.linalg.norm(f, axis=1, keepdims=True)
    expected = []
    for i, g in enumerate(group_ids.tolist()):
        others = [j for j, h in enumerate(group_ids.tolist()) if h == g and j != i]
        expected.append(sum(1 - float(f[i] @ f[j]) for j in others) / len(others))
    np.testing.assert_allclose(out.scores.numpy(), expected, rtol=0, atol=1e-5)
    assert out.scores[0] < out.scores[2] and out.scores[1] < out.scores[2]  # the duplicates are the least diverse
    assert out.extras["group_diversity/group_size"] == [3.0, 3.0, 3.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="a group of 1 sample has no other member"):
        mean_feature_distance(torch.ones(1, 4))
    with pytest.raises(FileNotFoundError, match="not a local model directory"):
        build_reward({"name": "group_diversity", "path": "/nonexistent"})


RANK_WORDS = ["ranking", ":", "1", "2", "3", "order", "the", "images", "a", "red", "circle"]
RANK_SCRIPT = {"order": "ranking", "ranking": ":", ":": "2", "2": "3", "3": "1", "1": "<eos>"}


@pytest.fixture(scope="module")
def ranking_judge_dir(tmp_path_factory):
    from test_rewards_vlm import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("rank_judge"), script=RANK_SCRIPT, words=RANK_WORDS)


def test_parse_ranking_and_rank_scores():
    assert parse_ranking("Ranking: 3, 1, 2", 3) == [2, 0, 1]
    assert parse_ranking("I looked at 4 images. ranking 2 1", 2) == [1, 0]  # the numbers after the last 'ranking'
    assert parse_ranking("Ranking: 1, 1, 2", 3) is None and parse_ranking("no idea", 2) is None
    assert rank_scores([2, 0, 1]) == [0.5, 0.0, 1.0]
    assert rank_scores([0]) == [0.5]


def test_vlm_judge_groupwise_ranks_each_group(ranking_judge_dir):
    judge = build_reward({"name": "vlm_judge", "path": str(ranking_judge_dir), "mode": "groupwise", "device": "cpu",
                          "group_template": "the {n} images a red circle {prompt} order"})
    assert judge.groupwise
    images = torch.rand(5, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    group_ids = torch.tensor([0, 1, 0, 1, 0])  # group 0 = samples 0, 2, 4 (ranked 2, 3, 1); group 1 = 1, 3
    judge_calls = []
    real = judge.vlm.turns
    judge.vlm.turns = lambda pictures, questions: (judge_calls.append([len(p) for p in pictures]),
                                                   real(pictures, questions))[1]
    with pytest.raises(ValueError, match=r"not a ranking of 1..2: 'ranking : 2 3 1'"):
        call_reward(judge, images, ["red"] * 5, None, group_ids=group_ids)
    assert judge_calls == [[3, 2]]  # one turn per group, all its images
    three = torch.tensor([0, 0, 0, 1, 1, 1])
    out = call_reward(judge, torch.cat([images, images[:1]]), ["red"] * 6, None, group_ids=three)
    assert judge.last_answers == ["ranking : 2 3 1"] * 2
    assert out.scores.tolist() == [0.0, 1.0, 0.5] * 2  # image 2 best, then 3, then 1
    exclude = build_reward({"name": "vlm_judge", "path": str(ranking_judge_dir), "mode": "groupwise",
                            "device": "cpu", "on_unparseable": "exclude",
                            "group_template": "the {n} images {prompt} order"})
    out = call_reward(exclude, images, ["red"] * 5, None, group_ids=group_ids)
    assert out.scores[[0, 2, 4]].tolist() == [0.0, 1.0, 0.5] and math.isnan(out.scores[1])
    assert out.extras["vlm_judge/unparseable"] == [0.0, 1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="mode='pairs' is not valid; allowed: pointwise, groupwise"):
        build_reward({"name": "vlm_judge", "path": str(ranking_judge_dir), "mode": "pairs"})


# ---------------------------------------------------------------------------------------------- 2 ranks
RECORDER_FILE = '''
import json, os
import torch
from polyrl.rewards import GroupReward, RewardOutput, register_reward

@register_reward("test_text_group_recorder")
class TextGroupRecorder(GroupReward):
    media = ("text",)

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def __call__(self, media, prompts, metadata, group_ids=None):
        self.groups = []
        out = super().__call__(media, prompts, metadata, group_ids)
        with open(os.path.join(self.out_dir, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
            f.write(json.dumps({"groups": self.groups, "ids": torch.as_tensor(group_ids).tolist()}) + "\\n")
        return out

    def score_group(self, media, prompt, metadata):
        self.groups.append({"prompt": prompt, "n": len(media), "answers": sorted({m["answer"] for m in metadata})})
        return RewardOutput(torch.tensor([float(len(t) % 3) for t in media]))
'''


def test_group_reward_on_two_ranks_gets_whole_groups(tiny_qwen3_dir, tmp_path):
    (tmp_path / "recorder.py").write_text(textwrap.dedent(RECORDER_FILE))
    rows = [{"prompt": f"question {i}: what comes after {i}?", "answer": str(i + 1)} for i in range(4)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out_dir = tmp_path / "calls"
    out_dir.mkdir()
    args = ["train", "--import", str(tmp_path / "recorder.py"), "recipe=causal_lm_grpo", f"model.path={tiny_qwen3_dir}",
            "model.dtype=float32", f"data.path={data}", "rollout.n=3", "data.prompts_per_step=4",
            "rollout.max_new_tokens=4", "rollout.batch_size=2", "reward=test_text_group_recorder",
            f"reward.out_dir={out_dir}", "reward.async=true", "actor.lora_rank=4", "actor.lora_alpha=8",
            "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=false", "trainer.tensorboard=false",
            "trainer.device=cpu", "trainer.max_steps=1", f"trainer.output_dir={tmp_path / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "polyrl"]
    res = subprocess.run(launcher + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    calls = {r: [json.loads(x) for x in (out_dir / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    for r in (0, 1):
        assert calls[r], f"rank {r} scored nothing"
        for call in calls[r]:
            assert all(g["n"] == 3 for g in call["groups"])  # every member, no other
            assert sorted(call["ids"]) == sorted(i for i in set(call["ids"]) for _ in range(3))
        # reward.async with chunks of 2 and groups of 3: each group is scored as soon as its last member arrives
        assert len(calls[r]) == 2 and all(len(call["groups"]) == 1 for call in calls[r])
    # the step's 4 groups: 2 per rank, each scored once
    per_rank = {r: [g["prompt"] for call in calls[r] for g in call["groups"]] for r in (0, 1)}
    assert len(per_rank[0]) == len(per_rank[1]) == 2
    assert len(set(per_rank[0] + per_rank[1])) == 4
