"""`polyrl eval checkpoint=DIR | model.path=DIR data.path=FILE [eval.KEY=VALUE ...] [scorer.NAME.KEY=VALUE ...]
[overrides...]`: parses the command line; the evaluation (plan, sampling, scoring, paired report, grids) is
polyrl/evaluation/engine.py, whose docstring `--help` prints."""

from __future__ import annotations

from ..evaluation.plan import USAGE, EvalOptions


def parse_args(args: list[str]) -> tuple[str | None, EvalOptions, dict, list[str]]:
    """(checkpoint, eval options, per-scorer overrides {name: {key: value}}, the config overrides)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ..config import ConfigError

    checkpoint, eval_args, scorer_args, rest = None, [], [], []
    for a in args:
        key, sep, value = a.partition("=")
        if key == "checkpoint" and value:
            checkpoint = value
        elif key.startswith("eval.") and sep:
            eval_args.append(a)
        elif key.startswith("scorer.") and sep:
            scorer_args.append(a)
        else:
            rest.append(a)
    allowed = [k for k in EvalOptions.__dataclass_fields__ if k != "extra"]
    try:
        given = OmegaConf.from_dotlist(eval_args).get("eval", {})
        unknown = [k for k in given if k not in allowed]
        if unknown:
            raise ConfigError(f"unknown key eval.{unknown[0]}; allowed: {', '.join(sorted(allowed))}")
        merged = OmegaConf.merge(OmegaConf.structured(EvalOptions), given)
        scorers_cfg = OmegaConf.to_container(OmegaConf.from_dotlist(scorer_args)).get("scorer", {})
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"bad value for {'eval.' + key if key else 'an eval option'}: "
                          f"{str(e).splitlines()[0]}") from None
    opts = EvalOptions(**OmegaConf.to_container(merged))
    if isinstance(opts.scorers, str):
        opts.scorers = [opts.scorers]
    for key in ("samples_per_prompt", "resamples"):
        if getattr(opts, key) < 1:
            raise ConfigError(f"eval.{key}={getattr(opts, key)} must be >= 1")
    for key in ("grid", "chunk_prompts", "max_prompts"):
        if getattr(opts, key) < 0:
            raise ConfigError(f"eval.{key}={getattr(opts, key)} must be >= 0")
    if opts.noise_level < 0:
        raise ConfigError(f"eval.noise_level={opts.noise_level} must be >= 0 (0: the deterministic ODE sampler)")
    if opts.scorers is not None and (not opts.scorers or not all(isinstance(s, str) and s for s in opts.scorers)):
        raise ConfigError(f"eval.scorers={opts.scorers} must be a non-empty list of reward names")
    return checkpoint, opts, scorers_cfg, rest


def main(args: list[str]) -> int:
    from ..evaluation import engine

    if any(a in ("-h", "--help") for a in args):
        print(USAGE + "\n\n" + engine.__doc__)
        return 0
    checkpoint, opts, extra, overrides = parse_args(args)
    return engine.run(checkpoint, opts, extra, overrides, args)
