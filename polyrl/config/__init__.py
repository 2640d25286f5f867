"""Hydra config groups (YAML beside this file) and `load_config`, the one way a run's config is made."""

from __future__ import annotations

import copy
import functools
import inspect
import json
import re
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from .schema import Config, ConfigError, UnknownKeyError, validate

ASSETS = Path(__file__).resolve().parent.parent / "assets"
if not OmegaConf.has_resolver("polyrl_asset"):
    OmegaConf.register_new_resolver("polyrl_asset", lambda rel: str(ASSETS / rel))


CONFIG_DIR = Path(__file__).resolve().parent
GROUPS = ("recipe", "model", "algorithm", "reward", "actor", "rollout", "data", "trainer", "rollout_correction",
          "parallel", "ray")


BUILDING_BLOCK = "# building block"  # a recipe header line: the file composes, but is not offered as a recipe


def is_building_block(path: Path) -> bool:
    """A YAML whose header comment (the lines before its first key) has a line starting with BUILDING_BLOCK: a part
    other recipes build on (toy_common) or a command uses (sd35m_flowgrpo_bench), not a run to offer."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            return False
        if line.startswith(BUILDING_BLOCK):
            return True
    return False


def group_options(group: str) -> list[str]:
    """The options of a config group: its YAML files except building blocks (and, for `reward`, every registered
    reward)."""
    names = {p.stem for p in (CONFIG_DIR / group).glob("*.yaml") if not is_building_block(p)}
    if group == "reward":
        from ..rewards import REWARDS

        names |= set(REWARDS)
    return sorted(names)


def _register_code_rewards() -> None:
    """A reward registered in code (`@register_reward`, e.g. from `polyrl train --import my_rewards.py`) without a
    YAML in config/reward/ becomes the option `reward=<name>`: its name and constructor defaults (arguments
    without a default must be set, e.g. reward.target=0.5)."""
    from hydra.core.config_store import ConfigStore

    from ..rewards import REWARDS

    store = ConfigStore.instance()
    for name, cls in REWARDS.items():
        if (CONFIG_DIR / "reward" / f"{name}.yaml").is_file():
            continue
        node = {"name": name}
        for param in inspect.signature(cls).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            default = param.default
            if default is param.empty:
                node[param.name] = "???"
            elif default is None or isinstance(default, (bool, int, float, str)):
                node[param.name] = default
            elif isinstance(default, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in default):
                node[param.name] = list(default)
        store.store(group="reward", name=name, node=node)


def _compose(overrides) -> DictConfig:
    """Hydra's `compose("config", overrides)`, done in Hydra's own two stages: the overrides that choose config
    groups (`recipe=`, `model=`, `+reward@...=`) build the defaults list and compose the YAMLs, then the value
    overrides (`key=value`, `+key=`, `++key=`, `~key`) are applied to the struct-mode result by Hydra's
    `_apply_overrides_to_config`. The first stage is kept per choice of groups (a deep copy costs ~10 ms where
    composing costs ~150 ms), so a command or a test suite that composes many configs parses and merges the YAMLs
    once per recipe."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from ..rewards import REWARDS

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    if any(o.is_hydra_override() or o.is_sweep_override() for o in parsed):  # not polyrl's: Hydra in one go
        return _hydra_compose(tuple(overrides))
    # Hydra's rule (defaults_list.Overrides): a group choice is an override whose key names a config group and whose
    # value is not a dict
    is_choice = [not isinstance(o.value(), dict) and _is_group(o.key_or_group) for o in parsed]
    choices = tuple(o.input_line for o, c in zip(parsed, is_choice, strict=True) if c)
    cfg = copy.deepcopy(_composed_choices(choices, tuple(REWARDS.items())))
    ConfigLoaderImpl._apply_overrides_to_config([o for o, c in zip(parsed, is_choice, strict=True) if not c], cfg)
    return cfg


def _is_group(key: str) -> bool:
    """Whether `key` (`model`, `reward`, ...) is a config group: a folder beside this file or a group in Hydra's
    ConfigStore (where `_register_code_rewards` puts rewards registered in code)."""
    from hydra.core.config_store import ConfigStore

    node = ConfigStore.instance().repo
    for part in key.split("/"):
        node = node.get(part) if isinstance(node, dict) else None
    return (CONFIG_DIR / key).is_dir() or isinstance(node, dict)


def _hydra_compose(overrides: tuple[str, ...]) -> DictConfig:
    from hydra import compose, initialize_config_module

    _register_code_rewards()  # before Hydra composes (a kept composition is keyed by the rewards it saw)
    with initialize_config_module("polyrl.config", version_base="1.3"):
        return compose("config", overrides=list(overrides))


@functools.lru_cache(maxsize=32)
def _composed_choices(choices: tuple[str, ...], rewards: tuple) -> DictConfig:
    """The composed config of these group choices, kept (callers copy it). `rewards`, the registered rewards that
    `reward=<name>` may choose, is part of the key: a reward registered later composes afresh."""
    return _hydra_compose(choices)


def _check_model_path(raw: DictConfig, overrides: list[str]) -> None:
    """`model=<family>` under a recipe that points model.path at an embedded toy model of another family would
    silently load the toy checkpoint into the wrong adapter: refuse, saying what to set instead."""
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("model=")]
    if not chosen or any(o.lstrip("+").startswith("model.path=") for o in overrides):
        return
    path = OmegaConf.select(raw, "model.path", default=None)
    if not isinstance(path, str) or not Path(path).resolve().is_relative_to(ASSETS):
        return
    recipe_model = _compose([o for o in overrides if not o.startswith("model=")]).model.name
    name = raw.model.name
    if recipe_model == name:
        return
    pattern = re.compile(rf"override /model: {re.escape(name)}\s*$", re.MULTILINE)
    recipes = sorted(p.stem for p in (CONFIG_DIR / "recipe").glob("*.yaml") if pattern.search(p.read_text()))
    raise ConfigError(
        f"model={chosen[-1]} under recipe {raw.get('name')}: model.path is still that recipe's embedded "
        f"{recipe_model} toy model ({path}), which a {name} model cannot load; set model.path=<your {name} "
        f"checkpoint> (and data.path)" + (f", or use its recipe: recipe={' | '.join(recipes)}" if recipes else "")
    )


def _override_value(overrides: list[str], key: str) -> str | None:
    """The value the last `key=value` override (`+key=`, `++key=` alike) gives, or None."""
    values = [o.split("=", 1)[1] for o in overrides if "=" in o and o.split("=", 1)[0].lstrip("+") == key]
    return values[-1] if values else None


def _recipe_data_path(selections: tuple[str, ...]):
    """data.path as the config groups chosen by `selections` (the overrides without a dot: `recipe=`, `data=`, ...)
    set it. Only those choose it (the YAMLs' data.path values are constants), so the other overrides are left out."""
    return OmegaConf.select(_compose(list(selections)), "data.path", default=None, throw_on_missing=False)


def _drop_recipe_heldout(raw: DictConfig, overrides: list[str]) -> str | None:
    """A recipe's held-out file belongs to the recipe's data: when the user sets another data.path and no
    data.heldout_path, evaluating on it (e.g. the toy's shapes_heldout.jsonl under a math data set) is wrong, so it
    is dropped (evaluations then use data.path's prompts). Returns the note to print, or None."""
    held, path = OmegaConf.select(raw, "data.heldout_path"), _override_value(overrides, "data.path")
    if not held or path is None or _override_value(overrides, "data.heldout_path") is not None:
        return None
    recipe_path = _recipe_data_path(tuple(o for o in overrides if "." not in o.split("=", 1)[0]))
    if isinstance(recipe_path, str) and Path(recipe_path).resolve() == Path(path).resolve():
        return None  # the recipe's own data: its held-out file still fits
    raw.data.heldout_path = None
    return (f"polyrl: note: data.path={path} is set and data.heldout_path is not, so the recipe's held-out file "
            f"({held}) is not used; evaluations and sample grids use data.path's prompts (set "
            "data.heldout_path=FILE for held-out prompts of your own)")


def _recipe_algorithm_hint(error: ConfigError, raw: DictConfig, overrides: list[str]) -> str:
    """`algorithm=<name>` under a recipe that sets keys of its own algorithm (the default's DiffusionNFT keys) fails
    on a key the user never typed: say that the recipe set it, and which recipes select <name> with its own keys."""
    message = str(error)
    if not isinstance(error, UnknownKeyError) or error.group != "algorithm":
        return message
    key, name = error.key, error.name
    if _override_value(overrides, "algorithm") is None or _override_value(overrides, f"algorithm.{key}") is not None:
        return message  # no algorithm chosen, or the key is the user's own
    pattern = re.compile(rf"override /algorithm: {re.escape(name)}\s*$", re.MULTILINE)
    recipes = sorted(p.stem for p in (CONFIG_DIR / "recipe").glob("*.yaml")
                     if not is_building_block(p) and pattern.search(p.read_text()))
    listed = f"recipe={' | '.join(recipes)}; " if recipes else ""
    return (f"{message}; algorithm.{key} is set by recipe {raw.get('name')} for its own algorithm: choose "
            f"algorithm {name} through a recipe that selects it ({listed}docs/recipes.md)")


def load_config(overrides: list[str] | tuple[str, ...] = (), notes: list[str] | None = None) -> DictConfig:
    """Compose `config.yaml` with Hydra overrides (`key=value`, `group=option`) and validate it. What composing
    changed on its own (a recipe's held-out file dropped) is appended to `notes` as lines to show the user once the
    run has started (`polyrl train` prints them after its run-directory line), so that an error before then stays
    the only line."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    # `reward.async` / `reward.frames` / `reward.frame_reduce` apply to every reward, and the step options
    # `algorithm.dynamic_sampling` / `algorithm.max_refills` to every algorithm, but most YAMLs do not name them:
    # add them rather than override them
    shared = ("reward.async=", "reward.frames=", "reward.frame_reduce=", "algorithm.dynamic_sampling=",
              "algorithm.max_refills=")
    overrides = [f"++{o}" if o.startswith(shared) else o for o in overrides]
    try:
        raw = _compose(overrides)
        _check_model_path(raw, list(overrides))
        note = _drop_recipe_heldout(raw, list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_hydra_message(str(e), list(overrides))) from None
    try:
        cfg = validate(raw)
    except ConfigError as e:
        raise ConfigError(_recipe_algorithm_hint(e, raw, list(overrides))) from None
    if note and notes is not None:
        notes.append(note)
    return cfg


COMMON_KEYS = (
    ("model.path", "a local diffusers directory (model_index.json + components)"),
    ("data.path", ".txt (a prompt a line), .jsonl or .parquet with a `prompt` column, or a benchmark's file"),
    ("data.heldout_path", "held-out prompts for the evaluation and the sample grid"),
    ("data.prompts_per_step", "prompt groups per step"),
    ("rollout.n", "samples per prompt (the group of the advantage)"),
    ("rollout.num_steps", "sampling steps"),
    ("rollout.height", "image height (also rollout.width; video: rollout.num_frames, rollout.fps)"),
    ("actor.lr", "learning rate"),
    ("actor.lora_rank", "LoRA rank; 0: full fine-tune"),
    ("trainer.max_steps", "training steps"),
    ("trainer.output_dir", "the run directory; null: runs/<name>/<timestamp>"),
    ("trainer.resume", "auto (the newest run of this name, or trainer.output_dir) | a checkpoint directory"),
    ("trainer.device", "auto | cpu | cuda"),
    ("trainer.save_every", "steps between checkpoints"),
    ("trainer.eval_every", "steps between held-out evaluations and sample grids"),
    ("trainer.loggers", "[tensorboard] | [tensorboard,wandb] | [tensorboard,mlflow] | ..."),
    ("rollout.max_new_tokens", "token models: response length (also rollout.temperature, rollout.top_p)"),
    ("actor.backend", "local | fsdp2 (torchrun; parallel.dp_shard, .dp_replicate, .sp, .tp; docs/distributed.md) | "
                      "veomni (fsdp2 sharded by VeOmni: dp_* only; its own environment)"),
    ("trainer.launcher", "local | ray (rollout.workers, ray.reward_workers, ray.address; docs/ray.md)"),
)


def train_help() -> str:
    """`polyrl train --help`: the groups with their options and the keys most runs set (read from the YAML
    groups and the schema, so it cannot go stale)."""
    import textwrap

    defaults = _compose([])
    lines = [
        "usage: polyrl train [--import FILE.py|MODULE ...] [group=option ...] [key=value ...]",
        "",
        "Compose a run from polyrl/config (default: recipe=toy_shapes, DiffusionNFT on the embedded toy model on the",
        "CPU) and train it. `polyrl config [same overrides]` prints every key of the composed config.",
        "",
        "groups (group=option; a recipe sets values in several groups and is applied last):",
    ]
    for g in GROUPS:
        lines += textwrap.wrap(", ".join(group_options(g)), 116, initial_indent=f"  {g:<19} ",
                               subsequent_indent=" " * 22)
    lines += ["", "common keys (key=value; [its value in the default run]):"]
    for key, what in COMMON_KEYS:
        value = OmegaConf.select(defaults, key, throw_on_missing=False, default="???")
        value = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
        value = "required" if value == "???" else value if isinstance(value, str) else json.dumps(value)
        if isinstance(value, str) and value.startswith(str(ASSETS)):
            value = "the embedded " + Path(value).relative_to(ASSETS).as_posix()
        lines.append(f"  {key:<23} {what} [{value}]")
    lines += [
        "",
        "  --import FILE.py|MODULE  import a file or module that registers your own reward with @register_reward",
        "                           (then reward=<its name>; docs/rewards.md, Your own reward)",
        "",
        "examples:",
        "  polyrl train                                          # the toy recipe, about 4-5 minutes on 2 CPU cores",
        "  polyrl train recipe=sd35_flowgrpo model.path=/ckpt/sd3.5-medium data.path=prompts.txt",
        "  polyrl train trainer.output_dir=runs/a trainer.resume=auto   # continue a stopped run",
    ]
    return "\n".join(lines)


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
        extra = ["async", "frame_reduce", "frames", "name"] if parent == "reward" else [
            "dynamic_sampling", "max_refills", "name"]
        return ", ".join(sorted(inspect.signature(cls).parameters) + extra)
    if parent == "model.options":  # a model's own options (its class's `options`, e.g. models/ltx2.py)
        from ..models import MODELS

        rest = [o for o in overrides if not o.lstrip("+~").startswith(parent + ".")]
        name = _compose(rest).model.name
        return ", ".join(sorted(getattr(MODELS.get(name), "options", {}))) or f"(none for model.name={name})"
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


__all__ = ["ASSETS", "Config", "ConfigError", "group_options", "load_config", "train_help", "validate"]
