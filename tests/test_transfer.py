"""Host copies (polyrl/perf/transfer.py)."""

from __future__ import annotations

import torch

from polyrl.perf.transfer import to_host


def test_host_copies_are_copies_through_dicts_and_tuples():
    """to_host (the rollout's conditioning on its way to the host; host_copy alone: the pre-update snapshot):
    every tensor copied, none aliased, the structure kept (on a GPU the same call queues pinned copies)."""
    a, b = torch.arange(6.0).view(2, 3), torch.ones(2, dtype=torch.long)
    out = to_host({"a": a, "pair": (a, b)}, pinned=False)
    assert set(out) == {"a", "pair"} and isinstance(out["pair"], tuple)
    for copy_, orig in ((out["a"], a), (out["pair"][0], a), (out["pair"][1], b)):
        assert torch.equal(copy_, orig) and copy_.dtype == orig.dtype and copy_.data_ptr() != orig.data_ptr()
