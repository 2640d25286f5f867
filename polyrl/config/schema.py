"""The config schema and its validation (run before any model is loaded).

Hydra composes the YAML groups under `polyrl/config/`; the result is merged into these dataclasses, so an
unknown key or a wrongly typed value fails with the key's full name and the allowed keys. `reward` and
`algorithm` are open groups whose keys are their registered class's constructor arguments, checked against
its signature.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Union

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

DTYPES = ("float32", "bfloat16", "float16", "float64")  # float64: equality tests across layouts and CPUs
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ModelConfig:
    name: str = "sd3"
    path: str = MISSING
    dtype: str = "float32"
    max_sequence_length: int = 256
    compile: str = "none"  # torch.compile the transformer after LoRA is added (and the SD3 VAE decoder): none | blocks (each block) | full
    # torch.compile's caches saved after the first step and at each checkpoint, loaded at start (perf/compile.py):
    # auto = <run dir>/compile_cache.bin (a resumed run starts warm), a path (shared across runs), null = off
    compile_cache: str | None = "auto"
    # frozen base linears as float8 matmuls (LoRA only; perf/fp8.py). auto: on where it runs and pays — a bf16/fp16
    # LoRA run on the local actor on a CUDA GPU with float8 tensor cores (compute capability >= 8.9); off elsewhere
    fp8: Union[bool, str] = "auto"  # noqa: UP007
    shift: float | None = None  # flow shift of the sigma grid where a model takes one (Wan); None: the checkpoint's
    # condition-image models (Qwen-Image-Edit): the condition is resized to about condition_size² pixels (the side of
    # that area), aspect kept; vl_condition_size the same for the VL encoder's copy. None: the model's published value
    condition_size: int | None = None
    vl_condition_size: int | None = None
    # models whose negative conditioning is per sample (Qwen-Image-Edit encodes it with each condition image); their
    # model config sets it to ${rollout.negative_prompt}. None: no negative conditioning is encoded
    negative_prompt: str | None = None
    # guidance-embedding models with optional true CFG (FLUX.1): > 1 adds true CFG with rollout.negative_prompt on top
    # of the embedded guidance (rollout.guidance_scale); 1: off
    true_cfg_scale: float = 1.0
    # model-specific options: keys and defaults are the model class's `options` (validated here before anything
    # loads; LTX-2: per-stream guidance, STG, modality guidance, rescale, cross timestep, frame rate: models/ltx2.py)
    options: dict = field(default_factory=dict)


@dataclass
class RolloutConfig:
    height: int = 64
    width: int = 64
    num_frames: int = 0  # video models: frames per sample (0: an image)
    fps: float = 16.0  # video models: frame rate of the sample videos (and of models conditioned on it)
    num_steps: int = 10
    n: int = 8  # samples per prompt (the GRPO group)
    guidance_scale: float = 1.0
    noise_level: float = 0.7
    sde_window_size: int = 0  # 0: every step is stochastic and trained
    sde_window_range: list = field(default_factory=lambda: [0, 0])
    batch_size: int = 64
    negative_prompt: str = ""
    step: str = "sde"  # sde | cps | dance (the reverse step; the actor re-scores with the same one) | dpm2 (an ODE solver)
    sde_window_strategy: str = "per_sample"  # per_sample | random | progressive
    sde_window_every: int = 1  # progressive: training steps between window slides
    shared_initial_noise: bool = False  # one initial noise per prompt group (DanceGRPO)
    log_density: str = "gaussian"  # gaussian | squared_distance (flow_grpo's cps score; sampling/steps.py)
    # sample every step through the training forward's graph (sampling/diffusion.py); auto: when model.compile
    # is not none and batch_size equals the training micro-batch (then exact; eager kernels agree either way)
    training_graph: Union[bool, str] = "auto"  # noqa: UP007
    # token policies (model=causal_lm, ...; docs/tokens.md): response length, π = softmax(logits / temperature),
    # nucleus sampling, and strings that end a response (the token completing one is kept)
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list = field(default_factory=list)
    # trainer.launcher=ray (docs/ray.md): K > 0 samples on K rollout replicas that receive the weights after every
    # update (0: the rollout runs in the actor's process); max_staleness k > 0 lets those replicas sample the next k
    # steps while the actor updates (one-step-off-policy for k = 1; rollout_correction then defaults to decoupled)
    workers: int = 0
    max_staleness: int = 0


@dataclass
class ActorConfig:
    backend: str = "local"
    lr: float = 1e-4
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 1e-4
    eps: float = 1e-8
    grad_clip: float = 1.0
    lora_rank: int = 32  # 0: full fine-tune
    lora_alpha: float = 64.0
    lora_targets: list | None = None  # None: the model adapter's default
    num_minibatches: int = 2  # optimizer steps per training step
    micro_batch_size: int = 0  # 0: the whole mini-batch in one forward
    ema_decay: float = 0.0  # > 0: keep an EMA copy of the trainable weights (the `old` policy), old ← d·old + (1−d)·θ
    # > 0: a separate EMA of the trainable weights that held-out evaluation samples with and checkpoints keep, moved
    # after every optimizer step s with d = min((1 + s)/(10 + s), eval_ema_decay) (DiffusionNFT's authors: 0.9)
    eval_ema_decay: float = 0.0
    # recompute block activations in the backward (memory for compute): true every block, a share in (0, 1] that
    # share of the blocks, evenly spread
    gradient_checkpointing: Union[bool, float] = False  # noqa: UP007 (OmegaConf reads typing.Union, not `|`)
    # the model's networks to train (model=qwen3_omni_speech: thinker, talker, code_predictor); None: all of them
    train_modules: list | None = None
    # a policy of several token streams (model=qwen3_omni_speech: text, speech): each stream's coefficient in the loss
    # ({speech: 0.5}; unnamed streams 1) and how a response's tokens are normalised: token (each token counts) |
    # stream (each stream's token mean, weighted by its coefficient: algorithms/streams.py)
    stream_weights: dict = field(default_factory=dict)
    stream_norm: str = "token"


@dataclass
class DataConfig:
    path: str = MISSING
    heldout_path: str | None = None
    pairs_path: str | None = None  # offline preference pairs (.jsonl / .parquet: prompt, chosen, rejected); no rollout
    prompts_per_step: int = 8
    shuffle: bool = True


@dataclass
class TrainerConfig:
    max_steps: int = 100
    output_dir: str | None = None  # None: runs/<name>/<timestamp>
    seed: int = 0
    resume: str | None = None  # None | auto | path to a checkpoint directory
    deterministic: bool = False
    device: str = "auto"
    save_every: int = 10
    keep_checkpoints: int | None = None  # keep the newest N complete checkpoints (None: all); older ones deleted
    keep_best: bool = False  # also keep the checkpoint with the best held-out reward (eval/reward_mean)
    eval_every: int = 10
    eval_samples: int = 64
    eval_seed: int = 1234
    num_validation: int = 16  # images in each sample grid (0: no sample grids written)
    # extra scorers of every held-out evaluation (eval/<scorer> in the metrics) and the reward-hacking watch on them
    # (eval/hacking_alarm; docs/evaluation.md); their arguments: +trainer.eval_scorer_args.<name>.<key>=value
    eval_scorers: list = field(default_factory=list)
    eval_scorer_args: dict = field(default_factory=dict)
    progress: bool = True
    tensorboard: bool = True  # false: leave tensorboard out of `loggers`
    loggers: list = field(default_factory=lambda: ["tensorboard"])  # any of LOGGERS (trainer/logging.py)
    peak_tflops: float | None = None  # the device's measured dense bf16 rate: enables perf/mfu in the metrics
    launcher: str = "local"  # local (this process, or torchrun ranks) | ray (worker groups on Ray: docs/ray.md)


@dataclass
class RolloutCorrectionConfig:
    mode: str | None = None  # bypass | recompute | decoupled (docs/algorithms.md §4); None: decoupled when the
    # rollout may be stale (rollout.max_staleness > 0) and the algorithm uses log-probs, else bypass
    is_cap: float = 2.0  # decoupled: w = min(exp(log p_old − log p_rollout), is_cap)
    log_ratio_bounds: list | None = None  # [lo, hi]: reject sample-steps whose log-ratio falls outside


@dataclass
class ParallelConfig:
    """Degrees of parallelism over the `torchrun` world (actor.backend=fsdp2 or veomni; docs/distributed.md)."""

    dp_replicate: int = 1  # data-parallel groups that each hold a full copy of the (sharded) weights (HSDP)
    dp_shard: int = -1  # data-parallel ranks the weights are sharded over (FSDP2); -1: the ranks left over
    sp: int = 1  # Ulysses sequence parallel: the transformer's tokens split over sp ranks (heads in attention)
    tp: int = 1  # tensor parallel: the transformer blocks' heads and MLPs split over tp ranks (DTensor)


@dataclass
class RayConfig:
    """trainer.launcher=ray (docs/ray.md): the cluster and the worker groups' resources."""

    address: str | None = None  # an existing cluster (auto, ray://host:10001, host:6379); None or "": a local Ray
    num_cpus: int | None = None  # a local Ray's CPUs (None: Ray counts them)
    reward_workers: int = 1  # reward workers in their own pool (0: score in the driver)
    worker_cpus: float = 1.0  # CPUs each rollout replica and reward worker reserves
    rollout_gpus: float | None = None  # GPUs per rollout replica (None: 1 when the actor is on a GPU, else 0)
    reward_gpus: float = 0.0  # GPUs per reward worker
    max_restarts: int = 3  # times Ray restarts a worker whose process died; its calls are sent again


@dataclass
class Config:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: Any = field(default_factory=lambda: {"name": "flow_grpo"})
    reward: Any = field(default_factory=lambda: {"name": "shapes"})
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ray: RayConfig = field(default_factory=RayConfig)


class ConfigError(ValueError):
    """A config problem, reported before anything is loaded."""


class UnknownKeyError(ConfigError):
    """`<group>.<key>` is not an argument of the group's chosen class `<group>.name=<name>`."""

    def __init__(self, message: str, group: str, key: str, name: str):
        super().__init__(message)
        self.group, self.key, self.name = group, key, name


def _allowed(node) -> str:
    return ", ".join(sorted(node.keys()))


AUTO_SWITCH = (True, False, "auto")  # the values of a switch whose default the run decides (trainer/loop.py)


def _check_choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not valid; allowed: {', '.join(map(str, allowed))}")


def _check_kwargs(group: str, cfg: dict, registry: dict, shared: tuple[str, ...] = ()) -> None:
    """Every key of `group` is a constructor argument of the named class, or one of the group's `shared` keys."""
    name = cfg.get("name")
    _check_choice(f"{group}.name", name, sorted(registry))
    params = inspect.signature(registry[name]).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    for key in cfg:
        if key != "name" and key not in params and key not in shared:
            raise UnknownKeyError(f"unknown key {group}.{key} for {group}.name={name}; allowed: "
                                  f"{', '.join(sorted([*params, *shared]))}", group, key, name)
    nested = getattr(registry[name], "nested_configs", None)  # e.g. reward=mix: validate each component too
    if nested is not None:
        try:
            subs = nested(cfg)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for sub_group, sub_cfg in subs:
            _check_kwargs(sub_group, sub_cfg, registry)


def _check_launcher(cfg: DictConfig) -> None:
    """trainer.launcher, ray.* and the rollout pool keys (docs/ray.md)."""
    import importlib.util

    t, r, ray = cfg.trainer, cfg.rollout, cfg.ray
    _check_choice("trainer.launcher", t.launcher, ["local", "ray"])
    for key, value in (("rollout.workers", r.workers), ("rollout.max_staleness", r.max_staleness),
                       ("ray.reward_workers", ray.reward_workers), ("ray.max_restarts", ray.max_restarts),
                       ("ray.worker_cpus", ray.worker_cpus), ("ray.reward_gpus", ray.reward_gpus)):
        if value < 0:
            raise ConfigError(f"{key}={value} must be >= 0")
    if t.launcher != "ray":
        if r.workers > 0:
            raise ConfigError(f"rollout.workers={r.workers} is a pool of Ray workers: set trainer.launcher=ray")
        return
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("trainer.launcher=ray needs Ray, which is not installed: pip install 'polyrl[ray]'")
    if r.max_staleness > 0 and r.workers == 0:
        raise ConfigError(f"rollout.max_staleness={r.max_staleness} overlaps the rollout with the update, which needs "
                          "a separate rollout pool: set rollout.workers >= 1")
    if r.workers > 0 and cfg.data.pairs_path is not None:
        raise ConfigError("rollout.workers is set but data.pairs_path trains on offline pairs, without a rollout")
    if cfg.actor.backend != "local":
        raise ConfigError(f"trainer.launcher=ray drives actor.backend=local; actor.backend={cfg.actor.backend} is "
                          "launched with torchrun (docs/distributed.md)")


def _check_streams(cfg: DictConfig, model_cls) -> None:
    """actor.train_modules (the model's networks) and actor.stream_weights / stream_norm (its token streams)."""
    from ..algorithms.streams import STREAM_NORMS

    a = cfg.actor
    if a.train_modules is not None:
        names = list(a.train_modules)
        known = getattr(model_cls, "module_names", None)
        if not names or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"actor.train_modules={names} must be a non-empty list of network names, or null (all)")
        if known is not None and any(n not in known for n in names):
            bad = next(n for n in names if n not in known)
            raise ConfigError(f"actor.train_modules: {bad!r} is not a network of model={cfg.model.name}; allowed: "
                              f"{', '.join(known)}")
        if a.backend != "local" or cfg.trainer.launcher != "local":
            raise ConfigError("actor.train_modules is implemented for actor.backend=local and trainer.launcher=local")
    _check_choice("actor.stream_norm", a.stream_norm, STREAM_NORMS)
    streams = tuple(getattr(model_cls, "streams", ()))
    if (a.stream_weights or a.stream_norm != "token") and not streams:
        raise ConfigError(f"actor.stream_weights / actor.stream_norm weigh the token streams of a policy of several "
                          f"(model=qwen3_omni_speech: text, speech); model={cfg.model.name} has one")
    for key, value in a.stream_weights.items():
        if key not in streams:
            raise ConfigError(f"actor.stream_weights.{key}: not a stream of model={cfg.model.name}; allowed: "
                              f"{', '.join(streams)}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ConfigError(f"actor.stream_weights.{key}={value!r} must be a number >= 0")


def scorer_configs(names: list[str], cfg, extra: dict, key: str = "eval.scorers",
                   arg_prefix: str = "scorer") -> dict[str, dict]:
    """The reward configs of extra scorers (`polyrl eval`'s `eval.scorers`, the trainer's `trainer.eval_scorers`).
    Each scorer's reward config: the run's `reward` for its own name, else config/reward/<name>.yaml (or only the
    name, for a reward registered in code), with `extra[name]` (`<arg_prefix>.<name>.<key>=value`) on top. A name
    that is not a registered reward, `extra` for a name not in `names`, or a required key left unset (`???`) is a
    ConfigError naming `key` / `arg_prefix`."""
    from pathlib import Path

    from ..rewards import REWARDS

    reward_dir = Path(__file__).resolve().parent / "reward"

    unknown = sorted(set(extra) - set(names))
    if unknown:
        raise ConfigError(f"{arg_prefix}.{unknown[0]}.* is set but {unknown[0]} is not in {key}={list(names)}")
    out = {}
    for name in names:
        if name not in REWARDS:
            raise ConfigError(f"{key}: {name!r} is not a registered reward; allowed: {', '.join(sorted(REWARDS))}")
        if name == cfg.reward.name:
            base = OmegaConf.to_container(cfg.reward)
        elif (reward_dir / f"{name}.yaml").is_file():
            base = OmegaConf.to_container(OmegaConf.load(reward_dir / f"{name}.yaml"))
        else:
            base = {"name": name}
        conf = {**base, **(extra.get(name) or {}), "name": name}
        missing = [k for k, v in conf.items() if v == "???"]
        if missing:
            raise ConfigError(f"scorer {name} needs {', '.join(f'{arg_prefix}.{name}.{k}=...' for k in missing)}")
        out[name] = conf
    return out


@functools.cache
def _schema() -> DictConfig:
    """The structured schema, built once (~17 ms): `OmegaConf.merge` copies it, so it is never changed."""
    return OmegaConf.structured(Config)


def validate(raw: DictConfig) -> DictConfig:
    """Merge into the schema and check values and combinations; raises ConfigError with a one-line message."""
    schema = _schema()
    try:
        cfg = OmegaConf.merge(schema, raw)
    except ConfigKeyError as e:
        full = e.full_key or e.key
        parent = full.rsplit(".", 1)[0] if "." in str(full) else None
        node = OmegaConf.select(schema, parent) if parent else schema
        raise ConfigError(f"unknown key {full}; allowed: {_allowed(node)}") from None
    except ValidationError as e:
        raise ConfigError(f"bad value for {e.full_key}: {e.msg.splitlines()[0]}") from None
    missing = sorted(OmegaConf.missing_keys(cfg), key=lambda k: ("model", "data").index(k.split(".")[0])
                     if k.split(".")[0] in ("model", "data") else 2)
    if OmegaConf.select(cfg, "data.pairs_path"):  # offline pairs replace the prompt file
        missing = [k for k in missing if k != "data.path"]
    if missing:
        raise ConfigError(f"{', '.join(missing)} must be set (e.g. `polyrl train {missing[0]}=...`)")

    from ..algorithms import ALGORITHMS
    from ..algorithms.base import STEP_OPTIONS
    from ..models import MODELS
    from ..rewards import REWARDS

    _check_choice("model.name", cfg.model.name, sorted(MODELS))
    _check_choice("model.dtype", cfg.model.dtype, DTYPES)
    _check_choice("model.compile", cfg.model.compile, ("none", "blocks", "full"))
    model_options = getattr(MODELS[cfg.model.name], "options", {})
    for key in cfg.model.options:
        if key not in model_options:
            raise ConfigError(f"unknown key model.options.{key} for model.name={cfg.model.name}; allowed: "
                              f"{', '.join(sorted(model_options)) or '(none)'}")
    for key in ("condition_size", "vl_condition_size"):
        if cfg.model[key] is not None and cfg.model[key] < 32:
            raise ConfigError(f"model.{key}={cfg.model[key]} must be >= 32 (condition sides are multiples of 32 px)")
    _check_choice("model.fp8", cfg.model.fp8, AUTO_SWITCH)
    _check_choice("rollout.training_graph", cfg.rollout.training_graph, AUTO_SWITCH)
    if cfg.model.fp8 is True and cfg.actor.lora_rank == 0:
        raise ConfigError("model.fp8=true quantizes the frozen base weights, so it needs LoRA (actor.lora_rank > 0)")
    checkpointing = cfg.actor.gradient_checkpointing
    if not isinstance(checkpointing, bool) and not 0 < checkpointing <= 1:
        raise ConfigError(f"actor.gradient_checkpointing={checkpointing} must be true, false or a share of the blocks "
                          "in (0, 1]")
    _check_choice("trainer.device", cfg.trainer.device, DEVICES)
    for logger in cfg.trainer.loggers:
        _check_choice("trainer.loggers", logger, ("tensorboard", "wandb", "mlflow"))
    from ..models.base import policy_kind

    # a model is a diffusion or a token policy, and a loss trains one kind (models/base.py, docs/tokens.md); checked
    # before the algorithm's keys, which a recipe may have set for its own algorithm (`polyrl train algorithm=grpo`
    # under the default's DiffusionNFT keys is first of all a token loss on a diffusion model)
    _check_choice("algorithm.name", cfg.algorithm.name, sorted(ALGORITHMS))
    model_kind, algo_kind = policy_kind(MODELS[cfg.model.name]), policy_kind(ALGORITHMS[cfg.algorithm.name])
    if model_kind != algo_kind:
        fitting = sorted(n for n, c in ALGORITHMS.items() if policy_kind(c) == model_kind)
        raise ConfigError(f"algorithm={cfg.algorithm.name} trains {algo_kind} policies, but model={cfg.model.name} is a "
                          f"{model_kind} policy; algorithms for {model_kind} policies: {', '.join(fitting)}")
    _check_kwargs("algorithm", OmegaConf.to_container(cfg.algorithm), ALGORITHMS, STEP_OPTIONS)
    from ..algorithms import build_algorithm

    try:  # an algorithm checks its own values (ranges, choices) on construction: one line, before anything loads
        build_algorithm(OmegaConf.to_container(cfg.algorithm))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if model_kind == "tokens":
        r = cfg.rollout
        if r.max_new_tokens < 1:
            raise ConfigError(f"rollout.max_new_tokens={r.max_new_tokens} must be >= 1")
        if r.temperature <= 0:
            raise ConfigError(f"rollout.temperature={r.temperature} must be > 0 (the policy is softmax(logits / T); "
                              "the held-out evaluation decodes greedily on its own)")
        if not 0 < r.top_p <= 1:
            raise ConfigError(f"rollout.top_p={r.top_p} must be in (0, 1]")
        if not all(isinstance(x, str) and x for x in r.stop):
            raise ConfigError(f"rollout.stop={list(r.stop)} must be a list of non-empty strings")
    reward_cfg = OmegaConf.to_container(cfg.reward)
    overlap = reward_cfg.pop("async", False)  # a reward-stage option (rewards/stage.py), for every reward
    if not isinstance(overlap, bool):
        raise ConfigError(f"reward.async={overlap!r} must be true or false")
    from ..rewards.base import pop_frame_sampling

    try:  # reward.frames / reward.frame_reduce: how an image scorer reads video (call_reward), for every reward
        pop_frame_sampling(reward_cfg, "reward")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_kwargs("reward", reward_cfg, REWARDS)
    from ..models.base import token_media
    from ..rewards.base import reward_inputs, reward_media

    # a token policy declares the media its rollout carries (`media`, default text: models.base.token_media): its
    # reward must read one of them, and a text-only reward cannot score a diffusion model
    if model_kind == "tokens":
        produced = set(token_media(MODELS[cfg.model.name]))
        if not produced & reward_media(REWARDS[reward_cfg["name"]]):
            kinds = " or ".join(sorted(produced))
            fitting = sorted(n for n, c in REWARDS.items() if produced & reward_media(c))
            raise ConfigError(f"reward={reward_cfg['name']} does not score {kinds}, which model={cfg.model.name} "
                              f"outputs; rewards for {kinds}: {', '.join(fitting)}")
        if "images" not in reward_inputs(REWARDS[reward_cfg["name"]]):
            raise ConfigError(f"reward={reward_cfg['name']} reads latents only, which model={cfg.model.name} (a token "
                              "policy) does not have")
    if model_kind == "diffusion" and reward_media(REWARDS[reward_cfg["name"]]) == {"text"}:
        raise ConfigError(f"reward={reward_cfg['name']} scores text only, but model={cfg.model.name} outputs media")
    r = cfg.rollout
    for key in ("height", "width", "num_steps", "n", "batch_size"):
        if r[key] < 1:
            raise ConfigError(f"rollout.{key}={r[key]} must be >= 1")
    if r.num_frames < 0:
        raise ConfigError(f"rollout.num_frames={r.num_frames} must be >= 0 (0: images)")
    if r.fps <= 0:
        raise ConfigError(f"rollout.fps={r.fps} must be > 0")
    if r.n < 2:
        raise ConfigError("rollout.n must be >= 2: group advantages need at least two samples per prompt")
    if not 0 <= r.sde_window_size <= r.num_steps:
        raise ConfigError(f"rollout.sde_window_size={r.sde_window_size} must be in [0, rollout.num_steps={r.num_steps}]")
    lo, hi = (list(r.sde_window_range) + [None, None])[:2]
    if r.sde_window_size and not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= r.num_steps - r.sde_window_size):
        raise ConfigError(
            f"rollout.sde_window_range={list(r.sde_window_range)} must be [lo, hi] with 0 <= lo <= hi <= "
            f"num_steps - sde_window_size = {r.num_steps - r.sde_window_size}"
        )
    from ..sampling.diffusion import WINDOW_STRATEGIES
    from ..sampling.steps import LOG_DENSITIES, ODE_STEPS, ROLLOUT_STEPS

    _check_choice("rollout.step", r.step, sorted(ROLLOUT_STEPS))
    _check_choice("rollout.log_density", r.log_density, LOG_DENSITIES)
    _check_choice("rollout.sde_window_strategy", r.sde_window_strategy, WINDOW_STRATEGIES)
    if r.sde_window_every < 1:
        raise ConfigError(f"rollout.sde_window_every={r.sde_window_every} must be >= 1")
    algo_cls = ALGORITHMS[cfg.algorithm.name]
    uses_log_probs = getattr(algo_cls, "uses_log_probs", True)
    if uses_log_probs and r.noise_level <= 0:
        raise ConfigError(f"rollout.noise_level={r.noise_level} must be > 0 (an ODE rollout has no log-probability; "
                          f"only likelihood-free algorithms such as diffusion_nft may sample with the ODE)")
    if r.noise_level < 0:
        raise ConfigError(f"rollout.noise_level={r.noise_level} must be >= 0")
    if r.step in ODE_STEPS and (uses_log_probs or r.noise_level != 0):
        need = (f"algorithm {cfg.algorithm.name} scores the rollout's log-probabilities" if uses_log_probs
                else f"rollout.noise_level={r.noise_level} must be 0")
        raise ConfigError(f"rollout.step={r.step} is a deterministic ODE solver without a log-density: {need}; it "
                          "serves the likelihood-free algorithms (diffusion_nft, awm, dgpo, diffusion_dpo) with "
                          "rollout.noise_level=0")
    if cfg.data.pairs_path is not None and not getattr(algo_cls, "trains_on_pairs", False):
        allowed = sorted(n for n, c in ALGORITHMS.items() if getattr(c, "trains_on_pairs", False))
        raise ConfigError(f"data.pairs_path is set but algorithm {cfg.algorithm.name} does not train on preference "
                          f"pairs; allowed: {', '.join(allowed)}")
    _check_launcher(cfg)
    rc = cfg.rollout_correction
    if rc.mode is None:  # a stale rollout is corrected unless the run says otherwise (docs/ray.md)
        rc.mode = "decoupled" if r.max_staleness > 0 and uses_log_probs else "bypass"
    _check_choice("rollout_correction.mode", rc.mode, ["bypass", "recompute", "decoupled"])
    if rc.mode != "bypass" and not uses_log_probs:
        raise ConfigError(f"rollout_correction.mode={rc.mode} needs log-probabilities, which algorithm "
                          f"{cfg.algorithm.name} does not use; use rollout_correction.mode=bypass")
    if rc.is_cap <= 0:
        raise ConfigError(f"rollout_correction.is_cap={rc.is_cap} must be > 0")
    if rc.log_ratio_bounds is not None and not (
            len(rc.log_ratio_bounds) == 2 and float(rc.log_ratio_bounds[0]) < float(rc.log_ratio_bounds[1])):
        raise ConfigError(f"rollout_correction.log_ratio_bounds={list(rc.log_ratio_bounds)} must be [lo, hi] with lo < hi")
    a = cfg.actor
    _check_choice("actor.backend", a.backend, ["local", "fsdp2", "veomni"])
    if a.backend == "veomni":  # VeOmni lives in its own environment (transformers < 5.23): say how, in one line
        from ..distributed.veomni import require_veomni

        require_veomni()
    from ..distributed.plan import check_parallel_config

    try:  # world size, degrees, the model's plan and heads: before any process group starts
        check_parallel_config(cfg, MODELS[cfg.model.name])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_streams(cfg, MODELS[cfg.model.name])
    if not 0 <= a.ema_decay < 1:
        raise ConfigError(f"actor.ema_decay={a.ema_decay} must be in [0, 1)")
    if not 0 <= a.eval_ema_decay < 1:
        raise ConfigError(f"actor.eval_ema_decay={a.eval_ema_decay} must be in [0, 1) (0: evaluate the trained weights)")
    if a.lora_rank < 0:
        raise ConfigError(f"actor.lora_rank={a.lora_rank} must be >= 0 (0 = full fine-tune)")
    batch = cfg.data.prompts_per_step * r.n
    if not 1 <= a.num_minibatches <= batch:
        raise ConfigError(f"actor.num_minibatches={a.num_minibatches} must be in [1, data.prompts_per_step * rollout.n = {batch}]")
    if cfg.trainer.resume not in (None, "auto") and not str(cfg.trainer.resume).strip():
        raise ConfigError("trainer.resume must be null, auto, or a checkpoint directory")
    if cfg.trainer.eval_scorers:
        scorer_configs(list(cfg.trainer.eval_scorers), cfg, OmegaConf.to_container(cfg.trainer.eval_scorer_args),
                       "trainer.eval_scorers", "trainer.eval_scorer_args")
    if cfg.trainer.max_steps < 0:
        raise ConfigError(f"trainer.max_steps={cfg.trainer.max_steps} must be >= 0")
    t = cfg.trainer
    if t.keep_checkpoints is not None and t.keep_checkpoints < 1:
        raise ConfigError(f"trainer.keep_checkpoints={t.keep_checkpoints} must be >= 1, or null to keep every "
                          "checkpoint")
    if t.keep_best and (t.eval_every <= 0 or t.save_every <= 0 or t.save_every % t.eval_every):
        raise ConfigError(f"trainer.keep_best=true keeps the checkpoint with the best held-out reward, so every "
                          f"checkpoint needs one: trainer.eval_every={t.eval_every} must be > 0 and divide "
                          f"trainer.save_every={t.save_every}")
    return cfg
