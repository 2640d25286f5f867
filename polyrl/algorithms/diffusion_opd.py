"""DiffusionOPD (docs/algorithms.md §3 on-policy distillation): frozen teachers replay the student's window states.

One teacher (`teacher_path`), or several (`teachers`: a list of {path, weight, key}), as verl-omni's multi-teacher
diffusion OPD (verl-project/verl-omni docs/algo/diffusion_opd.md "Multi-teacher", commit
7c52e7e78b4c40bcb31b0efaef270625db5a8851) routes samples: a teacher with a `key` scores the samples whose prompt
row has that value in its `teacher` column, a teacher without one scores every sample; each teacher's KL is
weighted by its `weight` and summed. A sample routed to no teacher (a `teacher` value no teacher has, or no column
and no key-less teacher) is an error, as in verl-omni. verl-omni routes each sample to exactly one teacher; the
weights and key-less teachers are polyrl's additions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batch import Rollout
from ..errors import UserError
from ..latents import entries
from .base import PolicyEvaluator, register_algorithm, weighted_mean
from .flow_grpo import FlowGRPO, checked_kl_form, kl_to_reference

TEACHER_COLUMN = "teacher"  # the prompt file's column that routes a prompt to a keyed teacher


def distill_kl(mean, teacher_mean, std, dt=None, form: str = "exact", step: str | None = "sde") -> torch.Tensor:
    """Per-sample KL from the student's transition to the teacher's, in `algorithm.distill_kl_form` (§3 OPD):
    `exact` mean_d (μ_θ − μ_teacher)² / (2·s²) with s the transition std; `verl_omni` verl-omni's `DistillKLLoss`,
    mean_d (μ_θ − μ_teacher)² / (2·std_dev_t²) with its scheduler's std_dev_t (`sde`: without √(−dt), i.e. the exact
    KL × (−dt); `cps`, `dance`: the exact KL); `flow_grpo` flow_grpo's reference-KL form (`sde`, `dance`: × (−dt);
    `cps`: exact), flow_grpo having no distillation loss (`flow_grpo.kl_to_reference`)."""
    return kl_to_reference(mean, teacher_mean, std, dt, form, step)


@dataclass(frozen=True)
class Teacher:
    path: str
    weight: float = 1.0
    key: str | None = None  # None: every sample; else the samples whose `teacher` column is this value


def parse_teachers(teacher_path: str | None, teachers: list | None) -> list[Teacher]:
    """The teachers of `algorithm.teacher_path` (one, weight 1) or `algorithm.teachers`; one-line ValueErrors."""
    if (teacher_path is None) == (not teachers):
        raise ValueError("set exactly one of algorithm.teacher_path (one teacher) and algorithm.teachers (a list of "
                         "{path, weight, key})")
    if teacher_path is not None:
        return [Teacher(str(teacher_path))]
    out = []
    for i, t in enumerate(teachers):
        if not isinstance(t, dict) or not t.get("path"):
            raise ValueError(f"algorithm.teachers[{i}]={t!r} must be a mapping with a path (and optionally weight, key)")
        unknown = sorted(set(t) - {"path", "weight", "key"})
        if unknown:
            raise ValueError(f"unknown key algorithm.teachers[{i}].{unknown[0]}; allowed: key, path, weight")
        weight = t.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight <= 0:
            raise ValueError(f"algorithm.teachers[{i}].weight={weight!r} must be a number > 0")
        key = t.get("key")
        if key is not None and (not isinstance(key, str) or not key):
            raise ValueError(f"algorithm.teachers[{i}].key={key!r} must be a non-empty string or null (every sample)")
        out.append(Teacher(str(t["path"]), float(weight), key))
    keys = [t.key for t in out if t.key is not None]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"algorithm.teachers: key {dup[0]!r} is given to more than one teacher")
    return out


def route_teachers(metadata: list[dict], teachers: list[Teacher]) -> torch.Tensor:
    """(J, B) float routing mask: m_j,i = 1 when teacher j scores sample i (key-less: all; keyed: the samples whose
    `teacher` column equals its key). UserError naming the first sample no teacher scores."""
    keys = {t.key for t in teachers if t.key is not None}
    mask = torch.zeros(len(teachers), len(metadata))
    for i, meta in enumerate(metadata):
        value = meta.get(TEACHER_COLUMN)
        if value is not None and str(value) not in keys:
            raise UserError(f"a prompt's {TEACHER_COLUMN}={value!r} names no teacher of algorithm.teachers (keys: "
                            f"{', '.join(sorted(keys)) or 'none'})")
        for j, t in enumerate(teachers):
            mask[j, i] = float(t.key is None or (value is not None and str(value) == t.key))
        if mask[:, i].sum() == 0:
            raise UserError(f"a prompt has no {TEACHER_COLUMN} column and every teacher of algorithm.teachers has a key: "
                            f"give the prompt a {TEACHER_COLUMN} or add a teacher without a key")
    return mask


def multi_teacher_kl(kls: list[torch.Tensor], mask: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """Per-sample Σ_j w_j·m_j,i·KL_j,i (KL_j of rows teacher j does not score is ignored, whatever its value)."""
    total = torch.zeros_like(kls[0])
    for j, kl in enumerate(kls):
        m = mask[j].to(kl)
        total = total + weights[j] * torch.where(m > 0, kl, torch.zeros_like(kl)) * m
    return total


def _rows(x, idx: torch.Tensor):
    if isinstance(x, dict):
        return {k: v[idx.to(v.device)] for k, v in x.items()}
    return x if x.dim() == 0 else x[idx.to(x.device)]


@register_algorithm("diffusion_opd")
class DiffusionOPD(FlowGRPO):
    """`distill_coef`·Σ_j w_j·distill_kl_j alone (`policy_gradient: false`) or added to the Flow-GRPO loss."""

    def __init__(self, teacher_path: str | None = None, teachers: list | None = None, distill_coef: float = 1.0,
                 policy_gradient: bool = False, clip_range: float = 1e-4, kl_beta: float = 0.0, adv_std: str = "global",
                 adv_clip_max: float = 5.0, kl_form: str = "exact", drop_zero_advantage: bool = False,
                 distill_kl_form: str = "exact"):
        super().__init__(clip_range, kl_beta, adv_std, adv_clip_max, kl_form, drop_zero_advantage)
        self.distill_kl_form = checked_kl_form(distill_kl_form, "distill_kl_form")
        self.teachers = parse_teachers(teacher_path, teachers)
        self.teacher_path = self.teachers[0].path
        self.teacher_paths = [t.path for t in self.teachers]
        self.distill_coef, self.policy_gradient = distill_coef, policy_gradient

    def prepare(self, batch: Rollout) -> Rollout:
        batch = super().prepare(batch)
        if len(self.teachers) > 1 or self.teachers[0].key is not None:
            batch.extras["teacher_mask"] = route_teachers(batch.metadata, self.teachers).T.contiguous()  # (B, J)
        return batch

    def step_loss(self, policy: PolicyEvaluator, batch: Rollout, k: int) -> tuple[torch.Tensor, dict]:
        out = policy.step(batch, k)
        if self.policy_gradient:
            loss, stats = self.policy_loss(policy, batch, k, out)
        else:
            loss, stats = 0.0, {}
        if "teacher_mask" not in batch.extras:  # one teacher for every sample
            with torch.no_grad():
                teacher = policy.step(batch, k, policy="teacher")
            per_sample = distill_kl(out.mean, teacher.mean, out.std, out.dt, self.distill_kl_form, out.step)
        else:
            mask = batch.extras["teacher_mask"].T  # (J, B)
            kls, dtype = [], next(iter(entries(out.mean).values())).dtype  # the KL's dtype is the student's means'
            for j in range(len(self.teachers)):
                idx = torch.nonzero(mask[j] > 0).flatten()
                kl = torch.zeros(len(batch), device=out.log_prob.device, dtype=dtype)
                if len(idx):
                    with torch.no_grad():
                        teacher = policy.step(batch.select(idx), k, policy=f"teacher:{j}")
                    dt = None if out.dt is None else _rows(out.dt, idx)
                    part = distill_kl(_rows(out.mean, idx), teacher.mean, _rows(out.std, idx), dt,
                                      self.distill_kl_form, out.step)
                    kl = kl.index_put((idx.to(kl.device),), part.to(kl))
                    stats[f"distill_kl/teacher{j}"] = part.detach().mean()
                kls.append(kl)
            per_sample = multi_teacher_kl(kls, mask, [t.weight for t in self.teachers])
        kl = weighted_mean(per_sample, out.weight)
        stats["distill_kl"] = kl.detach()
        loss = loss + self.distill_coef * kl
        stats["loss"] = loss.detach()
        return loss, stats
