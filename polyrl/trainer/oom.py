"""An out-of-memory on the device as one line: `polyrl: error: out of GPU memory in <stage> (asked X GiB, free Y GiB);
try <keys>`, after the run saved its last completed step (trainer/loop.py `_failed`), with no traceback.

The stage is the innermost stage timer the allocation failed in (perf/timer.py tags the exception: text_encode,
rollout, decode, reward, train, weight_sync, ...), else the trainer's phase (evaluation, checkpoint save). The keys
are the memory plan's first change that fits the card (`fixes`, on a GPU), else the stage's own levers, each a step
smaller than the run's (`stage_levers`).
"""

from __future__ import annotations

from ..errors import UserError
from ..perf.memory import free_memory_gib, is_out_of_memory, oom_sizes, release_cached_memory

PHASES = {"eval": "evaluation", "save": "checkpoint save", "update": "train", "step": "step"}
ROLLOUT_STAGES = ("text_encode", "rollout", "decode", "evaluation")


class OutOfDeviceMemory(UserError):
    """The device ran out of memory; the message says where, how much, and what to change."""


def oom_stage(error: BaseException, phase: str) -> str | None:
    """The stage an out-of-memory happened in (None: `error` is no out-of-memory). Drops the failed stage's tensors
    (its frames, through the traceback) and the allocator's cache, so that the last step can still be saved."""
    if not is_out_of_memory(error):
        return None
    tagged = getattr(error, "polyrl_stage", None)
    error.__traceback__ = None
    release_cached_memory()
    if phase in ("eval", "save"):
        return PHASES[phase] + (f" ({tagged})" if tagged and tagged != "step" else "")
    return tagged or PHASES.get(phase, phase or "startup")


def _half(n: int) -> int:
    return max(1, n // 2)


def stage_levers(cfg, stage: str) -> list[str]:
    """The keys that shrink what `stage` holds, each a step smaller than now (no plan needed)."""
    a, r = cfg.actor, cfg.rollout
    keys = []
    if stage.split(" ")[0] in ROLLOUT_STAGES or stage.startswith("evaluation"):
        if r.batch_size > 1:
            keys.append(f"rollout.batch_size={_half(r.batch_size)}")
        return keys or ["a model of fewer parameters, or more GPUs (actor.backend=fsdp2 under torchrun)"]
    mini = max(1, cfg.data.prompts_per_step * r.n // max(1, a.num_minibatches))
    micro = a.micro_batch_size or mini
    if micro > 1:
        keys.append(f"actor.micro_batch_size={_half(micro)}")
    if a.gradient_checkpointing is not True:
        keys.append("actor.gradient_checkpointing=true")
    if a.backend == "local":
        keys.append("actor.backend=fsdp2 on more GPUs (torchrun)")
    return keys


def fixes(cfg, stage: str, card_gib: float | None) -> list[str]:
    """The memory plan's first change that fits the card (trainer/memory_plan.py), else the stage's levers."""
    if cfg is None:
        return []
    if card_gib:
        from .memory_plan import smallest_fix

        try:
            rollout = stage.split(" ")[0] in ROLLOUT_STAGES
            found = smallest_fix(cfg, card_gib, ("rollout.", "actor.backend", "parallel.") if rollout else ("",))
        except Exception:  # the plan needs the checkpoint's headers; the stage's levers need nothing
            found = None
        if found:
            return found
    return stage_levers(cfg, stage)


def out_of_memory(error: BaseException, stage: str, cfg, note: str = "") -> OutOfDeviceMemory:
    """The one-line error for an out-of-memory in `stage` (`note`: what the run saved, the resume command)."""
    asked, free = oom_sizes(str(error))
    device = free_memory_gib()
    if free is None and device is not None:
        free = device[0]
    sizes = ", ".join(s for s in (f"asked {asked:.2f} GiB" if asked is not None else "",
                                  f"free {free:.2f} GiB" if free is not None else "") if s)
    keys = fixes(cfg, stage, device[1] if device is not None else None)
    line = (f"out of GPU memory in {stage}" + (f" ({sizes})" if sizes else "")
            + (f"; try {' or '.join(keys)}" if keys else ""))
    return OutOfDeviceMemory(line + (f"\n{note}" if note else ""))
