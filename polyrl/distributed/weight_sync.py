"""Weight sync from the actor to a rollout replica in another process: what moves, and proof that it landed.

A payload is the actor's tensors by name (`<network>.<state-dict key>`, e.g.
`transformer.transformer_blocks.0.attn.to_q.lora_A.default.weight`), the update count they come from (`version`)
and a checksum. A replica's first payload, and its first after a restart, is *full*: every tensor of every
network (frozen base weights included, so a replica never depends on having loaded the same checkpoint). After
that only the trainable tensors move (`trainable` names: the LoRA tensors of a LoRA run).

The receiver refuses a sync that does not land (verl-omni#552: after an engine upgrade an adapter silently bound
to zero modules and the reward stayed flat):
  * every name must resolve to a tensor of the replica's live networks (none left over, for a full sync);
  * after the copy it reads the tensors back from the networks, looked up afresh, and their checksum must equal
    the checksum of what was sent (cast to each destination's dtype);
  * a partial payload before any full one is refused (`NeedsFullSync`: the sender then sends a full one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

CHECKSUM_PERIOD = 97  # position weights 1..97: a permuted or transposed tensor changes the checksum


class WeightSyncError(RuntimeError):
    """A weight sync that did not land in the rollout replica's networks; the run stops (never samples from
    weights it did not receive)."""


class NeedsFullSync(WeightSyncError):
    """A partial (trainable-only) payload reached a replica that has no full one (a fresh or restarted replica)."""


def tensor_checksum(t: torch.Tensor) -> float:
    """Σ_i x_i · (1 + i mod 97) over the flattened tensor, in float64 on the tensor's own device."""
    flat = t.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64).remainder_(CHECKSUM_PERIOD).add_(1)
    return float((flat * weights).sum())


def checksum(tensors: dict[str, torch.Tensor]) -> float:
    """Σ over names (sorted) of `tensor_checksum`."""
    return sum(tensor_checksum(tensors[name]) for name in sorted(tensors))


def same_checksum(a: float, b: float, scale: float) -> bool:
    """Equal up to float64 summation order on another device (rtol 1e-9 of the sum of magnitudes `scale`)."""
    return abs(a - b) <= 1e-9 * (scale + 1.0)


def live_tensors(networks: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of the networks, by `<network>.<state-dict key>`: the live tensors
    (not copies), so a copy into one changes what the network computes."""
    return {f"{name}.{key}": value for name, network in networks.items()
            for key, value in network.state_dict(keep_vars=True).items()}


@dataclass
class WeightPayload:
    version: int  # the actor's update count these weights come from
    full: bool  # every tensor of every network, or the trainable ones only
    tensors: dict[str, torch.Tensor]  # on the CPU
    checksum: float

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def make_payload(networks: dict[str, torch.nn.Module], version: int, trainable: list[str] | None = None) -> WeightPayload:
    """The networks' tensors as they are now (CPU copies): all of them (`trainable` None: a full payload), or the
    named ones."""
    live = live_tensors(networks)
    if trainable is not None:
        missing = [n for n in trainable if n not in live]
        if missing:
            raise WeightSyncError(f"trainable tensors not in the actor's networks: {missing[:3]}")
        live = {n: live[n] for n in trainable}
    if not live:
        raise WeightSyncError("a weight sync with no tensors")
    tensors = {n: t.detach().to("cpu", copy=True) for n, t in live.items()}
    return WeightPayload(version, trainable is None, tensors, checksum(tensors))


class WeightReceiver:
    """The replica side: `apply(payload)` copies into the networks that `networks()` returns *now*, then checks."""

    def __init__(self, networks: Callable[[], dict[str, torch.nn.Module]]):
        self.networks = networks
        self.version: int | None = None  # None until a full payload has landed

    @torch.no_grad()
    def apply(self, payload: WeightPayload) -> dict:
        """Bind, copy, verify. Returns {"version", "bound", "bytes", "checksum"}; raises WeightSyncError."""
        sent = payload.tensors
        if not sent:
            raise WeightSyncError("weight sync: an empty payload")
        got = checksum(sent)
        if not same_checksum(got, payload.checksum, _magnitude(sent)):
            raise WeightSyncError(f"weight sync: the payload was damaged in transit (checksum {got!r}, sent "
                                  f"{payload.checksum!r})")
        if not payload.full and self.version is None:
            raise NeedsFullSync("weight sync: a partial payload before any full one (a fresh or restarted replica)")
        live = live_tensors(self.networks())
        unbound = [n for n in sent if n not in live]
        if unbound:
            raise WeightSyncError(
                f"weight sync bound {len(sent) - len(unbound)} of {len(sent)} tensors: {len(unbound)} name(s) are not "
                f"in the rollout replica's networks, e.g. {unbound[:3]} (replica tensors: {sorted(live)[:3]} …); the "
                "replica was built differently from the actor (LoRA targets, model version)")
        if payload.full:
            left = sorted(set(live) - set(sent))
            if left:
                raise WeightSyncError(f"weight sync: a full payload left {len(left)} replica tensor(s) unset, e.g. "
                                      f"{left[:3]}; the replica has networks or adapters the actor does not")
        for name, value in sent.items():
            dest = live[name]
            if dest.shape != value.shape:
                raise WeightSyncError(f"weight sync: {name} is {tuple(value.shape)} in the actor but "
                                      f"{tuple(dest.shape)} in the replica")
            if payload.full:  # adopt the actor's dtype too (trainable weights are float32 master copies)
                dest.data = value.to(dest.device, copy=True)
            else:
                dest.copy_(value)
        # read back through a fresh lookup: a copy into tensors the networks no longer use shows up here
        now = live_tensors(self.networks())
        if any(n not in now for n in sent):
            raise WeightSyncError("weight sync: the replica's networks changed while the weights were copied")
        landed = {n: now[n] for n in sent}
        expected = checksum({n: sent[n].to(landed[n].dtype) for n in sent})
        actual = checksum(landed)
        if not same_checksum(actual, expected, _magnitude(landed)):
            raise WeightSyncError(f"weight sync checksum mismatch: the replica's networks hold {actual!r} after the "
                                  f"copy, the actor sent {expected!r}: the weights bound to tensors the model does "
                                  "not use")
        self.version = payload.version
        return {"version": payload.version, "bound": len(sent), "bytes": payload.nbytes, "checksum": actual}


def _magnitude(tensors: dict[str, torch.Tensor]) -> float:
    return sum(float(t.detach().abs().to(torch.float64).sum()) * CHECKSUM_PERIOD for t in tensors.values())
