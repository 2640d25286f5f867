"""actor.backend=fsdp2 hands every block the inputs the plain network hands it, in the forward and in the
activation-checkpointing recompute alike.

FSDP2's default mixed-precision policy casts a sharded module's floating inputs to the gathered weights' dtype
before its forward; torch < 2.13 skipped that cast before the recompute in the backward, so a side input made
inside the network in float32 (Wan's rotary table, its per-token time embedding) reached a block in bfloat16 in the
forward and in float32 in the recompute, and torch stopped the backward with a CheckpointError (seen on an H200,
torch 2.11, Wan2.2-TI2V-5B at parallel.sp=2 with activation checkpointing). The policy now leaves inputs alone.
"""

from __future__ import annotations

import subprocess
import sys

WORLD_ONE = r'''
import torch
from torch.utils.checkpoint import checkpoint
from polyrl.distributed.dims import ParallelDims
from polyrl.distributed.fsdp2 import FSDP2Engine, parallelize

seen = []

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, table):
        seen.append((x.dtype, table.dtype))
        return self.linear(x) * table

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        table = torch.linspace(0.5, 1.5, 8)  # made inside the network, float32 (a rotary table)
        for block in self.blocks:
            x = checkpoint(block.__call__, x, table, use_reentrant=False)
        return x

def run(sharded):
    seen.clear()
    torch.manual_seed(0)
    net = Net()
    if sharded:
        parallelize(net, {"blocks": "blocks"}, engine, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(torch.randn(2, 8, requires_grad=True)).float().sum().backward()
    return list(seen)

engine = FSDP2Engine("cpu", ParallelDims())
plain, sharded = run(False), run(True)
engine.close()
print("PLAIN", plain)
print("SHARDED", sharded)
assert len(sharded) == 4, sharded  # 2 blocks: forward + recompute each
assert sharded == plain, (plain, sharded)
'''


def test_fsdp2_blocks_get_the_plain_networks_inputs_in_forward_and_recompute():
    out = subprocess.run([sys.executable, "-c", WORLD_ONE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    assert "PLAIN [(torch.float32, torch.float32)" in out.stdout
