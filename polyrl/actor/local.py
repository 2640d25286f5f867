"""Single-process actor backend: LoRA (peft) or full fine-tune, AdamW, grad-norm clip.

The actor owns the trainable weights and the optimisation loop over mini-batches; the algorithm supplies the
per-step loss. It is also the `PolicyEvaluator` the algorithm calls to re-score stored transitions.
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..batch import Rollout
from ..models.base import GeneratorAdapter
from ..sampling.rollout import SamplingPlan
from ..sampling.steps import StepOut, sde_step


def add_lora(transformer: torch.nn.Module, rank: int, alpha: float, targets: list[str]) -> None:
    from peft import LoraConfig

    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets))


class LocalActor:
    def __init__(self, adapter: GeneratorAdapter, cfg, plan: SamplingPlan, needs_reference: bool):
        self.adapter, self.cfg, self.plan = adapter, cfg, plan
        self.sigma_1 = float(adapter.sigmas(plan.num_steps, plan.height, plan.width)[1])
        transformer = adapter.transformer
        self.lora = cfg.lora_rank > 0
        self.reference_model = None
        if self.lora:
            targets = list(cfg.lora_targets) if cfg.lora_targets else adapter.default_lora_targets
            add_lora(transformer, cfg.lora_rank, cfg.lora_alpha, targets)
        else:
            transformer.requires_grad_(True)
            if needs_reference:
                self.reference_model = copy.deepcopy(transformer).requires_grad_(False).eval()
        # Trainable weights are kept in float32 (the optimizer needs full-precision master weights).
        self.params = [p for p in transformer.parameters() if p.requires_grad]
        for p in self.params:
            p.data = p.data.float()
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=cfg.eps
        )

    @property
    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.params)

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
            trained = self.adapter.transformer
            self.adapter.transformer = self.reference_model
            try:
                yield
            finally:
                self.adapter.transformer = trained

    # ------------------------------------------------------------------------------------ PolicyEvaluator
    def step(self, batch: Rollout, k: int, reference: bool = False) -> StepOut:
        dev = self.adapter.device
        b = len(batch)
        x, x_next = batch.latents[:, k].to(dev), batch.latents[:, k + 1].to(dev)
        sigma, sigma_next = batch.sigmas[:, k].to(dev), batch.sigmas[:, k + 1].to(dev)
        cond = {key: v.to(dev) for key, v in batch.cond.items()}
        neg = batch.neg_for(b)
        neg = None if neg is None else {key: v.to(dev) for key, v in neg.items()}
        with self.reference() if reference else nullcontext():
            v = self.adapter.velocity(x, sigma, cond, neg, self.plan.guidance_scale)
        return sde_step(x, v, sigma, sigma_next, batch.noise_levels[:, k].to(dev), self.sigma_1, prev=x_next)

    # ------------------------------------------------------------------------------------ update
    def update(self, algo, batch: Rollout, generator: torch.Generator) -> dict[str, float]:
        """`num_minibatches` optimizer steps over a shuffled batch; each accumulates every trained step."""
        b = len(batch)
        window = batch.log_probs.shape[1]
        order = torch.randperm(b, generator=generator)
        stats: dict[str, list[float]] = {}
        self.adapter.transformer.train()
        for mb in order.chunk(self.cfg.num_minibatches):
            self.optimizer.zero_grad(set_to_none=True)
            micro = self.cfg.micro_batch_size or len(mb)
            for part in mb.split(micro):
                sub = batch.select(part)
                for k in range(window):
                    loss, st = algo.step_loss(self, sub, k)
                    (loss * (len(part) / len(mb)) / window).backward()
                    for name, value in st.items():
                        stats.setdefault(name, []).append(float(value))
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
            if not torch.isfinite(grad_norm):
                raise FloatingPointError(f"non-finite gradient norm {grad_norm} (loss {float(loss)})")
            self.optimizer.step()
            stats.setdefault("grad_norm", []).append(float(grad_norm))
        self.adapter.transformer.eval()
        return {k: sum(v) / len(v) for k, v in stats.items()}

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
        meta = {"lora": self.lora, "lora_rank": self.cfg.lora_rank, "lora_alpha": self.cfg.lora_alpha,
                "lora_targets": list(self.cfg.lora_targets) if self.cfg.lora_targets else self.adapter.default_lora_targets}
        (directory / "weights.json").write_text(json.dumps(meta, indent=2))

    def load_weights(self, directory: Path) -> None:
        load_trained_weights(self.adapter, directory, lora_already_added=True)


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
