"""`polyrl bench`: the docs/benchmark.md workload through the normal training path, timed per stage.

It builds the random-weight pipeline of a workload at its published size (or a tiny one with `--tiny`, which runs
on a CPU) with `save_pretrained`, loads it back through the adapter's `from_pretrained` path, trains the workload's
recipe for `--warmup + --epochs` epochs, and reports the median of the measured epochs: images/s (and frames/s for
video), seconds per stage, MFU against the matmul rate measured on the same device, peak memory, versions.
Workloads: `sd35m` (docs/benchmark.md, recipe `sd35m_flowgrpo_bench`), `qwen_image` (`qwen_image_flowgrpo`), `wan22_5b`
(Wan2.2-TI2V-5B, recipe `wan22_flowgrpo`: full fine-tune at 704×1280, 9 frames), `wan22_a14b` (Wan2.2-T2V-A14B's two
experts, recipe `wan22_a14b_flowgrpo`: LoRA on both, the same shape; stored in float8 on disk), `grpo_lm` (GRPO on a
Qwen3-1.7B-shaped causal LM, recipe `causal_lm_grpo`: 8 prompts × 8 samples, 256 prompt tokens, 512 new tokens;
reports rollout and training tokens/s), `sd35m_nft` (DiffusionNFT as NVlabs/DiffusionNFT's `sd3_ocr` config trains
SD3.5-M, recipe `sd35_nft`, one GPU's share of it with the JPEG reward: the same work as
scripts/bench_diffusionnft_sd3.py runs through the authors' own loop).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ADJECTIVES = ["red", "tall", "old", "shiny", "small", "wooden", "happy", "giant"]
OBJECTS = ["robot", "cat", "tree", "lighthouse", "teapot", "dragon", "bicycle", "snowman"]
STAGES = ["text_encode", "rollout", "decode", "reward", "reward_wait", "old_logprob", "train", "weight_sync"]


def outside_stages(m: dict) -> float:
    """Seconds of a step's `time/step` that no stage timed: host work between the stages (drawing the noise,
    advantages, bookkeeping), while the device waits. decode is inside rollout and old_logprob inside train; an
    overlapped reward counts only its wait (`time/reward` is then the worker's busy time)."""
    reward = m.get("time/reward_wait", m.get("time/reward", 0.0))
    timed = sum(m.get(f"time/{s}", 0.0) for s in ("text_encode", "rollout", "train", "weight_sync")) + reward
    return m["time/step"] - timed


def bench_prompts(count: int) -> list[str]:
    """docs/benchmark.md's synthetic prompts: `a {adjective} {object} holding a sign that says "{i}"`."""
    return [f'a {ADJECTIVES[i % 8]} {OBJECTS[(i // 8) % 8]} holding a sign that says "{i}"' for i in range(count)]


def sd35_medium_spec(words: list[str]):
    """SD3.5-medium transformer and VAE at their published sizes, small CLIP/T5 stand-ins (docs/benchmark.md)."""
    from ..models.tiny import TinySD3Spec

    return TinySD3Spec(
        words=words, clip_hidden=64, clip_layers=1, clip_l_proj=768, clip_g_proj=1280, clip_max_length=77,
        t5_d_model=4096, t5_layers=1, t5_max_length=128, num_layers=24, heads=24, head_dim=64, latent_channels=16,
        image_size=512, sample_size=128, pos_embed_max_size=384, vae_channels=(128, 256, 512, 512), vae_layers=2,
        vae_norm_groups=32, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm", shift=3.0,
        vae_scaling_factor=1.5305, vae_shift_factor=0.0609,
    )


def tiny_spec(words: list[str], clip_max_length: int = 16, t5_max_length: int = 16):
    from ..models.tiny import TinySD3Spec

    return TinySD3Spec(words=words, latent_channels=16, image_size=64, vae_channels=(16, 32, 32, 32),
                       dual_attention_layers=(0,), qk_norm="rms_norm", clip_max_length=clip_max_length,
                       t5_max_length=t5_max_length)


LM_PROMPT_TOKENS, LM_NEW_TOKENS = 256, 512  # the grpo_lm workload's shape (tiny: 16 and 16)


def lm_words(vocab_size: int) -> list[str]:
    """The word tokenizer's vocabulary for `vocab_size` ids: `<unk>`, the three specials, then words t0, t1, ..."""
    return [f"t{i}" for i in range(vocab_size - 4)]


def build_causal_lm(directory: Path, tiny: bool, device: str) -> Path:
    """A Qwen3-1.7B-shaped random causal LM (28 layers, d=2048, 16/8 heads of 128, MLP 6144, vocabulary 151,936,
    tied embeddings) with a word tokenizer over that vocabulary, so every sampled id decodes; tiny: a CPU-sized one."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from ..models.tiny_lm import word_tokenizer

    vocab = 512 if tiny else 151_936
    tokenizer = word_tokenizer(lm_words(vocab))
    size = (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8) if tiny else
            dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128))
    config = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=40_960, rope_theta=1_000_000.0,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **size)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.float32 if tiny else torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def lm_prompts(count: int, tokens: int, vocab_size: int) -> list[dict]:
    """`count` rows of `tokens` random words (one token each, no chat template) with an `answer` for the reward."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size - 4, (count, tokens), generator=g)
    return [{"prompt": " ".join(f"t{int(i)}" for i in row), "answer": "1"} for row in ids]


def build_pipeline(directory: Path, tiny: bool, device: str, workload: str = "sd35m") -> Path:
    from ..models.tiny import save_tiny_qwen_image, save_tiny_sd3

    if (directory / "model_index.json").is_file() or (directory / "config.json").is_file():
        return directory
    words = sorted({w for p in bench_prompts(64) for w in p.replace('"', ' " ').split()})
    tmp = directory.with_name(directory.name + ".tmp")
    if workload == "grpo_lm":
        build_causal_lm(tmp, tiny, device)
    elif workload == "qwen_image":
        from ..models.tiny import TinyQwenImageSpec, qwen_image_bench_spec

        spec = TinyQwenImageSpec(words=words, image_size=64) if tiny else qwen_image_bench_spec(words)
        save_tiny_qwen_image(spec, tmp, device=device, dtype=torch.float32 if tiny else torch.bfloat16)
    elif workload == "wan22_5b":
        from ..models.tiny import TinyWanSpec, save_tiny_wan, wan_bench_spec

        spec = (TinyWanSpec(words=words, layout="wan2.2-ti2v", text_max_length=32) if tiny
                else wan_bench_spec(words, "wan2.2-ti2v"))
        save_tiny_wan(spec, tmp, device=device, dtype=torch.float32 if tiny else torch.bfloat16)
    elif workload == "wan22_a14b":
        from ..models.tiny import TinyWanSpec, save_tiny_wan, wan_bench_spec

        spec = (TinyWanSpec(words=words, layout="wan2.1", boundary_ratio=0.875, shift=12.0, text_max_length=32) if tiny
                else wan_bench_spec(words, "wan2.2-a14b"))
        # float8 on disk: both experts in bf16 would take 56 GB; the tiny one too, so CI exercises the cast at load
        save_tiny_wan(spec, tmp, device=device, dtype=torch.float32 if tiny else torch.bfloat16,
                      stored_dtype=torch.float8_e4m3fn)
    elif workload == "sd35m_nft" and tiny:  # DiffusionNFT's own loop pads CLIP to 77 tokens and T5 to 128
        save_tiny_sd3(tiny_spec(words, clip_max_length=77, t5_max_length=128), tmp, device=device)
    else:
        spec = tiny_spec(words) if tiny else sd35_medium_spec(words)
        save_tiny_sd3(spec, tmp, device=device, transformer_dtype=torch.float32 if tiny else torch.bfloat16)
    tmp.rename(directory)
    return directory


def measure_matmul_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float | None:
    """Dense bf16 matmul rate on random data (the MFU denominator, docs/algorithms.md §6); None off CUDA."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def versions() -> dict:
    import diffusers
    import peft
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
           "transformers": transformers.__version__, "peft": peft.__version__}
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
        out["gpu"] = torch.cuda.get_device_name()
    return out


def summarize(history: list[dict], warmup: int, images_per_epoch: int, frames_per_sample: int = 0,
              prompt_tokens: int = 0) -> dict:
    measured = [m for m in history if m.get("step", 0) > warmup and "time/step" in m]
    if not measured:
        raise ValueError("no measured epochs: use --epochs >= 1")
    med = lambda key: statistics.median(m.get(key, 0.0) for m in measured)
    step_s = med("time/step")
    out = {"epochs_measured": len(measured), "seconds_per_epoch": step_s, "images_per_epoch": images_per_epoch,
           "images_per_s": images_per_epoch / step_s, "stages_s": {s: med(f"time/{s}") for s in STAGES},
           "outside_stages_s": statistics.median(outside_stages(m) for m in measured),
           "model_tflop_per_epoch": med("perf/tflops"), "achieved_tflop_per_s": med("perf/achieved_tflops_per_s")}
    if frames_per_sample:  # video: the images of the unit are videos
        out["frames_per_s"] = out["images_per_s"] * frames_per_sample
    if all("ratio_absdev/first_minibatch" in m for m in measured):  # rollout vs training log-prob agreement
        out["ratio_absdev_first_minibatch"] = max(m["ratio_absdev/first_minibatch"] for m in measured)
    if all("perf/mfu" in m for m in measured):
        out["mfu"] = med("perf/mfu")
    if all("response_length/mean" in m for m in measured):  # a token policy: tokens/s of each stage
        response = [images_per_epoch * m["response_length/mean"] for m in measured]
        out["response_tokens_per_epoch"] = statistics.median(response)
        out["rollout_tokens_per_s"] = statistics.median(r / m["time/rollout"] for r, m in zip(response, measured, strict=True))
        out["train_tokens_per_s"] = statistics.median(
            (r + images_per_epoch * prompt_tokens) / m["time/train"] for r, m in zip(response, measured, strict=True))
    return out


def first_epoch(history: list[dict], setup_s: float) -> dict:
    """The cost of starting: `first_epoch_s` is step 1's wall time (compile warm-up included, as a fresh machine
    pays it) and `time_to_first_step_s` adds the setup before it (loading weights, building the optimizer)."""
    first = next((m for m in history if m.get("step") == 1 and "time/step" in m), None)
    if first is None:
        return {}
    return {"first_epoch_s": first["time/step"], "setup_s": setup_s, "time_to_first_step_s": setup_s + first["time/step"]}


def table(result: dict) -> str:
    s = result["summary"]
    unit = "videos/s" if "frames_per_s" in s else "samples/s" if "rollout_tokens_per_s" in s else "images/s"
    rows = [(unit, f"{s['images_per_s']:.3f}")]
    if "rollout_tokens_per_s" in s:
        rows += [("rollout tokens/s", f"{s['rollout_tokens_per_s']:.0f}"),
                 ("training tokens/s (prompt + response)", f"{s['train_tokens_per_s']:.0f}")]
    if "frames_per_s" in s:
        rows.append(("frames/s", f"{s['frames_per_s']:.3f}"))
    if result.get("world_size", 1) > 1:
        rows.append((f"{unit[:-2]}/s per GPU ({result['world_size']} GPUs)", f"{s['images_per_s_per_gpu']:.3f}"))
    rows.append(("s/epoch", f"{s['seconds_per_epoch']:.2f}"))
    if "first_epoch_s" in s:
        rows.append(("first epoch s (warm-up)", f"{s['first_epoch_s']:.2f} (+{s['setup_s']:.2f} setup)"))
    if s.get("compile_s"):
        rows.append(("  compiling s (whole run)", f"{s['compile_s']:.2f}"))
    rows += [(f"  {k} s", f"{v:.2f}") for k, v in s["stages_s"].items()]
    if "outside_stages_s" in s:
        rows.append(("  outside the stages s", f"{s['outside_stages_s']:.2f}"))
    rows += [("model TFLOP/epoch", f"{s['model_tflop_per_epoch']:.4g}"),
             ("achieved TFLOP/s", f"{s['achieved_tflop_per_s']:.4g}")]
    if "mfu" in s:
        rows.append(("MFU", f"{100 * s['mfu']:.1f}% of {result['peak_tflops']:.0f} TFLOP/s"))
    if result.get("peak_memory_gib") is not None:
        rows.append(("peak GPU memory" + (" (rank 0)" if result.get("world_size", 1) > 1 else ""),
                     f"{result['peak_memory_gib']:.1f} GiB"))
    if "ratio_absdev_first_minibatch" in s:
        rows.append(("|ρ−1| before any update", f"{s['ratio_absdev_first_minibatch']:.2e}"))
    rows.append(("precision", result["precision"]))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"| {k.ljust(width)} | {v} |" for k, v in rows)


WORKLOADS = {  # name -> (recipe, extra overrides at full size)
    "sd35m": ("sd35m_flowgrpo_bench", []),
    # docs/benchmark.md second workload; 4 prompts x 16 images per step keeps one step inside a short device call
    # (images/s does not depend on the number of prompts at a fixed per-call batch)
    "qwen_image": ("qwen_image_flowgrpo", ["data.prompts_per_step=4", "trainer.eval_every=0", "trainer.save_every=0",
                                           "trainer.tensorboard=false"]),
    # the Wan2.2 recipe's shape and work per video (704×1280, 9 frames, 10 steps, window 2, CFG 5, full fine-tune);
    # 2 prompts × 8 videos per step instead of 64 × 8 (videos/s does not depend on it at a fixed per-call batch)
    # GRPO on a Qwen3-1.7B-shaped LM: 8 prompts × 8 samples, 256 prompt tokens, exactly 512 new tokens (no stop:
    # random weights rarely sample EOS), LoRA r=32 and 4 minibatches as the recipe sets them
    "grpo_lm": ("causal_lm_grpo", ["data.prompts_per_step=8", "rollout.n=8", "rollout.batch_size=64",
                                   f"rollout.max_new_tokens={LM_NEW_TOKENS}", "model.max_sequence_length=1024",
                                   "trainer.eval_every=0", "trainer.save_every=0", "trainer.tensorboard=false"]),
    "wan22_5b": ("wan22_flowgrpo", ["data.prompts_per_step=2", "rollout.batch_size=4", "actor.micro_batch_size=1",
                                    "actor.num_minibatches=1", "model.max_sequence_length=512", "trainer.eval_every=0",
                                    "trainer.save_every=0", "trainer.tensorboard=false"]),
    # Wan2.2-T2V-A14B (two 14 B experts switched at boundary 0.875) as recipe wan22_a14b_flowgrpo trains it (LoRA r64
    # on both experts, activation checkpointing, 704×1280, 9 frames, 10 steps, window 2, CFG 4 / 3); 1 prompt × 4
    # videos per step
    "wan22_a14b": ("wan22_a14b_flowgrpo", ["data.prompts_per_step=1", "rollout.n=4", "actor.num_minibatches=1",
                                           "trainer.eval_every=0", "trainer.save_every=0", "trainer.tensorboard=false"]),
    # DiffusionNFT's SD3.5-M config (NVlabs/DiffusionNFT config/nft.py `sd3_ocr`, recipe sd35_nft: 512², 10 DPM-Solver-2
    # steps, no CFG, 9 of 10 grid steps trained, LoRA r32, old / current / reference forwards) as one of its 8 GPUs
    # runs it: 16 sampling batches of 9 = 144 images and 2 optimizer steps per epoch. Groups of 9 images (theirs 24:
    # on one GPU their sampler needs the group to divide the batch of 9; the work per image is the same), the JPEG
    # reward scored on a thread as theirs is (reward.async), polyrl's compiled blocks (docs/performance.md
    # "DiffusionNFT's own loop")
    "sd35m_nft": ("sd35_nft", ["reward=jpeg_compressibility", "data.prompts_per_step=16", "rollout.n=9",
                               "reward.async=true", "model.compile=blocks", "trainer.eval_every=0",
                               "trainer.save_every=0", "trainer.tensorboard=false"]),
}
TINY = {  # name -> overrides that make the workload's tiny pipeline run on a CPU in seconds
    "grpo_lm": ["rollout.max_new_tokens=16", "data.prompts_per_step=2", "rollout.n=4", "model.dtype=float32"],
    "sd35m": ["rollout.height=64", "rollout.width=64", "rollout.n=4", "data.prompts_per_step=2", "model.dtype=float32",
              "model.compile=none", "model.max_sequence_length=16", "actor.micro_batch_size=4"],
    "qwen_image": ["rollout.height=64", "rollout.width=64", "rollout.n=4", "data.prompts_per_step=2",
                   "model.dtype=float32", "model.compile=none", "model.max_sequence_length=16",
                   "actor.micro_batch_size=4"],
    "wan22_5b": ["rollout.height=64", "rollout.width=64", "rollout.num_frames=5", "rollout.num_steps=4", "model.compile=none",
                 "rollout.sde_window_range=[0,2]", "rollout.n=2", "model.dtype=float32", "model.max_sequence_length=16",
                 "actor.micro_batch_size=2", "reward.frames=2"],
}
TINY["wan22_a14b"] = TINY["wan22_5b"]  # the same tiny video shape; the A14B tiny pipeline has two experts
# 2 prompts × 2 images at 64²: 2 sampling batches of 2 and 2 optimizer steps, as the harness's --tiny runs it
TINY["sd35m_nft"] = ["rollout.height=64", "rollout.width=64", "rollout.n=2", "data.prompts_per_step=2",
                     "rollout.batch_size=2", "actor.micro_batch_size=2", "model.dtype=float32", "model.compile=none"]


def wait_for(path: Path, timeout_s: float) -> None:
    """Block until rank 0 has written `path` (the pipeline is built before it)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not write {path} within {timeout_s:.0f} s")
        time.sleep(0.5)


def run_bench(out: Path, tiny: bool, epochs: int, warmup: int, overrides: list[str], model_dir: Path | None = None,
              workload: str = "sd35m", profile: bool = False) -> dict:
    from ..config import load_config
    from ..distributed.engine import pick_device
    from ..perf.compile import compile_seconds
    from ..trainer.loop import Trainer

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    out.mkdir(parents=True, exist_ok=True)
    device = pick_device("cpu" if tiny and not torch.cuda.is_available() else "auto")
    if device.type == "cuda" and world > 1:  # under torchrun: this rank's GPU, as the training engine picks it
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    model_dir = model_dir or out / f"{workload}_{'tiny' if tiny else 'random'}"
    prompt_tokens = (16 if tiny else LM_PROMPT_TOKENS) if workload == "grpo_lm" else 0
    prompts = out / ("prompts.jsonl" if workload == "grpo_lm" else "prompts.txt")
    run_dir = out / "run"
    if rank == 0:  # one rank builds and writes; the others wait for its marker below (no process group yet)
        build_pipeline(model_dir, tiny, device.type, workload)
        if workload == "grpo_lm":
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            text = "".join(json.dumps(r) + "\n" for r in lm_prompts(64, prompt_tokens, vocab))
        else:
            text = "\n".join(bench_prompts(64)) + "\n"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        prompts.write_text(text)
    # one marker per torchrun launch, so that a later launch never reads an earlier launch's files as ready
    ready = out / f".ready-{os.environ.get('TORCHELASTIC_RUN_ID', 'single')}"
    if rank == 0 and world > 1:
        ready.touch()
    elif rank > 0:
        wait_for(ready, timeout_s=3600)
    build_s = time.perf_counter() - t0
    peak = measure_matmul_tflops(device)
    recipe, extra = WORKLOADS[workload]
    base = [f"recipe={recipe}", *extra, f"model.path={model_dir}", f"data.path={prompts}",
            f"trainer.output_dir={out / 'run'}", f"trainer.max_steps={warmup + epochs + int(profile)}",
            f"trainer.device={device.type}"]
    if tiny:
        base += TINY[workload]
    if peak:
        base.append(f"trainer.peak_tflops={peak}")
    cfg = load_config(base + list(overrides))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_setup = time.perf_counter()
    compiling_before = compile_seconds()
    trainer = Trainer(cfg)
    setup_s = time.perf_counter() - t_setup
    if profile:  # one more epoch after the measured ones, under the profiler (its overhead stays out of the figures)
        from ..perf.profile import profiled

        one_step = trainer._one_step

        def step_maybe_profiled():
            if trainer.step < warmup + epochs or rank:  # under torchrun rank 0 alone writes the profile
                return one_step()
            with profiled(out):
                return one_step()

        trainer._one_step = step_maybe_profiled
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    if rank:  # rank 0 holds the history (the step's numbers are global) and writes the report
        return {}
    measured = [m for m in history if m.get("step", 0) <= warmup + epochs]
    images = cfg.data.prompts_per_step * cfg.rollout.n
    stack = versions()
    result = {
        "workload": recipe + (" (tiny)" if tiny else ""),
        "date": time.strftime("%Y-%m-%d"), "device": stack.get("gpu", platform.processor() or "cpu"),
        "versions": stack, "overrides": list(overrides), "build_pipeline_s": build_s,
        "precision": (f"network {cfg.model.dtype}, trainable master weights float32, log-probs from float32 logits, "
                      f"compile={cfg.model.compile}, decoding CUDA graphs="
                      f"{dict(cfg.model.options).get('cuda_graphs', True) and device.type == 'cuda'}" if prompt_tokens else
                      f"transformer {cfg.model.dtype} (autocast), trainable master weights float32, step math float32, "
                      f"VAE weights float32 (decode autocast to the network dtype), compile={cfg.model.compile}, "
                      f"fp8={cfg.model.fp8}, training_graph={cfg.rollout.training_graph}"),
        "peak_tflops": cfg.trainer.peak_tflops,
        "summary": {**summarize(measured, warmup, images, cfg.rollout.num_frames, prompt_tokens),
                    **first_epoch(measured, setup_s), "compile_s": compile_seconds() - compiling_before},
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "world_size": world,
        "history": history,
    }
    result["summary"]["images_per_s_per_gpu"] = result["summary"]["images_per_s"] / world
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    (out / "bench.md").write_text(table(result) + "\n")
    return result


def main(args: list[str]) -> int:
    p = argparse.ArgumentParser(prog="polyrl bench", description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny pipeline at 64x64 (runs on a CPU in seconds)")
    p.add_argument("--epochs", type=int, default=2, help="measured epochs (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--model-dir", default=None, help="reuse (or create) the random pipeline here")
    p.add_argument("--workload", default="sd35m", choices=sorted(WORKLOADS))
    p.add_argument("--profile", action="store_true",
                   help="profile one more epoch after the measured ones: <out>/profile.md (per stage and phase: wall, "
                        "device-busy and idle seconds; kernels by kind; the largest kernels and host ops; on a GPU the "
                        "host-device synchronisations by Python stack)")
    a, overrides = p.parse_known_args(args)
    result = run_bench(Path(a.out), a.tiny, a.epochs, a.warmup, overrides, Path(a.model_dir) if a.model_dir else None,
                       a.workload, a.profile)
    if int(os.environ.get("RANK", "0")):
        return 0
    print(table(result))
    print(f"polyrl: wrote {Path(a.out) / 'bench.json'}" + (f" and {Path(a.out) / 'profile.md'}" if a.profile else ""),
          file=sys.stderr)
    return 0
