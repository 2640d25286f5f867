"""Offline preference pairs of text responses for token-policy DPO / IPO (docs/tokens.md), from JSONL or parquet.

Format: one pair per line (JSONL) or row (parquet) with three non-empty strings

    {"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5. The answer is 5.", "rejected": "The answer is 6."}

Other fields are kept as metadata. Like `pairs.py` (image pairs), every row is checked before training starts and
all bad rows are reported at once by line number (JSONL lines and parquet rows both numbered from 1).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..batch import Rollout, TokenBatch
from ..sampling.tokens import pad_left, pad_right
from .pairs import PAIR_FIELDS, PAIR_FORMATS, checked_rows, pair_fields


def load_text_pairs(path: str | Path) -> list[dict]:
    """Rows {prompt, chosen, rejected, line, ...metadata}; ValueError listing every bad row."""
    return checked_rows(Path(path), pair_fields)


@torch.no_grad()
def token_pair_batch(adapter, rows: list[dict]) -> Rollout:
    """Offline DPO pairs -> a batch: the chosen responses in `tokens`, the rejected ones in
    `extras["rejected_tokens"]`, both ending with EOS as generated responses do."""
    prompts = [r["prompt"] for r in rows]
    prompt_ids, cond = adapter.encode_prompts(prompts)
    pad = adapter.pad_token_id
    chosen = adapter.encode_responses([r["chosen"] for r in rows])
    rejected = adapter.encode_responses([r["rejected"] for r in rows])
    width = max(len(s) for s in chosen + rejected)
    p_ids, p_mask = pad_left(prompt_ids, pad)
    b = len(rows)

    def tokens(responses: list[list[int]]) -> TokenBatch:
        ids, mask = pad_right(responses, pad, width)
        return TokenBatch(p_ids, p_mask, ids, mask, pad)

    return Rollout(
        prompts=prompts, metadata=[{k: v for k, v in r.items() if k not in PAIR_FIELDS} for r in rows],
        group_ids=torch.arange(b), cond={k: v.cpu() for k, v in cond.items()}, shared={}, latents={},
        log_probs=torch.zeros(b, width), sigmas=torch.zeros(b, 0), noise_levels=torch.zeros(b, 0), final={},
        tokens=tokens(chosen), extras={"rejected_tokens": tokens(rejected)},
    )


@PAIR_FORMATS.register("tokens")
class TextPairs:
    """The offline pair format of token policies."""

    def __init__(self, rollout_cfg):
        pass

    load = staticmethod(load_text_pairs)

    def batch(self, adapter, rows: list[dict]) -> Rollout:
        return token_pair_batch(adapter, rows)
