"""`trainer.launcher=ray` (docs/ray.md): the run's worker groups, built from its config. Imported only when a run
asks for Ray, so the default path never imports it.

The driver (this process) holds the actor: it encodes prompts, trains, evaluates and checkpoints, as in one
process. With `rollout.workers=0` the rollout stays colocated with the actor (no weight movement at all); with
`rollout.workers=K` it runs on K replicas that receive the sampling policy's weights after every update. Rewards
are scored by `ray.reward_workers` workers (0: in the driver).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import partial

from omegaconf import DictConfig, OmegaConf

from ..actor.local import add_lora
from ..distributed.engine import pick_device
from ..distributed.ray_stages import RayRewardStage, RayRollout, RewardScorer, RolloutReplica, WorkerPool, connect
from ..distributed.weight_sync import WeightPayload, make_payload
from ..errors import UserError
from ..models import build_model
from ..perf.compile import compile_transformer
from ..perf.fp8 import apply_fp8
from ..rewards import REWARDS


def rollout_policy(model_cfg: dict, lora: dict | None, fp8: bool, compile_mode: str, device: str):
    """A rollout replica's policy: the run's model with the actor's LoRA layout, fp8 and compile applied in the
    actor's order. Its trainable values (and, at the first sync, every tensor) come from the actor."""
    adapter = build_model(OmegaConf.create(model_cfg), pick_device(device))
    for network in adapter.modules().values():
        if lora is not None:
            add_lora(network, **lora)
        network.requires_grad_(False)
        if fp8:
            apply_fp8(network)
        compile_transformer(network, compile_mode)
    return adapter


def _reward_names(node) -> set[str]:
    """Every string a reward config could name a registered reward by (its `name`s and a mix's component keys)."""
    if isinstance(node, dict):
        return set(node) | {v for k, v in node.items() if k == "name" and isinstance(v, str)} | {
            n for v in node.values() for n in _reward_names(v)}
    if isinstance(node, list):
        return {n for v in node for n in _reward_names(v)}
    return set()


def user_rewards(reward_cfg: dict) -> dict:
    """The run's rewards registered outside polyrl (`polyrl train --import my_rewards.py`): a reward worker is a
    fresh process that has not imported them, so their classes travel by value."""
    import ray.cloudpickle

    out = {}
    for name in _reward_names(reward_cfg):
        cls = REWARDS.get(name)
        if cls is not None and not cls.__module__.startswith("polyrl."):
            ray.cloudpickle.register_pickle_by_value(sys.modules[cls.__module__])
            out[name] = cls
    return out


@dataclass
class RayStages:
    reward_stage: RayRewardStage | None
    rollout: RayRollout | None
    started_ray: bool
    # GPUs the worker groups hold beside the driver's: MFU counts them (the replicas' forwards are in the FLOPs)
    gpus: float = 0.0

    def sync(self) -> dict[str, float]:
        """After every update: the rollout replicas get the new weights (nothing to move when colocated)."""
        return self.rollout.sync() if self.rollout is not None else {}

    def close(self) -> None:
        import ray

        for stage in (self.rollout, self.reward_stage):
            if stage is not None:
                stage.close()
        if self.started_ray:
            ray.shutdown()


def launch(cfg: DictConfig, actor, adapter, reads_media: bool) -> RayStages:
    """Connect to Ray (`ray.address`, or a local cluster), start the pools, and give every rollout replica the
    actor's weights (a full sync, checked: a replica the weights do not bind to stops the run here)."""
    r = cfg.ray
    gpus = r.rollout_gpus if r.rollout_gpus is not None else (1.0 if adapter.device.type == "cuda" else 0.0)
    started = connect(r.address or None, r.num_cpus)
    reward_stage = rollout = None
    try:
        if not r.address:
            check_fits(cfg, gpus)
        if r.reward_workers > 0:
            reward_cfg = OmegaConf.to_container(cfg.reward, resolve=True)
            factory = partial(RewardScorer, reward_cfg, cfg.reward.name, user_rewards(reward_cfg))
            pool = WorkerPool("reward", factory, r.reward_workers, num_cpus=r.worker_cpus, num_gpus=r.reward_gpus,
                              max_restarts=r.max_restarts)
            reward_stage = RayRewardStage(pool, reads_media)
        if cfg.rollout.workers > 0:
            lora = ({"rank": actor.cfg.lora_rank, "alpha": actor.cfg.lora_alpha, "targets": actor.lora_targets}
                    if actor.lora else None)
            build = partial(rollout_policy, OmegaConf.to_container(cfg.model, resolve=True), lora, cfg.model.fp8,
                            cfg.model.compile, "cuda" if gpus > 0 else "cpu")
            pool = WorkerPool("rollout", partial(RolloutReplica, build), cfg.rollout.workers, num_cpus=r.worker_cpus,
                              num_gpus=gpus, max_restarts=r.max_restarts)
            rollout = RayRollout(pool, adapter, partial(sampling_weights, actor), lambda: actor.num_updates)
        for stage in (reward_stage, rollout):  # the workers were started together; wait until all are built
            if stage is not None:
                stage.pool.ready()
        if rollout is not None:
            rollout.sync()
    except BaseException:
        RayStages(reward_stage, rollout, started).close()
        raise
    return RayStages(reward_stage, rollout, started, worker_gpus(cfg, gpus))


def worker_gpus(cfg: DictConfig, rollout_gpus: float) -> float:
    """GPUs the rollout replicas and reward workers ask for together."""
    return cfg.rollout.workers * rollout_gpus + cfg.ray.reward_workers * cfg.ray.reward_gpus


def check_fits(cfg: DictConfig, rollout_gpus: float) -> None:
    """On a local Ray, workers that ask for more than the machine has would wait forever: refuse, naming the keys."""
    import ray

    r = cfg.ray
    have = ray.cluster_resources()
    cpus = (cfg.rollout.workers + r.reward_workers) * r.worker_cpus
    gpus = worker_gpus(cfg, rollout_gpus)
    if cpus > have.get("CPU", 0) or gpus > have.get("GPU", 0):
        raise UserError(
            f"the worker groups ask for {cpus:g} CPUs and {gpus:g} GPUs (rollout.workers={cfg.rollout.workers}, "
            f"ray.reward_workers={r.reward_workers}, ray.worker_cpus={r.worker_cpus:g}, ray.rollout_gpus="
            f"{rollout_gpus:g}, ray.reward_gpus={r.reward_gpus:g}) but the local Ray has {have.get('CPU', 0):g} CPUs "
            f"and {have.get('GPU', 0):g} GPUs; lower them, or set ray.num_cpus")


def sampling_weights(actor, full: bool) -> WeightPayload:
    """The weights the rollout samples from (the `old` copy for algorithms that sample from it), as they are now:
    every tensor (`full`) or the trainable ones."""
    with actor.sampling_policy():
        return make_payload(actor.adapter.modules(), actor.num_updates, None if full else actor.param_names)
