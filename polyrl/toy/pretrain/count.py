"""`polyrl pretrain-toy --task count`: the toy text model, a tiny Qwen3-class causal LM that counts shapes.

Supervised next-token training on scenes of `polyrl.toy.count_task` (never a held-out one): the loss is on the
answer tokens (the number and EOS) after the raw prompt. The answers come from careless annotators: a share
`careless` (0.6) of them counts the matching *groups* instead of the objects ("two red circles" counted as one),
so the base model often answers the group count when the two differ, and samples the right count less often.
GRPO against the true count (`polyrl train recipe=toy_count`) has that to learn; the model is also trained briefly
(600 steps), so its counting itself is imperfect. The result is a transformers
directory (`Qwen3ForCausalLM` + a word-level tokenizer built offline) that `model=causal_lm` loads like any checkpoint,
with `pretrain.json` beside it (budget, losses, held-out accuracy).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

from ...models.tiny_lm import TinyLMSpec, build_tiny_causal_lm, word_tokenizer
from .. import count_task
from .loops import sft_batch, train_sft

COUNT_SPEC = TinyLMSpec(hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, intermediate=384, max_positions=64)


def _examples(tokenizer, scenes: list, answers: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, loss mask) right-padded: prompt tokens, answer tokens, EOS; loss on answer and EOS."""
    prompts = [tokenizer(s.text(), add_special_tokens=False).input_ids for s in scenes]
    targets = [tokenizer(str(a), add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for a in answers]
    return sft_batch(prompts, targets, tokenizer.pad_token_id)


def heldout_accuracy(path: str | Path, prompts_file: str | Path, n: int = 256, device: str = "cpu") -> float:
    """Greedy-decoding accuracy (`math_answer`) on the first n prompts of `prompts_file`, through `model=causal_lm`."""
    from ...data.prompts import load_prompts, split_row
    from ...models.causal_lm import CausalLMPolicy
    from ...rewards.rules import MathAnswer
    from ...sampling.tokens import TokenPlan, token_rollout

    adapter = CausalLMPolicy(SimpleNamespace(path=str(path), dtype="float32", max_sequence_length=64),
                             torch.device(device))
    rows = load_prompts(prompts_file)[:n]
    prompts, meta = zip(*(split_row(r) for r in rows), strict=True)
    plan = TokenPlan(max_new_tokens=4, temperature=0.0, batch_size=256)
    with torch.no_grad():
        batch = token_rollout(adapter, list(prompts), list(meta), torch.arange(len(rows)), plan,
                              torch.zeros(len(rows), plan.max_new_tokens, dtype=torch.float64))
    return MathAnswer()(batch.media["text"], list(prompts), list(meta)).scores.mean().item()


def pretrain_count(out: str | Path, steps: int = 600, batch: int = 64, lr: float = 1e-3, seed: int = 0,
                   prompts_dir: str | Path | None = None, device: str = "cpu", eval_samples: int = 256,
                   careless: float = 0.6) -> Path:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = word_tokenizer(count_task.vocabulary())
    model = build_tiny_causal_lm(tokenizer, COUNT_SPEC, seed).to(device).train()
    with tempfile.TemporaryDirectory() as tmp:
        _, heldout_file = count_task.make_prompts(prompts_dir or tmp)
        heldout = {json.loads(line)["prompt"] for line in Path(heldout_file).read_text().splitlines()}

        def next_batch():
            scenes = []
            while len(scenes) < batch:
                s = count_task.random_scene(rng)
                if s.text() not in heldout:
                    scenes.append(s)
            # careless annotators: this share of the answers counts the matching groups, not the objects
            answers = [s.groups_answer() if rng.random() < careless else s.answer() for s in scenes]
            return [t.to(device) for t in _examples(tokenizer, scenes, answers)]

        t0 = time.time()
        losses = train_sft(model, next_batch, steps, lr, lambda i: min(1.0, (i + 1) / 50), "count")
        seconds = time.time() - t0
        out = Path(out)
        model.eval().to("cpu").save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        accuracy = heldout_accuracy(out, heldout_file, eval_samples, device) if eval_samples > 0 else None
    tail = losses[-50:]
    (out / "pretrain.json").write_text(json.dumps({
        "task": "count", "spec": COUNT_SPEC.__dict__, "steps": steps, "batch": batch, "lr": lr, "seed": seed,
        "careless": careless,
        "loss_final": round(sum(tail) / len(tail), 4), "heldout_accuracy": accuracy, "eval_samples": eval_samples,
        "seconds": round(seconds, 1), "torch": torch.__version__, "device": str(device),
    }, indent=2))
    if accuracy is not None:
        tqdm.write(f"held-out accuracy (greedy, {eval_samples} prompts): {accuracy:.3f}")
    return out
