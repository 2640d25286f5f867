"""Recipes that claim a peer's published values: each recipe's keys held to a transcription of the peer's config
(docs/recipes.md "Which recipe to start from"). A recipe's comments name the file and commit of every value."""

from __future__ import annotations

import pytest

from polyrl.config import load_config


def their_nft_config(name: str) -> dict:
    """NVlabs/DiffusionNFT @ 24af5554 config/nft.py (on config/base.py), transcribed: `_get_config` with 8 GPUs and
    its per-config changes, including the per-GPU batch-size search (the largest bsz <= 9 with
    48·24 % (8·bsz) == 0, bsz·8 % 24 == 0 and the batches per epoch divisible by gradient_step_per_epoch)."""
    steps_per_epoch = {"sd3_ocr": 2}.get(name, 1)
    n_gpus, groups, per_prompt = 8, 48, 24
    bsz = 9
    while not (groups * per_prompt % (n_gpus * bsz) == 0 and bsz * n_gpus % per_prompt == 0
               and (groups * per_prompt // (n_gpus * bsz)) % steps_per_epoch == 0):
        bsz -= 1
    cfg = {"resolution": 512, "num_steps": 10, "guidance_scale": 1.0, "deterministic": True, "solver": "dpm2",
           "ref_beta": 1e-4, "num_image_per_prompt": per_prompt, "num_groups": groups, "bsz": bsz,
           "gradient_step_per_epoch": steps_per_epoch, "lr": 3e-4, "betas": [0.9, 0.999], "weight_decay": 1e-4,
           "eps": 1e-8, "max_grad_norm": 1.0, "adv_clip_max": 5, "timestep_fraction": 0.99, "ema_decay": 0.9,
           "lora_r": 32, "lora_alpha": 64, "seed": 42, "eval_freq": 10, "save_freq": 30, "beta": 1.0,
           "decay": (0, 0.001, 0.5), "max_sequence_length": 128}
    if name == "sd3_ocr":
        cfg.update(beta=0.1, decay=(75, 0.0075, 0.999))
    if name == "sd3_multi_reward":
        cfg.update(num_steps=25, beta=0.1)
    return cfg


def _nft_matches(cfg, theirs: dict) -> None:
    r, a, act, t = cfg.rollout, cfg.algorithm, cfg.actor, cfg.trainer
    assert (r.height, r.width, r.num_steps, r.n) == (theirs["resolution"],) * 2 + (theirs["num_steps"],
                                                                                    theirs["num_image_per_prompt"])
    assert r.guidance_scale == theirs["guidance_scale"] and r.noise_level == 0 and r.step == theirs["solver"]
    assert cfg.data.prompts_per_step == theirs["num_groups"]
    assert act.micro_batch_size == r.batch_size == theirs["bsz"] == 9
    assert act.num_minibatches == theirs["gradient_step_per_epoch"]
    assert (act.lr, list(act.betas), act.weight_decay, act.eps, act.grad_clip) == (
        theirs["lr"], theirs["betas"], theirs["weight_decay"], theirs["eps"], theirs["max_grad_norm"])
    assert (act.lora_rank, act.lora_alpha, act.lora_targets) == (theirs["lora_r"], theirs["lora_alpha"], None)
    assert act.eval_ema_decay == theirs["ema_decay"] and act.ema_decay == 0
    assert a.name == "diffusion_nft" and a.mix_beta == theirs["beta"] and a.adv_clip_max == theirs["adv_clip_max"]
    assert a.adv_std == "global" and a.ref_coef == theirs["ref_beta"]
    assert a.time_sampling == "grid" and a.grid_fraction == theirs["timestep_fraction"]
    flat, uprate, uphold = theirs["decay"]
    assert (a.decay_clock, a.decay, a.decay_start, a.decay_slope, a.decay_max) == (
        "optimizer_step", 0.0, flat, uprate, uphold)
    assert (t.seed, t.eval_every, t.save_every) == (theirs["seed"], theirs["eval_freq"], theirs["save_freq"])
    assert cfg.model.name == "sd3" and cfg.model.max_sequence_length == theirs["max_sequence_length"]


def test_sd35_nft_is_their_sd3_ocr():
    cfg = load_config(["recipe=sd35_nft", "model.path=/x", "data.path=/y.txt"])
    _nft_matches(cfg, their_nft_config("sd3_ocr"))
    assert cfg.reward.name == "ocr" and cfg.model.path == "/x" and cfg.data.path == "/y.txt"


@pytest.mark.parametrize("name,overrides,reward", [
    ("sd3_pickscore", [], "pickscore"),
    ("sd3_geneval", ["reward=geneval", "reward.mode=partial", "reward.detector_path=/d", "reward.clip_path=/c"],
     "geneval"),
    ("sd3_multi_reward", ["rollout.num_steps=25", "algorithm.mix_beta=0.1", "reward=mix",
                          "reward.mix={pickscore: {weight: 1.0, path: /p}, clip_score: {weight: 1.0, path: /c}}"],
     "mix"),
])
def test_sd35_nft_pickscore_and_its_documented_overrides_are_their_configs(name, overrides, reward):
    extra = ["reward.path=/z"] if reward == "pickscore" else []
    cfg = load_config(["recipe=sd35_nft_pickscore", "model.path=/x", "data.path=/y.txt", *extra, *overrides])
    _nft_matches(cfg, their_nft_config(name))
    assert cfg.reward.name == reward


# X-GenGroup/Flow-Factory @ b30dc004982c6b5ce58d79e2163dfc995575aa03, the keys of examples/dgpo/lora/sd3_5/default.yaml
# and examples/awm/lora/sd3_5/default.yaml that polyrl maps (transcribed; a scalar clip range is symmetric, a float
# timestep range is [0, value], as its hparams/training_args/_base.py reads them)
FLOW_FACTORY = {
    "sd35_dgpo": {"model": {"lora_rank": 64, "lora_alpha": 128, "mixed_precision": "bf16"},
                  "train": {"dpo_beta": 10, "use_shared_noise": True, "clip_dsm": True, "clip_kl": False,
                            "use_ema_ref": False, "ema_ref_max_decay": 0.3, "ema_ref_ramp_rate": 0.001,
                            "num_train_timesteps": 4, "time_sampling_strategy": "discrete", "timestep_range": 0.6,
                            "kl_beta": 0.001, "clip_range": 5.0e-2, "adv_clip_range": 5.0, "resolution": 512,
                            "num_inference_steps": 10, "guidance_scale": 4.5, "per_device_batch_size": 12,
                            "group_size": 24, "global_std": True, "unique_sample_num_per_epoch": 24,
                            "gradient_step_per_epoch": 1, "seed": 42, "dynamics_type": "ODE"},
                  "eval_freq": 60, "save_freq": 60},
    "sd35_awm": {"model": {"lora_rank": 32, "lora_alpha": 64, "mixed_precision": "bf16"},
                 "train": {"off_policy": False, "awm_weighting": "ghuber", "ghuber_power": 0.25,
                           "num_train_timesteps": 6, "time_sampling_strategy": "discrete_wo_init",
                           "timestep_range": 0.9, "clip_range": 1, "adv_clip_range": 1.0, "kl_beta": 0.0001,
                           "resolution": 512, "num_inference_steps": 14, "guidance_scale": 1.0,
                           "per_device_batch_size": 8, "group_size": 16, "global_std": True,
                           "unique_sample_num_per_epoch": 48, "gradient_step_per_epoch": 1, "seed": 42,
                           "dynamics_type": "ODE"},
                 "eval_freq": 20, "save_freq": 20},
}
OPTIMIZER = {"learning_rate": 3.0e-4, "weight_decay": 1.0e-4, "betas": [0.9, 0.999], "eps": 1.0e-8, "max_grad_norm": 1.0}


@pytest.mark.parametrize("recipe", sorted(FLOW_FACTORY))
def test_dgpo_and_awm_recipes_are_flow_factorys(recipe):
    theirs = FLOW_FACTORY[recipe]
    m, tr = theirs["model"], theirs["train"]
    cfg = load_config([f"recipe={recipe}", "model.path=/x", "data.path=/y.txt", "reward.path=/z"])
    a, r, act = cfg.algorithm, cfg.rollout, cfg.actor
    assert cfg.model.name == "sd3" and cfg.model.dtype == "bfloat16" and cfg.reward.name == "pickscore"
    assert (act.lora_rank, act.lora_alpha, act.lora_targets) == (m["lora_rank"], m["lora_alpha"], None)
    assert (act.lr, act.weight_decay, list(act.betas), act.eps, act.grad_clip) == tuple(OPTIMIZER.values())
    assert (r.height, r.width, r.num_steps, r.guidance_scale, r.n) == (
        tr["resolution"], tr["resolution"], tr["num_inference_steps"], tr["guidance_scale"], tr["group_size"])
    assert r.noise_level == 0 and tr["dynamics_type"] == "ODE" and r.batch_size == tr["per_device_batch_size"]
    assert cfg.data.prompts_per_step == tr["unique_sample_num_per_epoch"]
    assert act.num_minibatches == tr["gradient_step_per_epoch"]
    assert a.num_timesteps == tr["num_train_timesteps"] and a.time_sampling == tr["time_sampling_strategy"]
    assert list(a.timestep_range) == [0.0, tr["timestep_range"]]
    assert list(a.clip_range) == [-tr["clip_range"], tr["clip_range"]] and a.adv_clip_max == tr["adv_clip_range"]
    assert a.kl_beta == tr["kl_beta"] and a.adv_std == ("global" if tr["global_std"] else "group")
    assert (cfg.trainer.seed, cfg.trainer.eval_every, cfg.trainer.save_every) == (
        tr["seed"], theirs["eval_freq"], theirs["save_freq"])
    if recipe == "sd35_dgpo":
        assert a.name == "dgpo" and a.beta == tr["dpo_beta"] and a.shared_noise == tr["use_shared_noise"]
        assert (a.clip_dsm, a.clip_kl, a.use_ema_ref) == (tr["clip_dsm"], tr["clip_kl"], tr["use_ema_ref"])
        assert (a.ema_max_decay, a.ema_ramp_rate) == (tr["ema_ref_max_decay"], tr["ema_ref_ramp_rate"])
        assert act.micro_batch_size % r.n == 0  # whole groups per micro-batch (polyrl's DGPO)
    else:
        assert a.name == "awm" and a.off_policy == tr["off_policy"]
        assert (a.weighting, a.ghuber_power) == (tr["awm_weighting"], tr["ghuber_power"])
        assert act.micro_batch_size == tr["per_device_batch_size"]


# Flow-Factory @ b30dc00's DiffusionNFT configs (examples/nft/lora/flux1/default.yaml, wan21/t2v.yaml,
# qwen_image/rational_rewards_t2i.yaml), the keys polyrl maps; every one: piecewise_linear EMA flat_steps 0,
# ramp_rate 0.001, ema_decay 0.5 stepped at the epoch count (our `update` clock), ODE, off_policy, kl_beta 0, seed 42
FLOW_FACTORY_NFT = {
    "flux_nft": {"model": "flux", "lora": (64, 128), "nft_beta": 1, "num_train_timesteps": 2, "timestep_range": 0.7,
                 "resolution": (384, 384), "num_frames": 0, "num_inference_steps": 8, "guidance_scale": 1.0,
                 "per_device_batch_size": 1, "group_size": 16, "unique_sample_num_per_epoch": 48,
                 "learning_rate": 3.0e-4, "eval_freq": 20, "save_freq": 20},
    "wan21_nft": {"model": "wan", "lora": (128, 128), "nft_beta": 0.1, "num_train_timesteps": 4,
                  "timestep_range": 0.9, "resolution": (480, 832), "num_frames": 1, "num_inference_steps": 12,
                  "guidance_scale": 1.0, "per_device_batch_size": 1, "group_size": 16,
                  "unique_sample_num_per_epoch": 48, "learning_rate": 1.0e-4, "eval_freq": 20, "save_freq": 20},
    "qwen_image_nft": {"model": "qwen_image", "lora": (64, 128), "nft_beta": 1.0, "num_train_timesteps": 10,
                       "timestep_range": 0.5, "resolution": (512, 512), "num_frames": 0, "num_inference_steps": 30,
                       "guidance_scale": 1.0, "per_device_batch_size": 1, "group_size": 16,
                       "unique_sample_num_per_epoch": 32, "learning_rate": 2.0e-4, "eval_freq": 10, "save_freq": 20},
}


@pytest.mark.parametrize("recipe", sorted(FLOW_FACTORY_NFT))
def test_flow_factory_nft_recipes(recipe):
    theirs = FLOW_FACTORY_NFT[recipe]
    cfg = load_config([f"recipe={recipe}", "model.path=/x", "data.path=/y.txt", "reward.path=/z"])
    a, r, act = cfg.algorithm, cfg.rollout, cfg.actor
    assert cfg.model.name == theirs["model"] and cfg.model.dtype == "bfloat16" and a.name == "diffusion_nft"
    assert (act.lora_rank, act.lora_alpha, act.lora_targets) == (*theirs["lora"], None)
    assert a.mix_beta == theirs["nft_beta"] and a.adv_clip_max == 5.0 and a.adv_std == "group" and a.ref_coef == 0
    assert a.time_sampling == "discrete" and a.num_timesteps == theirs["num_train_timesteps"]
    assert list(a.timestep_range) == [0.0, theirs["timestep_range"]]
    assert (a.decay_clock, a.decay, a.decay_start, a.decay_slope, a.decay_max) == ("update", 0.0, 0, 0.001, 0.5)
    assert (r.height, r.width, r.num_frames, r.num_steps, r.guidance_scale, r.n, r.noise_level) == (
        *theirs["resolution"], theirs["num_frames"], theirs["num_inference_steps"], theirs["guidance_scale"],
        theirs["group_size"], 0.0)
    assert r.batch_size == act.micro_batch_size == theirs["per_device_batch_size"] and act.num_minibatches == 1
    assert cfg.data.prompts_per_step == theirs["unique_sample_num_per_epoch"]
    assert (act.lr, act.weight_decay, list(act.betas), act.eps, act.grad_clip) == (
        theirs["learning_rate"], *list(OPTIMIZER.values())[1:])
    assert (cfg.trainer.seed, cfg.trainer.eval_every, cfg.trainer.save_every) == (
        42, theirs["eval_freq"], theirs["save_freq"])
