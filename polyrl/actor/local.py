"""Single-process actor backend: LoRA (peft) or full fine-tune, AdamW, grad-norm clip, policy contexts.

The actor owns the trainable weights and the optimisation loop over mini-batches; the algorithm supplies the
per-term loss. It is also the `PolicyEvaluator` the algorithm calls to re-score stored transitions under a named
policy: `current`, `reference` (LoRA disabled / frozen initial copy), `old` (an EMA copy of the trainable weights,
swapped in and out) and `teacher` (a frozen network loaded from `algorithm.teacher_path`; `teacher:<j>` the j-th of
several, `algorithm.teachers`). What exists is decided
by the algorithm's declarations (needs_reference, needs_old, teacher_path) and `actor.ema_decay`.

Rollout correction (docs/algorithms.md §4) happens here too, before the first optimizer step of an update: `bypass`
uses the rollout's log-probs and means as the old policy's; `recompute` and `decoupled` run an old-policy forward
(timed as `time/old_logprob`), and `decoupled` adds truncated importance weights × a rejection mask, which reach
every loss as `StepOut.weight`.
"""

from __future__ import annotations

import copy
import json
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

from ..batch import Rollout
from ..distributed.dcp import DCP_DIR, adam_state, load_sharded
from ..distributed.engine import LocalEngine
from ..draws import UpdateDraws
from ..errors import UserError
from ..latents import Latents, select_step
from ..models.base import DiffusionPolicy, stream_sigma_1, stream_sigmas
from ..perf.compile import repeated_blocks
from ..perf.profile import region
from ..sampling.diffusion import SamplingPlan
from ..sampling.steps import STEPS, StepOut, step_latents


def is_transformers_model(network: torch.nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(network, PreTrainedModel)


def add_lora(network: torch.nn.Module, rank: int, alpha: float, targets: list[str]) -> None:
    from peft import LoraConfig

    network.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets)
    if is_transformers_model(network) or not hasattr(network, "add_adapter"):
        # transformers' own add_adapter wants a newer peft than diffusers' does: inject the LoRA layers directly
        from peft import inject_adapter_in_model

        inject_adapter_in_model(config, network, adapter_name="default")
        network.peft_config = {"default": config}
    else:
        network.add_adapter(config)


def set_adapters_enabled(network: torch.nn.Module, enabled: bool) -> None:
    """Switch a network's LoRA layers on or off (off: the base weights, the `reference` policy)."""
    if is_transformers_model(network):
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in network.modules():
            if isinstance(module, BaseTunerLayer):
                module.enable_adapters(enabled)
    elif enabled:
        network.enable_adapters()
    else:
        network.disable_adapters()


def load_teacher(path: str | Path, base: dict[str, torch.nn.Module], adapter=None) -> dict[str, torch.nn.Module]:
    """Frozen teacher networks: a polyrl checkpoint (the base networks + its trained weights), a model directory the
    adapter loads itself (`load_networks(path)`, e.g. a whole Qwen3-Omni checkpoint), or a diffusers directory (each
    network from its subfolder, e.g. `transformer/`)."""
    path = Path(path)
    own = getattr(adapter, "load_networks", None)
    if not (path / "weights.json").is_file() and own is not None:
        loaded = own(path)
        teacher = {k: loaded[k] for k in base}
    elif (path / "weights.json").is_file():
        holder = SimpleNamespace(networks={k: copy.deepcopy(v) for k, v in base.items()})
        holder.modules = lambda: holder.networks
        load_trained_weights(holder, path)
        teacher = holder.networks
    else:
        teacher = {}
        for name, network in base.items():
            sub = path / name if (path / name / "config.json").is_file() else path
            if not (sub / "config.json").is_file():
                raise FileNotFoundError(f"algorithm.teacher_path={str(path)!r} is neither a polyrl checkpoint "
                                        f"(weights.json) nor a diffusers directory ({name}/config.json)")
            dtype = next(network.parameters()).dtype
            teacher[name] = type(network).from_pretrained(str(sub), torch_dtype=dtype)
    return {k: t.to(next(base[k].parameters()).device).requires_grad_(False).eval() for k, t in teacher.items()}


def teacher_paths(algo) -> list[str]:
    """The frozen teachers an algorithm names: `teacher_paths` (several), else its one `teacher_path`, else none."""
    paths = getattr(algo, "teacher_paths", None)
    if paths:
        return list(paths)
    return [algo.teacher_path] if algo.teacher_path else []


def train_module_names(cfg, networks: dict[str, torch.nn.Module]) -> list[str]:
    """The networks the actor trains: `actor.train_modules` (in the model's order), or every network of the model
    when it is unset; an unknown name is a UserError naming the model's networks."""
    names = list(getattr(cfg, "train_modules", None) or [])
    if not names:
        return list(networks)
    unknown = [n for n in names if n not in networks]
    if unknown:
        raise UserError(f"actor.train_modules: {unknown[0]!r} is not a network of this model; allowed: "
                        f"{', '.join(networks)}")
    return [n for n in networks if n in names]


def correction_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, cap: float,
                       bounds: tuple[float, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled correction (§4): (w = min(exp(log p_old − log p_rollout), cap), rejection mask of bounds)."""
    log_ratio = old_log_prob - rollout_log_prob
    weight = torch.clamp(torch.exp(log_ratio), max=cap)
    return weight, in_bounds(log_ratio, bounds)


def in_bounds(log_ratio: torch.Tensor, bounds) -> torch.Tensor:
    if bounds is None:
        return torch.ones_like(log_ratio)
    lo, hi = bounds
    return ((log_ratio >= lo) & (log_ratio <= hi)).to(log_ratio)


def mean_stats(stats: dict[str, list], engine: LocalEngine | None = None) -> dict[str, float]:
    """Each stat's weighted mean Σ w·v / Σ w over its `(value, weight)` entries and over every rank; device
    tensors are read back in one transfer, not one sync each. A stat some rank lacks counts only where present."""
    engine = engine or LocalEngine(torch.device("cpu"))
    names = list(stats)
    if engine.world_size > 1:  # every rank's names in rank order: the same list on every rank (the sums align)
        names = []
        for other in engine.gather_objects(list(stats)):
            names += [n for n in other if n not in names]
    device = next((v.device for vs in stats.values() for v, _ in vs if torch.is_tensor(v)), torch.device("cpu"))
    if engine.world_size > 1:
        device = engine.device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    sums = [sum((torch.as_tensor(v, device=device).detach().double().reshape(()) * w for v, w in stats.get(n, [])),
                zero) for n in names]
    weights = [float(sum(w for _, w in stats.get(n, []))) for n in names]
    flat = engine.sum(torch.cat([torch.stack(sums), torch.tensor(weights, dtype=torch.float64, device=device)]))
    values = flat.tolist()
    k = len(names)
    return {n: values[i] / values[k + i] for i, n in enumerate(names) if values[k + i] > 0}


def micro_batch_samples(micro_batch_size: int | None, minibatch_samples: int) -> int:
    """Samples per training forward: `actor.micro_batch_size`, or (unset) this rank's whole mini-batch."""
    return micro_batch_size or max(minibatch_samples, 1)


def group_minibatches(group_ids: torch.Tensor, num_minibatches: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Shuffled mini-batches of whole prompt groups (`algo.whole_groups`): the groups in a random order, split into
    min(num_minibatches, groups) chunks; each chunk is its groups' sample indices, a group's in batch order."""
    ids = group_ids.cpu()
    groups = torch.unique(ids)
    order = groups[torch.randperm(len(groups), generator=generator)]
    return [torch.cat([torch.nonzero(ids == g).flatten() for g in chunk])
            for chunk in order.chunk(min(num_minibatches, len(groups)))]


def group_micro_batches(idx: torch.Tensor, group_ids: torch.Tensor, micro: int) -> list[torch.Tensor]:
    """`idx` (whole groups, each contiguous) split into micro-batches of whole groups of at most `micro` samples,
    or one group where a group alone is larger."""
    ids = group_ids.cpu()[idx.cpu()]
    parts, start, end = [], 0, 0
    while end < len(idx):
        g_end = end + int((ids[end:] == ids[end]).long().cumprod(0).sum())  # the end of the group starting at `end`
        if g_end - start > micro and end > start:
            parts.append(idx[start:end])
            start = end
        end = g_end
    if end > start:
        parts.append(idx[start:end])
    return parts


def global_places(index: torch.Tensor | None, n: int, engine: LocalEngine) -> list[torch.Tensor]:
    """Every data-parallel rank's samples' places 0..b−1 in the step's global training batch, rank by rank.

    `index` (`Rollout.sample_index`) is where the step put this rank's samples in its global order (the kept groups
    of every rollout of the step, dynamic sampling's refills included: a rank's samples need not be contiguous there),
    after the algorithm's selection (which may leave gaps); places are those positions renumbered densely, so they
    are the same numbers in every layout. Without an index a rank's samples follow the previous rank's."""
    if index is None:
        sizes = [int(k) for k in engine.gather_objects(n)]
        start = sum(sizes[: engine.dp_rank])
        index = torch.arange(start, start + n)
    every = [torch.as_tensor(p, dtype=torch.long) for p in engine.gather_objects(index.cpu().tolist())]
    dense = torch.unique(torch.cat(every))  # sorted
    return [torch.searchsorted(dense, p) for p in every]


DEFAULT_CORRECTION = SimpleNamespace(mode="bypass", is_cap=2.0, log_ratio_bounds=None)


def checkpointed_blocks(n: int, share: float) -> list[int]:
    """Indices of the round(share·n) of n blocks whose activations are recomputed, evenly spread (share 1: all)."""
    k = round(share * n)
    return [i for i in range(n) if (i + 1) * k // n > i * k // n]


def enable_checkpointing(name: str, network: torch.nn.Module, setting: bool | float) -> None:
    """`actor.gradient_checkpointing`: true recomputes every block's activations in the backward; a share in (0, 1]
    only that share of the blocks (the others keep theirs: less recompute for what memory allows)."""
    share = 1.0 if setting is True else float(setting)
    if not 0 < share <= 1:
        raise UserError(f"actor.gradient_checkpointing={setting}: true, false or a share of the blocks in (0, 1]")
    if not getattr(network, "_supports_gradient_checkpointing", False):
        raise UserError(f"actor.gradient_checkpointing={setting}: {name} ({type(network).__name__}) does not support it")
    if share == 1:  # diffusers: enable_gradient_checkpointing; transformers: gradient_checkpointing_enable
        (getattr(network, "enable_gradient_checkpointing", None) or network.gradient_checkpointing_enable)()
        return
    blocks = repeated_blocks(network)
    if not blocks or not hasattr(network, "enable_gradient_checkpointing"):
        raise UserError(f"actor.gradient_checkpointing={setting}: {name} ({type(network).__name__}) checkpoints all "
                         "of its blocks or none (true or false)")
    chosen = {id(blocks[i]) for i in checkpointed_blocks(len(blocks), share)}

    def checkpoint_chosen(block, *args):  # diffusers calls this for every block when checkpointing is on
        if id(block) in chosen:
            return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)
        return block(*args)

    network.enable_gradient_checkpointing(checkpoint_chosen)


class LocalActor:
    """The trainable networks of a policy, replicated on every rank of `engine` (one process: LocalEngine)."""

    def __init__(self, adapter: DiffusionPolicy, cfg, plan: SamplingPlan, algo, correction=None,
                 engine: LocalEngine | None = None):
        self.adapter, self.cfg, self.plan, self.algo = adapter, cfg, plan, algo
        self.engine = engine or LocalEngine(adapter.device)
        self.correction = correction or DEFAULT_CORRECTION
        self.bounds = None if self.correction.log_ratio_bounds is None else tuple(map(float, self.correction.log_ratio_bounds))
        self._init_sampler(plan)
        if getattr(algo, "whole_groups", False) and self.engine.dp_size > 1:
            raise UserError(f"algorithm={type(algo).__name__} needs every prompt group's samples in one micro-batch and "
                            f"runs on one data-parallel rank; this run has {self.engine.dp_size}")
        # the networks this actor trains (actor.train_modules); the model's others stay frozen, as they were loaded
        self.train_names = train_module_names(cfg, adapter.modules())
        networks = self.trained_networks()
        # frozen teachers: `teacher` (the first) and `teacher:<j>` (multi-teacher distillation, algo.teacher_paths)
        self.teachers = [load_teacher(path, networks, adapter) for path in teacher_paths(algo)]
        self.teacher_models = self.teachers[0] if self.teachers else None
        self.lora = cfg.lora_rank > 0
        self.lora_targets = list(cfg.lora_targets) if cfg.lora_targets else list(adapter.default_lora_targets)
        self.reference_models = None
        frozen = getattr(adapter, "frozen_submodules", {})  # parts a full fine-tune leaves frozen (encoders)
        for name, network in networks.items():
            if self.lora:
                try:
                    add_lora(network, cfg.lora_rank, cfg.lora_alpha, self.lora_targets)
                except ValueError as e:  # peft: no target module matched in this network
                    raise UserError(f"actor.lora_targets: no LoRA target matches a layer of the {name!r} network "
                                    f"({e})") from None
            else:
                network.requires_grad_(True)
                for prefix in frozen.get(name, ()):
                    network.get_submodule(prefix).requires_grad_(False)
        checkpointing = getattr(cfg, "gradient_checkpointing", False)
        if checkpointing is not False:
            for name, network in networks.items():
                enable_checkpointing(name, network, checkpointing)
        if not self.lora and algo.needs_reference:
            self.reference_models = {k: copy.deepcopy(v).requires_grad_(False).eval() for k, v in networks.items()}
        # Trainable weights are kept in float32 (the optimizer needs full-precision master weights).
        named = [(f"{name}.{n}", p) for name, network in networks.items()
                 for n, p in network.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        for p in self.params:
            p.data = p.data.to(torch.promote_types(p.dtype, torch.float32))  # float64 networks keep float64
        self.engine.broadcast_params(self.params)
        self.params = self._distribute(networks)  # a sharding actor's parameters are new (sharded) tensors
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=cfg.eps
        )
        self.ema_decay = float(getattr(cfg, "ema_decay", 0.0))
        keep_old = algo.needs_old or self.ema_decay > 0
        self.old_params = [p.detach().clone() for p in self.params] if keep_old else None
        # the evaluation EMA (DiffusionNFT's authors evaluate and save an EMA of the trainable weights, decay <= 0.9)
        self.eval_ema_decay = float(getattr(cfg, "eval_ema_decay", 0.0))
        self.eval_params = [p.detach().clone() for p in self.params] if self.eval_ema_decay > 0 else None
        self.num_updates = 0
        self.optimizer_steps = 0  # the old copy's clock when the algorithm moves it every optimizer step
        self.draws = UpdateDraws(0)  # the update in progress's keyed random numbers (set by `update`)
        self._masked: list = []
        self._dummy = False  # a padding micro-batch (see `_lockstep`) is running: record nothing
        self._sizes: list[int] = []  # every data-parallel rank's number of samples in the update in progress

    def trained_networks(self) -> dict[str, torch.nn.Module]:
        """The live networks this actor trains, by name (a subset of `adapter.modules()`: actor.train_modules)."""
        live = self.adapter.modules()
        return {n: live[n] for n in self.train_names}

    def _distribute(self, networks: dict[str, torch.nn.Module]) -> list[torch.nn.Parameter]:
        """The trainable parameters after placing the networks on the ranks: replicated here, as they are
        (actor/fsdp2.py shards them)."""
        return self.params

    def _lockstep(self, parts: list[torch.Tensor], shares: list[int]) -> list[torch.Tensor | None]:
        """This rank's micro-batches (sample indices) as they run. Replicated weights need nothing else; a sharded
        actor pads them with None (a zero-weight micro-batch) so that every rank runs the same number of forwards,
        since each forward is a collective there. `shares`: every data-parallel rank's samples in this loop."""
        return parts

    def _reduce_and_clip(self) -> torch.Tensor:
        """Sum the gradients over the ranks, clip them to actor.grad_clip; returns their norm before clipping."""
        self.engine.all_reduce_grads(self.params)
        return torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)

    def _init_sampler(self, plan) -> None:
        """What re-scoring a stored transition needs from the plan (diffusion: σ_1 and the step function)."""
        self._sigma_grid = self.adapter.sigmas(plan.num_steps, plan.shape)
        self.sigma_1 = stream_sigma_1(self.adapter, self._sigma_grid)
        self.step_fn = STEPS.get(plan.step)  # None: a multistep ODE solver, never re-scored (likelihood-free only)

    def sigma_grid(self) -> torch.Tensor:
        """The rollout's sampling grid σ_0 = 1 > … > σ_N = 0 (float32, N + 1 values): forward-process losses that
        train at the grid's own steps (DGPO, AWM: Flow-Factory's `discrete` time sampling) draw their σ from it."""
        return self._sigma_grid

    @property
    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.params)

    # ------------------------------------------------------------------------------------ policy contexts
    @contextmanager
    def reference(self):
        """Run the adapter's networks as the reference policy: LoRA disabled, or the frozen initial copies."""
        if not self.lora:
            with self._swap_networks(self.reference_models):
                yield
            return
        networks = list(self.trained_networks().values())
        for network in networks:
            set_adapters_enabled(network, False)
        try:
            yield
        finally:
            for network in networks:
                set_adapters_enabled(network, True)

    @contextmanager
    def _swap_networks(self, replacements: dict[str, torch.nn.Module]):
        live = self.adapter.modules()
        trained = dict(live)
        live.update(replacements)
        try:
            yield
        finally:
            live.update(trained)

    def _swap_old(self):
        """The EMA tensors swapped into the trainable parameters (and back): the `old` policy, no copy."""
        if self.old_params is None:
            raise RuntimeError("the `old` policy needs an EMA copy: set actor.ema_decay > 0 or use an algorithm that keeps one")
        return self._swap_in(self.old_params)

    @contextmanager
    def _swap_in(self, copies: list[torch.Tensor]):
        """`copies` (one tensor per trainable parameter) swapped into the parameters, and back on exit."""
        for p, o in zip(self.params, copies, strict=True):
            p.data, o.data = o.data, p.data
        try:
            yield
        finally:
            for p, o in zip(self.params, copies, strict=True):
                p.data, o.data = o.data, p.data

    def evaluation_weights(self):
        """A context in which the networks hold the weights evaluation samples with: the evaluation EMA
        (`actor.eval_ema_decay` > 0), else the trained weights as they are."""
        return nullcontext() if self.eval_params is None else self._swap_in(self.eval_params)

    def policy(self, name: str):
        """A context in which the adapter's networks are the named policy (see the module docstring)."""
        if name == "current":
            return nullcontext()
        if name == "reference":
            return self.reference()
        if name == "old":
            return self._swap_old()
        if name == "teacher" or name.startswith("teacher:"):
            j = int(name.partition(":")[2] or 0)
            if not self.teachers:
                raise RuntimeError("the `teacher` policy needs algorithm.teacher_path")
            if not 0 <= j < len(self.teachers):
                raise ValueError(f"policy {name!r}: this run has {len(self.teachers)} teacher(s)")
            return self._swap_networks(self.teachers[j])
        raise ValueError(f"unknown policy {name!r}; allowed: current, reference, old, teacher, teacher:<j>")

    def sampling_policy(self):
        """The policy the rollout samples from: `old` for algorithms that declare samples_from_old."""
        return self.policy("old" if self.algo.samples_from_old else "current")

    def train_mode(self, training: bool) -> None:
        for network in self.trained_networks().values():  # the frozen ones stay in eval mode
            network.train(training)

    # ------------------------------------------------------------------------------------ PolicyEvaluator
    def _cond(self, batch: Rollout, dev):
        cond = {k: v.to(dev) for k, v in batch.cond.items()}
        if "replay" in batch.extras:  # the network calls an adapter recorded in its own loop (models/diffusers_pipeline.py)
            cond["replay"] = batch.extras["replay"]
        return cond, {k: v.to(dev) for k, v in batch.shared.items()}

    def stream_sigmas(self, sigma: torch.Tensor):
        return stream_sigmas(self.adapter, sigma)

    def velocity(self, batch: Rollout, latents: Latents, sigma: torch.Tensor, policy: str = "current",
                 guidance: float | None = None) -> Latents:
        dev = self.adapter.device
        cond, shared = self._cond(batch, dev)
        g = self.plan.guidance.scale if guidance is None else guidance
        with self.policy(policy), region(f"velocity/{policy}"):
            return self.adapter.velocity({k: v.to(dev) for k, v in latents.items()}, sigma.to(dev), cond, shared, g)

    def step(self, batch: Rollout, k: int, policy: str = "current") -> StepOut:
        dev = self.adapter.device
        x = {name: v.to(dev) for name, v in select_step(batch.latents, k).items()}
        x_next = {name: v.to(dev) for name, v in select_step(batch.latents, k + 1).items()}
        sigma, sigma_next = batch.sigmas[:, k].to(dev), batch.sigmas[:, k + 1].to(dev)
        cond, shared = self._cond(batch, dev)
        with self.policy(policy), region(f"velocity/{policy}"):
            v = self.adapter.velocity(x, sigma, cond, shared, self.plan.guidance.scale)
        out = step_latents(self.step_fn, x, v, stream_sigmas(self.adapter, sigma), stream_sigmas(self.adapter, sigma_next),
                           batch.noise_levels[:, k].to(dev), self.sigma_1,
                           prev=x_next, log_density=self.plan.log_density)
        if policy == "current":
            out.weight = self._weight(batch, k, out.log_prob.detach())
        return out

    def _weight(self, batch: Rollout, k: int, log_prob: torch.Tensor) -> torch.Tensor | None:
        """The per-sample correction weight of step k: decoupled IS × mask, or the bypass rejection mask."""
        weight = None if batch.step_weights is None else batch.step_weights[:, k].to(log_prob)
        if self.correction.mode == "bypass" and self.bounds is not None:
            mask = in_bounds(log_prob - batch.log_probs[:, k].to(log_prob), self.bounds)
            if not self._dummy:
                self._masked.append((1 - mask.mean(), len(mask)))
            weight = mask if weight is None else weight * mask
        return weight

    # ------------------------------------------------------------------------------------ rollout correction
    @torch.no_grad()
    def prepare_old(self, batch: Rollout) -> dict[str, float]:
        """Fill `old_log_probs` (and `old_means` / `step_weights`) by rollout_correction.mode (§4); returns its stats:
        `bypass` takes the rollout's log-probs, `recompute` / `decoupled` run the old policy (`old_forward`, timed as
        `time/old_logprob`)."""
        if not self.algo.uses_log_probs:
            return {}
        if self.correction.mode == "bypass":
            batch.old_log_probs = batch.log_probs
            return {"time/old_logprob": 0.0}
        t0 = time.perf_counter()
        old_policy = "old" if self.algo.samples_from_old else "current"
        stats = self.old_forward(batch, old_policy, micro_batch_samples(self.cfg.micro_batch_size, len(batch)))
        out = mean_stats(stats, self.engine)
        out["time/old_logprob"] = time.perf_counter() - t0
        return out

    def old_forward(self, batch: Rollout, old_policy: str, micro: int) -> dict[str, list]:
        """`prepare_old`'s old-policy forward over every trained step, `micro` samples at a time: fills `old_log_probs`,
        `old_means` (and `step_weights` for decoupled); returns the correction stats for `mean_stats`."""
        lps, means = [], []
        for part in self._lockstep(list(torch.arange(len(batch)).split(micro)), self._sizes or [len(batch)]):
            sub = batch.select(torch.zeros(1, dtype=torch.long) if part is None else part)
            outs = [self.step(sub, k, policy=old_policy) for k in range(batch.log_probs.shape[1])]
            if part is None:  # a padding forward (see `_lockstep`)
                continue
            lps.append(torch.stack([o.log_prob for o in outs], 1).float())
            means.append({name: torch.stack([o.mean[name] for o in outs], 1).float() for name in outs[0].mean})
        batch.old_log_probs = torch.cat(lps)
        batch.old_means = {name: torch.cat([m[name] for m in means]) for name in means[0]}
        delta = (batch.old_log_probs - batch.log_probs).abs()
        n = delta.numel()
        stats = {"correction/abs_dlogp": [(delta.mean(), n)], "correction/max_abs_dlogp": [(delta.max(), 1)]}
        if self.correction.mode == "decoupled":
            weight, mask = correction_weights(batch.old_log_probs, batch.log_probs, self.correction.is_cap, self.bounds)
            batch.step_weights = weight * mask
            stats.update({"correction/is_weight_mean": [(weight.mean(), n)], "correction/is_weight_max": [(weight.max(), 1)],
                          "correction/is_weight_min": [(weight.min(), 1)], "correction/masked_frac": [(1 - mask.mean(), n)]})
        return stats

    # ------------------------------------------------------------------------------------ update
    def update(self, algo, batch: Rollout, generator: torch.Generator) -> dict[str, float]:
        """`num_minibatches` optimizer steps over a shuffled global batch; each accumulates every loss term.

        With several ranks each holds a share of the global batch (`global_places`): the shuffled order and the
        mini-batches are global, each rank runs its own samples of a mini-batch, and every loss is normalised by
        the global mini-batch size, so the summed gradient equals the 1-process one. `generator` (the step's update
        stream) shuffles the mini-batches; the loss terms' draws are keyed by it and by each sample's place in the
        global batch (`Rollout.sample_index`, draws.py), so no layout changes them.
        """
        self.draws = UpdateDraws(generator.initial_seed())
        # one copy to the device per update, not one per micro-batch and step: the conditioning alone is
        # ~100 MB per SD3 micro-batch (queued without waiting: Rollout.to); the sizes are host numbers, so that
        # nothing here waits for the copy
        batch = algo.prepare(batch).to(self.adapter.device)
        places = global_places(batch.sample_index, len(batch), self.engine)
        sizes = [len(p) for p in places]
        b = sum(sizes)
        self._sizes = sizes
        batch.sample_index = places[self.engine.dp_rank]
        local_of = torch.full((b,), -1, dtype=torch.long)  # global place -> this rank's sample (or -1)
        local_of[batch.sample_index] = torch.arange(len(batch))
        owner = torch.cat([torch.full((n,), r, dtype=torch.long) for r, n in enumerate(sizes)])
        owner[torch.cat(places)] = owner.clone()  # global place -> the rank holding it
        if b == 0:  # e.g. online DPO when every group's rewards are equal: nothing to learn from
            self._update_old(algo)
            return {"train/samples": 0.0}
        extra = self.prepare_old(batch)
        self._masked = []
        terms = algo.num_terms_on(batch, self) if len(batch) else 1
        # the mini-batch normalisation: by samples, or by the algorithm's per-sample weights (e.g. response tokens)
        weights = algo.loss_weights(batch) if hasattr(algo, "loss_weights") else None
        stats: dict[str, list] = {}
        whole_groups = getattr(algo, "whole_groups", False)  # e.g. DGPO's group preference needs each group whole
        if whole_groups:
            minibatches = group_minibatches(batch.group_ids, self.cfg.num_minibatches, generator)
        else:
            minibatches = torch.randperm(b, generator=generator).chunk(min(self.cfg.num_minibatches, b))
        self.train_mode(True)
        for i, mb in enumerate(minibatches):
            self.optimizer.zero_grad(set_to_none=True)
            mine = local_of[mb]
            mine = mine[mine >= 0]
            micro = micro_batch_samples(self.cfg.micro_batch_size, len(mine))
            total = None if weights is None else float(self.engine.sum(weights[mine.to(weights.device)].sum()))
            shares = torch.bincount(owner[mb], minlength=len(sizes)).tolist()
            # (a rank may hold none of a mini-batch, e.g. online DPO's pairs all on another rank: no forward here)
            parts = group_micro_batches(mine, batch.group_ids, micro) if whole_groups else [p for p in mine.split(micro) if len(p)]
            for part in self._lockstep(parts, shares):
                self._dummy = part is None  # a zero-weight forward and backward that keeps the ranks in step
                if self._dummy:
                    part = torch.zeros(1, dtype=torch.long)
                sub = batch.select(part)
                share = len(part) / len(mb) if weights is None else float(weights[part.to(weights.device)].sum()) / max(total, 1e-12)
                share = 0.0 if self._dummy else share
                # a stat's weight: the micro-batch's samples (or its normalisation weight, e.g. response tokens)
                weight = len(part) if weights is None else float(weights[part.to(weights.device)].sum())
                for k in range(terms):
                    loss, st = algo.step_loss(self, sub, k)
                    with region("backward"):
                        (loss * share / terms).backward()
                    if self._dummy:
                        continue
                    # stats stay on the device until the update ends: a float() here would sync every step
                    for name, value in st.items():
                        stats.setdefault(name, []).append((value.detach() if torch.is_tensor(value) else value, weight))
                    if i == 0 and "ratio_absdev" in st:
                        # before any update the ratio is 1 up to rollout-vs-training kernel differences: this is
                        # that difference, the number rollout correction exists for (§4)
                        stats.setdefault("ratio_absdev/first_minibatch", []).append((st["ratio_absdev"].detach(), len(part)))
            self._dummy = False
            with region("optimizer"):
                grad_norm = self._reduce_and_clip()
                if not torch.isfinite(grad_norm):
                    raise FloatingPointError(f"non-finite gradient norm {grad_norm}")
                self.optimizer.step()
            if getattr(algo, "old_every_optimizer_step", False):  # e.g. DGPO's old copy
                self._ema_old(algo, self.optimizer_steps)
            self.optimizer_steps += 1
            self._step_eval_ema()
            stats.setdefault("grad_norm", []).append((grad_norm.detach(), 1))
        self.train_mode(False)
        self._update_old(algo)
        if self._masked:
            stats["correction/masked_frac"] = self._masked
        out = mean_stats(stats, self.engine)
        out["train/samples"] = float(b)
        out.update(extra)
        return out

    def _update_old(self, algo) -> None:
        """old ← d·old + (1−d)·θ after every update (d from the algorithm's schedule, else actor.ema_decay), unless
        the algorithm moves it after every optimizer step instead (`old_every_optimizer_step`). The schedule reads
        the updates before this one, or with `old_decay_clock` = "optimizer_step" the optimizer steps taken so far."""
        if not getattr(algo, "old_every_optimizer_step", False):
            by_steps = getattr(algo, "old_decay_clock", "update") == "optimizer_step"
            self._ema_old(algo, self.optimizer_steps if by_steps else self.num_updates)
        self.num_updates += 1

    @torch.no_grad()
    def _ema_old(self, algo, clock: int) -> None:
        if self.old_params is not None:
            d = algo.old_decay(clock)
            d = self.ema_decay if d is None else d
            for p, o in zip(self.params, self.old_params, strict=True):
                o.mul_(d).add_(p.detach(), alpha=1 - d)

    @torch.no_grad()
    def _step_eval_ema(self) -> None:
        """e ← e + (1 − d)·(θ − e) after every optimizer step, d = `eval_ema_decay_at(optimizer steps so far)`."""
        if self.eval_params is None:
            return
        d = eval_ema_decay_at(self.optimizer_steps, self.eval_ema_decay)
        for p, e in zip(self.params, self.eval_params, strict=True):
            e.add_((1 - d) * (p.detach() - e))

    # ------------------------------------------------------------------------------------ weights
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Keys `<network>.<parameter>` (diffusers' pipeline LoRA layout: `transformer.…lora_A.weight`)."""
        out = {}
        for name, network in self.trained_networks().items():
            if self.lora:
                from peft.utils import get_peft_model_state_dict

                state = get_peft_model_state_dict(network)
            else:
                state = network.state_dict()
            out.update({f"{name}.{k}": v.detach().contiguous() for k, v in state.items()})
        return untie(out)

    def save_weights(self, directory: Path) -> None:
        old = None if self.old_params is None else dict(zip(self.param_names, self.old_params, strict=True))
        evaluated = None if self.eval_params is None else dict(zip(self.param_names, self.eval_params, strict=True))
        self._write_weights(directory, self.trainable_state(), old, evaluated)

    def _write_weights(self, directory: Path, state: dict[str, torch.Tensor], old: dict[str, torch.Tensor] | None,
                       evaluated: dict[str, torch.Tensor] | None = None, **meta) -> None:
        """The weight files of a checkpoint (full tensors) and weights.json with `meta` added."""
        directory.mkdir(parents=True, exist_ok=True)
        if self.lora:  # one file, keys `<network>.<peft key>` (the diffusers pipeline LoRA layout)
            save_file(state, str(directory / "adapter_model.safetensors"))
        else:  # one file per network: `transformer.safetensors`, ...
            for name, part in split_by_network(state, self.train_names).items():
                save_file(part, str(directory / f"{name}.safetensors"))
        if old is not None:  # the EMA / old policy, so that a resumed run continues exactly
            save_file({n: o.contiguous() for n, o in old.items()}, str(directory / "old_weights.safetensors"))
        if evaluated is not None:  # the evaluation EMA (actor.eval_ema_decay), the same way
            save_file({n: e.contiguous() for n, e in evaluated.items()}, str(directory / EVAL_EMA_FILE))
        meta = {"lora": self.lora, "lora_rank": self.cfg.lora_rank, "lora_alpha": self.cfg.lora_alpha,
                "lora_targets": self.lora_targets, "networks": self.train_names,
                "updates": self.num_updates, "optimizer_steps": self.optimizer_steps, **meta}
        (directory / "weights.json").write_text(json.dumps(meta, indent=2))

    def load_weights(self, directory: Path) -> None:
        directory = Path(directory)
        load_trained_weights(self.adapter, directory, lora_already_added=True)
        meta = json.loads((directory / "weights.json").read_text())
        self.num_updates, self.optimizer_steps = int(meta.get("updates", 0)), int(meta.get("optimizer_steps", 0))
        if self.eval_params is not None:
            if not (directory / EVAL_EMA_FILE).is_file() and (directory / DCP_DIR).is_dir():
                load_sharded(directory / DCP_DIR, {"eval_ema": dict(zip(self.param_names, self.eval_params, strict=True))})
            else:
                load_copies(directory, EVAL_EMA_FILE, self.param_names, self.eval_params, "the evaluation EMA "
                            "(actor.eval_ema_decay > 0)")
        if self.old_params is not None:
            path = directory / "old_weights.safetensors"
            if not path.is_file() and (directory / DCP_DIR).is_dir():  # written sharded (actor.backend=fsdp2)
                load_sharded(directory / DCP_DIR, {"old": dict(zip(self.param_names, self.old_params, strict=True))})
                return
            if not path.is_file():
                raise FileNotFoundError(f"{directory} has no old_weights.safetensors (the EMA copy this run needs)")
            state = load_file(str(path))
            for n, o in zip(self.param_names, self.old_params, strict=True):
                o.copy_(state[n])

    def optimizer_state(self) -> dict:
        """What trainer_state.pt keeps of the optimizer: its whole state here (a sharded actor keeps it in distcp/)."""
        return self.optimizer.state_dict()

    def load_optimizer_state(self, directory: Path, saved: dict) -> None:
        """The optimizer state of a checkpoint: trainer_state.pt's, or gathered from distcp/ (actor.backend=fsdp2)."""
        if "sharded" not in saved:
            self.optimizer.load_state_dict(saved)
            return
        load_sharded(Path(directory) / saved["sharded"],
                     {"optimizer": adam_state(self.optimizer, self.param_names, self.params)})
        set_hyperparameters(self.optimizer, saved["param_groups"])


EVAL_EMA_FILE = "eval_ema_weights.safetensors"


def eval_ema_decay_at(step: int, max_decay: float) -> float:
    """The evaluation EMA's decay after optimizer step `step` (1 after the first): min((1 + s)/(10 + s), max_decay),
    the warm-up of DiffusionNFT's `EMAModuleWrapper.get_current_decay` (flow_grpo/ema.py at 24af5554; their
    recipes: max 0.9)."""
    return min((1 + step) / (10 + step), max_decay)


def load_copies(directory: Path, name: str, names: list[str], copies: list[torch.Tensor], what: str,
                cut=None) -> None:
    """Fill `copies` (one per trainable parameter, in `names`' order) from `directory/name`; `cut(full, like)`
    makes a rank's shard of a full tensor (actor/fsdp2.py)."""
    path = directory / name
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no {name} ({what} this run keeps)")
    state = load_file(str(path))
    for n, c in zip(names, copies, strict=True):
        c.copy_(state[n] if cut is None else cut(state[n], c))


def set_hyperparameters(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    """A saved optimizer's per-group settings (lr, betas, ...) without its parameter lists."""
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{len(groups)} optimizer parameter groups saved, this run has {len(optimizer.param_groups)}")
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})


def untie(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of each tensor whose storage an earlier entry already holds (tied input / output embeddings, as in
    small Qwen checkpoints): safetensors refuses to write shared storage; loading assigns both keys again."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


def split_by_network(state: dict[str, torch.Tensor], names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
    for key, value in state.items():
        net, _, rest = key.partition(".")
        if net not in out:
            raise ValueError(f"checkpoint tensor {key!r} belongs to no network of this model ({', '.join(names)})")
        out[net][rest] = value
    return out


def load_trained_weights(adapter: DiffusionPolicy, directory: Path, lora_already_added: bool = False) -> None:
    """Load a checkpoint's weights (LoRA adapters or full networks) into `adapter.modules()`."""
    directory = Path(directory)
    meta_path = directory / "weights.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory} is not a polyrl checkpoint (no weights.json)")
    meta = json.loads(meta_path.read_text())
    live = adapter.modules()
    names = meta.get("networks", list(live))  # the networks the run trained (actor.train_modules), in model order
    if not names or any(n not in live for n in names) or names != [n for n in live if n in names]:
        raise ValueError(f"{directory} holds networks {meta.get('networks')}, this model has {list(live)}")
    networks = {n: live[n] for n in names}
    if meta["lora"]:
        from peft.utils import set_peft_model_state_dict

        parts = split_by_network(load_file(str(directory / "adapter_model.safetensors")), list(networks))
        for name, network in networks.items():
            if not lora_already_added:
                add_lora(network, meta["lora_rank"], meta["lora_alpha"], meta["lora_targets"])
            result = set_peft_model_state_dict(network, parts[name])
            if getattr(result, "unexpected_keys", None):
                raise ValueError(f"{directory}: adapter keys not in the model: {result.unexpected_keys[:5]}")
    else:
        for name, network in networks.items():
            network.load_state_dict(load_file(str(directory / f"{name}.safetensors")))
