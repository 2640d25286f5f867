"""`polyrl` command line: train | config | sample | pretrain-toy | bench | serve-reward.

    polyrl train [overrides...]            run the config (default: the embedded toy_shapes recipe)
    polyrl config [overrides...]           print the resolved config
    polyrl sample checkpoint=DIR [n=16] [out=PATH] [overrides...]   render a grid from a checkpoint
    polyrl pretrain-toy [--out DIR] ...    re-train the embedded toy base model
    polyrl bench [--tiny] [--workload sd35m|qwen_image] [--epochs 2] [overrides...]   BENCHMARK.md workload, timed
    polyrl serve-reward reward=NAME [reward.k=v ...] [--host H] [--port N] [--token T]   a reward over HTTP
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

USAGE = __doc__


def _split_special(args: list[str], keys: tuple[str, ...]) -> tuple[dict, list[str]]:
    special, rest = {}, []
    for a in args:
        k, _, v = a.partition("=")
        (special.__setitem__(k, v) if k in keys and v else rest.append(a))
    return special, rest


def cmd_train(args: list[str]) -> int:
    from ..config import load_config
    from ..trainer.loop import Trainer

    cfg = load_config(args)
    trainer = Trainer(cfg)
    main = trainer.engine.is_main
    if main:
        ranks = f", {trainer.engine.world_size} data-parallel ranks" if trainer.engine.world_size > 1 else ""
        print(f"polyrl: run directory {trainer.run_dir} ({trainer.actor.num_trainable:,} trainable parameters, "
              f"device {trainer.device}{ranks})", file=sys.stderr)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    evals = [m["eval/reward_mean"] for m in history if "eval/reward_mean" in m]
    if evals and main:
        print(f"polyrl: held-out reward {evals[0]:.4f} -> {evals[-1]:.4f}", file=sys.stderr)
    return 0


def cmd_config(args: list[str]) -> int:
    from omegaconf import OmegaConf

    from ..config import load_config

    print(OmegaConf.to_yaml(load_config(args), resolve=True), end="")
    return 0


def cmd_sample(args: list[str]) -> int:
    from omegaconf import OmegaConf

    from ..actor.local import load_trained_weights
    from ..config import validate
    from ..data.prompts import load_prompts
    from ..distributed.engine import pick_device
    from ..models import build_model
    from ..rewards import build_reward
    from ..trainer.logging import save_samples
    from ..trainer.loop import evaluate, plan_from_config

    special, rest = _split_special(args, ("checkpoint", "n", "out"))
    if "checkpoint" not in special:
        raise SystemExit("polyrl sample: checkpoint=DIR is required (a <run>/checkpoints/step_N directory)")
    ckpt = Path(special["checkpoint"])
    run_cfg = ckpt.parent.parent / "config.yaml"
    if not run_cfg.is_file():
        raise SystemExit(f"polyrl sample: {run_cfg} not found (is {ckpt} inside a polyrl run directory?)")
    cfg = validate(OmegaConf.merge(OmegaConf.load(run_cfg), OmegaConf.from_dotlist(rest)))
    adapter = build_model(cfg.model, pick_device(cfg.trainer.device))
    load_trained_weights(adapter, ckpt)
    rows = load_prompts(cfg.data.heldout_path or cfg.data.path)
    n = int(special.get("n", cfg.trainer.num_validation))
    reward = build_reward(OmegaConf.to_container(cfg.reward))
    plan = plan_from_config(cfg.rollout)
    mean, batch = evaluate(adapter, reward, cfg, rows, plan, n)
    out = Path(special.get("out", ckpt / "samples.png"))
    written = save_samples(batch, out.with_suffix(""), plan.shape.fps)
    print(f"polyrl: wrote {', '.join(map(str, written))} ({n} samples, mean reward {mean:.4f})")
    return 0


def cmd_pretrain_toy(args: list[str]) -> int:
    from ..config import ASSETS
    from .pretrain_toy import pretrain_toy

    p = argparse.ArgumentParser(prog="polyrl pretrain-toy", description="train the embedded toy base model")
    p.add_argument("--out", default=str(ASSETS / "toy_shapes"))
    p.add_argument("--prompts-dir", default=str(ASSETS / "prompts"))
    p.add_argument("--vae-steps", type=int, default=1000)
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--num-images", type=int, default=16000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(args)
    out = pretrain_toy(a.out, vae_steps=a.vae_steps, steps=a.steps, num_images=a.num_images, batch=a.batch,
                       seed=a.seed, prompts_dir=a.prompts_dir, device=a.device)
    print(f"polyrl: wrote {out}")
    return 0


def cmd_bench(args: list[str]) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def cmd_serve_reward(args: list[str]) -> int:
    from ..serving.cli import main as serve_main

    return serve_main(args)


COMMANDS = {"serve-reward": cmd_serve_reward, "bench": cmd_bench, "train": cmd_train, "config": cmd_config, "sample": cmd_sample, "pretrain-toy": cmd_pretrain_toy}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # silences optional-backend notices
    if not argv or argv[0] in ("-h", "--help", "help") or argv[0] not in COMMANDS:
        print(USAGE)
        return 0 if not argv or argv[0] in ("-h", "--help", "help") else 2
    from ..config import ConfigError

    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as e:
        print(f"polyrl: config error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError) as e:
        print(f"polyrl: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from ..rewards.stage import RewardUnavailable

        if not isinstance(e, RewardUnavailable):
            raise
        print(f"polyrl: stopped: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
