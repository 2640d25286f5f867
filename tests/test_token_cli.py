"""Every token-policy algorithm through `polyrl train` on a tiny Qwen3 the tests build (2 steps each), rollout
correction on tokens, DAPO's refill cap, offline DPO / IPO pairs, resume == uninterrupted, and the config errors
that keep diffusion and token policies apart."""

from __future__ import annotations

import json

import pytest

from polyrl.cli.main import main
from polyrl.config import ConfigError, load_config

ROWS = [{"prompt": "what is one plus one?", "answer": "2"}, {"prompt": "count: a b c", "answer": "3"},
        {"prompt": "say seven", "answer": "7"}, {"prompt": "zero?", "answer": "0"}]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("token_data")
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    pairs = [{"prompt": r["prompt"], "chosen": f"The answer is {r['answer']}.", "rejected": "I do not know."} for r in ROWS]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return root


def _args(model, data, out, steps=2, extra=()):
    # reward: 1 when the response holds a letter a..m: on random weights about a third of the responses do, so
    # groups differ and every loss gets a gradient
    return ["train", "recipe=causal_lm_grpo", f"model.path={model}", "model.dtype=float32",
            f"data.path={data / 'train.jsonl'}", f"data.heldout_path={data / 'train.jsonl'}", f"trainer.output_dir={out}",
            f"trainer.max_steps={steps}", "rollout.n=4", "data.prompts_per_step=2", "rollout.max_new_tokens=6",
            "rollout.batch_size=4", "trainer.eval_samples=4", "trainer.eval_every=2", "trainer.save_every=0",
            "trainer.progress=false", "trainer.tensorboard=false", "actor.lora_rank=4", "actor.lora_alpha=8",
            "actor.lr=1e-3", "actor.num_minibatches=2", "reward=format", "reward.pattern='.*[a-m].*'", *extra]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


CASES = {
    "grpo": ["algorithm=grpo", "algorithm.kl_beta=0.1"],
    "grpo_full": ["algorithm=grpo", "actor.lora_rank=0", "actor.lr=1e-4"],
    "grpo_decoupled": ["algorithm=grpo", "rollout_correction.mode=decoupled", "rollout_correction.log_ratio_bounds=[-1,1]"],
    "grpo_bypass_bounds": ["algorithm=grpo", "rollout_correction.log_ratio_bounds=[-0.05,0.05]"],
    "dapo": ["algorithm=dapo", "algorithm.overlong_buffer=2"],
    "gspo": ["algorithm=gspo", "algorithm.kl_beta=0.1"],
    "dpo_online": ["algorithm=dpo"],
}
KEYS = {
    "grpo": ("clip_frac", "kl", "ratio_absdev/first_minibatch"), "grpo_full": ("clip_frac",),
    "grpo_decoupled": ("correction/abs_dlogp", "correction/is_weight_mean", "correction/masked_frac"),
    "grpo_bypass_bounds": ("correction/masked_frac",), "dapo": ("dapo/refills", "dapo/kept_groups", "clip_frac"),
    "gspo": ("clip_frac", "kl"), "dpo_online": ("dpo/accuracy", "dpo/margin"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_token_algorithm_trains_two_steps(tiny_qwen3_dir, data, tmp_path, case):
    out = tmp_path / "run"
    assert main(_args(tiny_qwen3_dir, data, out, 2, CASES[case])) == 0
    rows = _metrics(out)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in ("loss", "grad_norm", "reward/mean", "response_length/mean", *KEYS[case]):
        assert key in steps[0], (case, key)
    assert all(r["loss"] == r["loss"] for r in steps)  # not NaN
    if case != "dpo_online":  # online pairs exist only where a group's rewards differ
        assert any(r["grad_norm"] > 0 for r in steps)
    if case == "grpo":  # the first mini-batch sees the rollout's own weights: the ratio is 1 up to kernel noise
        assert steps[0]["ratio_absdev/first_minibatch"] < 1e-5
    if case == "grpo_decoupled":  # the old-policy recompute is the rollout's forward: |Δlog p| ≈ 0
        assert steps[0]["correction/abs_dlogp"] < 1e-5
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 2]
    samples = (out / "samples" / "step_000002.jsonl").read_text().splitlines()
    assert len(samples) == 4 and set(json.loads(samples[0])) >= {"prompt", "response", "reward"}


def test_dapo_refills_up_to_the_cap(tiny_qwen3_dir, data, tmp_path):
    out = tmp_path / "run"
    # a reward no response earns: every group is flat, so each step refills max_refills times and keeps nothing
    args = _args(tiny_qwen3_dir, data, out, 1, ["algorithm=dapo", "algorithm.max_refills=2", "reward.pattern=NEVER"])
    assert main(args) == 0
    row = [r for r in _metrics(out) if "dapo/refills" in r][0]
    assert row["dapo/refills"] == 2 and row["dapo/kept_groups"] == 0 and row["train/samples"] == 0


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_offline_dpo_from_pairs(tiny_qwen3_dir, data, tmp_path, loss_type):
    out = tmp_path / "run"
    args = _args(tiny_qwen3_dir, data, out, 2, ["algorithm=dpo", f"algorithm.loss_type={loss_type}",
                                                f"data.pairs_path={data / 'pairs.jsonl'}", "trainer.eval_every=0",
                                                "actor.num_minibatches=1"])
    assert main(args) == 0
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["train/samples"] == 2 and rows[0]["grad_norm"] > 0
    if loss_type == "sigmoid":  # LoRA starts as a no-op: the policy is the reference, the loss is log 2
        assert rows[0]["loss"] == pytest.approx(0.6931, abs=1e-3)
    else:  # h = 0 at the start: (0 − 1/(2β))² = 25 with β = 0.1
        assert rows[0]["loss"] == pytest.approx(25.0, abs=1e-2)


def test_bad_pair_rows_are_reported_by_line(tiny_qwen3_dir, data, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p", "chosen": "a"}\nnot json\n')
    args = _args(tiny_qwen3_dir, data, tmp_path / "run", 1, ["algorithm=dpo", f"data.pairs_path={bad}"])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "polyrl: error:" in err and "2 bad pair row(s)" in err
    assert "line 2: missing, empty or non-string rejected" in err and "line 3: not valid JSON" in err


def test_rule_reward_needs_the_answer_column(tiny_qwen3_dir, data, tmp_path, capsys):
    rows = tmp_path / "no_answer.jsonl"
    rows.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    args = _args(tiny_qwen3_dir, data, tmp_path / "run", 1, [f"data.path={rows}", "reward=math_answer"])
    assert main([a for a in args if not a.startswith("reward.pattern")]) == 2
    err = capsys.readouterr().err
    assert f"{rows}:2: reward=math_answer needs the reference answer in an 'answer' column" in err


def test_resume_equals_uninterrupted(tiny_qwen3_dir, data, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    extra = ["algorithm=dapo", "trainer.eval_every=0", "trainer.save_every=1"]
    assert main(_args(tiny_qwen3_dir, data, full, 3, extra)) == 0
    assert main(_args(tiny_qwen3_dir, data, part, 1, extra)) == 0
    assert main(_args(tiny_qwen3_dir, data, part, 3, [*extra, "trainer.resume=auto"])) == 0

    def numbers(run):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/achieved"))} for r in _metrics(run)]

    assert numbers(full) == numbers(part)


def test_config_refuses_mixing_policy_kinds():
    with pytest.raises(ConfigError) as e:
        load_config(["recipe=toy_count", "algorithm=flow_grpo"])
    msg = str(e.value)
    assert "algorithm=flow_grpo" in msg and "model=causal_lm" in msg and "grpo" in msg
    with pytest.raises(ConfigError) as e:
        load_config(["algorithm=grpo"])  # the default recipe: the toy SD3 (diffusion) model
    msg = str(e.value)
    assert "algorithm=grpo" in msg and "model=sd3" in msg and "flow_grpo" in msg
    with pytest.raises(ConfigError, match="rollout.temperature=0.0 must be > 0"):
        load_config(["recipe=toy_count", "rollout.temperature=0"])


def test_config_refuses_a_reward_of_the_other_kind():
    with pytest.raises(ConfigError, match="reward=shapes does not score text, which model=causal_lm outputs; "
                                         "rewards for text: .*math_answer"):
        load_config(["recipe=toy_count", "reward=shapes"])
    with pytest.raises(ConfigError, match="reward=math_answer scores text only, but model=sd3 outputs media"):
        load_config(["reward=math_answer"])
