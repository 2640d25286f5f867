"""`reward.backend=openai` against a real server: `transformers serve` (a process of its own, on the CPU) serving a
tiny scripted Qwen2.5-VL judge (tests/tiny_judges.py) that answers "3" to a question about a square, "8" about a
triangle, "5" about squares, "ranking:2,1" when asked to rank, and UnifiedReward's answers for the
`unified_reward` adapter; a fault-injecting proxy in front of it for the API key, 429s, slow answers and the server
gone mid-run (tests/judge_servers.py)."""

import base64
import io
import json
import math

import numpy as np
import pytest
import torch
from conftest import SHAPE_PROMPTS
from judge_servers import FaultProxy, ServedJudge
from PIL import Image
from tiny_judges import save_tiny_qwen_judge

from polyrl.cli.main import main
from polyrl.errors import UserError
from polyrl.rewards import build_reward, call_reward
from polyrl.rewards.judge_backend import backoff_delay
from polyrl.rewards.stage import RewardUnavailable

ANSWERS = {"square": "3", "triangle": "8", "squares": "5"}  # the question's word -> the judge's answer
# unified_reward: "hexagon" -> "Final Score: 4"; "star" -> a Think answer preferring the second image; "oval" -> a
# verdict outside <answer> tags (a tie by upstream's rule)
PHRASES = ["Final Score: 4", "<think>", "</think>", "<answer>", "</answer>", "Image 1 is better", "Image 2 is better"]
LOOKUP = {**ANSWERS, "rank": "ranking", "hexagon": "Final Score: 4", "star": "<think>", "oval": "Image 1 is better"}
SCRIPT = {"3": "<eos>", "8": "<eos>", "5": "<eos>", "ranking": ":", ":": "2", "2": ",", ",": "1", "1": "<eos>",
          "Final Score: 4": "<eos>", "<think>": "</think>", "</think>": "<answer>", "<answer>": "Image 2 is better",
          "Image 2 is better": "</answer>", "</answer>": "<eos>", "Image 1 is better": "<eos>"}
WORDS = sorted({w for p in SHAPE_PROMPTS for w in p.split()} | {"rate", "the", "image", "rank", "these", "ranking",
                                                                "3", "8", "5", "2", "1", ":", ",", "hexagon", "star",
                                                                "oval"})
JUDGE = {"name": "vlm_judge", "template": "rate the image {prompt}", "pattern": r"(\d+)", "score_range": [0, 10],
         "group_template": "rank these {prompt}"}
KEY = "sk-polyrl-test-7f3a9c"


def expected(prompt: str) -> float:
    """The scripted judge's score for a prompt (its last word decides)."""
    return int(ANSWERS[prompt.split()[-1]]) / 10


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return save_tiny_qwen_judge(tmp_path_factory.mktemp("qwen_judge"), WORDS, LOOKUP, SCRIPT, phrases=PHRASES)


@pytest.fixture(scope="module")
def served(judge_dir, tmp_path_factory):
    server = ServedJudge(judge_dir, tmp_path_factory.mktemp("serve") / "serve.log").start()
    yield server
    server.kill()


def _images(n, seed=0):
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_remote_judge_answers_as_the_local_one(judge_dir, served):
    """Same turns, same parse: pointwise (6 samples, 4 requests in flight), video frames and groupwise give the local
    backend's answers and scores, each sample its own; the images travel as lossless PNG data URLs."""
    local = build_reward({**JUDGE, "path": str(judge_dir), "device": "cpu", "trust_remote_code": True})
    remote = build_reward({**JUDGE, "backend": "openai", "url": served.url.removesuffix("/v1"), "max_concurrency": 4})
    remote.preflight()
    assert remote.vlm.model == str(judge_dir)  # reward.model unset: the server's only model
    prompts = [SHAPE_PROMPTS[i % 4] for i in (0, 1, 2, 3, 2, 0)]
    images = _images(6)
    out = remote(images, prompts, None)
    assert remote.last_answers == local.answers(images, prompts) == [ANSWERS[p.split()[-1]] for p in prompts]
    assert out.scores.tolist() == pytest.approx([expected(p) for p in prompts])
    assert out.extras["vlm_judge/unparseable"] == [0.0] * 6
    video = torch.rand(2, 5, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    assert call_reward(remote, video, prompts[:2], [{}, {}]).scores.tolist() == pytest.approx(
        [expected(p) for p in prompts[:2]])
    group = build_reward({**JUDGE, "backend": "openai", "url": served.url, "mode": "groupwise"})
    out = call_reward(group, _images(4), ["x"] * 4, [{}] * 4, group_ids=torch.tensor([0, 0, 1, 1]))
    assert group.last_answers == ["ranking:2,1"] * 2 and out.scores.tolist() == [0.0, 1.0, 0.0, 1.0]
    # the request: one user turn [image, question], the image a PNG data URL of the exact pixels
    pixels = (images[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    body = remote.vlm.body([pixels], "q", 8)
    (image, text), = [body["messages"][0]["content"]]
    assert text == {"type": "text", "text": "q"} and body["temperature"] == 0.0 and body["max_tokens"] == 8
    url = image["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
    assert np.array_equal(decoded, pixels)


def test_429s_slow_answers_backoff_timeouts_and_the_retry_budget(served, monkeypatch):
    """Through a proxy that answers 429 twice (the second with Retry-After: 0.6) and holds the third request past
    `timeout`: the delays between attempts are the configured backoff (jittered within [0.5, 1] of
    backoff * 2^k) or the server's Retry-After, the slow one is abandoned after `timeout` s, the fourth is answered.
    Then every request 429: the step's `retry_budget` stops the call, naming the endpoint and the last status."""
    monkeypatch.setenv("POLYRL_JUDGE_API_KEY", KEY)
    faults = {0: ("status", 429, None), 1: ("status", 429, 0.6), 2: ("delay", 1.5)}
    args = {**JUDGE, "backend": "openai", "max_concurrency": 1, "backoff": 0.2, "max_backoff": 1.0, "timeout": 0.5,
            "max_retries": 4, "retry_budget": 10}
    with FaultProxy(served.url, key=KEY, plan=lambda n, path: faults.get(n)) as proxy:
        judge = build_reward({**args, "url": proxy.url})
        out = judge(_images(1), [SHAPE_PROMPTS[1]], None)
        assert judge.last_answers == ["8"] and out.scores.tolist() == [pytest.approx(0.8)]
        t = proxy.post_times()
        assert len(t) == 4 and judge.vlm.stats == {"requests": 4, "retries": 3, "timeouts": 1}
        assert 0.1 <= t[1] - t[0] <= 0.2 + 0.5  # U(0.5, 1) * 0.2 (+ scheduling slack)
        assert 0.6 <= t[2] - t[1] <= 0.6 + 0.5  # Retry-After 0.6 > the jittered 0.4 * U(0.5, 1)
        assert 0.5 + 0.4 <= t[3] - t[2] <= 0.5 + 0.8 + 0.5  # the 0.5 s timeout, then U(0.5, 1) * 0.8
    with FaultProxy(served.url, key=KEY, plan=lambda n, path: ("status", 429, None)) as proxy:
        judge = build_reward({**args, "url": proxy.url, "backoff": 0.01, "retry_budget": 3, "max_retries": 10})
        judge.begin_step()
        with pytest.raises(RewardUnavailable, match=rf"judge {proxy.url}/chat/completions: the step's retries are "
                                                    r"spent \(reward.retry_budget=3\); last status: HTTP 429"):
            judge(_images(2), SHAPE_PROMPTS[:2], None)
        assert len(proxy.post_times()) == 1 + 3  # the first sample's attempt and the budget's 3 retries; then stop
    rng = np.random.default_rng(0)
    for attempt in range(6):  # the formula itself
        for u in rng.random(5):
            d = backoff_delay(attempt, 0.5, 4.0, None, type("R", (), {"random": lambda self, u=u: u})())
            assert d == pytest.approx((0.5 + 0.5 * u) * min(4.0, 0.5 * 2**attempt))


def test_api_key_is_sent_and_a_missing_one_is_named(served, monkeypatch):
    with FaultProxy(served.url, key=KEY) as proxy:
        monkeypatch.delenv("POLYRL_JUDGE_API_KEY", raising=False)
        judge = build_reward({**JUDGE, "backend": "openai", "url": proxy.url})
        with pytest.raises(UserError, match=r"answered HTTP 401 .*read from \$POLYRL_JUDGE_API_KEY, which is unset"):
            judge.preflight()
        monkeypatch.setenv("MY_JUDGE_KEY", KEY)
        judge = build_reward({**JUDGE, "backend": "openai", "url": proxy.url, "api_key_env": "MY_JUDGE_KEY"})
        judge.preflight()
        assert judge(_images(1), [SHAPE_PROMPTS[0]], None).scores.tolist() == [pytest.approx(0.3)]


def test_unreachable_judge_names_the_url_and_last_error():
    judge = build_reward({**JUDGE, "backend": "openai", "url": "http://127.0.0.1:9/v1", "model": "m",
                          "max_retries": 1, "backoff": 0.01})
    with pytest.raises(RewardUnavailable, match=r"judge http://127.0.0.1:9/v1/chat/completions failed 2 attempts "
                                                r"\(reward.max_retries=1\); last status: ConnectError"):
        judge(_images(1), ["x"], None)
    with pytest.raises(UserError, match=r"reward.url=http://127.0.0.1:9/v1: GET http://127.0.0.1:9/v1/models failed"):
        judge.preflight()


def test_backend_keys_are_checked():
    with pytest.raises(ValueError, match=r"backend=openai needs reward.url"):
        build_reward({"name": "vlm_judge", "backend": "openai"})
    with pytest.raises(ValueError, match=r"reward.path must be set"):
        build_reward({"name": "vlm_judge"})
    with pytest.raises(ValueError, match=r"backend='vllm' is not valid; allowed: local, openai"):
        build_reward({"name": "vlm_judge", "backend": "vllm", "url": "http://h"})
    with pytest.raises(ValueError, match=r"request_options may not set messages"):
        build_reward({"name": "vlm_judge", "backend": "openai", "url": "http://h", "request_options": {"messages": 1}})


def _hydra(d: dict) -> str:
    """A flat mapping as a Hydra override value, strings quoted."""
    def value(v):
        return f"'{v}'" if isinstance(v, str) else "[" + ", ".join(map(str, v)) + "]" if isinstance(v, list) else v

    return "{" + ", ".join(f"{k}: {value(v)}" for k, v in d.items()) + "}"


def _train_args(model_dir, prompts, out, steps, reward_args):
    return [
        "train", f"model.path={model_dir}", f"data.path={prompts}", f"trainer.output_dir={out}",
        f"trainer.max_steps={steps}", "rollout.height=32", "rollout.width=32", "rollout.num_steps=3", "rollout.n=2",
        "data.prompts_per_step=2", "rollout.batch_size=2", "rollout.guidance_scale=2.0", "model.max_sequence_length=16",
        "trainer.progress=false", "trainer.tensorboard=false", "trainer.save_every=0", "trainer.deterministic=true",
        "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]", *reward_args,
    ]


def test_train_over_the_served_judge_outage_and_resume(served, tiny_sd3_dir, shape_prompts_file, tmp_path,
                                                       monkeypatch, capsys):
    """`polyrl train` with the judge inside reward=mix, scored while the rollout runs (reward.async=true), through a
    proxy that checks the API key. Step 1 is scored; from step 2's first request the server is gone (the proxy's
    forwards are refused: ConnectError, as from a killed server): the retries get 502s, the run saves step 1 and
    stops with one line naming the URL and the last status. The server is back, the run resumes and ends; every
    evaluation sample's judge score is its own prompt's; the key is in no file the run wrote."""
    monkeypatch.setenv("POLYRL_JUDGE_API_KEY", KEY)
    out = tmp_path / "run"
    down_at = 4 + 4  # the step-0 evaluation's 4 requests, step 1's 4; then step 2's first request
    with FaultProxy(served.url, key=KEY, plan=lambda n, path: ("down",) if n == down_at else None) as proxy:
        judge = {"weight": 1.0, "backend": "openai", "url": proxy.url, "max_retries": 2, "backoff": 0.05,
                 **{k: v for k, v in JUDGE.items() if k != "name"}}
        args = _train_args(tiny_sd3_dir, shape_prompts_file, out, 3, [
            "reward=mix", f"reward.mix={{vlm_judge: {_hydra(judge)}, jpeg_compressibility: 0.000001}}",
            "reward.async=true", "trainer.eval_every=3", "trainer.eval_samples=4"])
        assert main(args) == 3
        err = capsys.readouterr().err
        assert (f"polyrl: stopped: reward.mix component 'vlm_judge' (required) failed: RewardUnavailable: judge "
                f"{proxy.url}/chat/completions failed 3 attempts (reward.max_retries=2); last status: HTTP 502: "
                "upstream ConnectError") in err
        assert f"saved checkpoint {out / 'checkpoints' / 'step_000001'} (step 1)\nresume with: polyrl train " in err
        proxy.restore()
        assert main(args + ["trainer.resume=auto"]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2, 3]
    assert all(m["reward_extra/vlm_judge/unparseable"] == 0.0 for m in metrics if "reward/mean" in m)
    for step in (0, 3):
        rows = [json.loads(line) for line in (out / "samples" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(rows) == 4
        for row in rows:  # the mix is the prompt's own judge score (jpeg, weighted 1e-6, adds under 1e-4)
            assert math.isclose(row["reward"], expected(row["prompt"]), abs_tol=1e-4), row
    written = [p for p in out.rglob("*") if p.is_file()]
    assert proxy.url in (out / "config.yaml").read_text()  # the judge's config is saved, its key is not
    assert not [p for p in written if KEY.encode() in p.read_bytes()]
    assert KEY not in capsys.readouterr().err


def test_polyrl_eval_scores_with_the_served_judge(served, tiny_sd3_dir, shape_prompts_file, tmp_path):
    """`polyrl eval` with the remote judge as its scorer: each sample's score is its own prompt's."""
    out = tmp_path / "eval"
    judge = [f"scorer.vlm_judge.{k}={v}" for k, v in {
        "backend": "openai", "url": served.url, "template": "'rate the image {prompt}'", "pattern": r"'(\d+)'",
        "score_range": "[0,10]"}.items()]
    assert main(["eval", f"model.path={tiny_sd3_dir}", f"data.path={shape_prompts_file}", "eval.scorers=[vlm_judge]",
                 f"eval.output_dir={out}", "eval.progress=false", "eval.samples_per_prompt=2", "eval.grid=0",
                 "rollout.height=32", "rollout.width=32", "rollout.num_steps=2", "model.max_sequence_length=16",
                 *judge]) == 0
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 4
    for r in records:
        assert r["scores"]["vlm_judge"] == pytest.approx([expected(r["prompt"])] * 2)


# ----------------------------------------------------------------------------------------------- unified_reward
# sha256 of the upstream prompt strings, computed from the authors' sources: flow_grpo rewards.py
# unifiedreward_score_sglang's question with {prompt} left in (yifan123/flow_grpo @ ac4c86e) and Pref-GRPO's
# get_unifiedreward_think_image_template() (CodeGoat24/Pref-GRPO @ 3e787f6)
SCORE_TEMPLATE_SHA256 = "d68ab1dcf4dc3a39ec5dfab963d17fe30a6e5f713eb49f743ed88a4c8ce4317f"
THINK_TEMPLATE_SHA256 = "a8a0d80818246406b783d5cca630336c5fdf1264fef13f09d09bd94d61a139d5"


def _upstream_win_rate(n, pairs, outputs):
    """A transcription of Pref-GRPO's `_extract_answer` + `_pairwise_win_rate` (unifiedreward_think.py): the first
    <answer> block, "Image 1 is better" / "Image 2 is better" by containment, anything else half a win each."""
    import re as _re
    from collections import defaultdict

    win, count = defaultdict(int), defaultdict(int)
    for (i, j), text in zip(pairs, outputs, strict=True):
        count[i] += 1
        count[j] += 1
        m = _re.search(r"<answer>(.*?)</answer>", text, _re.DOTALL)
        final = m.group(1).strip() if m else None
        if final and "Image 1 is better" in final:
            win[i] += 1
        elif final and "Image 2 is better" in final:
            win[j] += 1
        else:
            win[i] += 0.5
            win[j] += 0.5
    return [round(win[k] / count[k], 3) if count[k] > 0 else 0.0 for k in range(n)]


def test_unified_reward_prompts_and_parse_are_upstreams():
    import hashlib
    import itertools
    import random

    from polyrl.rewards.unified_reward import (
        SCORE_PATTERN,
        SCORE_TEMPLATE,
        THINK_PAIR_TEMPLATE,
        pair_verdict,
        win_rates,
    )
    from polyrl.rewards.vlm_judge import parse_score

    assert hashlib.sha256(SCORE_TEMPLATE.encode()).hexdigest() == SCORE_TEMPLATE_SHA256
    assert hashlib.sha256(THINK_PAIR_TEMPLATE.encode()).hexdigest() == THINK_TEMPLATE_SHA256
    pieces = ["<think>x</think>", "<answer>Image 1 is better</answer>", "<answer>Image 2 is better</answer>",
              "<answer> Image 2 is better. </answer>", "<answer>Both images are equally good</answer>",
              "<answer>Image 1 is better and Image 2 is better</answer>", "Image 1 is better", "<answer>", "\n"]
    rng = random.Random(0)
    for n in (2, 3, 5):
        pairs = list(itertools.combinations(range(n), 2))
        for _ in range(40):
            outputs = ["".join(rng.choices(pieces, k=rng.randint(0, 3))) for _ in pairs]
            ours = win_rates(n, pairs, [pair_verdict(o) for o in outputs], [False] * len(pairs))
            assert ours == _upstream_win_rate(n, pairs, outputs), outputs
    # flow_grpo's _extract_scores: the first "Final Score: v" (v in 1-5), divided by 5; no match is our
    # on_unparseable (flow_grpo: 0.0)
    for text, v in [("Final Score: 4", 0.8), ("reasoning... Final Score:3.5 then Final Score: 1", 0.7),
                    ("Final Score: 7", None), ("final score: 4", None)]:
        got = parse_score(text, SCORE_PATTERN, (0, 5))
        assert got == (pytest.approx(v) if v is not None else None)


def test_unified_reward_local_and_served(judge_dir, served):
    """variant=score and variant=think_pair on the tiny Qwen2.5-VL judge, locally and through transformers serve
    (which moves the <think> block into reasoning_content; the verdict in content is parsed the same)."""
    common = {"name": "unified_reward", "dtype": "float32", "device": "cpu"}
    for backend in ({"path": str(judge_dir), "trust_remote_code": True},
                    {"backend": "openai", "url": served.url}):
        score = build_reward({**common, **backend, "max_new_tokens": 8})
        out = score(_images(2), ["a red hexagon", "a blue hexagon"], None)
        assert score.last_answers == ["Final Score: 4"] * 2 and out.scores.tolist() == pytest.approx([0.8, 0.8])
        pair = build_reward({**common, **backend, "variant": "think_pair", "max_new_tokens": 8})
        prompts = ["a green star"] * 3 + ["a red oval"] * 2
        out = call_reward(pair, _images(5), prompts, [{}] * 5, group_ids=torch.tensor([0, 0, 0, 1, 1]))
        # every star pair prefers its second image: wins 0, 1, 2 of 2; the oval pair has no <answer>: a tie
        assert out.scores.tolist() == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.5])
        assert out.extras["unified_reward/unparseable"] == [0.0, 0.0, 0.0, 1.0, 1.0]
        assert len(pair.last_answers) == 3 + 1 and pair.last_answers[-1] == "Image 1 is better"
        assert all(a.endswith("<answer>Image 2 is better</answer>") for a in pair.last_answers[:3])
        excluded = build_reward({**common, **backend, "variant": "think_pair", "max_new_tokens": 8,
                                 "on_unparseable": "exclude"})
        out = call_reward(excluded, _images(2), ["a red oval"] * 2, [{}] * 2, group_ids=torch.tensor([0, 0]))
        assert out.scores.tolist() == [0.5, 0.5]  # no comparison left: 0.5
