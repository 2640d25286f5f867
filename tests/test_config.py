"""Tests of config composition and validation (polyrl/config) and of the CLI's config-error path."""

from __future__ import annotations

import re

import pytest

from polyrl.cli.main import main
from polyrl.config import ConfigError, load_config


@pytest.mark.parametrize("override", ["trainer.foo=1", "+trainer.foo=1"])
def test_unknown_trainer_key(override):
    with pytest.raises(ConfigError, match=r"unknown key trainer\.foo") as e:
        load_config([override])
    msg = str(e.value)
    assert "allowed:" in msg
    for key in ("max_steps", "output_dir", "seed", "resume"):
        assert key in msg


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match=r"unknown key foo\b") as e:
        load_config(["foo=1"])
    for key in ("trainer", "rollout", "model", "algorithm"):
        assert key in str(e.value)


def test_unknown_algorithm_option():
    with pytest.raises(ConfigError, match="nope") as e:
        load_config(["algorithm=nope"])
    assert "flow_grpo" in str(e.value)


def test_unknown_algorithm_arg():
    with pytest.raises(ConfigError, match=r"algorithm\.bogus") as e:
        load_config(["algorithm.bogus=1"])
    # the default recipe's algorithm (DiffusionNFT) lists its own arguments, not another algorithm's
    assert "mix_beta" in str(e.value) and "decay_slope" in str(e.value) and "clip_range" not in str(e.value)
    with pytest.raises(ConfigError, match=r"algorithm\.bogus") as e:
        load_config(["recipe=toy_flow_grpo", "algorithm.bogus=1"])
    assert "clip_range" in str(e.value) and "kl_beta" in str(e.value) and "mix_beta" not in str(e.value)


def test_another_algorithm_under_a_recipe_names_the_recipes_that_select_it():
    """`polyrl train algorithm=flow_grpo` under the default stops at a DiffusionNFT key of the recipe's, which the user
    never typed: the error says so and names recipes that select flow_grpo; a key the user set gets no such hint."""
    with pytest.raises(ConfigError) as e:
        load_config(["algorithm=flow_grpo"])
    msg = str(e.value)
    assert msg.startswith("unknown key algorithm.mix_beta for algorithm.name=flow_grpo; allowed: ")
    assert "algorithm.mix_beta is set by recipe toy_shapes for its own algorithm" in msg
    named = msg.split("(recipe=")[1].split(";")[0].split(" | ")
    assert "toy_flow_grpo" in named and "toy_diffusion_nft" not in named
    from polyrl.config import _compose

    assert all(_compose([f"recipe={r}"]).algorithm.name == "flow_grpo" for r in named)  # each one does select it
    with pytest.raises(ConfigError) as e:
        load_config(["algorithm=flow_grpo", "algorithm.mix_beta=0.2"])
    assert "set by recipe" not in str(e.value)
    with pytest.raises(ConfigError) as e:  # no algorithm chosen: the key is the user's to fix
        load_config(["algorithm.bogus=1"])
    assert "set by recipe" not in str(e.value)


def test_unknown_reward_arg():
    with pytest.raises(ConfigError, match=r"reward\.bogus") as e:
        load_config(["reward.bogus=1"])
    assert "min_area" in str(e.value)


def test_bad_dtype():
    with pytest.raises(ConfigError, match=r"model\.dtype='int8'.*allowed: .*bfloat16"):
        load_config(["model.dtype=int8"])


def test_group_size_one():
    with pytest.raises(ConfigError, match=r"rollout\.n must be >= 2"):
        load_config(["rollout.n=1"])


@pytest.mark.parametrize("window_range", ["[0,9]", "[3,1]", "[-1,2]"])
def test_bad_sde_window_range(window_range):
    with pytest.raises(ConfigError, match=r"rollout\.sde_window_range=.*num_steps - sde_window_size = 8"):
        load_config(["rollout.sde_window_size=2", f"rollout.sde_window_range={window_range}"])


def test_good_sde_window_range():
    cfg = load_config(["rollout.sde_window_size=2", "rollout.sde_window_range=[0,5]"])
    assert list(cfg.rollout.sde_window_range) == [0, 5] and cfg.rollout.sde_window_size == 2


def test_bad_window_size():
    with pytest.raises(ConfigError, match=r"rollout\.sde_window_size=11"):
        load_config(["rollout.sde_window_size=11"])


def test_bad_type():
    with pytest.raises(ConfigError, match=r"rollout\.height.*abc"):
        load_config(["rollout.height=abc"])


def test_missing_model_path_for_sd35_recipe():
    with pytest.raises(ConfigError, match=r"model\.path(, data\.path)? must be set"):
        load_config(["recipe=sd35_flowgrpo"])


def test_too_many_minibatches():
    # default: 8 prompts per step × 8 samples = 64
    with pytest.raises(ConfigError, match=re.escape("actor.num_minibatches=65 must be in [1, data.prompts_per_step")):
        load_config(["actor.num_minibatches=65"])
    assert load_config(["actor.num_minibatches=64"]).actor.num_minibatches == 64


def test_default_config_keys():
    cfg = load_config([])
    for key in ("max_steps", "output_dir", "seed", "resume"):
        assert key in cfg.trainer
    for key in ("height", "width", "num_steps", "n"):
        assert key in cfg.rollout
    assert "path" in cfg.model and "path" in cfg.data
    assert cfg.trainer.output_dir is None and cfg.trainer.resume is None
    assert isinstance(cfg.trainer.max_steps, int) and isinstance(cfg.trainer.seed, int)
    assert cfg.rollout.n >= 2 and cfg.rollout.num_steps >= 1
    assert isinstance(cfg.model.path, str) and cfg.model.path
    assert cfg.data.path.endswith(".jsonl")


def test_sd35_recipe_composes():
    cfg = load_config(["recipe=sd35_flowgrpo", "model.path=/x", "data.path=/y.txt"])
    assert cfg.rollout.height == 512 and cfg.rollout.width == 512
    assert cfg.rollout.guidance_scale == 4.5
    assert cfg.algorithm.kl_beta == 0.04
    assert cfg.algorithm.name == "flow_grpo"
    assert cfg.reward.name == "jpeg_compressibility"
    assert cfg.model.path == "/x" and cfg.data.path == "/y.txt"
    assert cfg.model.dtype == "bfloat16"


def test_cli_config_error(capsys):
    assert main(["config", "trainer.foo=1"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"^polyrl: config error: unknown key trainer\.foo", err, re.M)
    assert "max_steps" in err


def test_cli_config_prints_resolved(capsys):
    assert main(["config", "trainer.max_steps=7"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  max_steps: 7$", out, re.M)
    assert "${" not in out  # interpolations resolved


def test_the_generic_pipeline_composes_with_the_likelihood_free_algorithms():
    """model=diffusers_pipeline re-calls its recorded denoiser calls at σ of an algorithm's own (models/
    diffusers_pipeline.py `fresh_call`), so the default (DiffusionNFT) and the other likelihood-free recipes compose
    with it, as Flow-GRPO's does."""
    for recipe, algorithm in (("toy_shapes", "diffusion_nft"), ("toy_awm", "awm"), ("toy_dgpo", "dgpo"),
                              ("toy_diffusion_dpo", "diffusion_dpo"), ("toy_flow_grpo", "flow_grpo")):
        cfg = load_config([f"recipe={recipe}", "model=diffusers_pipeline", "model.path=/nowhere"])
        assert cfg.model.name == "diffusers_pipeline" and cfg.algorithm.name == algorithm


@pytest.mark.parametrize("overrides", [
    ["model=sd3", "model.path=/x", "trainer.seed=3", "++reward.async=true", "~trainer.loggers"],
    ["recipe=toy_flow_grpo", "+trainer.new_key=1", "rollout.n=3"],
    ["algorithm=dgpo", "algorithm.beta=0.5", "trainer.loggers=[tensorboard,wandb]", "data.path=${oc.env:HOME}"],
    ["recipe=toy_count", "reward=shapes", "model.path=null"],
    ["model={name: sd3}"],  # a dict value is a value override even on a group's key (Hydra's rule)
    ["trainer.no_such_key=1"], ["recipe=no_such_recipe"], ["+model=sd3"], ["++model=sd3"],
])
def test_compose_in_two_stages_equals_hydras_compose(overrides):
    """polyrl composes the group choices once (kept) and applies the value overrides to a copy; Hydra's `compose`
    does both in one go. The result (values, interpolations, struct / read-only flags) and any error are the same,
    also the second time (the kept stage is not changed by the first caller)."""
    from omegaconf import OmegaConf

    from polyrl.config import _compose, _hydra_compose

    def outcome(fn):
        try:
            cfg = fn()
        except Exception as e:  # noqa: BLE001 - the error is what is compared
            return type(e), str(e)
        flags = (OmegaConf.is_struct(cfg), OmegaConf.is_readonly(cfg), OmegaConf.is_struct(cfg.trainer))
        text = OmegaConf.to_yaml(cfg)
        cfg.trainer.seed = 12345  # a caller may change its copy
        return text, flags

    expected = outcome(lambda: _hydra_compose(tuple(overrides)))
    assert outcome(lambda: _compose(overrides)) == expected
    assert outcome(lambda: _compose(overrides)) == expected


def test_a_reward_registered_after_a_compose_is_a_choice_of_the_next():
    from polyrl.config import _compose
    from polyrl.rewards import REWARDS, RewardOutput, register_reward

    assert _compose(["recipe=toy_shapes"]).reward.name != "test_late_reward"
    with pytest.raises(Exception, match="test_late_reward"):
        _compose(["recipe=toy_shapes", "reward=test_late_reward"])

    @register_reward("test_late_reward")
    class LateReward:
        def __init__(self, level: float = 0.25):
            self.level = level

        def __call__(self, samples, prompts, metadata=None):
            return RewardOutput(scores=[self.level] * len(prompts))

    try:
        assert dict(_compose(["recipe=toy_shapes", "reward=test_late_reward"]).reward) == {
            "name": "test_late_reward", "level": 0.25}
    finally:
        REWARDS.pop("test_late_reward", None)
