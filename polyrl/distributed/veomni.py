"""`actor.backend=veomni`: the fsdp2 backend (distributed/fsdp2.py, actor/fsdp2.py) with its parallel state and its
FSDP2 wrapping taken from VeOmni (ByteDance-Seed/VeOmni): `init_parallel_state` builds the device mesh,
`build_parallelize_model` applies `fully_shard` per block and at the root. Everything else (micro-batch lockstep,
clipping over shards, the `old` policy swap, sharded checkpoints) is the fsdp2 backend's.

Only data-parallel sharding is wired (parallel.dp_shard, parallel.dp_replicate; refused at world size 1, where
VeOmni's parallelizer does nothing): the config check refuses parallel.sp / parallel.tp with this backend.

VeOmni is imported only here, and only when actor.backend=veomni: VeOmni 0.1.12 fails to import with
transformers >= 5.23, so it lives in its own environment (scripts/ci_veomni.sh builds one; docs/distributed.md).
"""

from __future__ import annotations

import torch

from ..errors import UserError
from .dims import ParallelDims
from .fsdp2 import FSDP2Engine, blocks_of, reduce_by_sum

VEOMNI_VERSION = "0.1.12"
TRANSFORMERS_RANGE = ">=5.9.0,<5.23"
INSTALL = (f'pip install "transformers{TRANSFORMERS_RANGE}" "datasets>=2.16" "torchdata<1.0" psutil && '
           f"pip install --no-deps veomni=={VEOMNI_VERSION}")


def require_veomni() -> None:
    """Import the VeOmni modules this backend calls, or raise UserError with one line naming the install."""
    import importlib.util
    import os

    # VeOmni patches transformers' attention registry at import unless told to leave transformers as it is: polyrl
    # uses its parallelizer only
    os.environ.setdefault("MODELING_BACKEND", "hf")
    if importlib.util.find_spec("veomni") is None:
        reason = "veomni is not installed"
    else:
        try:
            import veomni.arguments  # noqa: F401
            import veomni.distributed.parallel_state  # noqa: F401
            import veomni.distributed.torch_parallelize  # noqa: F401

            return
        except Exception as e:  # an ImportError with transformers >= 5.23; anything else a broken install
            import transformers

            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            reason = f"import veomni failed with transformers {transformers.__version__}: {first}"
    raise UserError(f"actor.backend=veomni needs VeOmni {VEOMNI_VERSION} with transformers{TRANSFORMERS_RANGE}, "
                    f"best in its own environment ({reason}) ({INSTALL}; see docs/distributed.md)")


class VeOmniEngine(FSDP2Engine):
    """`FSDP2Engine` on VeOmni's parallel state: its device mesh gives the FSDP mesh and the data-parallel group."""

    def _build_meshes(self, dims: ParallelDims) -> None:
        from veomni.distributed.parallel_state import init_parallel_state, set_parallel_state

        # name=None: not registered under VeOmni's "base" (a second run in this process builds its own layout)
        self.veomni_state = init_parallel_state(dp_size=dims.dp, dp_replicate_size=dims.dp_replicate,
                                                dp_shard_size=dims.dp_shard, device_type=self.device.type,
                                                dp_mode="fsdp2", name=None)
        set_parallel_state(self.veomni_state)  # what VeOmni's parallelizer reads
        self.fsdp_mesh = self.veomni_state.fsdp_mesh
        self.dp_mesh = self.veomni_state.dp_mesh
        self.dp_group = self.dp_mesh.get_group()
        self.sp_group = self.tp_mesh = self.replica_group = None  # sp = tp = 1 (distributed/plan.py)


def parallelize_with_veomni(network: torch.nn.Module, plan: dict | None, engine: VeOmniEngine,
                            param_dtype: torch.dtype) -> list[torch.nn.Module]:
    """`fully_shard` on `network`'s blocks and root by VeOmni's `build_parallelize_model`, in place, keeping its
    values. VeOmni shards a network built on the meta device and then materializes it, so the parameters move to
    meta first (their values held aside) and are cut into this rank's shards afterwards. Returns [] (no tp)."""
    from veomni.arguments import MixedPrecisionConfig
    from veomni.distributed.parallel_state import use_parallel_state
    from veomni.distributed.torch_parallelize import build_parallelize_model

    from .dcp import shard_like

    blocks = sorted({type(b).__name__ for b in blocks_of(network, plan)})
    values = {n: t.detach() for n, t in network.named_parameters(remove_duplicate=False)}
    values.update({n: t.detach() for n, t in network.named_buffers(remove_duplicate=False)})
    _parameters_to_meta(network)
    if param_dtype in (torch.float32, torch.float64):  # full precision: VeOmni keeps the network's own dtype
        precision = MixedPrecisionConfig(enable=False)
    else:  # VeOmni then keeps every shard in float32 and gathers in param_dtype, reducing in float32
        precision = MixedPrecisionConfig(enable=True, param_dtype=str(param_dtype).removeprefix("torch."),
                                         reduce_dtype="float32")
    had_init = "init_weights" in network.__dict__
    # VeOmni materializes and then calls `init_weights()` (a transformers method): the values are copied in below
    network.init_weights = lambda *args, **kwargs: None
    try:
        with use_parallel_state(engine.veomni_state):
            wrapped = build_parallelize_model(
                network, weights_path=None, init_device="meta", mixed_precision=precision,
                enable_gradient_checkpointing=False,  # set up already by the actor (activation checkpointing)
                enable_reshard_after_forward=engine.fsdp_mesh.size() > 1, basic_modules=blocks)
    finally:
        if not had_init:
            del network.init_weights
    if wrapped is not network:
        raise RuntimeError(f"VeOmni returned a new module ({type(wrapped).__name__}); polyrl shards in place")
    with torch.no_grad():
        for name, t in [*network.named_parameters(remove_duplicate=False),
                        *network.named_buffers(remove_duplicate=False)]:
            t.copy_(shard_like(values[name], t))
    reduce_by_sum(network)  # VeOmni's FSDP units average over ranks; the actor's losses want a plain sum
    return []


def _parameters_to_meta(network: torch.nn.Module) -> None:
    """Every parameter replaced by a meta one of the same shape, dtype and requires_grad (tied ones stay tied)."""
    moved: dict[int, torch.nn.Parameter] = {}
    for module in network.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in moved:
                moved[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            module._parameters[name] = moved[id(p)]
