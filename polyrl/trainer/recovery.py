"""What lets a run stop cleanly: the weights before an update (to roll back a step cut short), and the stop
signals' exception types."""

from __future__ import annotations

import signal

import torch

from ..errors import UserError
from ..perf.transfer import host_copy

SNAPSHOT_MAX_PARAMS = 2**25  # trainable elements copied to the CPU before each update (see WeightSnapshot)


class WeightSnapshot:
    """The actor's trainable state before an update (weights, optimizer, EMA / old copy, evaluation EMA, update and
    optimizer step counts) on the CPU: a step that fails or is abandoned in the middle of its update is rolled back
    to it, so the last completed step can still be saved. Taken only while the trainable weights have at most SNAPSHOT_MAX_PARAMS elements
    (every LoRA we train; a full fine-tune of a large model is not copied every step).

    From a GPU the tensors are copied into pinned memory without waiting: a copy into pageable memory makes the
    host wait for the device once per tensor (1,544 waits per update for SD3's LoRA with AdamW and EMA). The copies
    are queued before the update's kernels on the same stream, so they read the weights as they were; `restore`
    waits for them."""

    def __init__(self, actor):
        self.params = [_host_copy(p) for p in actor.params]
        self.optimizer = _to_cpu(actor.optimizer.state_dict())
        old = getattr(actor, "old_params", None)
        self.old = None if old is None else [_host_copy(o) for o in old]
        evaluated = getattr(actor, "eval_params", None)  # the evaluation EMA (actor.eval_ema_decay)
        self.evaluated = None if evaluated is None else [_host_copy(e) for e in evaluated]
        self.updates, self.optimizer_steps = actor.num_updates, getattr(actor, "optimizer_steps", 0)
        devices = {p.device for p in actor.params if p.device.type == "cuda"}
        self.copied = [torch.cuda.current_stream(d).record_event() for d in devices]

    @staticmethod
    def fits(actor) -> bool:
        return sum(p.numel() for p in actor.params) <= SNAPSHOT_MAX_PARAMS

    @torch.no_grad()
    def restore(self, actor) -> None:
        for event in self.copied:
            event.synchronize()
        for p, saved in zip(actor.params, self.params, strict=True):
            p.copy_(saved)
        actor.optimizer.load_state_dict(self.optimizer)
        if self.old is not None:
            for o, saved in zip(actor.old_params, self.old, strict=True):
                o.copy_(saved)
        if self.evaluated is not None:
            for e, saved in zip(actor.eval_params, self.evaluated, strict=True):
                e.copy_(saved)
        actor.num_updates, actor.optimizer_steps = self.updates, self.optimizer_steps


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` on the CPU; a plain CUDA tensor goes to pinned memory without waiting for the device (the
    caller records an event after the copies). A sharded (DTensor) parameter is copied as it is."""
    tensor = tensor.detach()
    return host_copy(tensor, pinned=tensor.device.type == "cuda" and type(tensor) is torch.Tensor)


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return _host_copy(obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class StopRequested(BaseException):
    """Raised by the SIGINT / SIGTERM handler to abandon the work in progress (like KeyboardInterrupt, it is not an
    Exception, so no library `except Exception` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class RunStopped(UserError):
    """The run stopped after saving its last completed step: on a signal (`exit_code` 128 + the signal), or because
    another rank exited (`exit_code` given). `report`: whether this rank prints the message (`polyrl: <message>`);
    in a multi-rank run one rank does."""

    def __init__(self, message: str, signum: int | None = None, exit_code: int | None = None, report: bool = True):
        super().__init__(message)
        self.exit_code = exit_code if exit_code is not None else 128 + (signum or 0)
        self.report = report


class RankStopped(RunStopped):
    """A rank of a multi-rank run that stops without a word: another rank prints why (trainer/stopping.py)."""

    def __init__(self, exit_code: int):
        super().__init__("", exit_code=exit_code, report=False)
