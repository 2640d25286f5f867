"""`trainer.deterministic=true`: deterministic kernels where torch has them, and every op that has none named.

torch.use_deterministic_algorithms(True, warn_only=True) picks the deterministic kernel of every op that has one
(index / scatter backward, cuBLAS with a fixed workspace, cuDNN without autotuning) and warns, instead of raising,
at an op that has none. Such an op is named once, when the run first reaches it (on a GPU that is the first step's
rollout or update), as one `polyrl: warning:` line: the run goes on, but its results are then not bit-identical
from run to run. The alternative, raising, would stop a run after its first rollout for an op the user may accept.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable

import torch

CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS reuses one fixed workspace: its reductions no longer depend on the stream's
_NO_KERNEL = re.compile(r"^(.*?) does not have a deterministic implementation")


def settings() -> str:
    """What deterministic mode sets, as one line for the run's start."""
    return (f"torch.use_deterministic_algorithms(True, warn_only=True), CUBLAS_WORKSPACE_CONFIG="
            f"{os.environ.get('CUBLAS_WORKSPACE_CONFIG', CUBLAS_WORKSPACE)}, cudnn.benchmark=False, "
            f"cudnn.deterministic=True")


class _NameOps:
    """A `warnings.showwarning` that turns torch's "<op> does not have a deterministic implementation" warning into
    one line per op (through `say`) and passes every other warning on."""

    def __init__(self, say: Callable[[str], None], previous):
        self.say, self.previous, self.named = say, previous, set()

    def __call__(self, message, category, filename, lineno, file=None, line=None):
        m = _NO_KERNEL.match(str(message))
        if m is None:
            return self.previous(message, category, filename, lineno, file, line)
        op = m.group(1)
        if op not in self.named:
            self.named.add(op)
            self.say(f"polyrl: warning: trainer.deterministic=true, but {op} has no deterministic kernel: this run "
                     "is not bit-identical to another where it runs")
        return None


def set_determinism(deterministic: bool, say: Callable[[str], None] | None = None) -> None:
    """Deterministic kernels (see the module docstring); `say` receives the line naming each op without one."""
    if not deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    if say is not None:
        current = warnings.showwarning
        if isinstance(current, _NameOps):  # a second run in the same process: one hook, the newest `say`
            current.say = say
        else:
            warnings.showwarning = _NameOps(say, current)
        # torch warns through Python's warnings; "always" so that a second op from the same call site is named too
        warnings.filterwarnings("always", message=".*does not have a deterministic implementation")
