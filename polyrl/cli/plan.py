"""`polyrl plan [overrides...] [--gpu-memory GiB] [--gpus N] [--prompt-tokens N]`: the estimated peak GPU memory per
GPU of a run's config, part by part, before anything loads (it reads the checkpoint's safetensors headers only),
and where it does not fit, the smallest change that does (trainer/memory_plan.py; docs/memory.md).

    polyrl plan recipe=qwen_image_flowgrpo model.path=/ckpt/Qwen-Image data.path=prompts.txt --gpu-memory 80
    polyrl plan recipe=wan22_flowgrpo model.path=/ckpt/Wan2.2-TI2V-5B-Diffusers data.path=p.txt --gpus 2 \\
        actor.backend=fsdp2 parallel.sp=2

--gpu-memory: the budget per GPU in GiB (default: this machine's GPU, if it has one); --gpus: the GPUs of the run
(torchrun's world size); --prompt-tokens: a token policy's prompt length (default model.max_sequence_length, the
most a prompt may hold). Exit code 0 when it fits (or no budget is known), 1 when it does not.
"""

from __future__ import annotations

import os

from ..errors import UserError


def parse(args: list[str]) -> tuple[dict, list[str]]:
    opts, rest, i = {"gpu-memory": None, "gpus": "1", "prompt-tokens": None}, [], 0
    while i < len(args):
        a = args[i]
        key = a[2:].split("=", 1)[0] if a.startswith("--") else None
        if key in opts:
            if "=" in a:
                opts[key] = a.split("=", 1)[1]
            elif i + 1 < len(args):
                opts[key], i = args[i + 1], i + 1
            else:
                raise UserError(f"polyrl plan: --{key} needs a value")
        else:
            rest.append(a)
        i += 1
    try:
        return {"gpu_memory": None if opts["gpu-memory"] is None else float(opts["gpu-memory"]),
                "gpus": int(opts["gpus"]),
                "prompt_tokens": None if opts["prompt-tokens"] is None else int(opts["prompt-tokens"])}, rest
    except ValueError as e:
        raise UserError(f"polyrl plan: {e} (--gpu-memory takes GiB, --gpus and --prompt-tokens whole numbers)") from None


def main(args: list[str]) -> int:
    from ..config import load_config
    from ..perf.memory import free_memory_gib
    from ..trainer.memory_plan import estimate, fits, read_inventory

    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    opts, overrides = parse(args)
    gpus = opts["gpus"]
    previous = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(gpus)  # parallel.* is checked against the world the run will have
    try:
        notes: list[str] = []
        cfg = load_config(overrides, notes)
    finally:
        if previous is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = previous
    inventory = read_inventory(cfg.model.path)
    plan = estimate(cfg, inventory, gpus, prompt_tokens=opts["prompt_tokens"])
    budget = opts["gpu_memory"]
    device = free_memory_gib()
    if budget is None and device is not None:
        budget = device[1]
    print(f"polyrl plan: {cfg.name}, model.path={cfg.model.path}")
    print(plan.table(budget))
    print(f"  calibration: {plan.calibration}")
    for note in plan.notes:
        print(f"  note: {note}")
    if budget is None or plan.peak_gib <= budget:
        return 0
    found = fits(cfg, inventory, budget, gpus)
    if found is None:
        print(f"  does not fit {budget:.1f} GiB per GPU, and no single change the plan tries does (micro-batch, "
              "gradient checkpointing, rollout batch, FSDP2 over up to 8 GPUs, sequence parallel)")
        return 1
    changes, n, fitted = found
    where = f" on {n} GPUs (torchrun --nproc-per-node {n})" if n != gpus else ""
    print(f"  fits with: {' '.join(changes)}{where}: {fitted.peak_gib:.2f} GiB per GPU ({fitted.layout})")
    return 1
