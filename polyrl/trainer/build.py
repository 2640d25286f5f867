"""A run's stages built from its config: data, reward, algorithm, and the policy (model, sampler, actor) of the
model's kind. Everything that can fail on a bad config, bad data or an absent service fails here, before the
model loads. The kind only selects classes from the registries of the layers below (sampling/, actor/, data/)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from ..actor import actor_class
from ..actor.local import micro_batch_samples
from ..algorithms import build_algorithm
from ..config.schema import ConfigError
from ..data import pair_format
from ..data.benchmarks import Benchmark, read_prompt_data
from ..data.prompts import MissingConditionImage, PromptSampler, split_row
from ..distributed.dims import SHARDED_BACKENDS
from ..errors import UserError
from ..models import MODELS, build_model
from ..models.base import policy_kind
from ..perf.compile import compile_cache_path, compile_transformer, load_compile_cache
from ..perf.fp8 import apply_fp8, resolve_fp8
from ..rewards import build_reward
from ..sampling import sampler_class


@dataclass
class Data:
    source: PromptSampler  # the step's rows: prompt rows, or offline pairs
    heldout: list[dict] | None
    pairs: object | None  # the kind's pair format when the run trains on offline pairs (data.pairs_path)


def build_reward_and_algorithm(cfg: DictConfig):
    try:
        reward = build_reward(OmegaConf.to_container(cfg.reward))
    except ValueError as e:  # a reward refuses its arguments (they name the key): a config problem, one line
        raise ConfigError(str(e)) from None
    if hasattr(reward, "preflight"):  # e.g. reward=http: the server answers /health
        reward.preflight()
    try:
        algo = build_algorithm(OmegaConf.to_container(cfg.algorithm))
    except ValueError as e:  # a step option's value (algorithm.max_refills, ...)
        raise ConfigError(str(e)) from None
    return reward, algo


def load_data(cfg: DictConfig, reward, kind: str, say=None) -> Data:
    """The run's prompts (or offline pairs) and held-out prompts, every row checked before anything trains. A
    benchmark's file (a .csv, .tsv, .json or a folder: data/benchmarks.py) is read as `polyrl eval` reads it, and
    `say` is told what was read."""
    try:
        pairs = pair_format(kind)(cfg.rollout) if cfg.data.pairs_path else None
        rows = pairs.load(cfg.data.pairs_path) if pairs else None
    except ValueError as e:  # bad rows, each named by line
        raise UserError(str(e)) from None
    # a model conditioned on images (model class attribute `condition_images`: a bool, or a function of
    # model.options for a model whose modes differ) refuses a row without one
    needs_images = getattr(MODELS.get(cfg.model.name), "condition_images", False)
    needs_images = bool(needs_images(cfg.model.options) if callable(needs_images) else needs_images)
    try:
        prompts = None if pairs else read_prompt_data(cfg.data.path, require_image=needs_images)
        heldout = read_prompt_data(cfg.data.heldout_path, require_image=needs_images) if cfg.data.heldout_path else None
    except MissingConditionImage as e:
        raise ConfigError(f"{e}; model.name={cfg.model.name} needs a condition image in every row") from None
    except ValueError as e:  # the data file's own problems, each message names the file (and line)
        raise UserError(str(e)) from None
    for key, bench in (("data.path", prompts), ("data.heldout_path", heldout)):
        if bench is not None and bench.format != "polyrl" and say is not None:
            say(bench.describe(key))
        check_rows(reward, bench)
    return Data(PromptSampler(rows or prompts.rows, cfg.trainer.seed, cfg.data.shuffle),
                heldout.rows if heldout else None, pairs)


def check_rows(reward, bench: Benchmark | None) -> None:
    """Every data row is one the reward can score (rewards that can tell define `check_prompt`)."""
    check = getattr(reward, "check_prompt", None)
    if check is None or bench is None:
        return
    for i, row in enumerate(bench.rows):
        prompt, meta = split_row(row)
        try:
            check(prompt if isinstance(prompt, str) else prompt["text"], meta)
        except ValueError as e:
            raise UserError(f"{bench.location(i)}: {e}") from None


def build_policy(cfg: DictConfig, engine, algo, say, run_dir, reads_media: bool):
    """(adapter, sampler, actor, compile cache path) of the model's kind; model.fp8=auto and
    rollout.training_graph=auto are decided here (config/schema.py AUTO_SWITCH) and recorded in the run's config."""
    kind = policy_kind(MODELS.get(cfg.model.name))
    sampler_cls = sampler_class(kind)
    a = cfg.actor
    cfg.model.fp8 = (resolve_fp8(cfg.model.fp8, engine.device, lora=a.lora_rank > 0,
                                 sharded=a.backend in SHARDED_BACKENDS, dtype=cfg.model.dtype)
                     if sampler_cls.fp8_auto else cfg.model.fp8 is True)
    micro = micro_batch_samples(a.micro_batch_size, cfg.data.prompts_per_step * cfg.rollout.n
                                // max(a.num_minibatches, 1) // engine.dp_size)  # before any group is dropped
    plan = sampler_cls.plan_from_config(cfg, micro, say)
    cache = compile_cache_path(cfg.model.get("compile_cache"), run_dir)
    if cfg.model.get("compile", "none") != "none":
        load_compile_cache_noting(cfg, cache, say)
    adapter = build_model(cfg.model, engine.device)
    try:
        sampler = sampler_cls(adapter, plan, cfg.trainer.seed, reads_media)
    except ValueError as e:  # a media shape the model cannot make is a config error
        raise ConfigError(str(e)) from None
    actor = actor_class(a.backend, kind)(adapter, a, plan, algo, cfg.rollout_correction, engine)
    sampler.policy = actor.sampling_policy
    for network in adapter.modules().values():
        if cfg.model.fp8:
            apply_fp8(network)  # after LoRA: only the frozen base layers are swapped
        compile_transformer(network, cfg.model.compile)  # after LoRA, so the graph includes it
    return adapter, sampler, actor, cache


def load_compile_cache_noting(cfg: DictConfig, cache, say) -> None:
    """Load the saved compile cache before anything compiled runs (the SD3 VAE decoder too), saying what a cold
    first step will cost when there is none."""
    try:
        loaded = load_compile_cache(cache)
    except ValueError as e:  # costs only time: the graphs compile as without a cache
        say(f"polyrl: warning: compile cache not loaded: {e}; compiling from scratch")
        loaded = 0
    if loaded:
        say(f"polyrl: compile cache: loaded {loaded / 2**20:.1f} MiB from {cache}")
    else:  # a cold first step can take minutes (docs/performance.md): say why it is slow, and what helps
        saved = (f"saved to {cache} after it (point model.compile_cache at that file to start warm)" if cache
                 else "not saved (model.compile_cache=null)")
        say(f"polyrl: model.compile={cfg.model.compile}: the first step also compiles the networks (minutes unless "
            f"torch's own cache holds them); the graphs are {saved}")
