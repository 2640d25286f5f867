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
