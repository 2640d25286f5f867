"""Random numbers keyed by what they are for, never by the layout that draws them (docs/algorithms.md §7).

An update's loss terms draw forward-process times, noise and per-sample choices. Each draw comes from a generator
seeded by a key of (the update, a purpose, the sample's place in the step's global batch, the loss term), so one
process, N data-parallel ranks, sequence-parallel groups and any micro-batch split draw the same numbers for the
same sample, and a resumed run draws what the uninterrupted one did. "The next numbers of one generator" would
instead hand the same values to different samples on different ranks (their gradient noise correlates) and give a
sample other values when the micro-batch size changes.
"""

from __future__ import annotations

import zlib

import torch

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of SplitMix64 (Steele et al. 2014): a bijective 64-bit mix, so nearby keys give unrelated seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def purpose_id(purpose: str) -> int:
    """A stable integer for a draw's purpose (Python's str hash changes between processes; CRC-32 does not)."""
    return zlib.crc32(purpose.encode())


def key_seed(*parts: int) -> int:
    """A 63-bit seed from a sequence of integers; every part changes it, in order."""
    h = 0
    for part in parts:
        h = _splitmix64(h ^ (int(part) & _MASK))
    return h >> 1


def keyed_generator(*parts: int) -> torch.Generator:
    """A fresh CPU generator seeded by `key_seed(parts)`."""
    return torch.Generator().manual_seed(key_seed(*parts))


class UpdateDraws:
    """The random numbers of one update, each from a generator keyed by (update key, purpose, index, term).

    `key` identifies the update (the step's update generator's seed: a function of trainer.seed and the step);
    `index` is a sample's place in the step's global training batch (`Rollout.sample_index`), or a prompt group's
    id for numbers a group shares. Every draw is made on the CPU in float32, so a run draws the same numbers on any
    device; callers move them where they are needed.
    """

    def __init__(self, key: int):
        self.key = int(key)

    def generator(self, purpose: str, index: int = 0, term: int = 0) -> torch.Generator:
        return keyed_generator(self.key, purpose_id(purpose), index, term)

    def uniform(self, purpose: str, index: torch.Tensor, term: int = 0) -> torch.Tensor:
        """(B,) float32 U[0, 1), one per index."""
        return torch.stack([torch.rand((), generator=self.generator(purpose, i, term))
                            for i in index.tolist()]) if len(index) else torch.zeros(0)

    def normal(self, purpose: str, index: torch.Tensor, shapes: dict[str, tuple[int, ...]],
               term: int = 0) -> dict[str, torch.Tensor]:
        """{name: (B, *shape)} float32 N(0, 1): each index's generator draws its entries in `shapes`' order."""
        out = {name: torch.empty((len(index), *shape)) for name, shape in shapes.items()}
        for row, i in enumerate(index.tolist()):
            g = self.generator(purpose, i, term)
            for name, shape in shapes.items():
                out[name][row] = torch.randn(shape, generator=g)
        return out

    def permutation(self, purpose: str, index: torch.Tensor, n: int) -> torch.Tensor:
        """(B, n) long: a random permutation of range(n) per index (the same for every term)."""
        if not len(index):
            return torch.zeros((0, n), dtype=torch.long)
        return torch.stack([torch.randperm(n, generator=self.generator(purpose, i)) for i in index.tolist()])

    def shared_uniform(self, purpose: str, term: int = 0) -> float:
        """One U[0, 1) for the whole update (e.g. a loss term's σ that every sample shares)."""
        return float(torch.rand((), generator=self.generator(purpose, -1, term)))
