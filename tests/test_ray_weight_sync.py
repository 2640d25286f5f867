"""Weight sync to rollout replicas (distributed/weight_sync.py) and the Ray launcher's config, without Ray: a full
sync then trainable-only syncs make the replica equal the actor; a sync that does not bind is an error that names
the tensors; the default path never imports Ray."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model

from polyrl.config import load_config
from polyrl.config.schema import ConfigError
from polyrl.distributed.weight_sync import (
    NeedsFullSync,
    WeightReceiver,
    WeightSyncError,
    checksum,
    make_payload,
    tensor_checksum,
)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = torch.nn.Linear(6, 6)
        self.to_k = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.register_buffer("scale", torch.ones(6))

    def forward(self, x):
        return self.norm(self.to_q(x) + self.to_k(x)) * self.scale


def lora_net(seed: int, targets=("to_q", "to_k")) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = Net()
    if targets:
        inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=list(targets), init_lora_weights="gaussian"),
                                net)
    return net


def trainable(networks: dict) -> list[str]:
    return [f"{name}.{n}" for name, net in networks.items() for n, p in net.named_parameters() if "lora_" in n]


def test_full_sync_then_lora_only_makes_the_replica_equal_the_actor():
    actor, replica = {"transformer": lora_net(0)}, {"transformer": lora_net(1)}
    receiver = WeightReceiver(lambda: replica)
    x = torch.randn(3, 6)
    assert not torch.allclose(actor["transformer"](x), replica["transformer"](x))

    full = make_payload(actor, version=0)
    report = receiver.apply(full)
    assert full.full and report["bound"] == len(actor["transformer"].state_dict()) == 11 and receiver.version == 0
    torch.testing.assert_close(replica["transformer"](x), actor["transformer"](x), rtol=0, atol=0)

    with torch.no_grad():  # an update moves the LoRA weights only
        for n, p in actor["transformer"].named_parameters():
            if "lora_" in n:
                p.add_(torch.randn_like(p))
    delta = make_payload(actor, version=1, trainable=trainable(actor))
    assert not delta.full and sorted(delta.tensors) == sorted(trainable(actor)) and len(delta.tensors) == 4
    assert delta.nbytes < full.nbytes / 2
    assert receiver.apply(delta)["version"] == 1
    torch.testing.assert_close(replica["transformer"](x), actor["transformer"](x), rtol=0, atol=0)


def test_a_partial_sync_before_a_full_one_is_refused():
    actor = {"transformer": lora_net(0)}
    with pytest.raises(NeedsFullSync, match="partial payload before any full one"):
        WeightReceiver(lambda: {"transformer": lora_net(1)}).apply(make_payload(actor, 3, trainable(actor)))


def test_a_sync_that_binds_to_nothing_fails_loudly():
    actor = {"transformer": lora_net(0)}
    # a replica built without the adapter: the LoRA tensors have nowhere to go
    bare = {"transformer": lora_net(1, targets=())}
    with pytest.raises(WeightSyncError, match=r"bound 0 of 4 tensors: 4 name\(s\) are not in the rollout replica"):
        receiver = WeightReceiver(lambda: bare)
        receiver.version = 0  # as if the base had been synced before
        receiver.apply(make_payload(actor, 1, trainable(actor)))
    with pytest.raises(WeightSyncError, match=r"bound 3 of 11 tensors.*lora_A"):
        WeightReceiver(lambda: bare).apply(make_payload(actor, 0))
    # a replica whose networks are rebuilt on every lookup: the copy lands in tensors the model does not use
    replica = lora_net(1)
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        WeightReceiver(lambda: {"transformer": copy.deepcopy(replica)}).apply(make_payload(actor, 0))
    # a replica with an adapter the actor does not have
    extra = {"transformer": lora_net(1, targets=("to_q", "to_k"))}
    with pytest.warns(UserWarning, match="multiple adapters"):
        inject_adapter_in_model(LoraConfig(r=2, target_modules=["to_q"]), extra["transformer"], adapter_name="other")
    with pytest.raises(WeightSyncError, match=r"left 2 replica tensor\(s\) unset.*other"):
        WeightReceiver(lambda: extra).apply(make_payload(actor, 0))


def test_a_damaged_payload_is_refused():
    actor = {"transformer": lora_net(0)}
    payload = make_payload(actor, 0)
    next(iter(payload.tensors.values()))[0] += 1.0
    with pytest.raises(WeightSyncError, match="damaged in transit"):
        WeightReceiver(lambda: {"transformer": lora_net(1)}).apply(payload)


def test_checksum_is_the_position_weighted_sum():
    t = torch.randn(5, 7, dtype=torch.float32)
    flat = t.double().reshape(-1).tolist()
    expected = sum(x * (1 + i % 97) for i, x in enumerate(flat))
    assert tensor_checksum(t) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    square = torch.randn(4, 4)
    assert tensor_checksum(square) != pytest.approx(tensor_checksum(square.T), rel=1e-6)  # a transposed bind
    assert checksum({"a": t, "b": square}) == pytest.approx(tensor_checksum(t) + tensor_checksum(square))


def test_the_default_path_never_imports_ray():
    code = ("import sys, polyrl.trainer.loop, polyrl.cli.main, polyrl.distributed.weight_sync; "
            "from polyrl.config import load_config; load_config([]); "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("overrides, message", [
    (["rollout.workers=2"], "rollout.workers=2 is a pool of Ray workers: set trainer.launcher=ray"),
    (["trainer.launcher=ray", "rollout.max_staleness=1"], "rollout.max_staleness=1 overlaps the rollout with the "
                                                          "update, which needs a separate rollout pool"),
    (["trainer.launcher=slurm"], "trainer.launcher='slurm' is not valid; allowed: local, ray"),
    (["trainer.launcher=ray", "ray.reward_workers=-1"], "ray.reward_workers=-1 must be >= 0"),
    (["ray.adress=auto"], "unknown key ray.adress; allowed: address, max_restarts"),
])
def test_launcher_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(overrides)


def test_rollout_correction_defaults_to_decoupled_when_the_rollout_may_be_stale():
    pytest.importorskip("ray")
    assert load_config([]).rollout_correction.mode == "bypass"
    stale = ["trainer.launcher=ray", "rollout.workers=1", "rollout.max_staleness=1"]
    flow_grpo = ["recipe=toy_flow_grpo", *stale]  # an algorithm with log-probabilities
    assert load_config(flow_grpo).rollout_correction.mode == "decoupled"
    assert load_config(flow_grpo + ["rollout_correction.mode=bypass"]).rollout_correction.mode == "bypass"
    # a likelihood-free algorithm (the default recipe's DiffusionNFT) has no log-probabilities to correct
    assert load_config(stale).rollout_correction.mode == "bypass"
    assert load_config(stale + ["recipe=toy_diffusion_nft"]).rollout_correction.mode == "bypass"
