#!/usr/bin/env python
"""Throughput of NVlabs/DiffusionNFT's own SD3 training loop (scripts/train_nft_sd3.py), without touching its files.

It runs that script's `main()` (DPM-Solver-2 sampling from the `old` LoRA adapter, the NFT loss with its old / current /
reference forwards, fp16 autocast with a GradScaler, EMA, the old-adapter decay, torch DDP) on the random-weight
SD3.5-medium pipeline that `polyrl bench --workload sd35m_nft` trains, and prints images/s. What this file changes,
all by monkeypatching before and around the import of the script:

  * the pipeline: polyrl's builder (`polyrl.cli.bench.build_pipeline`, workload sd35m_nft) writes the random
    SD3.5-M transformer, the SD3 VAE and the small CLIP-L / CLIP-G / T5 stand-ins of docs/benchmark.md with
    word-level tokenizers to a diffusers folder, and the script's own `StableDiffusion3Pipeline.from_pretrained`
    loads it (float32 weights, as it loads the published checkpoint). Both sides train the same model files.
  * prompts: a folder with train.txt / test.txt of polyrl bench's synthetic prompts (every word in the vocabulary).
  * reward: config.reward_fn = {"jpeg_compressibility": 1.0} (their own rewards.py function; needs no weights).
  * wandb: an in-process no-op stub; `imp` (config/nft.py imports it; Python 3.12 removed it): a small shim.
  * eval_fn: replaced by a timing hook called at the top of every epoch (eval_freq forced to 1); after
    --warmup-epochs + --epochs epochs it stops the run (main() loops over 100000 epochs). save_ckpt: a no-op.
  * pipeline_with_logprob, PerPromptStatTracker.update and the reward function: wrapped only to time the phases; a
    forward pre-hook on the transformer counts its calls with and without autograd.
  * sample.num_image_per_prompt: their sampler needs it to divide (GPUs × per-GPU batch); sd3_ocr's 24 with one GPU's
    batch of 9 does not, so on fewer than 8 GPUs it becomes the largest divisor of that product not above 24 (9 on
    one GPU: 16 prompts × 9 images per epoch). The work per image is unchanged.
  * without CUDA (--tiny on a CPU): a gloo process group, `torch.device("cuda:N")` read as the CPU, DDP without
    device ids, no mixed precision. On a GPU the script's own NCCL / CUDA path runs unchanged.

Usage (from a polyrl checkout; --repo points at a copy of NVlabs/DiffusionNFT; RANK / WORLD_SIZE / LOCAL_RANK
default to one process, torchrun sets them for more):

  python scripts/bench_diffusionnft_sd3.py --repo .fg/DiffusionNFT --epochs 1 --warmup-epochs 1 --out nft.json
  python scripts/bench_diffusionnft_sd3.py --repo .fg/DiffusionNFT --tiny      # CPU, seconds

Any ml_collections override works after the harness flags, e.g. --config.sample.num_batches_per_epoch=8
--config.train.gradient_accumulation_steps=4.
"""
import argparse
import importlib.machinery
import importlib.util
import json
import math
import os
import sys
import time
import types
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]  # the polyrl checkout this file belongs to (its builders)

ap = argparse.ArgumentParser(add_help=True)
ap.add_argument("--repo", default=str(CHECKOUT / ".fg" / "DiffusionNFT"), help="a copy of NVlabs/DiffusionNFT")
ap.add_argument("--config", default=None, help="config file:name (default <repo>/config/nft.py:sd3_ocr)")
ap.add_argument("--epochs", type=int, default=2, help="measured epochs")
ap.add_argument("--warmup-epochs", type=int, default=1, help="epochs run but not counted")
ap.add_argument("--tiny", action="store_true",
                help="polyrl bench's tiny sd35m_nft pipeline at 64x64, 2 batches of 2 images per epoch, no mixed "
                     "precision: runs on a CPU in seconds (the same shape as `polyrl bench --tiny --workload sd35m_nft`)")
ap.add_argument("--model-dir", default=None,
                help="the random pipeline folder, built here if absent (share it with polyrl bench --model-dir)")
ap.add_argument("--images-per-prompt", type=int, default=None,
                help="sample.num_image_per_prompt (default: the config's, or its largest fitting divisor, see above)")
ap.add_argument("--reward", default="jpeg_compressibility")
ap.add_argument("--work-dir", default="/tmp/nft_bench", help="prompts, logs")
ap.add_argument("--out", default=None, help="write the JSON summary here (rewritten after every epoch)")
hargs, rest = ap.parse_known_args()
for _key in ("out", "model_dir", "work_dir"):  # relative to where it was started, before the chdir below
    if getattr(hargs, _key):
        setattr(hargs, _key, str(Path(getattr(hargs, _key)).resolve()))

REPO = Path(hargs.repo).resolve()
if not (REPO / "scripts" / "train_nft_sd3.py").is_file():
    sys.exit(f"bench_diffusionnft_sd3: error: {REPO}/scripts/train_nft_sd3.py not found (--repo: a copy of "
             "NVlabs/DiffusionNFT)")
config_arg = hargs.config or f"{REPO / 'config' / 'nft.py'}:sd3_ocr"
path_part, _, name_part = config_arg.partition(":")
config_arg = str(Path(path_part).resolve()) + (f":{name_part}" if name_part else "")
sys.argv = [sys.argv[0], f"--config={config_arg}"] + rest
for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "localhost")):
    os.environ.setdefault(key, value)
if "MASTER_PORT" not in os.environ:  # their default 12355, unless taken (a second run on the same machine)
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
WORK = Path(hargs.work_dir)
WORK.mkdir(parents=True, exist_ok=True)
sys.path.insert(0, str(CHECKOUT))  # polyrl's builders
os.chdir(REPO)  # config/nft.py builds dataset paths from os.getcwd()
sys.path.insert(0, str(REPO))  # `import flow_grpo...` (their package) without installing it

# the HF stack first, so that its "is wandb installed?" probes see the truth
import diffusers  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

CUDA = torch.cuda.is_available()

# ---------------------------------------------------------------------------------------------- stubs: wandb, imp
_wb = types.ModuleType("wandb")
_wb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
_wb.init = _wb.log = _wb.finish = lambda *a, **k: None
_wb.Image = type("Image", (), {"__init__": lambda self, *a, **k: None})
sys.modules["wandb"] = _wb
try:
    import imp  # noqa: F401  (Python ≤ 3.11)
except ModuleNotFoundError:
    _imp = types.ModuleType("imp")

    def _load_source(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    _imp.load_source = _load_source
    sys.modules["imp"] = _imp

# ---------------------------------------------------------------------------------------------- pipeline + prompts
from polyrl.cli.bench import bench_prompts, build_pipeline  # noqa: E402

BUILD = {}
MODEL_DIR = Path(hargs.model_dir) if hargs.model_dir else WORK / f"sd35m_nft_{'tiny' if hargs.tiny else 'random'}"
if int(os.environ["RANK"]) == 0:
    t0 = time.perf_counter()
    build_pipeline(MODEL_DIR, hargs.tiny, "cuda" if CUDA else "cpu", "sd35m_nft")
    BUILD["build_pipeline_s"] = time.perf_counter() - t0
PROMPTS = WORK / "prompts"
PROMPTS.mkdir(exist_ok=True)
for split in ("train", "test"):
    (PROMPTS / f"{split}.txt").write_text("\n".join(bench_prompts(64)) + "\n")

STATE = dict(epoch_starts=[], sample_end=[], train_start=[], pipe_calls=0, pipe_seconds=0.0, reward_seconds=0.0,
             reward_calls=0, grad_calls=0, nograd_calls=0, cur_epoch=-1)

_orig_from_pretrained = diffusers.StableDiffusion3Pipeline.from_pretrained.__func__


def _from_pretrained(cls, *args, **kwargs):
    t0 = time.perf_counter()
    pipe = _orig_from_pretrained(cls, *args, **kwargs)

    def count(module, a, k):
        STATE["grad_calls" if torch.is_grad_enabled() else "nograd_calls"] += 1

    pipe.transformer.register_forward_pre_hook(count, with_kwargs=True)
    BUILD.update(load_s=time.perf_counter() - t0, model_dir=str(MODEL_DIR),
                 transformer_params=sum(p.numel() for p in pipe.transformer.parameters()),
                 vae_params=sum(p.numel() for p in pipe.vae.parameters()),
                 transformer_dtype=str(pipe.transformer.dtype),
                 transformer_config={k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")})
    return pipe


diffusers.StableDiffusion3Pipeline.from_pretrained = classmethod(_from_pretrained)

# ---------------------------------------------------------------------------------------------- their script
_spec = importlib.util.spec_from_file_location("nft_train_sd3", REPO / "scripts" / "train_nft_sd3.py")
T = importlib.util.module_from_spec(_spec)
sys.modules["nft_train_sd3"] = T
_spec.loader.exec_module(T)
import flow_grpo.rewards as R  # noqa: E402  (theirs, from --repo)

if not CUDA:  # a CPU run: gloo, the CPU for "cuda:N", DDP without device ids
    import torch.distributed as dist

    def _setup_distributed(rank, lock_rank, world_size):
        dist.init_process_group("gloo", rank=rank, world_size=world_size)

    class _CpuTorch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    _torch = _CpuTorch("torch")
    _torch.device = lambda spec, *a: torch.device("cpu") if str(spec).startswith("cuda") else torch.device(spec, *a)
    T.setup_distributed = _setup_distributed
    T.torch = _torch
    T.DDP = lambda module, **kwargs: torch.nn.parallel.DistributedDataParallel(
        module, find_unused_parameters=kwargs.get("find_unused_parameters", False))


def _sync():
    if CUDA:
        torch.cuda.synchronize()


class _BenchDone(Exception):
    pass


def _eval_hook(*args, **kwargs):  # called by main() at the first sampling batch of every epoch (eval_freq = 1)
    _sync()
    STATE["epoch_starts"].append(time.perf_counter())
    STATE["cur_epoch"] += 1
    if STATE["cur_epoch"] >= 1:
        _write_summary(partial=True)
    if STATE["cur_epoch"] >= hargs.warmup_epochs + hargs.epochs:
        raise _BenchDone()


T.eval_fn = _eval_hook
T.save_ckpt = lambda *a, **k: None

_orig_pwl = T.pipeline_with_logprob


def _timed_pwl(*a, **k):
    t0 = time.perf_counter()
    out = _orig_pwl(*a, **k)
    _sync()
    now = time.perf_counter()
    STATE["pipe_seconds"] += now - t0
    STATE["pipe_calls"] += 1
    ends = STATE["sample_end"]
    if len(ends) == len(STATE["epoch_starts"]):
        ends[-1] = now
    else:
        ends.append(now)
    return out


T.pipeline_with_logprob = _timed_pwl


class _TimedTracker(T.PerPromptStatTracker):
    def update(self, *a, **k):  # the advantages: every reward is in; training starts after this
        STATE["train_start"].append(time.perf_counter())
        return super().update(*a, **k)


T.PerPromptStatTracker = _TimedTracker

_orig_multi = R.multi_score


def _timed_multi(device, score_dict):
    fn = _orig_multi(device, score_dict)

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        STATE["reward_seconds"] += time.perf_counter() - t0
        STATE["reward_calls"] += 1
        return out

    return timed


R.multi_score = _timed_multi

# ---------------------------------------------------------------------------------------------- config, run, summary
CFG = {}


def _configure(cfg, world):
    cfg.reward_fn = {hargs.reward: 1.0}
    cfg.eval_freq = 1
    cfg.save_freq = 10 ** 9
    cfg.dataset = str(PROMPTS)
    cfg.prompt_fn = "general_ocr"  # TextPromptDataset(train.txt / test.txt)
    cfg.logdir = str(WORK / "logs")
    cfg.save_dir = str(WORK / "logs" / "save")
    cfg.pretrained.model = str(MODEL_DIR)
    cfg.debug = False
    if hargs.tiny:
        cfg.resolution = 64
        cfg.mixed_precision = "fp16" if CUDA else "no"
        cfg.sample.train_batch_size = cfg.train.batch_size = 2
        cfg.sample.num_batches_per_epoch = 2
        cfg.train.gradient_accumulation_steps = 1
        cfg.sample.num_image_per_prompt = 2
    per_call = world * cfg.sample.train_batch_size
    k = hargs.images_per_prompt or cfg.sample.num_image_per_prompt
    if not hargs.images_per_prompt and per_call % k:
        k = max(d for d in range(1, k + 1) if per_call % d == 0)
    cfg.sample.num_image_per_prompt = k


def _write_summary(partial=False):
    cfg = CFG.get("cfg")
    if cfg is None or int(os.environ["RANK"]):
        return None
    world = int(os.environ["WORLD_SIZE"])
    starts = STATE["epoch_starts"]
    ep = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    samp = [e - s for s, e in zip(starts, STATE["sample_end"], strict=False)][:len(ep)]
    train = [b - t for t, b in zip(STATE["train_start"], starts[1:], strict=False)]
    meas = ep[hargs.warmup_epochs:]
    per_epoch = cfg.sample.train_batch_size * world * cfg.sample.num_batches_per_epoch
    summary = dict(
        partial=partial, harness=vars(hargs), repo=str(REPO), config=sys.argv[1], build=BUILD,
        world_size=world, images_per_epoch=per_epoch, images_per_epoch_per_gpu=per_epoch // world,
        batch_per_gpu=cfg.sample.train_batch_size, batches_per_epoch=cfg.sample.num_batches_per_epoch,
        num_image_per_prompt=cfg.sample.num_image_per_prompt, grad_accum=cfg.train.gradient_accumulation_steps,
        num_steps=cfg.sample.num_steps, num_train_timesteps=int(cfg.sample.num_steps * cfg.train.timestep_fraction),
        solver=cfg.sample.solver, guidance_scale=cfg.sample.guidance_scale, resolution=cfg.resolution,
        mixed_precision=cfg.mixed_precision, kl_beta=cfg.train.beta, nft_beta=cfg.beta, use_lora=bool(cfg.use_lora),
        ema=bool(cfg.train.ema), epoch_seconds=ep, sampling_seconds=samp, training_seconds=train,
        measured_epochs=len(meas), seconds_per_epoch=(sum(meas) / len(meas)) if meas else None,
        images_per_second=(per_epoch * len(meas) / sum(meas)) if meas else None,
        startup_seconds=(starts[0] - CFG["t_start"]) if starts else None,
        pipeline_calls=STATE["pipe_calls"], pipeline_seconds=STATE["pipe_seconds"],
        reward_calls=STATE["reward_calls"], reward_compute_seconds_total=STATE["reward_seconds"],
        transformer_calls_with_grad=STATE["grad_calls"], transformer_calls_no_grad=STATE["nograd_calls"],
        peak_cuda_mem_gib=(torch.cuda.max_memory_allocated() / 2 ** 30) if CUDA else None,
        device=torch.cuda.get_device_name() if CUDA else "cpu",
        versions=dict(python=sys.version.split()[0], torch=torch.__version__, diffusers=diffusers.__version__,
                      transformers=transformers.__version__, peft=peft.__version__),
    )
    if hargs.out:
        Path(hargs.out).write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _main(argv):
    cfg = T.FLAGS.config
    _configure(cfg, int(os.environ["WORLD_SIZE"]))
    CFG.update(cfg=cfg, t_start=time.perf_counter())
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    try:
        T.main(argv)
    except _BenchDone:
        pass
    summary = _write_summary()
    if summary is not None:
        print("DIFFUSIONNFT_BENCH " + json.dumps(summary, default=str), flush=True)
        if summary["images_per_second"] is not None:
            print(f"DiffusionNFT's own loop: {summary['images_per_second']:.3f} images/s, "
                  f"{summary['seconds_per_epoch']:.2f} s/epoch ({summary['images_per_epoch']} images), "
                  f"peak {summary['peak_cuda_mem_gib'] or math.nan:.1f} GiB", flush=True)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    T.app.run(_main)
