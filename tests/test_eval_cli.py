"""`polyrl eval` end to end (through the CLI into polyrl/evaluation/engine.py) on a tiny random SD3: an interrupted
evaluation that resumes without sampling done prompts again, noise that does not depend on the chunking, and one-line
user errors. The paired report of a trained toy checkpoint against its base is tests/test_eval_toy.py."""

import json

import pytest
import torch

from polyrl.cli.main import main
from polyrl.rewards import REWARDS, RewardOutput


class MeanPixel:
    """The mean intensity of each image: a continuous scorer whose scores move with any change of the samples."""

    def __call__(self, images, prompts, metadata=None):
        return RewardOutput(images.float().mean(dim=(1, 2, 3)))


class Interrupting:
    """Scores 0; `armed`: raises KeyboardInterrupt (a Ctrl-C) on the call after `after` calls."""

    armed, after, calls = False, 1, 0

    def __call__(self, images, prompts, metadata=None):
        Interrupting.calls += 1
        if Interrupting.armed and Interrupting.calls > Interrupting.after:
            raise KeyboardInterrupt
        return RewardOutput(torch.zeros(len(images)))


@pytest.fixture
def test_scorers(monkeypatch):
    monkeypatch.setitem(REWARDS, "interrupting", Interrupting)
    monkeypatch.setitem(REWARDS, "mean_pixel", MeanPixel)


def _records(out):
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def _tiny_args(model_dir, prompts, out, scorers="[interrupting]"):
    return ["eval", f"model.path={model_dir}", f"data.path={prompts}", f"eval.scorers={scorers}",
            f"eval.output_dir={out}", "eval.progress=false", "eval.chunk_prompts=1", "eval.samples_per_prompt=2",
            "eval.grid=0", "rollout.height=32", "rollout.width=32", "rollout.num_steps=2",
            "model.max_sequence_length=16", "reward=jpeg_compressibility"]


def test_interrupted_eval_resumes_without_resampling_done_prompts(tiny_sd3_dir, shape_prompts_file, test_scorers,
                                                                 tmp_path, monkeypatch, capsys):
    import polyrl.evaluation.engine as evaluate

    sampled = []
    real = evaluate.sample_chunk

    def spy(models, which, plan, rows, keys, seed):
        sampled.append(sorted({p for p, _ in keys}))
        return real(models, which, plan, rows, keys, seed)

    monkeypatch.setattr(evaluate, "sample_chunk", spy)
    out = tmp_path / "eval"
    Interrupting.armed, Interrupting.after, Interrupting.calls = True, 1, 0
    assert main(_tiny_args(tiny_sd3_dir, shape_prompts_file, out)) == 130
    err = capsys.readouterr().err
    assert "polyrl: eval interrupted after 1 of 4 prompts; resume with: polyrl eval" in err
    assert f"eval.output_dir={out}" in err
    first = [r["index"] for r in _records(out)]
    assert first == [0]
    first_scores = _records(out)[0]["scores"]

    sampled.clear()
    Interrupting.armed = False
    assert main(_tiny_args(tiny_sd3_dir, shape_prompts_file, out)) == 0
    assert sampled == [[1], [2], [3]]  # prompt 0 was not sampled again
    records = _records(out)
    assert [r["index"] for r in records] == [0, 1, 2, 3] and records[0]["scores"] == first_scores
    report = json.loads((out / "report.json").read_text())
    assert report["prompts"] == 4 and report["samples"] == 8 and report["checkpoint"] is None

    # the same directory with other settings is refused, naming what differs
    assert main(_tiny_args(tiny_sd3_dir, shape_prompts_file, out, "[jpeg_compressibility]")) == 2
    assert "holds another evaluation (scorer_configs: " in capsys.readouterr().err


def test_seeded_noise_does_not_depend_on_chunking(tiny_sd3_dir, shape_prompts_file, test_scorers, tmp_path,
                                                  monkeypatch):
    import polyrl.trainer.samples as samples

    grids, real = [], samples.save_grid
    monkeypatch.setattr(samples, "save_grid", lambda images, captions, scores, path, **kw: (
        grids.append((path.name, scores, kw.get("notes"))), real(images, captions, scores, path, **kw)))
    Interrupting.armed = False
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(_tiny_args(tiny_sd3_dir, shape_prompts_file, a, "[mean_pixel,interrupting]") + ["eval.grid=2"]) == 0
    assert (a / "best.png").is_file() and (a / "worst.png").is_file()  # without a base: the best and worst samples
    # tiles captioned with the first scorer's score (r=) and the other scorers' (interrupting scores 0)
    assert [g[0] for g in grids] == ["best.png", "worst.png"] and all(g[2] == ["interrupting=0.00"] * 2 for g in grids)
    flat = sorted(v for r in _records(a) for v in r["scores"]["mean_pixel"])
    assert grids[0][1] == pytest.approx(flat[::-1][:2]) and grids[1][1] == pytest.approx(flat[:2])
    args = [x for x in _tiny_args(tiny_sd3_dir, shape_prompts_file, b, "[mean_pixel]")
            if not x.startswith("eval.chunk_prompts")] + ["eval.chunk_prompts=3"]
    assert main(args) == 0
    flat_a = [v for r in _records(a) for v in r["scores"]["mean_pixel"]]
    flat_b = [v for r in _records(b) for v in r["scores"]["mean_pixel"]]
    assert flat_a == pytest.approx(flat_b, abs=1e-6)
    assert len(set(flat_a)) == 8  # every sample drew its own noise


def test_user_errors_are_one_line(tiny_sd3_dir, shape_prompts_file, tmp_path, capsys):
    assert main(["eval", f"data.path={shape_prompts_file}"]) == 2
    assert "checkpoint=DIR or model.path=DIR is required" in capsys.readouterr().err
    args = _tiny_args(tiny_sd3_dir, shape_prompts_file, tmp_path / "x", "[nope]")
    assert main(args) == 2
    assert "eval.scorers: 'nope' is not a registered reward" in capsys.readouterr().err
    assert main(_tiny_args(tiny_sd3_dir, shape_prompts_file, tmp_path / "y", "[pickscore]")) == 2
    assert "scorer pickscore needs scorer.pickscore.path=..." in capsys.readouterr().err
    assert main(_tiny_args(tiny_sd3_dir, shape_prompts_file, tmp_path / "z") + ["eval.compare_base=true"]) == 2
    assert "eval.compare_base=true compares a checkpoint with its base" in capsys.readouterr().err
    assert main(_tiny_args(tiny_sd3_dir, shape_prompts_file, tmp_path / "w") + ["eval.samples=3"]) == 2
    assert "unknown key eval.samples; allowed: chunk_prompts, compare_base" in capsys.readouterr().err
    assert main(_tiny_args(tiny_sd3_dir, shape_prompts_file, tmp_path / "v") + ["eval.samples_per_prompt=x"]) == 2
    assert "bad value for eval.samples_per_prompt" in capsys.readouterr().err


TOKEN_ROWS = [{"prompt": "what is one plus one?", "answer": "2"}, {"prompt": "count: a b c", "answer": "3"},
              {"prompt": "say seven", "answer": "7"}, {"prompt": "zero?", "answer": "0"}]


def test_token_policy_paired_against_its_base(tiny_qwen3_dir, tmp_path):
    """A token policy: greedy responses (every sample of a prompt alike) of a 1-step checkpoint and of its base (the
    LoRA off), each scored by the reward; temperature sampling draws each sample from its own seeded uniforms."""
    import re

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TOKEN_ROWS))
    run = tmp_path / "run"
    assert main(["train", "recipe=causal_lm_grpo", f"model.path={tiny_qwen3_dir}", "model.dtype=float32",
                 f"data.path={data}", "data.heldout_path=null", f"trainer.output_dir={run}", "trainer.max_steps=1",
                 "rollout.n=4", "data.prompts_per_step=2", "rollout.max_new_tokens=6", "rollout.batch_size=8",
                 "trainer.eval_every=0", "trainer.save_every=1", "trainer.progress=false", "trainer.loggers=[]",
                 "actor.lora_rank=4", "actor.lora_alpha=8", "actor.lr=3e-2", "actor.num_minibatches=1",
                 "reward=format", "reward.pattern='.*[a-m].*'"]) == 0
    ckpt = run / "checkpoints" / "step_000001"
    out = tmp_path / "eval"
    args = ["eval", f"checkpoint={ckpt}", f"data.path={data}", "eval.compare_base=true", "eval.samples_per_prompt=2",
            "eval.progress=false", "eval.chunk_prompts=2", "eval.resamples=50"]
    assert main([*args, f"eval.output_dir={out}"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["policy"] == "tokens" and report["prompts"] == 4 and report["samples"] == 8
    assert report["max_new_tokens"] == 6 and "greedy decoding" in (out / "report.md").read_text()
    assert not list(out.glob("*.png"))  # no grids for text
    records = _records(out)
    pattern = re.compile(".*[a-m].*", re.DOTALL)
    for r in records:  # greedy: both samples alike; each score is the reward of its response
        assert r["responses"][0] == r["responses"][1] and r["base_responses"][0] == r["base_responses"][1]
        assert r["scores"]["format"] == [float(bool(pattern.fullmatch(t))) for t in r["responses"]]
        assert r["base"]["format"] == [float(bool(pattern.fullmatch(t))) for t in r["base_responses"]]
    a = [v for r in records for v in r["scores"]["format"]]
    b = [v for r in records for v in r["base"]["format"]]
    assert report["scorers"]["format"]["delta"] == pytest.approx(sum(a) / 8 - sum(b) / 8, abs=1e-12)
    assert any(r["responses"] != r["base_responses"] for r in records)  # the LoRA was on for one, off for the other

    # temperature sampling: samples of a prompt differ, and the same seeds give the same responses again
    hot = [f"eval.output_dir={tmp_path / 'hot'}", "eval.noise_level=1.0", "rollout.top_p=1.0"]
    assert main([*args, *hot]) == 0
    again = [f"eval.output_dir={tmp_path / 'hot2'}", *hot[1:]]
    assert main([*args, *again]) == 0
    first, second = _records(tmp_path / "hot"), _records(tmp_path / "hot2")
    assert [r["responses"] for r in first] == [r["responses"] for r in second]
    assert any(r["responses"][0] != r["responses"][1] for r in first)
    assert "sampling at temperature 1.0" in (tmp_path / "hot" / "report.md").read_text()
