"""Single-process actor backend: LoRA (peft) or full fine-tune, AdamW, grad-norm clip, policy contexts.

The actor owns the trainable weights and the optimisation loop over mini-batches; the algorithm supplies the
per-term loss. It is also the `PolicyEvaluator` the algorithm calls to re-score stored transitions under a named
policy: `current`, `reference` (LoRA disabled / frozen initial copy), `old` (an EMA copy of the trainable weights,
swapped in and out) and `teacher` (a frozen network loaded from `algorithm.teacher_path`). What exists is decided
by the algorithm's declarations (needs_reference, needs_old, teacher_path) and `actor.ema_decay`.

Rollout correction (ALGORITHMS.md §4) happens here too, before the first optimizer step of an update: `bypass`
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
from ..models.base import GeneratorAdapter
from ..sampling.rollout import SamplingPlan
from ..sampling.steps import STEPS, StepOut


def add_lora(transformer: torch.nn.Module, rank: int, alpha: float, targets: list[str]) -> None:
    from peft import LoraConfig

    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets))


def load_teacher(path: str | Path, base: torch.nn.Module) -> torch.nn.Module:
    """A frozen teacher: a polyrl checkpoint (the base network + its trained weights) or a diffusers directory."""
    path = Path(path)
    if (path / "weights.json").is_file():
        holder = SimpleNamespace(transformer=copy.deepcopy(base))
        load_trained_weights(holder, path)
        teacher = holder.transformer
    else:
        sub = path / "transformer" if (path / "transformer" / "config.json").is_file() else path
        if not (sub / "config.json").is_file():
            raise FileNotFoundError(f"algorithm.teacher_path={str(path)!r} is neither a polyrl checkpoint (weights.json) "
                                    "nor a diffusers directory (transformer/config.json)")
        dtype = next(base.parameters()).dtype
        teacher = type(base).from_pretrained(str(sub), torch_dtype=dtype)
    return teacher.to(next(base.parameters()).device).requires_grad_(False).eval()


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


def mean_stats(stats: dict[str, list]) -> dict[str, float]:
    """Each stat's mean as a float; device tensors are read back in one transfer, not one sync each."""
    device = next((v.device for vs in stats.values() for v in vs if torch.is_tensor(v)), "cpu")
    flat = torch.stack([torch.as_tensor(v, device=device).detach().double().reshape(())
                        for vs in stats.values() for v in vs]).tolist()
    out, i = {}, 0
    for k, vs in stats.items():
        out[k] = sum(flat[i:i + len(vs)]) / len(vs)
        i += len(vs)
    return out


DEFAULT_CORRECTION = SimpleNamespace(mode="bypass", is_cap=2.0, log_ratio_bounds=None)


class LocalActor:
    def __init__(self, adapter: GeneratorAdapter, cfg, plan: SamplingPlan, algo, correction=None):
        self.adapter, self.cfg, self.plan, self.algo = adapter, cfg, plan, algo
        self.correction = correction or DEFAULT_CORRECTION
        self.bounds = None if self.correction.log_ratio_bounds is None else tuple(map(float, self.correction.log_ratio_bounds))
        self.sigma_1 = float(adapter.sigmas(plan.num_steps, plan.height, plan.width)[1])
        self.step_fn = STEPS[plan.step]
        transformer = adapter.transformer
        self.teacher_model = load_teacher(algo.teacher_path, transformer) if algo.teacher_path else None
        self.lora = cfg.lora_rank > 0
        self.reference_model = None
        if self.lora:
            targets = list(cfg.lora_targets) if cfg.lora_targets else adapter.default_lora_targets
            add_lora(transformer, cfg.lora_rank, cfg.lora_alpha, targets)
        else:
            transformer.requires_grad_(True)
            if algo.needs_reference:
                self.reference_model = copy.deepcopy(transformer).requires_grad_(False).eval()
        # Trainable weights are kept in float32 (the optimizer needs full-precision master weights).
        named = [(n, p) for n, p in transformer.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        for p in self.params:
            p.data = p.data.float()
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=cfg.eps
        )
        self.ema_decay = float(getattr(cfg, "ema_decay", 0.0))
        keep_old = algo.needs_old or self.ema_decay > 0
        self.old_params = [p.detach().clone() for p in self.params] if keep_old else None
        self.num_updates = 0
        self.generator = torch.Generator().manual_seed(0)
        self._masked: list[torch.Tensor] = []

    @property
    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.params)

    # ------------------------------------------------------------------------------------ policy contexts
    @contextmanager
    def reference(self):
        """Run the adapter's network as the reference policy: LoRA disabled, or the frozen initial copy."""
        if self.lora:
            self.adapter.transformer.disable_adapters()
            try:
                yield
            finally:
                self.adapter.transformer.enable_adapters()
        else:
            with self._swap_network(self.reference_model):
                yield

    @contextmanager
    def _swap_network(self, network: torch.nn.Module):
        trained = self.adapter.transformer
        self.adapter.transformer = network
        try:
            yield
        finally:
            self.adapter.transformer = trained

    @contextmanager
    def _swap_old(self):
        """Swap the EMA tensors into the trainable parameters (and back): the `old` policy, no copy."""
        if self.old_params is None:
            raise RuntimeError("the `old` policy needs an EMA copy: set actor.ema_decay > 0 or use an algorithm that keeps one")
        for p, o in zip(self.params, self.old_params, strict=True):
            p.data, o.data = o.data, p.data
        try:
            yield
        finally:
            for p, o in zip(self.params, self.old_params, strict=True):
                p.data, o.data = o.data, p.data

    def policy(self, name: str):
        """A context in which the adapter's network is the named policy (see the module docstring)."""
        if name == "current":
            return nullcontext()
        if name == "reference":
            return self.reference()
        if name == "old":
            return self._swap_old()
        if name == "teacher":
            if self.teacher_model is None:
                raise RuntimeError("the `teacher` policy needs algorithm.teacher_path")
            return self._swap_network(self.teacher_model)
        raise ValueError(f"unknown policy {name!r}; allowed: current, reference, old, teacher")

    def sampling_policy(self):
        """The policy the rollout samples from: `old` for algorithms that declare samples_from_old."""
        return self.policy("old" if self.algo.samples_from_old else "current")

    # ------------------------------------------------------------------------------------ PolicyEvaluator
    def _cond(self, batch: Rollout, dev):
        cond = {key: v.to(dev) for key, v in batch.cond.items()}
        neg = batch.neg_for(len(batch))
        return cond, None if neg is None else {key: v.to(dev) for key, v in neg.items()}

    def velocity(self, batch: Rollout, latents: torch.Tensor, sigma: torch.Tensor, policy: str = "current",
                 guidance: float | None = None) -> torch.Tensor:
        dev = self.adapter.device
        cond, neg = self._cond(batch, dev)
        g = self.plan.guidance_scale if guidance is None else guidance
        with self.policy(policy):
            return self.adapter.velocity(latents.to(dev), sigma.to(dev), cond, neg, g)

    def step(self, batch: Rollout, k: int, policy: str = "current") -> StepOut:
        dev = self.adapter.device
        x, x_next = batch.latents[:, k].to(dev), batch.latents[:, k + 1].to(dev)
        sigma, sigma_next = batch.sigmas[:, k].to(dev), batch.sigmas[:, k + 1].to(dev)
        cond, neg = self._cond(batch, dev)
        with self.policy(policy):
            v = self.adapter.velocity(x, sigma, cond, neg, self.plan.guidance_scale)
        out = self.step_fn(x, v, sigma, sigma_next, batch.noise_levels[:, k].to(dev), self.sigma_1, prev=x_next)
        if policy == "current":
            out.weight = self._weight(batch, k, out.log_prob.detach())
        return out

    def _weight(self, batch: Rollout, k: int, log_prob: torch.Tensor) -> torch.Tensor | None:
        """The per-sample correction weight of step k: decoupled IS × mask, or the bypass rejection mask."""
        weight = None if batch.step_weights is None else batch.step_weights[:, k].to(log_prob)
        if self.correction.mode == "bypass" and self.bounds is not None:
            mask = in_bounds(log_prob - batch.log_probs[:, k].to(log_prob), self.bounds)
            self._masked.append(1 - mask.mean())
            weight = mask if weight is None else weight * mask
        return weight

    # ------------------------------------------------------------------------------------ rollout correction
    @torch.no_grad()
    def prepare_old(self, batch: Rollout) -> dict[str, float]:
        """Fill `old_log_probs` / `old_means` / `step_weights` by rollout_correction.mode (§4); returns its stats."""
        if not self.algo.uses_log_probs:
            return {}
        mode = self.correction.mode
        if mode == "bypass":
            batch.old_log_probs = batch.log_probs
            return {"time/old_logprob": 0.0}
        t0 = time.perf_counter()
        old_policy = "old" if self.algo.samples_from_old else "current"
        micro = self.cfg.micro_batch_size or len(batch)
        lps, means = [], []
        for part in torch.arange(len(batch)).split(micro):
            sub = batch.select(part)
            outs = [self.step(sub, k, policy=old_policy) for k in range(batch.log_probs.shape[1])]
            lps.append(torch.stack([o.log_prob for o in outs], 1).float())
            means.append(torch.stack([o.mean for o in outs], 1).float())
        batch.old_log_probs, batch.old_means = torch.cat(lps), torch.cat(means)
        delta = batch.old_log_probs - batch.log_probs
        stats = {"correction/abs_dlogp": float(delta.abs().mean()), "correction/max_abs_dlogp": float(delta.abs().max())}
        if mode == "decoupled":
            weight, mask = correction_weights(batch.old_log_probs, batch.log_probs, self.correction.is_cap, self.bounds)
            batch.step_weights = weight * mask
            stats.update({"correction/is_weight_mean": float(weight.mean()), "correction/is_weight_max": float(weight.max()),
                          "correction/is_weight_min": float(weight.min()), "correction/masked_frac": float(1 - mask.mean())})
        stats["time/old_logprob"] = time.perf_counter() - t0
        return stats

    # ------------------------------------------------------------------------------------ update
    def update(self, algo, batch: Rollout, generator: torch.Generator) -> dict[str, float]:
        """`num_minibatches` optimizer steps over a shuffled batch; each accumulates every loss term."""
        self.generator = generator
        # one copy to the device per update, not one per micro-batch and step: the conditioning alone is
        # ~100 MB per SD3 micro-batch, and every host-to-device copy from pageable memory stalls the GPU queue
        batch = algo.prepare(batch).to(self.adapter.device)
        b = len(batch)
        stats: dict[str, list] = {"train/samples": [float(b)]}
        if b == 0:  # e.g. online DPO when every group's rewards are equal: nothing to learn from
            self._update_old(algo)
            return {"train/samples": 0.0}
        extra = self.prepare_old(batch)
        self._masked = []
        terms = algo.num_terms(batch)
        order = torch.randperm(b, generator=generator)
        self.adapter.transformer.train()
        for i, mb in enumerate(order.chunk(min(self.cfg.num_minibatches, b))):
            self.optimizer.zero_grad(set_to_none=True)
            micro = self.cfg.micro_batch_size or len(mb)
            for part in mb.split(micro):
                sub = batch.select(part)
                for k in range(terms):
                    loss, st = algo.step_loss(self, sub, k)
                    (loss * (len(part) / len(mb)) / terms).backward()
                    # stats stay on the device until the update ends: a float() here would sync every step
                    for name, value in st.items():
                        stats.setdefault(name, []).append(value.detach() if torch.is_tensor(value) else value)
                    if i == 0 and "ratio_absdev" in st:
                        # before any update the ratio is 1 up to rollout-vs-training kernel differences: this is
                        # that difference, the number rollout correction exists for (§4)
                        stats.setdefault("ratio_absdev/first_minibatch", []).append(st["ratio_absdev"].detach())
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
            if not torch.isfinite(grad_norm):
                raise FloatingPointError(f"non-finite gradient norm {grad_norm} (loss {float(loss)})")
            self.optimizer.step()
            stats.setdefault("grad_norm", []).append(grad_norm.detach())
        self.adapter.transformer.eval()
        self._update_old(algo)
        if self._masked:
            stats["correction/masked_frac"] = self._masked
        out = mean_stats(stats)
        out.update(extra)
        return out

    @torch.no_grad()
    def _update_old(self, algo) -> None:
        """old ← d·old + (1−d)·θ after every update (d from the algorithm's schedule, else actor.ema_decay)."""
        if self.old_params is not None:
            d = algo.old_decay(self.num_updates)
            d = self.ema_decay if d is None else d
            for p, o in zip(self.params, self.old_params, strict=True):
                o.mul_(d).add_(p.detach(), alpha=1 - d)
        self.num_updates += 1

    # ------------------------------------------------------------------------------------ weights
    def trainable_state(self) -> dict[str, torch.Tensor]:
        if self.lora:
            from peft.utils import get_peft_model_state_dict

            return {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(self.adapter.transformer).items()}
        return {k: v.detach().contiguous() for k, v in self.adapter.transformer.state_dict().items()}

    def save_weights(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        name = "adapter_model.safetensors" if self.lora else "transformer.safetensors"
        save_file(self.trainable_state(), str(directory / name))
        if self.old_params is not None:  # the EMA / old policy, so that a resumed run continues exactly
            save_file({n: o.contiguous() for n, o in zip(self.param_names, self.old_params, strict=True)},
                      str(directory / "old_weights.safetensors"))
        meta = {"lora": self.lora, "lora_rank": self.cfg.lora_rank, "lora_alpha": self.cfg.lora_alpha,
                "lora_targets": list(self.cfg.lora_targets) if self.cfg.lora_targets else self.adapter.default_lora_targets,
                "updates": self.num_updates}
        (directory / "weights.json").write_text(json.dumps(meta, indent=2))

    def load_weights(self, directory: Path) -> None:
        directory = Path(directory)
        load_trained_weights(self.adapter, directory, lora_already_added=True)
        self.num_updates = int(json.loads((directory / "weights.json").read_text()).get("updates", 0))
        if self.old_params is not None:
            path = directory / "old_weights.safetensors"
            if not path.is_file():
                raise FileNotFoundError(f"{directory} has no old_weights.safetensors (the EMA copy this run needs)")
            state = load_file(str(path))
            for n, o in zip(self.param_names, self.old_params, strict=True):
                o.copy_(state[n])


def load_trained_weights(adapter: GeneratorAdapter, directory: Path, lora_already_added: bool = False) -> None:
    """Load a checkpoint's weights (LoRA adapter or full transformer) into `adapter.transformer`."""
    directory = Path(directory)
    meta_path = directory / "weights.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory} is not a polyrl checkpoint (no weights.json)")
    meta = json.loads(meta_path.read_text())
    if meta["lora"]:
        from peft.utils import set_peft_model_state_dict

        if not lora_already_added:
            add_lora(adapter.transformer, meta["lora_rank"], meta["lora_alpha"], meta["lora_targets"])
        state = load_file(str(directory / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(adapter.transformer, state)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{directory}: adapter keys not in the model: {result.unexpected_keys[:5]}")
    else:
        state = load_file(str(directory / "transformer.safetensors"))
        adapter.transformer.load_state_dict(state)
