"""Any diffusers flow-matching pipeline, trained without a model file: record the rollout, replay the denoiser
(`model=diffusers_pipeline model.path=DIR`; docs/image_models.md "The generic pipeline adapter").

**Rollout.** The pipeline's own `__call__` runs, with its scheduler stood in for by `_Stepper`: the pipeline's
scheduler still sets the grid (`set_timesteps`, `timesteps`, `sigmas`, its config), but `step` is polyrl's sampler
(sampling/diffusion.py `Walk`: the `sde` / `cps` / `dance` step, the SDE window, the same noise draws as every
dedicated adapter), which receives the velocity the pipeline computed. A forward pre-hook on each denoiser
(`transformer`, `transformer_2`) records the arguments of every call made at a step some sample trains (nothing at
the others), and a forward hook its output.

**The combination is identified, never assumed.** At each recorded step the outputs of that step's calls are split
into branches (row blocks of B samples: one call of 2B rows is two branches) and every known form is tried against
the velocity the scheduler received, to 1e-5 relative (float32; 1e-2 for a half-precision network):

| form | velocity (§1 CFG) | pipelines |
|---|---|---|
| `identity` | ±o | no CFG, guidance-distilled or guidance-embedding (FLUX, Chroma at scale 1) |
| `cfg` | ±(u + s·(c − u)), either branch order | SD3 (one batched call), Wan (two calls), Sana, HiDream, HunyuanVideo-1.5 |
| `cfg_renorm` | g·‖c‖/‖g‖ over the last dim, g = u + s·(c − u) | Qwen-Image's true CFG |

where s is the guidance scale the pipeline was called with. A step whose outputs match none (three branches, a
rescale, APG, STG, a latent edit between steps) is refused with one `polyrl: error:` line naming the pipeline class
and what was seen; a log-prob is never computed against a velocity the replay cannot reproduce.

**Replay.** Each sample keeps, per trained step, its rows of every recorded argument (`Rollout.extras["replay"]`;
an argument equal to the latents is not stored but taken from the latents the actor passes; one that is the same
tensor at every step, e.g. the prompt's embeddings, is stored once per sample), plus the call structure and the
identified form; an argument whose leading channels are the latents (HunyuanVideo-1.5 concatenates condition latents
and a mask to them) keeps only its other channels, stored once while they are the same from step to step.
`velocity` finds each sample's record by its σ, batches the samples whose calls have the same
structure, calls the live denoisers (LoRA weights with gradients) and recombines the outputs with the recorded
form: the velocity the scheduler received, as a function of the trained weights.

**A fresh σ.** A likelihood-free algorithm (DiffusionNFT, AWM, DGPO, Diffusion-DPO) asks for the velocity at σ and
latents of its own. `fresh_call` identifies, across a sample's recorded steps, the one argument of each call that is
the timestep — every element equal to T·σ or T·σ/T ≈ σ (TIMESTEP_FORMS; T the scheduler's num_train_timesteps) at
every recorded step — and checks that everything else is the latent input or the same at every step; the sample's
first recorded calls are then made with the given latents and that argument evaluated at the new σ. What cannot be
identified is refused with one `polyrl: error:` line naming it. Guidance 1 on a CFG form (the conditional branch)
runs only the conditional branch's rows.

**Guidance scale.** `rollout.guidance_scale` goes to the pipeline's `true_cfg_scale` where it takes one, else its
`guidance_scale`, else — a pipeline with a diffusers guider component (HunyuanVideo-1.5) — to a copy of that guider
(`guider.new(guidance_scale=s)`) put in for the call; a guider in the original formulation c + s·(c − u) is the
`cfg` form at scale s + 1.

Decoding is the pipeline's own (`output_type="pt"`; `model.options.decode_batch` splits the VAE's decode into
chunks of that many samples; four-channel images, RGBA, are composited over white); a reward that reads latents gets the final latents in the
pipeline's layout (packed for FLUX-like pipelines). The sampled latents are one entry, `latents`.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import UserError
from ..latents import Latents, MediaShape
from .base import Cond, Guidance, Media, Prompt, register_model, text_only
from .diffusers_base import DTYPES, load_model_index
from .options import read_options
from .wan import wan_sigmas

DENOISERS = ("transformer", "transformer_2")
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


# ----------------------------------------------------------------------------------------------- combinations
def cfg(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance u + s·(c − u) (docs/algorithms.md §1 CFG), in the order diffusers writes it."""
    return uncond + scale * (cond - uncond)


def cfg_renorm(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """True CFG with norm rescale (Qwen-Image): g = u + s·(c − u), then g·‖c‖/‖g‖ with norms over the last dim."""
    guided = cfg(uncond, cond, scale)
    return guided * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(guided, dim=-1, keepdim=True))


COMBINATIONS = {"cfg": cfg, "cfg_renorm": cfg_renorm}


def crop(output: torch.Tensor, part: tuple | None) -> torch.Tensor:
    """The velocity's positions of a denoiser output: all of it (None), or its first / last L positions along dim 1
    (("head", L) / ("tail", L)) where the output keeps text or condition tokens (Qwen-Image 2.1 returns the whole
    joint sequence and the pipeline takes its last L)."""
    if part is None:
        return output
    side, n = part
    return output[:, :n] if side == "head" else output[:, output.shape[1] - n:]


def crops(branches: list[torch.Tensor], velocity: torch.Tensor) -> list[tuple | None]:
    """The ways to read a velocity-shaped tensor out of every branch: as it is when the shapes agree, else the head
    or the tail along dim 1 when every branch is at least as long there and agrees on the other dims."""
    if all(b.shape == velocity.shape for b in branches):
        return [None]
    n = velocity.shape[1] if velocity.dim() > 1 else 0
    if n and all(b.dim() == velocity.dim() and b.shape[0] == velocity.shape[0] and b.shape[2:] == velocity.shape[2:]
                 and b.shape[1] >= n for b in branches):
        return [("tail", n), ("head", n)]
    return []


def combine(form: tuple, branches: list[torch.Tensor], guidance: float | None = None) -> torch.Tensor:
    """The velocity of `form` = (kind, branch order, scale, sign[, crop]) from the branch outputs, in their dtype.
    `guidance` 1 on a CFG form gives the conditional branch alone (the actor's guidance-free velocity)."""
    kind, order, scale, sign, *part = form
    branches = [crop(b, part[0] if part else None) for b in branches]
    if kind == "identity":
        return sign * branches[order[0]]
    uncond, cond = branches[order[0]], branches[order[1]]
    if guidance == 1.0:
        return sign * cond
    return sign * COMBINATIONS[kind](uncond, cond, scale)


def candidate_forms(branches: int, scales: list[float]) -> list[tuple]:
    """The known forms for a step with `branches` row blocks of B samples (see the module docstring)."""
    if branches == 1:
        return [("identity", (0,), 1.0, sign) for sign in (1.0, -1.0)]
    if branches != 2:
        return []
    return [(kind, order, s, sign) for kind in ("cfg", "cfg_renorm") for order in ((0, 1), (1, 0))
            for s in scales for sign in (1.0, -1.0)]


def identify(branches: list[torch.Tensor], velocity: torch.Tensor, scales: list[float]) -> tuple[tuple | None, str]:
    """The first known form that maps `branches` to `velocity` within the dtype's tolerance (relative L2), or
    (None, what was seen)."""
    parts = crops(branches, velocity)
    if not parts:
        shapes = ", ".join(str(tuple(b.shape)) for b in branches)
        return None, f"denoiser outputs of shape {shapes} per branch vs. a velocity of shape {tuple(velocity.shape)}"
    tol = max(TOLERANCE.get(b.dtype, 1e-2) for b in branches)
    norm = velocity.norm().clamp_min(1e-30)
    best = (float("inf"), None)
    for form in (f + (part,) for part in parts for f in candidate_forms(len(branches), scales)):
        err = float((combine(form, branches).float() - velocity).norm() / norm)
        if err <= tol:
            return form, ""
        best = min(best, (err, form), key=lambda t: t[0])
    if best[1] is None:
        return None, f"{len(branches)} output branches of B rows (known forms take 1 or 2)"
    kind, order, s, sign, part = best[1]
    where = f", {part[0]} {part[1]} positions" if part else ""
    return None, (f"{len(branches)} output branch(es); the closest known form, {kind} (order {order}, scale {s:g}, "
                  f"sign {sign:+g}{where}), is off by {best[0]:.2e} relative (tolerance {tol:g})")


def over_white(images: torch.Tensor) -> torch.Tensor:
    """RGBA in [0, 1] composited over a white background: rgb·a + (1 − a) (Qwen-Image 2.1's VAE decodes four
    channels); three-channel images pass through."""
    if images.dim() == 4 and images.shape[1] == 4:
        rgb, alpha = images[:, :3], images[:, 3:]
        return rgb * alpha + (1 - alpha)
    return images


def first_tensor(output) -> torch.Tensor:
    """A denoiser's output tensor: the tensor, a tuple's first entry (return_dict=False) or the `.sample`."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list):
        return output[0]
    return output.sample if hasattr(output, "sample") else output[0]


def attention_lora_targets(networks: dict[str, torch.nn.Module]) -> list[str]:
    """Names (relative to their attention module) of the linear layers inside every attention module of the
    denoisers: q/k/v/out and the joint-attention text projections, whatever a family calls them."""
    names = set()
    for network in networks.values():
        for _, module in network.named_modules():
            if "Attention" not in type(module).__name__:
                continue
            for name, child in module.named_modules():
                if name and isinstance(child, torch.nn.Linear):
                    names.add(name)
    return sorted(names)


def recorded_bytes(records: list) -> int:
    """Bytes of the per-sample argument tensors held by `Rollout.extras["replay"]` (each tensor counted once)."""
    seen, total = set(), 0
    for steps in records:
        for rec in steps:
            for slot in rec["slots"]:
                if isinstance(slot, torch.Tensor) and id(slot) not in seen:
                    seen.add(id(slot))
                    total += slot.numel() * slot.element_size()
    return total


def replay_bytes(once: list[tuple[int, tuple[int, ...], int]], per_step: list[tuple[int, tuple[int, ...], int]],
                 window: int) -> int:
    """Bytes one sample's replay record holds, from shapes (docs/image_models.md "What it stores"): each argument
    that is the same tensor, or the same values, at every step (the prompt's embeddings) once, each that changes from
    step to step (the timestep) once per recorded (window) step; an entry is (rows per sample — the CFG branches the
    call carries —, shape of one row, bytes per element). The latents themselves are never stored."""
    def size(entries):
        return sum(rows * math.prod(shape) * itemsize for rows, shape, itemsize in entries)
    return size(once) + window * size(per_step)


# ----------------------------------------------------------------------------------------------- recording
def _fingerprint_node(s):
    """One recorded argument structure as a comparable value (constant tensors by their bytes)."""
    tag = s[0]
    if tag == "const":
        v = s[1]
        if isinstance(v, torch.Tensor):
            data = v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            return ("T", tuple(v.shape), str(v.dtype), hashlib.sha1(data).hexdigest())
        return ("V", repr(v))
    if tag in ("list", "tuple"):
        return (tag, tuple(_fingerprint_node(e) for e in s[1]))
    if tag == "dict":
        return (tag, tuple((k, _fingerprint_node(e)) for k, e in s[1].items()))
    return s


def _fingerprint(spec) -> str:
    """A string equal for two call structures that replay as one batch (constant tensors by their bytes)."""
    calls, form = spec
    return repr((tuple((name, _fingerprint_node(a), _fingerprint_node(k)) for name, a, k in calls), form))


class _Stepper:
    """Stands in for the pipeline's scheduler: everything but `step` is the pipeline's own scheduler's, and so is
    the grid where that scheduler is a flow-matching Euler one. A multistep scheduler (UniPC, DPM-Solver: Wan, Sana)
    gets the shifted linear grid in its place, σ_i = s·u_i/(1 + (s − 1)·u_i), u = linspace(1, 0, N+1), with its
    `flow_shift` / `shift` (models/wan.py `wan_sigmas`, as the dedicated adapters replace it), and timesteps
    1000·σ_i."""

    def __init__(self, inner, on_step):
        from diffusers import FlowMatchEulerDiscreteScheduler

        self.__dict__.update(_inner=inner, _on_step=on_step)
        if not isinstance(inner, FlowMatchEulerDiscreteScheduler):  # else its own (whose signature pipelines inspect)
            self.__dict__["set_timesteps"] = self._linear_grid

    def _linear_grid(self, num_inference_steps=None, device=None, **kwargs):
        inner = self._inner
        inner.set_timesteps(num_inference_steps, device=device)
        config = inner.config
        shift = config.get("flow_shift") or config.get("shift") or 1.0
        sigmas = wan_sigmas(num_inference_steps, float(shift)).to(device or "cpu")
        inner.sigmas = sigmas
        inner.timesteps = sigmas[:-1] * config.get("num_train_timesteps", 1000)

    def __getattr__(self, name):
        return getattr(self.__dict__["_inner"], name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)

    def step(self, model_output, timestep, sample, *args, return_dict: bool = True, **kwargs):
        out = self._on_step(model_output, timestep, sample)
        if return_dict:
            from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteSchedulerOutput

            return FlowMatchEulerDiscreteSchedulerOutput(prev_sample=out)
        return (out,)


class _Probed(Exception):
    def __init__(self, sample: torch.Tensor):
        self.sample = sample


class _Recorder:
    """One pipeline call's state: the sampler's step, the denoiser calls of the current step, each sample's
    records of its trained steps."""

    def __init__(self, name: str, x: torch.Tensor, step, trained: torch.Tensor, sigmas: torch.Tensor,
                 scales: list[float]):
        self.name, self.x, self.walk_step, self.trained, self.sigmas, self.scales = name, x, step, trained, sigmas, scales
        self.j, self.calls = 0, []
        self.b = x.shape[0]
        self.records: list[list[dict]] = [[] for _ in range(self.b)]
        self._slices: dict[int, tuple] = {}  # id(argument) -> (argument, its per-sample rows): shared across steps
        self._contents: list[tuple] = []  # (a copy of an argument, its per-sample rows): the same values, new tensor
        self.last_step = time.perf_counter()

    def recording(self) -> bool:
        return self.j < self.trained.shape[1] and bool(self.trained[:, self.j].any())

    def pre_hook(self, network: str):
        def hook(module, args, kwargs):
            if self.recording():
                self.calls.append([network, args, kwargs, None])
        return hook

    def post_hook(self):
        def hook(module, args, kwargs, output):
            if self.recording():
                self.calls[-1][3] = first_tensor(output).detach()
        return hook

    def on_step(self, model_output: torch.Tensor, timestep, sample: torch.Tensor) -> torch.Tensor:
        j = self.j
        if j >= self.trained.shape[1]:
            raise UserError(f"model=diffusers_pipeline: {self.name} stepped its scheduler more than "
                            f"num_inference_steps={self.trained.shape[1]} times (a multistep or second-order loop)")
        if sample.shape != self.x.shape or not torch.equal(sample, self.x.to(sample.dtype)):
            raise UserError(f"model=diffusers_pipeline: {self.name} changed its latents between scheduler steps (at "
                            f"step {j}), so a replay of its calls would not see what it sampled from")
        v = model_output.float()
        if v.shape != self.x.shape:
            raise UserError(f"model=diffusers_pipeline: {self.name} stepped with a velocity of shape "
                            f"{tuple(v.shape)} for latents of shape {tuple(self.x.shape)}")
        if self.recording():
            self._keep(j, v)
        self.x = self.walk_step(j, {"latents": v})["latents"]
        self.j, self.calls = j + 1, []
        self.last_step = time.perf_counter()
        return self.x.to(sample.dtype)

    def _keep(self, j: int, v: torch.Tensor) -> None:
        """Identify step j's combination and keep each training sample's rows of its calls."""
        b = self.b
        if not self.calls or any(c[3] is None for c in self.calls):
            raise UserError(f"model=diffusers_pipeline: {self.name} called no denoiser ({', '.join(DENOISERS)}) "
                            f"before scheduler step {j}")
        outs = [c[3] for c in self.calls]
        rows = [o.shape[0] for o in outs]
        if any(n % b for n in rows):
            raise UserError(f"model=diffusers_pipeline: {self.name} called its denoiser with {rows} rows at step {j} "
                            f"for a batch of {b} samples (not a multiple)")
        branches = [o.reshape(n // b, b, *o.shape[1:])[r] for o, n in zip(outs, rows, strict=True)
                    for r in range(n // b)]
        form, seen = identify(branches, v, self.scales)
        if form is None:
            raise UserError(f"model=diffusers_pipeline: {self.name} combines its denoiser outputs in no known form "
                            f"at step {j}: {len(outs)} call(s) of {rows} rows, {seen}; known: identity, cfg, "
                            f"cfg_renorm (models/diffusers_pipeline.py)")
        slots: list = []
        calls = tuple((name, self._split(args, n, slots), self._split(kwargs, n, slots))
                      for (name, args, kwargs, _), n in zip(self.calls, rows, strict=True))
        spec = (calls, form)
        shapes = tuple(tuple(s[0].shape) if isinstance(s[0], torch.Tensor) else None for s in slots)
        key = _fingerprint(spec) + repr(shapes)  # replayed together: the same structure and per-sample shapes
        sigma = float(self.sigmas[j])
        for i in range(b):
            if self.trained[i, j]:
                self.records[i].append({"sigma": sigma, "key": key, "spec": spec,
                                        "slots": [s[i] for s in slots]})

    def _split(self, value, n: int, slots: list):
        """A call argument -> its structure, with per-row values moved to `slots` (one list per slot: per sample)."""
        b, m = self.b, n // self.b
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != n:
                return ("const", value.detach().cpu())
            blocks = value.detach().reshape(m, b, *value.shape[1:])
            x, c = self.x, self.x.shape[1] if self.x.dim() > 1 else 0
            if value.is_floating_point() and value.shape[1:] == x.shape[1:]:
                if all(torch.equal(blocks[r], x.to(value.dtype)) for r in range(m)):
                    return ("latent", value.dtype, m)
            if (value.is_floating_point() and value.dim() == x.dim() > 2 and value.shape[2:] == x.shape[2:]
                    and value.shape[1] > c and all(torch.equal(blocks[r][:, :c], x.to(value.dtype)) for r in range(m))):
                slots.append(self._rows(value.detach()[:, c:], m))  # the latents, then channels of their own
                return ("latent_cat", value.dtype, m, len(slots) - 1)
            slots.append(self._rows(value, m))
            return ("rows", len(slots) - 1, m)
        if isinstance(value, list) and len(value) == n and not any(isinstance(e, torch.Tensor) for e in value):
            slots.append([[value[r * b + i] for r in range(m)] for i in range(b)])
            return ("rowlist", len(slots) - 1, m)
        if isinstance(value, list | tuple):
            return ("list" if isinstance(value, list) else "tuple", [self._split(e, n, slots) for e in value])
        if isinstance(value, dict):
            return ("dict", {k: self._split(e, n, slots) for k, e in value.items()})
        return ("const", value)


    @staticmethod
    def _unique_rows(blocks: torch.Tensor) -> list[torch.Tensor]:
        """Each sample's rows `blocks[:, i]` on the CPU, samples with equal rows (the samples of one prompt, a
        timestep) sharing one copy."""
        rows: list[torch.Tensor] = []
        firsts: list[int] = []  # the first sample of each distinct value
        for i in range(blocks.shape[1]):
            same = next((j for j in firsts if torch.equal(blocks[:, j], blocks[:, i])), None)
            if same is None:
                firsts.append(i)
                rows.append(blocks[:, i].cpu().clone())
            else:
                rows.append(rows[same])
        return rows

    def _rows(self, value: torch.Tensor, m: int) -> list[torch.Tensor]:
        """Each sample's rows (m, ...) of `value`, on the CPU; the same list as an earlier argument that is the same
        tensor (the prompt's embeddings at every step) or has the same values (a condition rebuilt every step)."""
        if id(value) in self._slices:
            return self._slices[id(value)][1]
        keep = not value._is_view()  # a view (a slice made for this call) is never passed again
        for other, rows in self._contents:
            if other.shape == value.shape and other.dtype == value.dtype and torch.equal(other, value):
                if keep:
                    self._slices[id(value)] = (value, rows)
                return rows
        rows = self._unique_rows(value.detach().reshape(m, self.b, *value.shape[1:]))
        if keep:
            self._slices[id(value)] = (value, rows)
        self._contents.append((value.detach().clone(), rows))
        return rows


def _build(spec, recs: list[dict], x: torch.Tensor, device: torch.device, sigma: torch.Tensor | None = None,
           block: int | None = None):
    """A recorded argument structure -> the arguments of one call for the samples of `recs` (rows block-major, as
    the pipeline laid them out: block r holds every sample's r-th row). `sigma` (one per sample) fills the "time"
    nodes of a call made at a fresh σ (`fresh_call`); `block` keeps only that row block of a call of several (the
    conditional branch of a batched CFG call)."""
    tag = spec[0]
    if tag == "latent":
        _, dtype, m = spec
        x = x.to(dtype)
        m = 1 if block is not None else m
        return torch.cat([x] * m) if m > 1 else x
    if tag == "latent_cat":
        _, dtype, m, slot = spec
        return torch.cat([_build(("latent", dtype, m), recs, x, device, sigma, block),
                          _build(("rows", slot, m), recs, x, device, sigma, block).to(dtype)], dim=1)
    if tag in ("rows", "time"):
        slot, m = spec[1], spec[2]
        if tag == "rows":
            stacked = torch.stack([r["slots"][slot] for r in recs]).to(device)  # (G, m, ...)
        else:  # the timestep as a function of each sample's σ, in the recorded dtype and shape
            form, timescale = spec[3], spec[4]
            like = recs[0]["slots"][slot]
            value = TIMESTEP_FORMS[form](sigma.to(device, torch.float32), timescale).to(like.dtype)
            stacked = value.view(-1, *[1] * like.dim()).expand(len(recs), *like.shape)
        if block is not None:
            stacked, m = stacked[:, block:block + 1], 1
        return stacked.transpose(0, 1).reshape(m * len(recs), *stacked.shape[2:])
    if tag == "rowlist":
        _, slot, m = spec
        blocks = range(m) if block is None else [block]
        return [r["slots"][slot][k] for k in blocks for r in recs]
    if tag == "const":
        return spec[1].to(device) if isinstance(spec[1], torch.Tensor) else spec[1]
    if tag == "list":
        return [_build(s, recs, x, device, sigma, block) for s in spec[1]]
    if tag == "tuple":
        return tuple(_build(s, recs, x, device, sigma, block) for s in spec[1])
    return {k: _build(s, recs, x, device, sigma, block) for k, s in spec[1].items()}


def _blocks(spec) -> int | None:
    """The row blocks (CFG branches) one recorded call carries, read from any per-row argument; None if it has none."""
    tag = spec[0]
    if tag in ("latent", "latent_cat", "rows", "rowlist", "time"):
        return spec[2]
    children = spec[1].values() if tag == "dict" else spec[1] if tag in ("list", "tuple") else ()
    return next((m for m in map(_blocks, children) if m is not None), None)


def branch_call(calls: tuple, branch: int) -> tuple[int, int] | None:
    """(call index, row block) that produces output branch `branch` (branches are numbered call by call, block by
    block, as `_keep` splits them), or None where a call's blocks cannot be read from its arguments."""
    first = 0
    for c, (_, args_spec, kwargs_spec) in enumerate(calls):
        m = _blocks(("list", [args_spec, kwargs_spec]))
        if m is None:
            return None
        if branch < first + m:
            return c, branch - first
        first += m
    return None


# ----------------------------------------------------------------------------------------------- a fresh σ
# The timestep argument as a function of σ, with T the scheduler's num_train_timesteps: the scheduler's timestep T·σ
# (SD3, Wan, Sana, HunyuanVideo-1.5 pass it as it is), or that divided by T (FLUX, Chroma, Qwen-Image), which float32
# may round apart from σ itself. Evaluated in float32, then cast to the dtype the pipeline passed.
TIMESTEP_FORMS = {
    "T·σ": lambda s, t: s * t,
    "T·σ/T": lambda s, t: s * t / t,
    "σ": lambda s, t: s,
}
TIME_TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def _time_matches(value: torch.Tensor, want: torch.Tensor, exact: bool) -> bool:
    """Every element of `value` equals `want` (a float32 scalar) in value's dtype, or within its TIME_TOLERANCE."""
    if exact:
        want = want.to(value.dtype)
        first = value.reshape(-1)[0]
        return bool(first == want) and bool((value == want).all())  # the first element rules most arguments out
    tol = TIME_TOLERANCE.get(value.dtype, 1e-2) * abs(float(want))
    return (abs(float(value.reshape(-1)[0]) - float(want)) <= tol
            and bool(((value.double() - float(want)).abs() <= tol).all()))


def timestep_form(values: list, sigmas: list[float], timescale: float) -> str | None:
    """The first form f of TIMESTEP_FORMS with every element of values[r] = f(σ_r) at every recorded step r
    (exactly; failing that, within TIME_TOLERANCE relative), or None."""
    if not all(isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() for v in values):
        return None
    for exact in (True, False):
        for name, f in TIMESTEP_FORMS.items():
            if all(_time_matches(v, f(torch.tensor(s, dtype=torch.float32), timescale), exact)
                   for v, s in zip(values, sigmas, strict=True)):
                return name
    return None


def _same(values: list) -> bool:
    """All recorded values equal the first (the same tensor, or equal values)."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return all(v is first or (isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype
                                  and torch.equal(v, first)) for v in values[1:])
    return all(v == first for v in values[1:])


def _fresh_node(nodes: list, slots: list[list], sigmas: list[float], timescale: float, path: str, found: dict):
    """One argument of a call, recorded at each of a sample's steps (`nodes`, `slots` per step) -> its fresh-σ spec:
    the timestep becomes a "time" node; everything else must be the latents or the same at every step. Notes in
    `found`: (path, form) of the timestep ("time"), count of latent inputs ("latent"), paths that change ("changes")."""
    node, tag = nodes[0], nodes[0][0]
    if any(n[0] != tag for n in nodes):
        found["changes"].append(path)
        return node
    if tag == "const":
        if len({repr(_fingerprint_node(n)) for n in nodes}) > 1:
            found["changes"].append(path)
        return node
    if tag == "latent":
        found["latent"] += 1
        return node
    if tag == "latent_cat":
        found["latent"] += 1
        if not _same([s[n[3]] for s, n in zip(slots, nodes, strict=True)]):
            found["changes"].append(f"{path} (its channels after the latents)")
        return node
    if tag == "rows":
        values = [s[n[1]] for s, n in zip(slots, nodes, strict=True)]
        form = timestep_form(values, sigmas, timescale)
        if form is not None:
            found["time"].append((path, form))
            return ("time", node[1], node[2], form, timescale)
        if not _same(values):
            found["changes"].append(path)
        return node
    if tag == "rowlist":
        if not _same([s[n[1]] for s, n in zip(slots, nodes, strict=True)]):
            found["changes"].append(path)
        return node
    if tag in ("list", "tuple"):
        if len({len(n[1]) for n in nodes}) > 1:
            found["changes"].append(path)
            return node
        return (tag, [_fresh_node([n[1][i] for n in nodes], slots, sigmas, timescale, f"{path}[{i}]", found)
                      for i in range(len(node[1]))])
    if len({tuple(n[1]) for n in nodes}) > 1:
        found["changes"].append(path)
        return node
    return ("dict", {k: _fresh_node([n[1][k] for n in nodes], slots, sigmas, timescale, f"{path}.{k}", found)
                     for k in node[1]})


def _argument(path: str) -> str:
    """A call argument's name from its `_fresh_node` path: "timestep" for kwargs.timestep, "0" for args[0]."""
    if path.startswith("kwargs."):
        return path[len("kwargs."):]
    return path[len("args["):].replace("]", "", 1) if path.startswith("args[") else path


def fresh_call(name: str, steps: list[dict], timescale: float) -> dict:
    """How one sample's denoiser calls are made at a σ its rollout did not step through (a likelihood-free
    algorithm's forward process): the calls of its first recorded step with, in each call, the one argument that
    equals a TIMESTEP_FORMS form of σ at every recorded step made a function of σ, and the latent input taken from
    the latents given — {"spec", "key"} (the spec reads the first step's slots); or {"error": one line} naming what
    could not be identified (no timestep, two candidates, no latent input, an argument that changes from step to step
    otherwise, calls or a combination that differ between steps)."""
    sigmas = [r["sigma"] for r in steps]
    recorded = f"(recorded σ: {', '.join(f'{s:.4g}' for s in sigmas)})"

    def fail(reason: str) -> dict:
        return {"error": f"model=diffusers_pipeline: {name} cannot be evaluated at a σ its rollout did not step "
                         f"through (a likelihood-free algorithm's forward process): {reason} {recorded}"}

    calls0, form0 = steps[0]["spec"]
    for rec in steps[1:]:
        calls, form = rec["spec"]
        if [c[0] for c in calls] != [c[0] for c in calls0]:
            return fail(f"its steps call different denoisers ({', '.join(c[0] for c in calls0)} at σ={sigmas[0]:.4g}, "
                        f"{', '.join(c[0] for c in calls)} at σ={rec['sigma']:.4g})")
        if form[:4] != form0[:4]:
            return fail(f"its steps combine their outputs differently ({form0[0]} scale {form0[2]:g} at "
                        f"σ={sigmas[0]:.4g}, {form[0]} scale {form[2]:g} at σ={rec['sigma']:.4g})")
    slots = [rec["slots"] for rec in steps]
    fresh, times = [], []
    for c, (network, _, _) in enumerate(calls0):
        label = f"{network} (call {c + 1} of {len(calls0)})" if len(calls0) > 1 else network
        found = {"time": [], "latent": 0, "changes": []}
        args = _fresh_node([rec["spec"][0][c][1] for rec in steps], slots, sigmas, timescale, "args", found)
        kwargs = _fresh_node([rec["spec"][0][c][2] for rec in steps], slots, sigmas, timescale, "kwargs", found)
        paths = [_argument(p) for p, _ in found["time"]]
        if found["changes"]:
            one = len(found["changes"]) == 1
            return fail(f"{label}'s {'argument' if one else 'arguments'} {', '.join(map(_argument, found['changes']))} "
                        f"{'changes' if one else 'change'} from step to step and {'is' if one else 'are'} neither its "
                        "latents nor its timestep")
        if not found["latent"]:
            return fail(f"no argument of {label} is the latents")
        if not paths:
            return fail(f"no argument of {label} equals {timescale:g}·σ or σ at every recorded step, so its timestep "
                        "is not identified")
        if len(paths) > 1:
            return fail(f"{len(paths)} arguments of {label} ({', '.join(paths)}) equal {timescale:g}·σ or σ at every "
                        "recorded step, so which is the timestep is not identified (more recorded steps tell them "
                        "apart: rollout.sde_window_size)")
        fresh.append((network, args, kwargs))
        times.append(found["time"])
    # batched with the samples whose first recorded step has the same structure (its key) and the same timesteps
    return {"spec": (tuple(fresh), form0), "key": f"fresh {steps[0]['key']} {times!r}"}


# ----------------------------------------------------------------------------------------------- the policy
@register_model("diffusers_pipeline")
class PipelinePolicy:
    """A diffusers flow-matching pipeline run as it is (see the module docstring)."""

    family = "diffusers_pipeline"
    # `model.options`: `pipeline` a diffusers pipeline class name ("" = model_index.json's `_class_name`);
    # `max_sequence_length` passed to the pipeline where it takes one (null: the pipeline's default);
    # `decode_batch` the VAE decodes this many samples at a time (null: the whole batch in one call)
    options = {"pipeline": "", "max_sequence_length": None, "decode_batch": None}

    def __init__(self, cfg, device: torch.device):
        import diffusers

        self.opts = read_options(self.options, dict(getattr(cfg, "options", None) or {}))
        self.root = Path(cfg.path)
        index = load_model_index(self.root)
        for entry in index.values():  # diffusers loads a component of a non-diffusers module only once imported
            if isinstance(entry, list) and isinstance(entry[0], str) and entry[0].startswith("polyrl."):
                importlib.import_module(entry[0])  # ours (models/tiny.py), never a checkpoint's own code
        name = self.opts["pipeline"] or index.get("_class_name", "")
        cls = getattr(diffusers, name, None)
        if cls is None or not hasattr(cls, "from_pretrained"):
            raise UserError(f"model.options.pipeline={name!r} is not a diffusers pipeline class (diffusers "
                            f"{diffusers.__version__})")
        self.device, self.dtype = device, DTYPES[cfg.dtype]
        self.pipe = cls.from_pretrained(str(self.root), dtype=self.dtype).to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.name = type(self.pipe).__name__
        for component in self.pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.requires_grad_(False).eval()
        self.networks = {n: getattr(self.pipe, n) for n in DENOISERS
                         if isinstance(getattr(self.pipe, n, None), torch.nn.Module)}
        if not self.networks:
            raise UserError(f"model=diffusers_pipeline: {self.name} at {self.root} has no denoiser named "
                            f"{' or '.join(DENOISERS)}")
        self.params = inspect.signature(self.pipe.__call__).parameters
        for needed in ("latents", "num_inference_steps", "output_type"):
            if needed not in self.params:
                raise UserError(f"model=diffusers_pipeline: {self.name}.__call__ takes no `{needed}`")
        self.default_lora_targets = attention_lora_targets(self.networks)
        self.flops = 0.0  # not counted: the generic adapter knows no architecture (docs/algorithms.md §6)
        # T of a timestep T·σ (`fresh_call`): the scheduler's num_train_timesteps
        self.timescale = float(self.pipe.scheduler.config.get("num_train_timesteps", 1000))
        self._probed: dict = {}

    def modules(self) -> dict[str, torch.nn.Module]:
        return self.networks

    # ------------------------------------------------------------------------------------------- prompts
    def encode_prompts(self, prompts: list[Prompt]) -> Cond:
        """Nothing: the pipeline encodes its prompts itself; what training needs is recorded by the rollout."""
        text_only(prompts, self.family)
        return {}

    def encode_guidance(self, guidance: Guidance) -> Cond:
        return {}

    # ------------------------------------------------------------------------------------------- the pipeline call
    def _call_kwargs(self, texts: list[str], shape: MediaShape, num_steps: int, guidance: Guidance,
                     latents: torch.Tensor | None, output_type: str) -> dict:
        kw = {"prompt": texts, "num_inference_steps": num_steps, "output_type": output_type, "latents": latents}
        for key, value in (("height", shape.height), ("width", shape.width)):
            if key in self.params:
                kw[key] = value
        if shape.is_video:
            if "num_frames" not in self.params:
                raise UserError(f"rollout.num_frames={shape.frames}: {self.name} makes no video (no `num_frames`)")
            kw["num_frames"] = shape.frames
        scale_key = next((k for k in ("true_cfg_scale", "guidance_scale") if k in self.params), None)
        if scale_key is not None:
            kw[scale_key] = guidance.scale
        elif self._guider() is None and guidance.scale != 1.0:
            raise UserError(f"rollout.guidance_scale={guidance.scale}: {self.name} takes no guidance scale")
        if guidance.scale != 1.0 and "negative_prompt" in self.params:
            kw["negative_prompt"] = [guidance.negative_prompt] * len(texts)
        if self.opts["max_sequence_length"] is not None and "max_sequence_length" in self.params:
            kw["max_sequence_length"] = int(self.opts["max_sequence_length"])
        if "use_resolution_binning" in self.params:  # sample at rollout.height/width, not the nearest trained bin
            kw["use_resolution_binning"] = False
        if "use_kv_cache" in self.params:  # a cache filled at step 0 would replay stale keys at the later steps
            kw["use_kv_cache"] = False
        if "generator" in self.params:  # draws the pipeline makes besides the initial noise (none for text-to-X)
            kw["generator"] = torch.Generator(self.device).manual_seed(0)
        return kw

    def _guider(self):
        """The pipeline's diffusers guider (a `guider` component with a `guidance_scale`) where its `__call__` takes
        no scale of its own (HunyuanVideo-1.5), else None."""
        guider = getattr(self.pipe, "guider", None)
        if any(k in self.params for k in ("true_cfg_scale", "guidance_scale")) or not hasattr(guider, "new"):
            return None
        return guider if hasattr(guider, "guidance_scale") else None

    def _scales(self, scale: float) -> list[float]:
        """The guidance scales a CFG form may carry: s, and s + 1 for a guider in the original formulation
        c + s·(c − u) = u + (s + 1)·(c − u)."""
        guider = self._guider()
        original = guider is not None and bool(getattr(guider, "use_original_formulation", False))
        return [scale, scale + 1.0] if original else [scale]

    def _chunked_decode(self, decode, n: int):
        """`decode` (the VAE's) run on chunks of `n` samples, its outputs concatenated."""
        def run(z, *args, return_dict: bool = True, **kwargs):
            out = torch.cat([first_tensor(decode(z[i:i + n], *args, return_dict=False, **kwargs))
                             for i in range(0, z.shape[0], n)])
            if return_dict:
                from diffusers.models.autoencoders.vae import DecoderOutput

                return DecoderOutput(sample=out)
            return (out,)
        return run

    @contextmanager
    def _running(self, stepper: _Stepper, recorder: _Recorder | None = None, scale: float = 1.0):
        """The pipeline with `stepper` as its scheduler, the live networks (the actor may swap one for a policy's)
        as its denoisers, a guider at `scale` where the pipeline has one, the VAE decoding `decode_batch` samples at
        a time where set and, with a recorder, the recording hooks on them."""
        pipe, names = self.pipe, ["scheduler", *self.networks]
        guider = self._guider()
        if guider is not None:
            names.append("guider")
        saved = {n: pipe.__dict__[n] for n in names}
        pipe.__dict__["scheduler"] = stepper  # not setattr: that would rewrite the pipeline's config
        pipe.__dict__.update(self.networks)
        if guider is not None:
            pipe.__dict__["guider"] = guider.new(guidance_scale=scale)
        vae = getattr(pipe, "vae", None)
        chunk = self.opts["decode_batch"]
        if chunk is not None and hasattr(vae, "decode"):
            vae.decode = self._chunked_decode(type(vae).decode.__get__(vae), int(chunk))
        handles = []
        if recorder is not None:
            for name, network in self.networks.items():
                handles.append(network.register_forward_pre_hook(recorder.pre_hook(name), with_kwargs=True))
                handles.append(network.register_forward_hook(recorder.post_hook(), with_kwargs=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            pipe.__dict__.update(saved)
            if "decode" in getattr(vae, "__dict__", {}):
                del vae.decode

    def _probe(self, shape: MediaShape, num_steps: int) -> tuple[torch.Tensor, tuple[int, ...]]:
        """(σ grid, per-sample latent shape) of the pipeline at this shape: one call stopped at its first step."""
        key = (shape, num_steps)
        if key not in self._probed:
            def stop(model_output, timestep, sample):
                raise _Probed(sample)

            stepper = _Stepper(self.pipe.scheduler, stop)
            kwargs = self._call_kwargs(["a photo"], shape, num_steps, Guidance(), None, "latent")
            try:
                with self._running(stepper), torch.no_grad():
                    self.pipe(**kwargs)
            except _Probed as probed:
                sample = probed.sample
            else:
                raise UserError(f"model=diffusers_pipeline: {self.name} never stepped its scheduler")
            sigmas = torch.as_tensor(self.pipe.scheduler.sigmas).float().cpu()
            ok = (len(sigmas) == num_steps + 1 and float(sigmas[0]) <= 1 and float(sigmas[-1]) == 0
                  and bool((sigmas[1:] < sigmas[:-1]).all()))
            if not ok:
                raise UserError(f"model=diffusers_pipeline: {self.name}'s scheduler "
                                f"({type(self.pipe.scheduler).__name__}) set the σ grid {sigmas.tolist()} for "
                                f"{num_steps} steps; a flow-matching grid of num_steps + 1 values from ≤ 1 down to 0 "
                                "is needed")
            self._probed[key] = (sigmas, tuple(sample.shape[1:]))
        return self._probed[key]

    def latent_shapes(self, shape: MediaShape) -> dict[str, tuple[int, ...]]:
        return {"latents": self._probe(shape, 2)[1]}

    def sigmas(self, num_steps: int, shape: MediaShape) -> torch.Tensor:
        return self._probe(shape, num_steps)[0].clone()

    @torch.no_grad()
    def run_pipeline(self, prompts: list[Prompt], initial: Latents, step, trained: torch.Tensor, plan,
                     decode: bool) -> tuple[Media | None, list, float]:
        """The pipeline's own call on `initial`, each scheduler step taken by `step(j, v)` (sampling/diffusion.py
        `sample_pipeline`); returns (decoded media or None, each sample's records, decode seconds)."""
        texts = text_only(prompts, self.family)
        sigmas = self.sigmas(plan.num_steps, plan.shape)
        recorder = _Recorder(self.name, initial["latents"], step, trained, sigmas,
                             self._scales(float(plan.guidance.scale)))
        stepper = _Stepper(self.pipe.scheduler, recorder.on_step)
        kwargs = self._call_kwargs(texts, plan.shape, plan.num_steps, plan.guidance,
                                   initial["latents"].to(self.dtype), "pt" if decode else "latent")
        with self._running(stepper, recorder, float(plan.guidance.scale)):
            try:
                out = self.pipe(**kwargs)
            except RuntimeError as e:  # after the last step: the decode of the batch (HunyuanVideo-1.5's VAE at B > 1)
                batch = len(texts)
                if not decode or recorder.j != plan.num_steps or batch == 1 or self.opts["decode_batch"] is not None:
                    raise
                raise UserError(f"model=diffusers_pipeline: {self.name} failed to decode a batch of {batch} after its "
                                f"last step ({str(e).splitlines()[0]}); model.options.decode_batch=1 decodes one "
                                "sample at a time") from e
        decode_s = time.perf_counter() - recorder.last_step
        if recorder.j != plan.num_steps:
            raise UserError(f"model=diffusers_pipeline: {self.name} took {recorder.j} scheduler steps for "
                            f"num_inference_steps={plan.num_steps}")
        if not torch.equal(torch.as_tensor(self.pipe.scheduler.sigmas).float().cpu(), sigmas):
            raise UserError(f"model=diffusers_pipeline: {self.name} set another σ grid for these prompts than for "
                            "the probe (a prompt-dependent schedule)")
        media = None
        if decode:
            result = out[0]
            if not isinstance(result, torch.Tensor):
                raise UserError(f"model=diffusers_pipeline: {self.name} returned {type(result).__name__} for "
                                "output_type='pt'")
            result = over_white(result.float().clamp(0, 1))
            media = {"video" if result.dim() == 5 else "images": result}
        return media, recorder.records, decode_s

    # ------------------------------------------------------------------------------------------- replay
    def velocity(self, latents: Latents, sigma: torch.Tensor, cond: Cond, shared: Cond, guidance: float) -> Latents:
        """Each sample's recorded calls at `sigma` — the ones of its step at that σ, else (a σ the rollout did not step
        through) its first step's with the timestep made σ's (`fresh_call`) — run on the live networks with the given
        latents and recombined; `guidance` 1 on a CFG form runs only the conditional branch's rows."""
        records = cond.get("replay")
        if records is None:
            raise UserError("model=diffusers_pipeline evaluates its denoiser only by replaying the calls its rollout "
                            "recorded (Rollout.extras['replay']); this algorithm or stage asks for a velocity "
                            "outside a rollout")
        x = latents["latents"]
        picks = []  # per sample: (record whose slots the call reads, call structure, batching key)
        for i, steps in enumerate(records):
            s = float(sigma[i])
            rec = next((r for r in steps if r["sigma"] == s), None)
            if rec is not None:
                picks.append((rec, rec["spec"], rec["key"]))
                continue
            if not steps:
                raise UserError(f"model=diffusers_pipeline: sample {i} recorded no denoiser call (σ={s:g} asked)")
            if "fresh" not in steps[0]:  # identified once per sample, kept with its records
                steps[0]["fresh"] = fresh_call(self.name, steps, self.timescale)
            fresh = steps[0]["fresh"]
            if "error" in fresh:
                raise UserError(fresh["error"])
            picks.append((steps[0], fresh["spec"], fresh["key"]))
        groups: dict[str, list[int]] = {}
        for i, (_, _, key) in enumerate(picks):
            groups.setdefault(key, []).append(i)
        parts, order = [], []
        for idx in groups.values():
            recs = [picks[i][0] for i in idx]
            calls, form = picks[idx[0]][1]
            rows = torch.tensor(idx, device=x.device)
            xg, sg = x.index_select(0, rows), sigma.index_select(0, rows.to(sigma.device))
            cond_only = branch_call(calls, form[1][1]) if guidance == 1.0 and form[0] in COMBINATIONS else None
            if cond_only is not None:  # guidance 1: the conditional branch alone (combine's answer, half the rows)
                c, block = cond_only
                name, args_spec, kwargs_spec = calls[c]
                out = first_tensor(self.networks[name](*_build(args_spec, recs, xg, self.device, sg, block),
                                                       **_build(kwargs_spec, recs, xg, self.device, sg, block)))
                parts.append((form[3] * crop(out, form[4] if len(form) > 4 else None)).float())
                order += idx
                continue
            branches = []
            for name, args_spec, kwargs_spec in calls:
                out = first_tensor(self.networks[name](*_build(args_spec, recs, xg, self.device, sg),
                                                       **_build(kwargs_spec, recs, xg, self.device, sg)))
                m = out.shape[0] // len(idx)
                branches += list(out.reshape(m, len(idx), *out.shape[1:]).unbind(0))
            parts.append(combine(form, branches, guidance).float())
            order += idx
        v = torch.cat(parts) if len(parts) > 1 else parts[0]
        if order != sorted(order):
            v = v.index_select(0, torch.tensor(order, device=v.device).argsort())
        return {"latents": v}

    # ------------------------------------------------------------------------------------------- media
    def decode(self, latents: Latents) -> Media:
        raise UserError("model=diffusers_pipeline decodes inside the pipeline call (output_type='pt'); it has no "
                        "separate decode")

    def encode_media(self, media: Media) -> Latents:
        raise UserError("model=diffusers_pipeline has no media encoder (offline preference pairs, data.pairs_path, "
                        "need a dedicated model file)")
