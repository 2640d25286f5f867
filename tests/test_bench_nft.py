"""`polyrl bench --workload sd35m_nft` is one GPU's share of NVlabs/DiffusionNFT's SD3.5-M config, the work that
scripts/bench_diffusionnft_sd3.py runs through the authors' own loop (docs/performance.md "DiffusionNFT's own loop").

The official numbers are written out below from their config/nft.py `sd3_ocr` at 24af5554 (8 GPUs, 2 optimizer steps
per epoch): `_get_config` picks the largest per-GPU batch b ≤ 9 with 48·24 images divisible by 8·b and 8·b by 24,
so b = 9, 1152 / 72 = 16 batches per epoch and 16 / 2 = 8 accumulated batches per optimizer step. The tests that
read their files skip without a copy of the repository (.fg/DiffusionNFT, or $POLYRL_DIFFUSIONNFT); CI has none.
"""

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from polyrl.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
NFT_REPO = Path(os.environ.get("POLYRL_DIFFUSIONNFT", ROOT / ".fg" / "DiffusionNFT"))
OFFICIAL = {  # sd3_ocr, per GPU
    "sample.train_batch_size": 9, "sample.num_batches_per_epoch": 16, "train.gradient_accumulation_steps": 8,
    "resolution": 512, "sample.num_steps": 10, "sample.guidance_scale": 1.0, "sample.solver": "dpm2",
    "sample.deterministic": True, "train.timestep_fraction": 0.99, "beta": 0.1, "train.beta": 1.0e-4,
    "train.learning_rate": 3.0e-4, "train.adam_weight_decay": 1.0e-4, "train.max_grad_norm": 1.0,
    "train.adv_clip_max": 5, "decay_type": 2, "sample.num_image_per_prompt": 24,
}


def _workload_config(tiny: bool = False):
    from polyrl.cli.bench import TINY, WORKLOADS
    from polyrl.config import load_config

    recipe, extra = WORKLOADS["sd35m_nft"]
    return load_config([f"recipe={recipe}", *extra, *(TINY["sd35m_nft"] if tiny else []), "model.path=/unused",
                        "data.path=/unused"])


def test_sd35m_nft_workload_is_one_gpu_share_of_their_sd3_ocr_config():
    cfg = _workload_config()
    o = OFFICIAL
    images = o["sample.train_batch_size"] * o["sample.num_batches_per_epoch"]
    assert cfg.data.prompts_per_step * cfg.rollout.n == images == 144
    # the group: their sampler needs it to divide one GPU's batch of 9 (24 does not); 9 images per prompt
    assert cfg.rollout.n == o["sample.train_batch_size"]
    assert cfg.rollout.batch_size == cfg.actor.micro_batch_size == o["sample.train_batch_size"]
    # 2 optimizer steps per epoch, each over 8 micro-batches of 9 (their gradient accumulation)
    assert cfg.actor.num_minibatches == o["sample.num_batches_per_epoch"] // o["train.gradient_accumulation_steps"]
    assert images // cfg.actor.num_minibatches // cfg.actor.micro_batch_size == o["train.gradient_accumulation_steps"]
    assert (cfg.rollout.height, cfg.rollout.width) == (o["resolution"],) * 2
    assert cfg.rollout.num_steps == o["sample.num_steps"] and cfg.rollout.step == o["sample.solver"]
    assert cfg.rollout.guidance_scale == o["sample.guidance_scale"] and cfg.rollout.noise_level == 0.0
    assert cfg.algorithm.name == "diffusion_nft" and cfg.algorithm.time_sampling == "grid"
    assert cfg.algorithm.grid_fraction == o["train.timestep_fraction"]
    assert int(cfg.rollout.num_steps * cfg.algorithm.grid_fraction) == 9  # trained steps per sample
    assert cfg.algorithm.mix_beta == o["beta"] and cfg.algorithm.ref_coef == o["train.beta"]
    assert cfg.algorithm.adv_clip_max == o["train.adv_clip_max"]
    assert (cfg.algorithm.decay_start, cfg.algorithm.decay_slope, cfg.algorithm.decay_max) == (75, 0.0075, 0.999)
    assert cfg.actor.lr == o["train.learning_rate"] and cfg.actor.weight_decay == o["train.adam_weight_decay"]
    assert cfg.actor.grad_clip == o["train.max_grad_norm"]
    assert (cfg.actor.lora_rank, cfg.actor.lora_alpha, cfg.actor.eval_ema_decay) == (32, 64.0, 0.9)
    assert cfg.reward.name == "jpeg_compressibility" and cfg.reward["async"] is True
    assert cfg.model.max_sequence_length == 128  # their compute_text_embeddings(..., max_sequence_length=128)
    assert (cfg.trainer.eval_every, cfg.trainer.save_every) == (0, 0)


def _their_config():
    pytest.importorskip("ml_collections")
    if not (NFT_REPO / "config" / "nft.py").is_file():
        pytest.skip(f"no copy of NVlabs/DiffusionNFT at {NFT_REPO}")
    if "imp" not in sys.modules and importlib.util.find_spec("imp") is None:  # config/nft.py imports it (≤ 3.11)
        shim = types.ModuleType("imp")

        def load_source(name, path):
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module

        shim.load_source = load_source
        sys.modules["imp"] = shim
    spec = importlib.util.spec_from_file_location("their_nft_config", NFT_REPO / "config" / "nft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("sd3_ocr")


def test_the_official_numbers_are_theirs():
    theirs = _their_config()
    for key, value in OFFICIAL.items():
        got = theirs
        for part in key.split("."):
            got = got[part]
        assert got == value, key


def test_harness_runs_their_loop_on_the_tiny_pipeline_polyrl_bench_trains(tmp_path):
    """scripts/bench_diffusionnft_sd3.py --tiny on a CPU: their main() runs one epoch of 2 sampling batches of 2
    images; every transformer call is counted: 10 DPM-Solver-2 steps per batch, and per micro-batch and trained step
    (9 of 10) one forward with autograd and two without (the old adapter; the reference, adapters off). Then
    `polyrl bench --tiny --workload sd35m_nft` trains the same tiny model files with the same shape (about 30 s in
    all, hence out of CI with the copy of their repository)."""
    from transformers import AutoTokenizer

    pytest.importorskip("ml_collections")
    if not (NFT_REPO / "scripts" / "train_nft_sd3.py").is_file():
        pytest.skip(f"no copy of NVlabs/DiffusionNFT at {NFT_REPO}")
    out = tmp_path / "nft.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_diffusionnft_sd3.py"), "--repo", str(NFT_REPO),
                          "--tiny", "--epochs", "1", "--warmup-epochs", "0", "--work-dir", str(tmp_path / "work"),
                          "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    s = json.loads(out.read_text())
    assert not s["partial"] and s["measured_epochs"] == 1 and s["images_per_epoch"] == 4
    assert (s["batch_per_gpu"], s["batches_per_epoch"], s["grad_accum"], s["num_image_per_prompt"]) == (2, 2, 1, 2)
    assert (s["solver"], s["num_steps"], s["num_train_timesteps"], s["resolution"]) == ("dpm2", 10, 9, 64)
    assert s["pipeline_calls"] == 2 and s["reward_calls"] == 2
    assert s["transformer_calls_with_grad"] == 2 * 9  # one call per micro-batch of 2 and trained step
    assert s["transformer_calls_no_grad"] == 2 * 10 + 2 * 2 * 9
    assert s["images_per_second"] == pytest.approx(4 / s["seconds_per_epoch"])

    # polyrl on the same model folder and shape: 2 prompts × 2 images at 64², 2 optimizer steps of one micro-batch
    cfg = _workload_config(tiny=True)
    assert (cfg.data.prompts_per_step, cfg.rollout.n, cfg.rollout.batch_size, cfg.actor.micro_batch_size,
            cfg.actor.num_minibatches, cfg.rollout.height) == (2, 2, 2, 2, 2, 64)
    model = Path(s["build"]["model_dir"])
    # CLIP padded to 77 tokens and T5 to 128, as their encode_prompt pads them
    assert [AutoTokenizer.from_pretrained(str(model / t)).model_max_length for t in ("tokenizer", "tokenizer_3")] == [
        77, 128]
    bench = tmp_path / "bench"
    assert main(["bench", "--tiny", "--workload", "sd35m_nft", "--out", str(bench), "--model-dir", str(model),
                 "--epochs", "1", "--warmup", "0", "trainer.progress=false"]) == 0
    result = json.loads((bench / "bench.json").read_text())
    assert result["workload"] == "sd35_nft (tiny)" and result["summary"]["images_per_epoch"] == s["images_per_epoch"]
    assert result["history"][-1]["reward_extra/jpeg/kilobytes"] > 0
