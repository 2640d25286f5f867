"""Every real-model recipe through the CLI, stage by stage: the validation matrix of issue 47.

For each recipe of polyrl/config/recipe/ that is not a toy one, a random-weight checkpoint is built once, then:

  train    `polyrl train recipe=R` for 2 steps, a checkpoint after each;
  resume   `polyrl train ... trainer.resume=auto` to step 3;
  export   `polyrl export` of step 3 (a LoRA for `pipe.load_lora_weights`, or `--merge` for a full fine-tune), then
           the export loaded into the family's diffusers pipeline class (transformers models: polyrl export writes
           diffusers pipelines only, so the stage is "n/a" there);
  eval     `polyrl eval` of step 3 on 4 prompts.

Per recipe: pass / fail / n/a of each stage, s/step (step 2: step 1 pays compilation), peak GPU memory (the
`memory/peak_gib` metric), MFU (with the card's measured matmul rate as `trainer.peak_tflops`), |ρ−1| before any
update, and the memory plan's estimate beside the measured peak. Results: docs/bench/gpu_matrix_<date>.json (rows
merge into an existing file of the same date, so several device calls fill one table) and a table in
docs/gpu_matrix.md (card, date, commit).

    python scripts/gpu_matrix.py                       # on a GPU: published sizes where bench has a builder
    python scripts/gpu_matrix.py --only sd35_flowgrpo,wan22_flowgrpo
    python scripts/gpu_matrix.py --only sd35_flowgrpo --out /tmp/gm --results $OUT --deadline 500 --stage-timeout 300
                                                       # a device call: results in $OUT after every row, no stage
                                                       # past 500 s, none longer than 300 s
    python scripts/gpu_matrix.py --tiny                # the same matrix on the CPU with tiny random checkpoints
    python scripts/gpu_matrix.py --deterministic       # two 2-step runs with trainer.deterministic=true per row
                                                       # (SD3.5-M bf16 and FP8, Wan2.2-TI2V-5B, a token policy):
                                                       # bit-identical checkpoints? and s/step with / without

Published sizes come from `polyrl bench`'s builders (polyrl/cli/bench.py: SD3.5-M, Qwen-Image, Wan2.2-TI2V-5B and
-T2V-A14B, a Qwen3-1.7B-shaped LM), their text encoders the bench's small stand-ins (each row says which). A recipe
without such a builder runs its tiny checkpoint on the GPU instead (`size: tiny`), and says so. A published row whose
memory plan does not fit the card is not run and gets the plan's layout instead. Tiny checkpoints are
polyrl/models/tiny.py's builders, or the families' test builders (tests/), which is why --tiny runs from a clone.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
REWARDS_FILE = Path(__file__).resolve().parent / "matrix_rewards.py"
SHAPE_PROMPTS = ["two red circles above a blue square", "a green triangle", "three yellow squares",
                 "a blue circle to the left of a red triangle"]
AUDIO_PROMPTS = ["a dog barks loudly", "soft piano melody", "birds sing at dawn", "a dog barks in the rain"]
EDIT_PROMPTS = ["make the circle red", "turn the square blue", "add a green triangle", "make the triangle blue"]
IMAGE_REWARD = ["reward=jpeg_compressibility"]  # model-free: the recipes' own learned scorers need checkpoints
AUDIO_REWARD = ["--import", str(REWARDS_FILE), "reward=audio_energy"]
TINY_COMMON = ["model.dtype=float32", "model.compile=none", "rollout.n=2", "data.prompts_per_step=2"]
LORA_TINY = ["actor.lora_rank=4", "actor.lora_alpha=8"]
IMAGE_TINY = ["rollout.height=32", "rollout.width=32", "rollout.num_steps=3", "rollout.batch_size=4",
              "actor.micro_batch_size=2", "actor.num_minibatches=1"]
IMAGE_TINY_STEPS = [a for a in IMAGE_TINY if not a.startswith("rollout.num_steps=")]
VIDEO_TINY = ["rollout.height=32", "rollout.width=32", "rollout.num_frames=5", "rollout.num_steps=3",
              "rollout.batch_size=4", "actor.micro_batch_size=2", "actor.num_minibatches=1", "reward.frames=2",
              "model.max_sequence_length=16", "rollout.sde_window_range=[0,1]"]


def words(prompts: list[str]) -> list[str]:
    return sorted({w for p in prompts for w in p.replace('"', " ").split()})


def tests_module(name: str):
    """A test module's builders (tests/ is not a package: put it on sys.path first)."""
    import importlib

    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    return importlib.import_module(name)


# ----------------------------------------------------------------------------------------------- tiny builders
def tiny_sd3(d: Path) -> Path:
    from polyrl.models.tiny import TinySD3Spec, save_tiny_sd3

    return save_tiny_sd3(TinySD3Spec(words=words(SHAPE_PROMPTS), image_size=32, t5_max_length=16), d)


def tiny_qwen_image(d: Path) -> Path:
    from polyrl.models.tiny import TinyQwenImageSpec, save_tiny_qwen_image

    return save_tiny_qwen_image(TinyQwenImageSpec(words=words(SHAPE_PROMPTS), image_size=32), d)


def tiny_qwen_edit(plus: bool) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        from polyrl.models.tiny import TinyQwenImageEditSpec, save_tiny_qwen_image_edit

        return save_tiny_qwen_image_edit(TinyQwenImageEditSpec(words=words(EDIT_PROMPTS), plus=plus), d)

    return build


def tiny_wan(**spec) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        from polyrl.models.tiny import TinyWanSpec, save_tiny_wan

        return save_tiny_wan(TinyWanSpec(words=words(SHAPE_PROMPTS), text_max_length=16, **spec), d)

    return build


def tiny_flux(layout: str) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        from polyrl.models.tiny import TinyFluxSpec, save_tiny_flux

        return save_tiny_flux(TinyFluxSpec(words=words(SHAPE_PROMPTS + EDIT_PROMPTS), layout=layout), d)

    return build


def tiny_flux2(d: Path) -> Path:
    from polyrl.models.tiny import TinyFlux2Spec, save_tiny_flux2

    return save_tiny_flux2(TinyFlux2Spec(words=words(SHAPE_PROMPTS), layout="klein", text_max_length=48), d)


def tiny_lm(d: Path) -> Path:
    from polyrl.models.tiny_lm import save_tiny_causal_lm

    return save_tiny_causal_lm(d)


def tiny_from_tests(module: str, fn: str, *args, save: bool = False, **kwargs) -> Callable[[Path], Path]:
    """A builder of tests/<module>.py: `fn(d, *args)` writes the checkpoint, or (`save`) `fn(*args)` returns a
    pipeline to `save_pretrained`."""
    def build(d: Path) -> Path:
        f = getattr(tests_module(module), fn)
        if save:
            f(*args, **kwargs).save_pretrained(str(d))
        else:
            f(d, *args, **kwargs)
        return d

    return build


def tiny_janus(d: Path) -> Path:
    import torch
    from transformers import (
        JanusConfig,
        JanusForConditionalGeneration,
        JanusVisionConfig,
        JanusVQVAEConfig,
        LlamaConfig,
    )

    m = tests_module("test_janus_pro")
    tok = m.janus_tokenizer(words(m.PROMPTS))
    text = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    vision = JanusVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=16,
                               projection_dim=32, num_image_tokens=m.IMAGE_TOKENS, mlp_ratio=2)
    vq = JanusVQVAEConfig(embed_dim=4, num_embeddings=m.CODEBOOK, latent_channels=32, base_channels=32,
                          channel_multiplier=[1, 1, 1], num_res_blocks=1, projection_dim=32, image_token_embed_dim=32)
    config = JanusConfig(text_config=text, vision_config=vision, vq_config=vq,
                         image_token_id=tok.convert_tokens_to_ids("<image_placeholder>"))
    torch.manual_seed(0)
    JanusForConditionalGeneration(config).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def tiny_minimax(d: Path) -> Path:
    tests_module("minimax_h3_tiny").save_tiny(str(d))
    return d


# ----------------------------------------------------------------------------------------------- published builders
def bench_builder(workload: str) -> Callable[[Path, str], Path]:
    def build(d: Path, device: str) -> Path:
        from polyrl.cli.bench import build_pipeline

        return build_pipeline(d, tiny=False, device=device, workload=workload)

    return build


def published_ti2v(d: Path, device: str) -> Path:
    """Wan2.2-TI2V-5B at its published size as image-to-video (bench's wan22_5b spec, first-frame condition)."""
    import dataclasses

    import torch

    from polyrl.cli.bench import bench_prompts
    from polyrl.models.tiny import save_tiny_wan, wan_bench_spec

    if (d / "model_index.json").is_file():
        return d
    spec = dataclasses.replace(wan_bench_spec(words(bench_prompts(64)), "wan2.2-ti2v"), image_to_video=True)
    return save_tiny_wan(spec, d, device=device, dtype=torch.bfloat16)


BENCH_STAND_INS = {
    "sd35m": "SD3.5-M transformer and VAE; CLIP-L/G (1 layer, hidden 64) and T5 (1 layer, d 4096) stand-ins",
    "qwen_image": "Qwen-Image transformer (20.4 B) and VAE; one-layer Qwen2.5-VL text stand-in of width 3584",
    "wan22_5b": "Wan2.2-TI2V-5B transformer and VAE; one-layer UMT5 stand-in of width 4096",
    "wan22_a14b": "Wan2.2-T2V-A14B's two 14 B experts (float8 on disk) and the Wan2.1 VAE; one-layer UMT5 stand-in",
    "grpo_lm": "Qwen3-1.7B-shaped LM (28 layers, d 2048), word tokenizer over its 151,936 ids",
}


@dataclass
class Row:
    recipe: str
    data: str  # what the data file holds: prompts | audio | edit | edit_plus | i2v | math | pairs | omni | rewrite
    tiny: Callable[[Path], Path]
    tiny_args: list[str]
    reward: list[str] = field(default_factory=lambda: list(IMAGE_REWARD))
    published: Callable[[Path, str], Path] | None = None
    workload: str | None = None  # bench workload of the published builder (its stand-ins)
    published_args: list[str] = field(default_factory=list)  # what one GPU's call can hold (the row says so)
    export: str = "lora"  # lora | merge | n/a: <why>
    note: str = ""


TOKEN_TINY = ["model.dtype=float32", "rollout.n=2", "data.prompts_per_step=2", "rollout.max_new_tokens=8",
              "rollout.batch_size=4", "actor.num_minibatches=1", "actor.micro_batch_size=2", *LORA_TINY]
ROWS = [
    Row("sd35_flowgrpo", "prompts", tiny_sd3, [*TINY_COMMON, *IMAGE_TINY, *LORA_TINY, "model.max_sequence_length=16"],
        published=bench_builder("sd35m"), workload="sd35m", published_args=["data.prompts_per_step=2"]),
    Row("sd35m_flowgrpo_bench", "prompts", tiny_sd3,
        [*TINY_COMMON, *IMAGE_TINY, *LORA_TINY, "model.max_sequence_length=16", "rollout.sde_window_size=2"],
        published=bench_builder("sd35m"), workload="sd35m"),
    *[Row(recipe, "prompts", tiny_sd3, [*TINY_COMMON, *IMAGE_TINY_STEPS, *LORA_TINY, "model.max_sequence_length=16"],
          published=bench_builder("sd35m"), workload="sd35m", published_args=["data.prompts_per_step=2"],
          note="the recipe's own rollout steps (its time sampling reads them)")
      for recipe in ("sd35_nft", "sd35_nft_pickscore", "sd35_awm", "sd35_dgpo")],
    Row("qwen_image_nft", "prompts", tiny_qwen_image,
        [*TINY_COMMON, *IMAGE_TINY_STEPS, *LORA_TINY, "model.max_sequence_length=16", "rollout.num_steps=10"],
        published=bench_builder("qwen_image"), workload="qwen_image",
        published_args=["data.prompts_per_step=1", "actor.micro_batch_size=2"],
        note="published: 1 prompt × 16 images, 2 per training call, eager without checkpointing (an 80 GB card)"),
    Row("flux_nft", "prompts", tiny_flux("dev"), [*TINY_COMMON, *IMAGE_TINY_STEPS, *LORA_TINY,
                                                  "model.max_sequence_length=16"]),
    Row("wan21_nft", "prompts", tiny_wan(layout="wan2.1"),
        [*TINY_COMMON, *IMAGE_TINY_STEPS, *LORA_TINY, "model.max_sequence_length=16"]),
    Row("qwen3_omni_speech_grpo", "math", tiny_from_tests("omni_speech_tiny", "save_tiny_omni"),
        [*TOKEN_TINY, "model.options.max_speech_frames=6", "actor.lora_rank=0", "rollout.max_new_tokens=4"],
        reward=["reward=format", "reward.pattern='.*[a-m].*'"],
        export="n/a: a transformers model (polyrl export writes diffusers pipelines)",
        note="full fine-tune here (the speech stack's tiny LoRA targets are the tests'); reward format"),
    Row("qwen_image_flowgrpo", "prompts", tiny_qwen_image,
        [*TINY_COMMON, *IMAGE_TINY, *LORA_TINY, "model.max_sequence_length=16", "rollout.sde_window_range=[0,1]",
         "actor.gradient_checkpointing=false"],
        published=bench_builder("qwen_image"), workload="qwen_image",
        published_args=["data.prompts_per_step=1", "rollout.batch_size=8", "actor.micro_batch_size=4"],
        note="published: 1 prompt × 16 images, 8 per sampling call, 4 per training call (an 80 GB card)"),
    Row("qwen_image_edit_flowgrpo", "edit", tiny_qwen_edit(False),
        [*TINY_COMMON, *IMAGE_TINY, *LORA_TINY, "model.condition_size=64", "rollout.sde_window_range=[0,1]",
         "rollout.sde_window_size=2"]),
    Row("qwen_image_edit_plus_flowgrpo", "edit_plus", tiny_qwen_edit(True),
        [*TINY_COMMON, *IMAGE_TINY, *LORA_TINY, "model.condition_size=64", "model.vl_condition_size=48",
         "rollout.sde_window_range=[0,1]", "rollout.sde_window_size=2"]),
    Row("flux_flowgrpo", "prompts", tiny_flux("dev"), [*TINY_COMMON, *IMAGE_TINY, *LORA_TINY, "model.max_sequence_length=16",
                                                       "rollout.sde_window_size=2"]),
    Row("flux_kontext_flowgrpo", "edit", tiny_flux("kontext"),
        [*TINY_COMMON, *IMAGE_TINY, *LORA_TINY, "model.max_sequence_length=16", "model.condition_size=64",
         "rollout.sde_window_size=2"]),
    Row("flux2_flowgrpo", "prompts", tiny_flux2, [*TINY_COMMON, *IMAGE_TINY, *LORA_TINY, "model.max_sequence_length=48",
                                                  "rollout.num_steps=4"]),
    Row("z_image_flowgrpo", "prompts", tiny_from_tests("test_z_image", "save_tiny_z_image", {"shift": 3.0}),
        [*TINY_COMMON, *IMAGE_TINY, *LORA_TINY, "model.max_sequence_length=40", "rollout.num_steps=4"]),
    Row("hunyuan_image_flowgrpo", "prompts", tiny_from_tests("test_hunyuan_image", "save_tiny_hunyuan_image", True),
        [*TINY_COMMON, *IMAGE_TINY[2:], *LORA_TINY, "rollout.height=16", "rollout.width=16", "rollout.num_steps=4"]),
    Row("wan22_flowgrpo", "prompts", tiny_wan(layout="wan2.1"), [*TINY_COMMON, *VIDEO_TINY],
        published=bench_builder("wan22_5b"), workload="wan22_5b", export="merge",
        published_args=["data.prompts_per_step=1", "rollout.batch_size=4", "actor.micro_batch_size=1",
                        "actor.num_minibatches=1", "actor.gradient_checkpointing=true"],
        note="published: full fine-tune, 1 prompt × 8 videos, checkpointed (an 80 GB card)"),
    Row("wan22_a14b_flowgrpo", "prompts", tiny_wan(layout="wan2.1", boundary_ratio=0.875),
        [*TINY_COMMON, *VIDEO_TINY, *LORA_TINY, "rollout.num_steps=10", "rollout.sde_window_range=[6,7]"],
        published=bench_builder("wan22_a14b"), workload="wan22_a14b",
        published_args=["data.prompts_per_step=1", "rollout.n=4", "actor.num_minibatches=1",
                        "rollout.sde_window_range=[6,6]", "model.compile=none"],
        note="published: 1 prompt × 4 videos, a window that trains both experts, eager (compiled: 83 GiB measured)"),
    Row("wan22_ti2v_flowgrpo", "i2v", tiny_wan(layout="wan2.2-ti2v", image_to_video=True),
        [*TINY_COMMON, *VIDEO_TINY, "rollout.height=64", "rollout.num_frames=9"], published=published_ti2v, workload="wan22_5b",
        export="merge",
        published_args=["data.prompts_per_step=1", "rollout.batch_size=4", "actor.micro_batch_size=1",
                        "actor.num_minibatches=1", "actor.gradient_checkpointing=true"],
        note="published: full fine-tune, 1 prompt × 8 videos, checkpointed (an 80 GB card)"),
    Row("ltx2_flowgrpo", "prompts", tiny_from_tests("test_ltx2", "build_tiny_ltx2", "ltx2.3", save=True),
        [*TINY_COMMON, *LORA_TINY, "model.max_sequence_length=16", "rollout.height=32", "rollout.width=32",
         "rollout.num_frames=9", "rollout.fps=25.0", "rollout.num_steps=4", "rollout.batch_size=2",
         "rollout.sde_window_size=2", "rollout.sde_window_range=[0,2]", "actor.num_minibatches=1",
         "actor.micro_batch_size=2", "reward.frames=2"]),
    Row("minimax_h3_flowgrpo", "prompts", tiny_minimax,
        [*TINY_COMMON, *LORA_TINY, "rollout.height=32", "rollout.width=64", "rollout.num_frames=124",
         "rollout.num_steps=3", "rollout.batch_size=2", "rollout.sde_window_size=2", "rollout.sde_window_range=[0,1]",
         "actor.num_minibatches=1", "actor.micro_batch_size=2", "reward.frames=2"],
        export="n/a: MiniMax-H3 is a diffusers modular pipeline (modular_model_index.json), which polyrl export does "
               "not write"),
    Row("stable_audio_flowgrpo", "audio", tiny_from_tests("test_stable_audio", "build_tiny_sao", save=True),
        [*TINY_COMMON, *LORA_TINY, "model.options.seconds=0.4", "rollout.num_steps=4", "rollout.batch_size=4",
         "rollout.sde_window_size=2", "rollout.sde_window_range=[0,2]", "actor.num_minibatches=1",
         "actor.micro_batch_size=2"], reward=list(AUDIO_REWARD)),
    Row("stable_audio_3_flowgrpo", "audio", tiny_from_tests("test_stable_audio3", "build_tiny_sa3", save=True),
        [*TINY_COMMON, *LORA_TINY, "model.options.seconds=0.3", "rollout.num_steps=3", "rollout.batch_size=4",
         "actor.num_minibatches=1", "actor.micro_batch_size=2"], reward=list(AUDIO_REWARD)),
    Row("ace_step_flowgrpo", "audio", tiny_from_tests("test_ace_step", "build_tiny_ace", save=True),
        [*TINY_COMMON, *LORA_TINY, "model.options.seconds=0.3", "rollout.num_steps=4", "rollout.batch_size=4",
         "rollout.sde_window_size=2", "rollout.sde_window_range=[0,2]", "actor.num_minibatches=1",
         "actor.micro_batch_size=2"], reward=list(AUDIO_REWARD)),
    Row("bagel_flowgrpo", "prompts", tiny_from_tests("test_bagel", "save_tiny_bagel"),
        [*TINY_COMMON, *IMAGE_TINY, *LORA_TINY, "model.max_sequence_length=32", "rollout.sde_window_range=[0,1]"],
        export="n/a: BAGEL has no diffusers or transformers class (polyrl's own port)"),
    Row("janus_pro_grpo", "janus", tiny_janus,
        [*TOKEN_TINY, "model.options.cfg_weight=3", "rollout.max_new_tokens=16"],
        export="n/a: a transformers model (polyrl export writes diffusers pipelines)"),
    Row("qwen3_omni_grpo", "omni", tiny_from_tests("test_qwen3_omni", "save_tiny_thinker"),
        [*TOKEN_TINY, "model.max_sequence_length=256"], reward=["reward=math_answer"],
        export="n/a: a transformers model (polyrl export writes diffusers pipelines)"),
    Row("causal_lm_grpo", "math", tiny_lm, TOKEN_TINY, reward=["reward=math_answer"],
        published=bench_builder("grpo_lm"), workload="grpo_lm",
        published_args=["data.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=512",
                        "model.max_sequence_length=1024"],
        export="n/a: a transformers model (polyrl export writes diffusers pipelines)"),
    Row("causal_lm_dpo", "pairs", tiny_lm, TOKEN_TINY, reward=["reward=math_answer"],
        published=bench_builder("grpo_lm"), workload="grpo_lm", published_args=["data.prompts_per_step=8"],
        export="n/a: a transformers model (polyrl export writes diffusers pipelines)"),
    Row("prompt_rewriter", "rewrite", tiny_lm,
        [*TOKEN_TINY, "reward.rollout.height=32", "reward.rollout.width=32", "reward.rollout.num_steps=2"],
        reward=[], published=bench_builder("grpo_lm"), workload="grpo_lm",
        published_args=["data.prompts_per_step=4", "rollout.n=4"],
        export="n/a: a transformers model (polyrl export writes diffusers pipelines)",
        note="the frozen generator is the shipped toy_shapes model at every size"),
]
BY_NAME = {r.recipe: r for r in ROWS}
DETERMINISTIC = {  # name -> (row, overrides): issue 47 item 4
    "sd35m_bf16": ("sd35m_flowgrpo_bench", ["model.fp8=false"]),
    "sd35m_fp8": ("sd35m_flowgrpo_bench", ["model.fp8=true"]),
    "wan22_ti2v_5b": ("wan22_flowgrpo", []),
    "causal_lm_grpo": ("causal_lm_grpo", []),
}


def real_recipes() -> list[str]:
    return sorted(p.stem for p in (ROOT / "polyrl" / "config" / "recipe").glob("*.yaml")
                  if not p.stem.startswith("toy_"))


# ----------------------------------------------------------------------------------------------- data
def write_images(root: Path, count: int) -> list[str]:
    import numpy as np
    from PIL import Image

    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = []
    for i in range(count):
        h, w = (48, 40) if i % 2 else (32, 48)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "images" / f"{i}.png")
        names.append(f"images/{i}.png")
    return names


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_data(row: Row, root: Path, tiny: bool) -> tuple[list[str], list[str]]:
    """(training data overrides, evaluation data overrides) for the row, 4 prompts each."""
    root.mkdir(parents=True, exist_ok=True)
    if row.data in ("prompts", "audio", "janus"):
        if row.data == "janus":
            prompts = tests_module("test_janus_pro").PROMPTS
        elif row.data == "audio":
            prompts = AUDIO_PROMPTS
        elif tiny or row.workload is None:
            prompts = SHAPE_PROMPTS
        else:
            from polyrl.cli.bench import bench_prompts

            prompts = bench_prompts(64)
        path = root / "prompts.txt"
        path.write_text("\n".join(prompts) + "\n")
        evals = root / "eval.txt"
        evals.write_text("\n".join(prompts[:4]) + "\n")
        return [f"data.path={path}"], [f"data.path={evals}"]
    if row.data in ("edit", "edit_plus", "i2v"):
        images = write_images(root, 4)
        prompts = EDIT_PROMPTS if row.data != "i2v" else SHAPE_PROMPTS
        rows = [{"prompt": p, "image": [images[i], images[(i + 1) % 4]] if row.data == "edit_plus" and i % 2 == 0
                 else images[i]} for i, p in enumerate(prompts)]
        path = write_jsonl(root / "rows.jsonl", rows)
        return [f"data.path={path}"], [f"data.path={path}"]
    if row.data in ("math", "pairs"):
        if tiny or row.workload is None:
            rows = [{"prompt": f"what is {a} plus {b}?", "answer": str(a + b)} for a, b in ((1, 1), (2, 3), (4, 4), (5, 2))]
        else:
            from polyrl.cli.bench import LM_PROMPT_TOKENS, lm_prompts

            vocab = 151_936
            rows = lm_prompts(64, LM_PROMPT_TOKENS, vocab)
        path = write_jsonl(root / "train.jsonl", rows)
        evals = write_jsonl(root / "eval.jsonl", rows[:4])
        if row.data == "pairs":
            pairs = write_jsonl(root / "pairs.jsonl", [{"prompt": r["prompt"], "chosen": f"The answer is {r['answer']}.",
                                                         "rejected": "I do not know."} for r in rows])
            return [f"data.pairs_path={pairs}", f"data.path={path}"], [f"data.path={evals}"]
        return [f"data.path={path}", f"data.heldout_path={evals}"], [f"data.path={evals}"]
    if row.data == "omni":
        m = tests_module("test_qwen3_omni")
        (root / "media").mkdir(exist_ok=True)
        m.write_wav(root / "media" / "a.wav", 0.3)
        images = write_images(root, 2)
        rows = [{"prompt": "what is one plus one?", "answer": "2", "image": images[0], "audio": "media/a.wav"},
                {"prompt": "what is two plus two?", "answer": "4", "image": images[1]},
                {"prompt": "name three colors", "answer": "3", "audio": "media/a.wav"},
                {"prompt": "what is one plus two?", "answer": "3"}]
        path = write_jsonl(root / "train.jsonl", rows)
        return [f"data.path={path}"], [f"data.path={path}"]
    if row.data == "rewrite":
        assets = ROOT / "polyrl" / "assets" / "prompts"
        rows = [json.loads(line) for line in (assets / "shapes_train.jsonl").read_text().splitlines()[:8]]
        path = write_jsonl(root / "requests.jsonl", rows)
        evals = write_jsonl(root / "eval.jsonl", rows[:4])
        return [f"data.path={path}", f"data.heldout_path={evals}"], [f"data.path={evals}"]
    raise ValueError(f"row {row.recipe}: data={row.data!r}")


# ----------------------------------------------------------------------------------------------- stages
@dataclass
class Stage:
    status: str  # pass | fail | n/a | not run
    seconds: float = 0.0
    detail: str = ""

    def as_dict(self) -> dict:
        return {"status": self.status, "seconds": round(self.seconds, 2), "detail": self.detail}


NOT_STARTED = 125  # run_cli's code for a stage the call's deadline left no time for
TIMED_OUT = 124  # run_cli's code for a stage stopped at its time limit (as timeout(1) says it)
LIMITS = {"deadline": None, "stage_timeout": None}  # monotonic end of the call; seconds a stage may take (main sets)
MIN_STAGE_S = 30.0  # a stage is not started with less time than this left before the deadline


def deadline_left() -> float | None:
    """Seconds left before the call's deadline (None: no deadline)."""
    return None if LIMITS["deadline"] is None else LIMITS["deadline"] - time.monotonic()


def time_left() -> float | None:
    """Seconds a subprocess stage may run now: the stage limit, cut to what is left before the call's deadline."""
    limits = [LIMITS["stage_timeout"]]
    if LIMITS["deadline"] is not None:
        limits.append(LIMITS["deadline"] - time.monotonic())
    limits = [x for x in limits if x is not None]
    return min(limits) if limits else None


def status(code: int, ok: bool) -> str:
    return "pass" if ok else "not run" if code == NOT_STARTED else "fail"


def run_subprocess(cmd: list[str], timeout: float | None) -> tuple[int, str]:
    """`cmd` in its own process group (its compile workers too are stopped at the limit); (exit code, output)."""
    import signal

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
        return proc.returncode, text
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        return TIMED_OUT, (text or "") + f"\ngpu_matrix: stopped: the stage ran past its {timeout:.0f} s limit\n"


def run_cli(argv: list[str], in_process: bool, log: Path) -> tuple[int, float, str]:
    """`polyrl ARGV` (this process: the same entry point, no interpreter start; else a subprocess, stopped at
    `time_left()`); returns (exit code, seconds, the last polyrl line of its stderr). Its whole output goes to `log`.
    With less than MIN_STAGE_S left before the deadline the stage is not started (code NOT_STARTED)."""
    t0 = time.perf_counter()
    left = None if in_process else deadline_left()
    if left is not None and left < MIN_STAGE_S:
        with open(log, "a") as f:
            f.write(f"$ polyrl {' '.join(argv)}\nnot started: {left:.0f} s left before the deadline\n\n")
        return NOT_STARTED, 0.0, f"not started: {max(left, 0):.0f} s left before the call's deadline"
    if in_process:
        from polyrl.cli.main import main

        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
            try:
                code = main(list(argv))
            except SystemExit as e:
                code = int(e.code or 0)
            except BaseException as e:  # a bug's traceback: record it, go on with the next row
                import traceback

                traceback.print_exc(file=err)
                code = 1 if not isinstance(e, KeyboardInterrupt) else 130
                if code == 130:
                    raise
        text = err.getvalue()
    else:
        code, text = run_subprocess([sys.executable, "-m", "polyrl", *argv], time_left())
    seconds = time.perf_counter() - t0
    with open(log, "a") as f:
        f.write(f"$ polyrl {' '.join(argv)}\n{text}\n[exit {code}, {seconds:.1f} s]\n\n")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if ln.startswith("polyrl:")), lines[-1] if lines else "")
    if code and any("Traceback" in ln for ln in lines):
        last = next((ln for ln in reversed(lines) if ln and not ln.startswith(" ")), last)
    return code, seconds, last[:400]


def load_export(base: Path, out: Path, merged: bool) -> str:
    """Load an export into its diffusers pipeline class: the merged directory, or the base + `load_lora_weights`."""
    import torch

    from polyrl.cli.export import absent_components, pipeline_class, required_absent

    cls = pipeline_class(base)
    if merged:
        cls.from_pretrained(str(out), torch_dtype=torch.bfloat16, **required_absent(base))
        return f"loaded into {cls.__name__}"
    pipe = cls.from_pretrained(str(base), torch_dtype=torch.bfloat16, **absent_components(base))
    pipe.load_lora_weights(str(out))
    adapters = pipe.get_list_adapters()
    if not adapters:
        raise RuntimeError("no adapter after load_lora_weights")
    return f"loaded into {cls.__name__} with adapters {adapters}"


def check_export(base: Path, out: Path, merged: bool, in_process: bool) -> str:
    """`load_export` here, or in a subprocess (a published pipeline is gigabytes of host memory)."""
    if in_process:
        return load_export(base, out, merged)
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); from pathlib import Path; "
            f"from gpu_matrix import load_export; print(load_export(Path({str(base)!r}), Path({str(out)!r}), {merged!r}))")
    left = deadline_left()
    if left is not None and left < MIN_STAGE_S:
        raise RuntimeError(f"not loaded: {max(left, 0):.0f} s left before the call's deadline")
    rc, text = run_subprocess([sys.executable, "-c", code], time_left())
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if rc:
        raise RuntimeError(lines[-1] if lines else f"exit {rc}")
    return lines[-1]


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(rows: list[dict]) -> dict:
    """s/step (steps 1 and 2), peak memory, MFU and |ρ−1| from a run's metrics."""
    by_step = {m["step"]: m for m in rows if "time/step" in m}
    out = {}
    for k in (1, 2):
        if k in by_step:
            out[f"s_per_step_{k}"] = round(by_step[k]["time/step"], 3)
    peaks = [m["memory/peak_gib"] for m in rows if "memory/peak_gib" in m]
    if peaks:
        out["peak_memory_gib"] = round(max(peaks), 2)
    if 2 in by_step and "perf/mfu" in by_step[2]:
        out["mfu"] = round(by_step[2]["perf/mfu"], 4)
    if 1 in by_step and "ratio_absdev/first_minibatch" in by_step[1]:
        out["ratio_absdev"] = by_step[1]["ratio_absdev/first_minibatch"]
    return out


def plan_estimate(argv: list[str], imports: list[str]) -> dict:
    """The memory plan's peak for the train stage's config (trainer/memory_plan.py)."""
    from polyrl.cli.main import import_user_module
    from polyrl.config import load_config
    from polyrl.trainer.memory_plan import estimate_config

    try:
        for spec in imports[1::2]:  # `--import FILE` registers a reward the config names
            import_user_module(spec)
        plan = estimate_config(load_config([a for a in argv[1:] if "=" in a and a not in imports]))
    except Exception as e:  # a config the plan cannot read is reported, not fatal
        return {"plan_error": f"{type(e).__name__}: {e}"[:200]}
    return {"plan_gib": round(plan.peak_gib, 2), "plan_layout": plan.layout}


def published_dir(row: Row, out: Path) -> Path:
    """Where a published-size checkpoint is built: one per builder, shared by the rows (and deterministic checks) of
    one call that use it (SD3.5-M is ~4.5 GB and ~15 s to build; the builders skip a finished directory)."""
    return out / "models" / (row.workload + ("_i2v" if row.published is published_ti2v else ""))


def run_row(row: Row, out: Path, tiny: bool, device: str, peak_tflops: float | None, in_process: bool,
            extra: list[str]) -> dict:
    """Every stage of one row (see the module docstring)."""
    work = out / row.recipe
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    log = work / "log.txt"
    size = "tiny" if tiny or row.published is None else "published"
    result = {"recipe": row.recipe, "size": size, "device": device, "note": row.note,
              "stand_ins": ("tiny random checkpoint (every component)" if size == "tiny" else BENCH_STAND_INS[row.workload]),
              "stages": {}}
    stages = result["stages"]
    t0 = time.perf_counter()
    try:
        model = row.tiny(work / "model") if size == "tiny" else row.published(published_dir(row, out), device)
    except Exception as e:
        stages["build"] = Stage("fail", time.perf_counter() - t0, f"{type(e).__name__}: {e}"[:400]).as_dict()
        return result
    stages["build"] = Stage("pass", time.perf_counter() - t0).as_dict()
    train_data, eval_data = make_data(row, work / "data", tiny=size == "tiny")
    run = work / "run"
    sizes = row.tiny_args if size == "tiny" else row.published_args
    gpu = [f"trainer.device={device}"] + ([f"trainer.peak_tflops={peak_tflops}"] if peak_tflops else [])
    imports = [a for a in row.reward if a == "--import" or a.endswith(".py")]
    reward = [a for a in row.reward if a not in imports]
    base = ["train", *imports, f"recipe={row.recipe}", f"model.path={model}", *train_data, f"trainer.output_dir={run}",
            "trainer.eval_every=0", "trainer.save_every=1", "trainer.progress=false", "trainer.tensorboard=false",
            "trainer.keep_checkpoints=null", *reward, *sizes, *gpu, *extra]
    result["train_overrides"] = [*reward, *sizes, *extra]
    result.update(plan_estimate(base, imports))
    code, s, last = run_cli([*base, "trainer.max_steps=2"], in_process, log)
    ok = code == 0 and (run / "checkpoints" / "step_000002").is_dir()
    stages["train"] = Stage(status(code, ok), s, "" if ok else last).as_dict()
    result.update(summarize(metrics(run)))
    if not ok:
        return result
    code, s, last = run_cli([*base, "trainer.max_steps=3", "trainer.resume=auto"], in_process, log)
    ckpt = run / "checkpoints" / "step_000003"
    ok = code == 0 and ckpt.is_dir() and [m["step"] for m in metrics(run)][-1] == 3
    stages["resume"] = Stage(status(code, ok), s, "" if ok else last).as_dict()
    if not ok:
        ckpt = run / "checkpoints" / "step_000002"
    if row.export.startswith("n/a"):
        stages["export"] = Stage("n/a", 0.0, row.export[5:]).as_dict()
    else:
        merged, exported, fallback = row.export == "merge", work / "export", ""
        code, s, last = run_cli(["export", f"checkpoint={ckpt}", f"out={exported}", *(["--merge"] if merged else [])],
                                in_process, log)
        if code and "export with --merge instead" in last:  # a pipeline without a LoRA writer: polyrl's advice
            fallback = last.split("polyrl: error: ")[-1].split(";")[0] + "; merged instead: "
            merged = True
            code, s2, last = run_cli(["export", f"checkpoint={ckpt}", f"out={exported}", "--merge"], in_process, log)
            s += s2
        if code:
            stages["export"] = Stage(status(code, False), s, fallback + last).as_dict()
        else:
            t1 = time.perf_counter()
            try:
                loaded = check_export(model, exported, merged, in_process)
                stages["export"] = Stage("pass", s + time.perf_counter() - t1, fallback + loaded).as_dict()
            except Exception as e:
                state = ("not checked" if "requires the Torchvision library" in str(e) else
                         "not run" if str(e).startswith("not loaded:") else "fail")
                detail = ("exported; loading it needs torchvision (the pipeline's Qwen2-VL processor), which this "
                          "machine lacks" if state == "not checked" else f"load: {e}"[:400])
                stages["export"] = Stage(state, s + time.perf_counter() - t1, fallback + detail).as_dict()
    code, s, last = run_cli(["eval", *imports, f"checkpoint={ckpt}", *eval_data, f"eval.output_dir={work / 'eval'}",
                             "eval.max_prompts=4", "eval.grid=0", *gpu], in_process, log)
    ok = code == 0 and (work / "eval" / "report.json").is_file()
    stages["eval"] = Stage(status(code, ok), s, "" if ok else last).as_dict()
    return result


def plan_rows(names: list[str], card_gib: float, margin: float = 0.95, extra: list[str] | None = None) -> list[dict]:
    """The memory plan of every published row's config on one GPU of `card_gib`, from its checkpoint built on the meta
    device (no memory, no files): whether the row fits (within `margin` of the card: the plan's error on the
    recorded runs reaches ±10%), else the plan's smallest change and its GPUs."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from plan_calibration import meta_inventory

    from polyrl.config import load_config
    from polyrl.trainer.memory_plan import estimate, fits

    out = []
    for name in names:
        row = BY_NAME[name]
        if row.published is None:
            out.append({"recipe": name, "plan": "no published-size builder: the GPU call runs its tiny checkpoint"})
            continue
        inventory = meta_inventory(row.workload if row.recipe != "wan22_ti2v_flowgrpo" else "wan22_ti2v")
        data = ["data.pairs_path=/nonexistent.jsonl"] if row.data == "pairs" else []
        overrides = [f"recipe={name}", "model.path=/nonexistent", "data.path=/nonexistent.txt", *data,
                     *[a for a in row.reward if "=" in a], *row.published_args, *(extra or [])]
        try:
            cfg = load_config(overrides)
        except Exception as e:
            out.append({"recipe": name, "plan": f"config: {e}"[:200]})
            continue
        prompt_tokens = 256 if row.workload == "grpo_lm" else None
        plan = estimate(cfg, inventory, 1, prompt_tokens=prompt_tokens)
        item = {"recipe": name, "plan_gib": round(plan.peak_gib, 1), "fits": plan.peak_gib <= margin * card_gib,
                "overrides": [*row.published_args, *(extra or [])], "calibration": plan.calibration}
        if not item["fits"]:
            found = fits(cfg, inventory, margin * card_gib)
            item["change"] = None if found is None else {"overrides": found[0], "gpus": found[1],
                                                         "plan_gib": round(found[2].peak_gib, 1)}
        out.append(item)
    return out


def run_deterministic(name: str, out: Path, tiny: bool, device: str, in_process: bool,
                      extra: list[str] | None = None) -> dict:
    """Two 2-step runs with trainer.deterministic=true (bit-identical checkpoints?) and one without (the cost)."""
    from polyrl.trainer.checkpoint_compare import checkpoint_differences

    recipe, overrides = DETERMINISTIC[name]
    row = BY_NAME[recipe]
    work = out / f"deterministic_{name}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    log = work / "log.txt"
    size = "tiny" if tiny or row.published is None else "published"
    model = row.tiny(work / "model") if size == "tiny" else row.published(published_dir(row, out), device)
    train_data, _ = make_data(row, work / "data", tiny=size == "tiny")
    sizes = row.tiny_args if size == "tiny" else row.published_args
    imports = [a for a in row.reward if a == "--import" or a.endswith(".py")]
    reward = [a for a in row.reward if a not in imports]
    overrides = [*overrides, *(extra or [])]
    result = {"name": name, "recipe": recipe, "size": size, "device": device, "overrides": overrides, "runs": {}}
    for label, flag in (("a", "true"), ("b", "true"), ("off", "false")):
        run = work / label
        code, s, last = run_cli(["train", *imports, f"recipe={recipe}", f"model.path={model}", *train_data,
                                 f"trainer.output_dir={run}", "trainer.max_steps=2",
                                 f"trainer.save_every={2 if label != 'off' else 0}",  # "off" times, compares nothing
                                 "trainer.eval_every=0", "trainer.progress=false", "trainer.tensorboard=false",
                                 f"trainer.deterministic={flag}", f"trainer.device={device}", *reward, *sizes,
                                 *overrides], in_process, log)
        result["runs"][label] = {"exit": code, "seconds": round(s, 2), **summarize(metrics(run)),
                                 **({"error": last} if code else {})}
    a, b = (work / x / "checkpoints" / "step_000002" for x in ("a", "b"))
    if a.is_dir() and b.is_dir():
        differ = checkpoint_differences(a, b)
        result["bit_identical"] = not differ
        result["differences"] = differ[:20]
    named = [ln for ln in log.read_text().splitlines() if "has no deterministic kernel" in ln]
    result["ops_without_deterministic_kernel"] = sorted(set(named))
    return result


# ----------------------------------------------------------------------------------------------- report
def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def card() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    import platform

    return f"CPU ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def fmt(v, spec: str = ".2f", none: str = "—") -> str:
    return none if v is None else format(v, spec)


def markdown(report: dict) -> str:
    """The table of one report (docs/gpu_matrix.md holds one per device call)."""
    gpu = report["device"] != "cpu"
    head = (f"**{report['card']}**, {report['date']}, commit {report['commit']}, "
            f"{'GPU' if gpu else 'CPU, tiny random checkpoints — no GPU figures'}; "
            f"{report['seconds']:.0f} s for the table.\n\n")
    cols = ["recipe", "size", "train 2 steps", "resume to 3", "export + load", "eval 4 prompts", "s/step (step 2)",
            "peak GPU GiB", "plan GiB (error)", "MFU", "|ρ−1|", "checkpoint"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in report["rows"]:
        st = r.get("stages", {})

        def cell(name, st=st):
            s = st.get(name)
            if s is None:
                return "not run"
            text = s["status"]
            if s["status"] == "pass" and "merged instead" in s.get("detail", ""):
                text += " (--merge: the pipeline has no LoRA writer)"
            if s["status"] in ("fail", "not checked") and s.get("detail"):
                text += f": {s['detail'][:120]}".replace("|", "/")
            return text

        peak, plan = r.get("peak_memory_gib"), r.get("plan_gib")
        plan_cell = "—" if plan is None or not gpu else (
            f"{plan:.1f}" + (f" ({100 * (plan - peak) / peak:+.0f}%)" if peak else ""))
        if r.get("not_run"):
            lines.append(f"| `{r['recipe']}` | {r.get('size', '')} | not run: {r['not_run']} | | | | | | {plan_cell} | | | "
                         f"{r.get('stand_ins', '')} |")
            continue
        lines.append("| " + " | ".join([
            f"`{r['recipe']}`", r["size"], cell("train"), cell("resume"), cell("export"), cell("eval"),
            fmt(r.get("s_per_step_2")), fmt(peak, ".1f", "—" if not gpu else "n/a"), plan_cell,
            fmt(r.get("mfu") and 100 * r["mfu"], ".1f") + ("%" if r.get("mfu") else ""),
            fmt(r.get("ratio_absdev"), ".1e"), r.get("stand_ins", "") + (f"; {r['note']}" if r.get("note") else ""),
        ]) + " |")
    text = head + "\n".join(lines) + "\n"
    if report.get("deterministic"):
        text += ("\n| deterministic check | size | bit-identical (weights + AdamW) | s/step (step 2) with / without "
                 "the flag | ops named |\n|---|---|---|---|---|\n")
        for d in report["deterministic"]:
            on, off = d["runs"].get("a", {}), d["runs"].get("off", {})
            text += (f"| {d['name']} (`{d['recipe']}` {' '.join(d['overrides'])}) | {d['size']} | "
                     f"{ {True: 'yes', False: 'NO', None: 'not compared'}[d.get('bit_identical')] } | "
                     + (f"{fmt(on.get('s_per_step_2'))} / {fmt(off.get('s_per_step_2'))} | " if gpu else
                        "not measured (CPU: tiny steps on a shared machine time nothing of the flag) | ")
                     + f"{', '.join(d['ops_without_deterministic_kernel']) or 'none'} |\n")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny random checkpoints on the CPU (CI)")
    p.add_argument("--only", default="", help="comma-separated recipes (default: every real recipe)")
    p.add_argument("--out", default="runs/gpu_matrix", help="work directory (checkpoints, runs, logs)")
    p.add_argument("--json", default=None, help="results file (default docs/bench/gpu_matrix_<date>[_tiny].json)")
    p.add_argument("--in-process", action="store_true",
                   help="run the CLI stages in this process (no interpreter start per stage: the CI test)")
    p.add_argument("--deterministic", action="store_true", help="the bit-identity check (issue 47 item 4)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when there is one, cpu with --tiny)")
    p.add_argument("--plan-only", type=float, default=None, metavar="GIB",
                   help="print the memory plan of every published row on one GPU of GIB GiB, run nothing")
    p.add_argument("--results", default=None, metavar="DIR",
                   help="also write the results here after every row: gpu_matrix.json (with --json FILE: the rows "
                        "of FILE merged with this call's, FILE updated too), gpu_matrix.md (the table) and "
                        "gpu_matrix_logs.txt (each row's log tail); e.g. $OUT on the device machine, which returns "
                        "only that folder")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="seconds from the start after which no stage starts and a running one is stopped (rows left "
                        "say 'not run'); keep it under the device call's limit so the results are written")
    p.add_argument("--stage-timeout", type=float, default=None, metavar="S",
                   help="stop any one CLI stage after S seconds (a hang fails its row, not the call)")
    a, extra = p.parse_known_args(argv)
    t_start = time.monotonic()
    LIMITS["deadline"] = None if a.deadline is None else t_start + a.deadline
    LIMITS["stage_timeout"] = a.stage_timeout
    import torch

    if a.plan_only is not None:
        names = a.only.split(",") if a.only else real_recipes()
        for item in plan_rows(names, a.plan_only, extra=extra):
            print(json.dumps(item))
        return 0
    device = a.device or ("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    date = time.strftime("%Y-%m-%d")
    results = Path(a.results) if a.results else None
    if a.json:
        path = Path(a.json)
    elif results is not None:
        path = results / "gpu_matrix.json"
    else:
        path = ROOT / "docs" / "bench" / f"gpu_matrix_{date}{'_tiny' if a.tiny else ''}.json"
    report = json.loads(path.read_text()) if path.is_file() else {"rows": [], "deterministic": []}
    report.setdefault("rows", [])
    report.setdefault("deterministic", [])
    peak = None
    if device == "cuda":
        from polyrl.cli.bench import measure_matmul_tflops

        peak = measure_matmul_tflops(torch.device("cuda"))
    report.update({"date": date, "commit": commit(), "card": card(), "device": device, "peak_tflops": peak,
                   "torch": torch.__version__})
    t0 = time.perf_counter()
    seconds_before = report.get("seconds", 0.0)

    def save(log: Path | None = None) -> str:
        """The report so far, written after every row: a call stopped at its limit keeps what it measured."""
        report["seconds"] = seconds_before + time.perf_counter() - t0
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        table = markdown(report)
        (out / "gpu_matrix.md").write_text(table)
        if results is not None:
            results.mkdir(parents=True, exist_ok=True)
            (results / "gpu_matrix.md").write_text(table)
            if path.resolve() != (results / "gpu_matrix.json").resolve():  # --json merged into a file of the tree
                (results / "gpu_matrix.json").write_text(json.dumps(report, indent=2) + "\n")
            if log is not None and log.is_file():
                lines = log.read_text(errors="replace").splitlines()
                with open(results / "gpu_matrix_logs.txt", "a") as f:
                    f.write(f"===== {log.parent.name} (last {min(len(lines), 200)} of {len(lines)} lines)\n")
                    f.write("\n".join(lines[-200:]) + "\n\n")
        return table

    if a.deterministic:
        names = [n for n in DETERMINISTIC if not a.only or n in a.only.split(",")]
        done = {d["name"]: d for d in report.get("deterministic", [])}
        for name in names:
            left = deadline_left()
            if left is not None and left < MIN_STAGE_S:
                print(f"gpu_matrix: deterministic {name}: not run ({left:.0f} s left)", file=sys.stderr, flush=True)
                continue
            print(f"gpu_matrix: deterministic {name} ...", file=sys.stderr, flush=True)
            done[name] = run_deterministic(name, out, a.tiny, device, a.in_process, extra)
            report["deterministic"] = [done[n] for n in DETERMINISTIC if n in done]
            save(out / f"deterministic_{name}" / "log.txt")
        report["deterministic"] = [done[n] for n in DETERMINISTIC if n in done]
    else:
        names = a.only.split(",") if a.only else real_recipes()
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            print(f"gpu_matrix: no row for {', '.join(unknown)} (rows: {', '.join(BY_NAME)})", file=sys.stderr)
            return 2
        done = {r["recipe"]: r for r in report["rows"]}
        plans = {}
        if device == "cuda" and not a.tiny:  # rows whose plan does not fit this card are not run: their layout instead
            card_gib = torch.cuda.mem_get_info()[1] / 2**30
            plans = {item["recipe"]: item for item in plan_rows(names, card_gib, extra=extra)}
        for name in names:
            item = plans.get(name, {})
            if item.get("fits") is False:
                change = item.get("change")
                layout = ("no single change the plan knows fits" if change is None else
                          f"{' '.join(change['overrides'])} on {change['gpus']} GPU(s): {change['plan_gib']} GiB each")
                done[name] = {"recipe": name, "size": "published", "device": device, "plan_gib": item["plan_gib"],
                              "not_run": f"the plan needs {item['plan_gib']} GiB on this card; {layout}",
                              "stand_ins": BENCH_STAND_INS[BY_NAME[name].workload]}
                print(f"gpu_matrix: {name}: not run ({done[name]['not_run']})", file=sys.stderr, flush=True)
                continue
            left = deadline_left()
            if left is not None and left < MIN_STAGE_S:
                done[name] = {"recipe": name, "size": "tiny" if a.tiny or not BY_NAME[name].published else "published",
                              "device": device, "not_run": f"the call's deadline ({left:.0f} s left)"}
                print(f"gpu_matrix: {name}: not run ({left:.0f} s left)", file=sys.stderr, flush=True)
                continue
            print(f"gpu_matrix: {name} ...", file=sys.stderr, flush=True)
            done[name] = run_row(BY_NAME[name], out, a.tiny, device, peak, a.in_process, extra)
            st = done[name].get("stages", {})
            print(f"gpu_matrix: {name}: " + ", ".join(f"{k} {v['status']}" for k, v in st.items()), file=sys.stderr,
                  flush=True)
            report["rows"] = [done[n] for n in sorted(done)]
            save(out / name / "log.txt")
        report["rows"] = [done[n] for n in sorted(done)]
    table = save()
    print(table)
    print(f"gpu_matrix: wrote {path} and {out / 'gpu_matrix.md'}" + (f" (and into {results})" if results else ""),
          file=sys.stderr)
    failed = [r["recipe"] for r in report["rows"] if any(s["status"] == "fail" for s in r.get("stages", {}).values())]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
