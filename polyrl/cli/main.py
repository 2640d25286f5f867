"""`polyrl` command line: train | config | sample | eval | export | pretrain-toy | bench | plan | serve-reward | view.

    polyrl train [overrides...]            run the config (default: the embedded toy_shapes recipe); --help lists them
    polyrl config [overrides...]           print the resolved config
    polyrl sample checkpoint=DIR [n=16] [out=PATH] [overrides...]   render a grid from a checkpoint
    polyrl eval checkpoint=DIR data.path=FILE [eval.scorers=[NAME,...]] [eval.compare_base=true] ...   benchmark a
                                           checkpoint, paired against its base (docs/evaluation.md)
    polyrl export checkpoint=DIR out=DIR [--merge]   a diffusers LoRA (pipe.load_lora_weights) or merged pipeline
    polyrl pretrain-toy [--task shapes|motion|count|text|rewrite] [--out DIR] ...   re-train an embedded toy base model
    polyrl plan [overrides...] [--gpu-memory GiB] [--gpus N]   the estimated peak GPU memory per GPU of a config,
                                           and the smallest change that fits (docs/memory.md)
    polyrl bench [--tiny] [--workload sd35m|sd35m_nft|qwen_image|wan22_5b|wan22_a14b|grpo_lm] [--epochs 2] [overrides...]
                                           a published-size workload (docs/performance.md), timed per stage
    polyrl serve-reward reward=NAME [reward.k=v ...] [--host H] [--port N] [--token T]   a reward over HTTP
    polyrl view [DIR ...] [--port N] [--host H]   a local web page over run directories (read-only)

`--import FILE.py|MODULE` (any command, repeatable) first imports a file or module of your own, e.g. one that
registers a reward with `@register_reward`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import UserError, missing_extra

USAGE = __doc__


def _split_special(args: list[str], keys: tuple[str, ...]) -> tuple[dict, list[str]]:
    special, rest = {}, []
    for a in args:
        k, _, v = a.partition("=")
        (special.__setitem__(k, v) if k in keys and v else rest.append(a))
    return special, rest


def pop_imports(args: list[str]) -> tuple[list[str], list[str]]:
    """(`--import X` / `--import=X` values, the other arguments)."""
    imports, rest, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a == "--import":
            if i + 1 >= len(args):
                raise UserError("--import needs a value: a .py file or a module name")
            imports.append(args[i + 1])
            i += 2
            continue
        if a.startswith("--import="):
            imports.append(a.split("=", 1)[1])
        else:
            rest.append(a)
        i += 1
    return imports, rest


def import_user_module(spec: str):
    """Import a user's file (`my_rewards.py`, any path) or module (`my_pkg.rewards`, on sys.path); an error inside
    it keeps its traceback (it is their code's), a file or module that is not there is a UserError."""
    import importlib
    import importlib.util

    if spec.endswith(".py") or os.sep in spec or "/" in spec:
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise UserError(f"--import {spec}: no such file")
        name = f"polyrl_user_{path.stem}"
        if name in sys.modules:  # imported already (e.g. `polyrl train` after `--import` in the same process)
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        if e.name != spec.split(".")[0] and e.name != spec:
            raise
        raise UserError(f"--import {spec}: no module named {spec!r} (give a .py file, or a module on "
                        "PYTHONPATH)") from None


def cmd_train(args: list[str]) -> int:
    from ..config import load_config, train_help
    from ..trainer.loop import RunStopped, Trainer

    if any(a in ("-h", "--help") for a in args):
        print(train_help())
        return 0
    imports, overrides = pop_imports(args)
    notes = []
    cfg = load_config(overrides, notes)
    if os.environ.get("RANK", "0") == "0":  # on a GPU: the memory plan, before the weights load
        from ..trainer.memory_plan import launch_warning

        warning = launch_warning(cfg)
        if warning:
            print(warning, file=sys.stderr)
    trainer = Trainer(cfg, overrides=[a for spec in imports for a in ("--import", spec)] + overrides)
    main = trainer.engine.is_main
    if main:
        dims = trainer.engine.dims  # only the dp ranks hold different samples; sp / tp ranks split one sample
        layout = [f"{d}={getattr(dims, d)}" for d in ("dp", "sp", "tp") if getattr(dims, d) > 1]
        ranks = f", {trainer.engine.world_size} ranks: {' '.join(layout)}" if trainer.engine.world_size > 1 else ""
        print(f"polyrl: run directory {trainer.run_dir} ({trainer.actor.num_trainable:,} trainable parameters, "
              f"device {trainer.device}{ranks})", file=sys.stderr)
        for note in notes:  # after the run started: an error before it stays the only line
            print(note, file=sys.stderr)
    try:
        history = trainer.fit()
    except RunStopped as e:  # printed before close(): under torchrun a rank that exits first ends the others
        if e.report:  # one rank of a multi-rank run says it (trainer/stopping.py)
            print(f"polyrl: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    finally:
        trainer.close()
    evals = [m["eval/reward_mean"] for m in history if "eval/reward_mean" in m]
    if evals and main:
        print(f"polyrl: held-out reward {evals[0]:.4f} -> {evals[-1]:.4f}", file=sys.stderr)
    return 0


def cmd_config(args: list[str]) -> int:
    from omegaconf import OmegaConf

    from ..config import load_config, train_help

    if any(a in ("-h", "--help") for a in args):
        print(train_help().replace("polyrl train", "polyrl config"))
        return 0
    notes = []
    print(OmegaConf.to_yaml(load_config(pop_imports(args)[1], notes), resolve=True), end="")
    for note in notes:
        print(note, file=sys.stderr)
    return 0


def cmd_sample(args: list[str]) -> int:
    from omegaconf import OmegaConf

    from ..actor.local import load_trained_weights
    from ..config import validate
    from ..data.benchmarks import read_prompt_data
    from ..distributed import pick_device
    from ..models import MODELS, build_model
    from ..models.base import policy_kind
    from ..rewards import build_reward
    from ..sampling import sampler_class
    from ..trainer.checkpoint import read_checkpoint
    from ..trainer.evaluation import evaluate
    from ..trainer.samples import save_samples, save_text_samples

    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    special, rest = _split_special(pop_imports(args)[1], ("checkpoint", "n", "out"))
    if "checkpoint" not in special:
        raise UserError("polyrl sample: checkpoint=DIR is required (a <run>/checkpoints/step_N directory)")
    ckpt = Path(special["checkpoint"])
    run_cfg = ckpt.parent.parent / "config.yaml"
    if not run_cfg.is_file():
        raise UserError(f"polyrl sample: {run_cfg} not found (is {ckpt} inside a polyrl run directory?)")
    cfg = validate(OmegaConf.merge(OmegaConf.load(run_cfg), OmegaConf.from_dotlist(rest)))
    read_checkpoint(ckpt)  # every file checked before anything is loaded
    try:
        device = pick_device(cfg.trainer.device)
    except RuntimeError as e:  # trainer.device=cuda without a GPU
        raise UserError(str(e)) from None
    adapter = build_model(cfg.model, device)
    load_trained_weights(adapter, ckpt)
    try:
        rows = read_prompt_data(cfg.data.heldout_path or cfg.data.path).rows
    except ValueError as e:  # the data file's own problems, each message names the file (and line)
        raise UserError(str(e)) from None
    n = int(special.get("n", cfg.trainer.num_validation))
    reward = build_reward(OmegaConf.to_container(cfg.reward))
    cls = sampler_class(policy_kind(MODELS[cfg.model.name]))
    sampler = cls(adapter, cls.plan_from_config(cfg, 1, lambda msg: None), cfg.trainer.seed)
    mean, batch = evaluate(sampler, reward, cfg.reward.name, rows, n, cfg.trainer.eval_seed)
    # beside the run's own samples, never inside the checkpoint (a checkpoint holds what training wrote)
    stem = Path(special["out"]).with_suffix("") if "out" in special else ckpt.parent.parent / "samples" / f"sample_{ckpt.name}"
    written = save_samples(batch, stem, sampler.fps) or [save_text_samples(batch, stem.with_suffix(".jsonl"))]
    print(f"polyrl: wrote {', '.join(map(str, written))} ({n} samples, mean reward {mean:.4f})")
    return 0


def cmd_eval(args: list[str]) -> int:
    from .evaluate import main as eval_main

    return eval_main(args)


def cmd_export(args: list[str]) -> int:
    from .export import main as export_main

    return export_main(args)


def cmd_pretrain_toy(args: list[str]) -> int:
    from .pretrain_toy import main as pretrain_main

    return pretrain_main(args)


def cmd_plan(args: list[str]) -> int:
    from .plan import main as plan_main

    return plan_main(args)


def cmd_bench(args: list[str]) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def cmd_serve_reward(args: list[str]) -> int:
    try:
        from ..serving.cli import main as serve_main
    except ModuleNotFoundError as e:  # the web framework is the `serve` extra
        if (e.name or "").split(".")[0] not in ("fastapi", "starlette", "uvicorn"):
            raise
        raise missing_extra("polyrl serve-reward", "serve", "fastapi, uvicorn") from None

    return serve_main(args)


def cmd_view(args: list[str]) -> int:
    from .view import main as view_main

    return view_main(args)


COMMANDS = {"train": cmd_train, "config": cmd_config, "sample": cmd_sample, "eval": cmd_eval, "export": cmd_export,
            "pretrain-toy": cmd_pretrain_toy, "bench": cmd_bench, "plan": cmd_plan, "serve-reward": cmd_serve_reward, "view": cmd_view}


def quiet_libraries() -> None:
    """What a user would only learn to ignore: the per-component "Loading weights" bars of transformers and
    diffusers, and torch's notice when the toy model's zero-width placeholder encoder is initialised."""
    import warnings

    warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
    try:
        import diffusers.utils.logging as diffusers_logging
        import transformers.utils.logging as transformers_logging
    except ImportError:  # the reward server's environment may lack them
        return
    transformers_logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # silences optional-backend notices
    # transformers 5 with its `kernels` dependency swaps layers for Hub kernels at .train() / .eval() on a GPU, a
    # download that fails offline (seen on an H100: a toy pretrain died at its final .eval()); polyrl loads nothing
    # from the Hub
    os.environ.setdefault("USE_HUB_KERNELS", "NO")
    if argv and argv[0] == "view":  # reads files only: no model library is imported
        try:
            return cmd_view(argv[1:])
        except UserError as e:
            print(f"polyrl: error: {e}", file=sys.stderr)
            return 2
    quiet_libraries()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        print(f"polyrl: error: unknown command {argv[0]!r}{f' (did you mean {close[0]}?)' if close else ''}; "
              f"commands: {', '.join(COMMANDS)} (polyrl --help)", file=sys.stderr)
        return 2
    from ..config import ConfigError
    from ..rewards.stage import RewardUnavailable
    from ..trainer.loop import RunStopped

    try:
        imports, rest = pop_imports(argv[1:])
        for spec in imports:  # before the command reads a config that may name what they register
            import_user_module(spec)
        return COMMANDS[argv[0]](argv[1:] if argv[0] == "train" else rest)
    except ConfigError as e:
        print(f"polyrl: config error: {e}", file=sys.stderr)
        return 2
    except RunStopped as e:
        print(f"polyrl: {e}", file=sys.stderr)
        return e.exit_code
    except (UserError, FileNotFoundError, FileExistsError) as e:
        print(f"polyrl: error: {e}", file=sys.stderr)
        return 2
    except (RewardUnavailable, FloatingPointError) as e:  # the run saved its last completed step first
        print(f"polyrl: stopped: {e}", file=sys.stderr)
        return 3
    except Exception as e:  # an out-of-memory outside a training step (loading, `polyrl eval`): one line too
        from ..trainer.oom import oom_stage, out_of_memory

        stage = oom_stage(e, "")
        if stage is None:
            raise
        where = f"{stage} of polyrl {argv[0]}" if stage != "startup" else f"polyrl {argv[0]} (loading the model)"
        print(f"polyrl: error: {out_of_memory(e, where, None)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
