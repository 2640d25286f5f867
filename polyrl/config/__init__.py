"""Hydra config groups (YAML beside this file) and `load_config`, the one way a run's config is made."""

from __future__ import annotations

import inspect
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .schema import Config, ConfigError, validate

ASSETS = Path(__file__).resolve().parent.parent / "assets"
if not OmegaConf.has_resolver("polyrl_asset"):
    OmegaConf.register_new_resolver("polyrl_asset", lambda rel: str(ASSETS / rel))


def _compose(overrides) -> DictConfig:
    from hydra import compose, initialize_config_module

    with initialize_config_module("polyrl.config", version_base="1.3"):
        return compose("config", overrides=list(overrides))


def load_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose `config.yaml` with Hydra overrides (`key=value`, `group=option`) and validate it."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    # `reward.async` / `reward.frames` / `reward.frame_reduce` apply to every reward but are in no reward's YAML:
    # add them rather than override them
    overrides = [f"++{o}" if o.startswith(("reward.async=", "reward.frames=", "reward.frame_reduce=")) else o
                 for o in overrides]
    try:
        raw = _compose(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_hydra_message(str(e), list(overrides))) from None
    return validate(raw)


def _allowed_under(parent: str | None, overrides: list[str]) -> str:
    """The keys allowed under `parent`: schema fields, or the selected class's arguments for open groups."""
    if parent == "reward.mix":
        return ("any registered reward as a component; a new one needs a leading + (+reward.mix.<reward>=<weight>), "
                "or set them all: reward.mix={ocr: 0.7, pickscore: 0.3}")
    if parent is not None and parent.startswith("reward.mix."):
        return "weight, required, reward and the component reward's own arguments (a new key needs a leading +)"
    if parent in ("reward", "algorithm"):
        from ..algorithms import ALGORITHMS
        from ..rewards import REWARDS

        rest = [o for o in overrides if not o.lstrip("+~").startswith(parent + ".")]
        name = _compose(rest)[parent]["name"]
        cls = (REWARDS if parent == "reward" else ALGORITHMS)[name]
        extra = ["async", "frame_reduce", "frames", "name"] if parent == "reward" else ["name"]
        return ", ".join(sorted(inspect.signature(cls).parameters) + extra)
    schema = OmegaConf.structured(Config)
    node = OmegaConf.select(schema, parent) if parent else schema
    return ", ".join(sorted(node.keys())) if isinstance(node, DictConfig) else "?"


def _hydra_message(text: str, overrides: list[str]) -> str:
    if "Could not override" in text or "is not in struct" in text:
        key = text.split("'")[1] if "'" in text else "?"
        parent = key.rsplit(".", 1)[0] if "." in key else None
        return f"unknown key {key}; allowed: {_allowed_under(parent, overrides)}"
    text = text.split("Config search path")[0]
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


__all__ = ["ASSETS", "Config", "ConfigError", "load_config", "validate"]
