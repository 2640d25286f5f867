"""`polyrl pretrain-toy --task rewrite`: the toy prompt rewriter, a tiny Qwen3-class causal LM (`recipe=toy_rewriter`).

Supervised next-token training on (request -> rewrite) pairs: each request is a prompt of `shapes_train.jsonl`
(never a held-out one), wrapped in the ChatML template as one user message; its target is a fresh rewrite of
`polyrl.toy.rewrite_task.rewrite` (a chatty, careless annotator: polite openings the generator does not know,
relations replaced by "and", reorderings, dropped plurals, wrong colours), then EOS; the loss is on the target.
The base model so writes rewrites of mixed quality when sampled, and mostly careless ones when decoding greedily;
GRPO through the frozen `toy_shapes` generator (`polyrl train recipe=toy_rewriter`) has that to learn.

The result is a transformers directory (`Qwen3ForCausalLM` + a word-level tokenizer with the ChatML template) with
`pretrain.json` beside it: budget, losses, and on the first `eval_samples` held-out requests the `shapes` reward of
the generator's images of (a) the requests themselves, (b) the base rewriter's greedy rewrites, (c) its sampled
rewrites (temperature 1), rendered as `reward=rewrite_render` renders them.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

from ...models.tiny_lm import CHATML_TEMPLATE, TinyLMSpec, build_tiny_causal_lm, word_tokenizer
from .. import rewrite_task
from ..shapes_task import ShapesSpec
from .loops import sft_batch, train_sft

REWRITE_SPEC = TinyLMSpec(hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, intermediate=384, max_positions=64)
# the generator's render of a rewrite: the recipe's reward.rollout (config/recipe/toy_rewriter.yaml)
RENDER = {"height": 64, "width": 64, "num_steps": 10, "batch_size": 64}


def _load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _examples(tokenizer, requests: list[str], targets: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, loss mask) right-padded: the chat-templated request, the rewrite, EOS; loss on the
    rewrite and EOS."""
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": r}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False).input_ids
               for r in requests]
    answers = [tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for t in targets]
    return sft_batch(prompts, answers, tokenizer.pad_token_id)


def rewrite_rewards(path: str | Path, prompts_file: str | Path, n: int = 64, device: str = "cpu",
                    seed: int = 0, render: dict | None = None) -> dict:
    """On the first n requests of `prompts_file`: the mean `shapes` reward of the generator's renders of the requests
    themselves (`requests`), of the rewriter's greedy rewrites (`greedy`) and of its sampled ones (temperature 1,
    uniforms from `seed`: `sampled`), plus the share of greedy rewrites that open with a filler word and 8 examples.
    `render`: the generator's `reward.rollout` keys (default `RENDER`, the recipe's)."""
    from ...config import ASSETS
    from ...data.prompts import load_prompts, split_row
    from ...models.causal_lm import CausalLMPolicy
    from ...rewards import build_reward
    from ...sampling.tokens import TokenPlan, draw_uniforms, token_rollout

    adapter = CausalLMPolicy(SimpleNamespace(path=str(path), dtype="float32", max_sequence_length=64),
                             torch.device(device))
    render = build_reward({"name": "rewrite_render", "generator": {"name": "sd3", "path": str(ASSETS / "toy_shapes")},
                           "scorer": {"name": "shapes"}, "rollout": render or RENDER, "device": device})
    rows = load_prompts(prompts_file)[:n]
    prompts, meta = (list(x) for x in zip(*(split_row(r) for r in rows), strict=True))
    out = {"requests": render(prompts, prompts, meta).scores.mean().item()}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        plan = TokenPlan(max_new_tokens=16, temperature=temperature, batch_size=256)
        with torch.no_grad():
            batch = token_rollout(adapter, prompts, meta, torch.arange(len(rows)), plan,
                                  draw_uniforms(len(rows), plan, torch.Generator().manual_seed(seed)))
        texts = batch.media["text"]
        out[name] = render(texts, prompts, meta).scores.mean().item()
        if name == "greedy":
            out["greedy_filler_share"] = sum(t.split()[:1] == ["please"] for t in texts) / len(texts)
            out["greedy_examples"] = [{"request": p, "rewrite": t} for p, t in zip(prompts[:8], texts[:8], strict=True)]
    return out


def pretrain_rewrite(out: str | Path, steps: int = 800, batch: int = 64, lr: float = 1e-3, seed: int = 0,
                     prompts_dir: str | Path | None = None, device: str = "cpu", eval_samples: int = 64) -> Path:
    from ...config import ASSETS

    prompts_dir = Path(prompts_dir or ASSETS / "prompts")
    train_rows = _load_rows(prompts_dir / "shapes_train.jsonl")
    heldout_file = prompts_dir / "shapes_heldout.jsonl"
    heldout = {r["prompt"] for r in _load_rows(heldout_file)}
    specs = [ShapesSpec.from_metadata(r) for r in train_rows if r["prompt"] not in heldout]  # never a held-out one
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = word_tokenizer(rewrite_task.vocabulary(), chat_template=CHATML_TEMPLATE)
    model = build_tiny_causal_lm(tokenizer, REWRITE_SPEC, seed).to(device).train()

    def next_batch():
        picked = [rng.choice(specs) for _ in range(batch)]
        return [t.to(device) for t in _examples(tokenizer, [s.text() for s in picked],
                                                [rewrite_task.rewrite(s, rng) for s in picked])]

    t0 = time.time()
    losses = train_sft(model, next_batch, steps, lr, lambda i: min(1.0, (i + 1) / 50) * max(0.1, 1 - i / steps),
                       "rewrite", progress=sys.stderr.isatty())
    seconds = time.time() - t0
    out = Path(out)
    model.eval().to("cpu").save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    rewards = rewrite_rewards(out, heldout_file, eval_samples, device) if eval_samples > 0 else None
    tail = losses[-50:]
    curve_every = max(1, steps // 8)
    (out / "pretrain.json").write_text(json.dumps({
        "task": "rewrite", "command": "polyrl pretrain-toy --task rewrite " + " ".join(
            f"--{k} {v}" for k, v in (("steps", steps), ("batch", batch), ("seed", seed))),
        "spec": REWRITE_SPEC.__dict__, "steps": steps, "batch": batch, "lr": lr, "seed": seed,
        "rates": {"filler": rewrite_task.P_FILLER, "and_relation": rewrite_task.P_AND,
                  "reorder": rewrite_task.P_REORDER, "singular": rewrite_task.P_SINGULAR,
                  "recolor": rewrite_task.P_RECOLOR},
        "loss_final": round(sum(tail) / len(tail), 4),
        "loss_curve": [round(sum(losses[i : i + curve_every]) / len(losses[i : i + curve_every]), 4)
                       for i in range(0, steps, curve_every)],
        "eval_samples": eval_samples,
        "heldout_shapes_reward": None if rewards is None else {k: v if isinstance(v, list) else round(v, 4)
                                                               for k, v in rewards.items()},
        "seconds": round(seconds, 1), "torch": torch.__version__, "device": str(device),
    }, indent=2))
    if rewards is not None:
        tqdm.write(f"held-out shapes reward ({eval_samples} requests): requests {rewards['requests']:.3f}, "
                   f"greedy rewrites {rewards['greedy']:.3f}, sampled rewrites {rewards['sampled']:.3f}")
    return out
