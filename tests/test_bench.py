"""`polyrl bench --tiny`: the benchmark path runs end to end on a CPU and its FLOP count is the analytic one."""

import json
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import Background
from diffusers import SD3Transformer2DModel, WanTransformer3DModel

from polyrl.cli.main import main
from polyrl.models.sd3 import sd3_forward_flops
from polyrl.perf.compile import repeated_blocks
from polyrl.perf.flops import epoch_flops


def test_bench_tiny_reports_every_stage_and_the_analytic_flops(tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "--tiny", "--out", str(out), "--epochs", "1", "--warmup", "1", "--profile",
                 "trainer.progress=false"]) == 0
    result = json.loads((out / "bench.json").read_text())
    s = result["summary"]
    # --profile adds a third epoch under the profiler, kept out of the figures
    assert [m["step"] for m in result["history"]] == [1, 2, 3]
    assert s["epochs_measured"] == 1 and s["images_per_epoch"] == 8
    assert s["seconds_per_epoch"] == result["history"][1]["time/step"]
    regions = json.loads((out / "profile.json").read_text())["regions"]
    assert {"step", "rollout", "train", "velocity/rollout", "step_math/rollout", "velocity/current",
            "velocity/reference", "backward", "optimizer"} <= set(regions)
    # 10 sampling steps in one chunk; 2 micro-batches of 4 images x 9 trained steps, one backward each
    assert regions["velocity/rollout"]["calls"] == 10 and regions["backward"]["calls"] == 18
    assert regions["train"]["wall_s"] <= regions["step"]["wall_s"]
    assert "| velocity/reference | 18 |" in (out / "profile.md").read_text()  # a CPU run: host seconds only
    assert s["images_per_s"] == pytest.approx(8 / s["seconds_per_epoch"])
    assert set(s["stages_s"]) == {"text_encode", "rollout", "decode", "reward", "reward_wait", "old_logprob", "train",
                                  "weight_sync"}
    # the step's seconds no stage timed: what the host did between them (never negative: the stages nest in the step)
    m = result["history"][1]
    exposed = sum(m.get(f"time/{k}", 0.0) for k in ("text_encode", "rollout", "train", "weight_sync")) + m.get(
        "time/reward_wait", m.get("time/reward", 0.0))
    assert s["outside_stages_s"] == pytest.approx(m["time/step"] - exposed) and 0 <= s["outside_stages_s"] < m["time/step"]
    assert "mfu" not in s  # no GPU: no measured peak, no MFU
    # every transformer call was counted: 10 CFG sampling steps + 9 trained CFG steps (3x) with a KL forward (1x)
    model = SD3Transformer2DModel.from_pretrained(str(out / "sd35m_tiny"), subfolder="transformer")
    text_tokens = 16 + 16  # CLIP (16 in the tiny spec) + T5 (model.max_sequence_length=16)
    per_sample = sd3_forward_flops(model.config, (64 // 8 // 2) ** 2, text_tokens)
    expected = epoch_flops(per_sample, 8, 10, 9, cfg=True, reference_forward=True)
    assert s["model_tflop_per_epoch"] * 1e12 == pytest.approx(expected, rel=1e-9)
    assert "images/s" in (out / "bench.md").read_text()
    # bypass: the first mini-batch re-scores the rollout's transitions with the same weights; what is left is
    # float32 rounding of CPU kernels that block differently per batch size (0 or ~1e-8 by the CPU's vector
    # width). A wrong old log-prob, or an optimizer step before the first mini-batch, gives >= 1e-4.
    assert s["ratio_absdev_first_minibatch"] < 1e-6
    assert all(math.isfinite(m["reward/mean"]) for m in result["history"])
    # the warm-up epoch is reported, not hidden: step 1's own wall time, plus the setup before it
    first = next(m for m in result["history"] if m["step"] == 1)
    assert s["first_epoch_s"] == first["time/step"] and s["setup_s"] > 0
    assert s["time_to_first_step_s"] == pytest.approx(s["setup_s"] + s["first_epoch_s"])
    assert "first epoch s" in (out / "bench.md").read_text()
    assert s["compile_s"] == 0.0 and "compiling s" not in (out / "bench.md").read_text()  # nothing compiled


def test_compile_seconds_count_the_forward_and_the_lazy_backward_compiles():
    """`compile_s` in bench.json: the forward graph compiles at the first call, the backward at the first backward
    (AOTAutograd compiles it lazily); both are counted, and a second call compiles nothing. Torch's on-disk caches
    are off: a graph found there loads its backward with the forward, and nothing compiles lazily."""
    from polyrl.perf.compile import compile_seconds

    fn = torch.compile(lambda x: (x.sin() * x).cos().sum())
    x = torch.randn(8, requires_grad=True)
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        start = compile_seconds()
        loss = fn(x)
        after_forward = compile_seconds()
        loss.backward()
        after_backward = compile_seconds()
        fn(x).backward()
    assert after_forward > start and after_backward > after_forward
    assert compile_seconds() == after_backward



def test_bench_under_torchrun_reports_per_gpu_rates_and_the_one_process_numbers(tmp_path):
    """`torchrun --nproc-per-node=2 -m polyrl bench`: rank 0 builds the pipeline while rank 1 waits, one report is
    written, the rate is per step and per GPU, and the step's numbers are the one-process run's (same global batch)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # float64 networks: the layouts then differ by the order of float64 sums, not by one CPU's float32 kernels
    # sampling calls of 4 images in both runs (the ranks' share): the float32 VAE decode behind the JPEG reward then
    # sees the same shapes, whatever kernel a CPU picks per batch size
    args = ["bench", "--tiny", "--epochs", "1", "--warmup", "0", "trainer.progress=false", "model.dtype=float64",
            "rollout.batch_size=4"]
    # the one-process run in a process of its own with the ranks' thread count: run in pytest's process (2 threads
    # on CI) a float32 VAE decode behind the JPEG reward split its sums otherwise (AVX2: reward/mean -3.903250 vs
    # -3.903125 for the ranks)
    # (both launched at once: three one-thread processes on CI's two cores instead of one process, then two)
    with Background([sys.executable, "-m", "polyrl", *args, "--out", str(tmp_path / "one")], env=env) as one_run, \
            Background([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                        "polyrl", *args, "--out", str(tmp_path / "two")], env=env) as two_run:
        one, two = one_run.wait(timeout=300), two_run.wait(timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("images/s per GPU (2 GPUs)") == 1  # rank 0 alone prints the table
    a, b = (json.loads((tmp_path / d / "bench.json").read_text()) for d in ("one", "two"))
    assert (a["world_size"], b["world_size"]) == (1, 2)
    s = b["summary"]
    assert s["images_per_epoch"] == a["summary"]["images_per_epoch"] == 8
    assert s["images_per_s_per_gpu"] == pytest.approx(8 / s["seconds_per_epoch"] / 2)
    numbers = {k: v for k, v in a["history"][0].items()
               if isinstance(v, float) and not k.startswith(("time/", "perf/"))}
    assert {"reward/mean", "grad_norm", "loss"} <= set(numbers)
    for key, value in numbers.items():  # 4 samples per rank instead of 8 in one batch: float64 rounding only
        assert b["history"][0][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_regional_compile_finds_the_transformer_blocks():
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                  pooled_projection_dim=8, out_channels=4, pos_embed_max_size=8)
    blocks = repeated_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["JointTransformerBlock"] * 3


def test_bench_tiny_wan_reports_frames_and_the_wan_flops(tmp_path):
    """`--workload wan22_5b` at tiny size: videos/s and frames/s, and the FLOPs the Wan adapter counted equal the
    model's analytic count for the work the recipe does (4 sampling steps with CFG, 2 trained CFG steps, no KL)."""
    from polyrl.models.wan import wan_forward_flops

    out = tmp_path / "bench"
    assert main(["bench", "--tiny", "--workload", "wan22_5b", "--out", str(out), "--epochs", "1", "--warmup", "1",
                 "trainer.progress=false"]) == 0
    s = json.loads((out / "bench.json").read_text())["summary"]
    assert s["images_per_epoch"] == 4 and s["frames_per_s"] == pytest.approx(5 * s["images_per_s"])
    config = WanTransformer3DModel.load_config(str(out / "wan22_5b_tiny" / "transformer"))
    tokens = 2 * (64 // 16 // 2) ** 2  # (5 − 1)/4 + 1 = 2 latent frames of (64/16/2)² patches
    per_sample = wan_forward_flops(SimpleNamespace(**config), tokens, 16, per_token_timesteps=True)
    expected = epoch_flops(per_sample, 4, 4, 2, cfg=True, reference_forward=False)
    assert s["model_tflop_per_epoch"] * 1e12 == pytest.approx(expected, rel=1e-9)
    assert "frames/s" in (out / "bench.md").read_text()


def test_bench_tiny_wan_a14b_stores_float8_and_trains_both_experts(tmp_path):
    """`--workload wan22_a14b` at tiny size: both experts are written in float8 (half of bf16 on disk), load back in
    the run's dtype, and the FLOPs counted are the two-expert model's (each step runs one expert of equal size)."""
    from safetensors import safe_open

    from polyrl.models.wan import wan_forward_flops

    out = tmp_path / "bench"
    assert main(["bench", "--tiny", "--workload", "wan22_a14b", "--out", str(out), "--epochs", "1", "--warmup", "1",
                 "trainer.progress=false"]) == 0
    model = out / "wan22_a14b_tiny"
    for expert in ("transformer", "transformer_2"):
        with safe_open(str(next((model / expert).glob("*.safetensors"))), "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert dtypes == {"F8_E4M3"}, (expert, dtypes)
    s = json.loads((out / "bench.json").read_text())["summary"]
    assert s["images_per_epoch"] == 2 and s["frames_per_s"] == pytest.approx(5 * s["images_per_s"])
    config = WanTransformer3DModel.load_config(str(model / "transformer"))
    tokens = 2 * (64 // 8 // 2) ** 2  # wan2.1 layout: 2 latent frames of (64/8/2)² patches
    per_sample = wan_forward_flops(SimpleNamespace(**config), tokens, 16)
    expected = epoch_flops(per_sample, 2, 4, 2, cfg=True, reference_forward=False)
    assert s["model_tflop_per_epoch"] * 1e12 == pytest.approx(expected, rel=1e-9)


def test_bench_tiny_grpo_lm_reports_tokens_per_second_of_each_stage(tmp_path):
    """`--workload grpo_lm` at tiny size: every prompt is exactly 16 tokens, and rollout / training tokens/s are the
    response tokens (and prompt + response tokens) of the measured epoch over that stage's time."""
    from transformers import AutoTokenizer

    out = tmp_path / "bench"
    assert main(["bench", "--tiny", "--workload", "grpo_lm", "--out", str(out), "--epochs", "1", "--warmup", "1",
                 "trainer.progress=false"]) == 0
    result = json.loads((out / "bench.json").read_text())
    s, measured = result["summary"], result["history"][-1]
    tokenizer = AutoTokenizer.from_pretrained(str(out / "grpo_lm_tiny"))
    rows = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert {len(tokenizer(r["prompt"]).input_ids) for r in rows} == {16}
    samples = 8  # 2 prompts × 4 samples
    response = samples * measured["response_length/mean"]
    assert s["images_per_epoch"] == samples and s["response_tokens_per_epoch"] == pytest.approx(response)
    assert s["rollout_tokens_per_s"] == pytest.approx(response / measured["time/rollout"])
    assert s["train_tokens_per_s"] == pytest.approx((response + samples * 16) / measured["time/train"])
    assert "rollout tokens/s" in (out / "bench.md").read_text()
