"""Where a token rollout's decode step goes: the grpo_lm workload's model, timed per decode step in variants.

    polyrl bench --workload grpo_lm --out runs/bench/lm --epochs 0 ...   # or any run that built runs/bench/lm
    python scripts/token_decode_microbench.py runs/bench/lm/grpo_lm_random [--steps 64]

Variants (batch 64, prompt 256 tokens, one cached forward per new token):
  hf        the bare transformers model, bf16, no LoRA, no autocast (the floor)
  lora      + the run's LoRA (peft, float32 adapters) without autocast
  polyrl    the adapter's forward as the rollout calls it (LoRA under bf16 autocast)
  sampler   polyrl's `sample_tokens` end to end (forward + sampling + bookkeeping), per step
Prints ms per decode step for each.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def timed(fn, steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(steps)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=64)
    a = p.parse_args()

    from polyrl.config import load_config
    from polyrl.sampling.tokens import TokenPlan, sample_tokens
    from polyrl.trainer.loop import Trainer

    prompts = Path(a.model).parent / "prompts.jsonl"
    cfg = load_config(["recipe=causal_lm_grpo", f"model.path={a.model}", f"data.path={prompts}", "trainer.device=cuda",
                       "trainer.output_dir=runs/bench/decode", "trainer.eval_every=0", "trainer.save_every=0",
                       "trainer.tensorboard=false", "trainer.progress=false"])
    trainer = Trainer(cfg)
    adapter = trainer.adapter
    rows = [json.loads(x) for x in prompts.read_text().splitlines()][:64]
    ids, _ = adapter.encode_prompts([r["prompt"] for r in rows])
    dev = adapter.device
    prompt = torch.tensor(ids, device=dev)
    mask0 = torch.ones_like(prompt)
    network = adapter.network
    out = {}

    def decode_loop(call):
        def run(steps):
            logits, cache = call(prompt, mask0, None)
            mask = mask0
            tok = logits[:, -1].argmax(-1)
            for _ in range(steps):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                logits, cache = call(tok[:, None], mask, cache)
                tok = logits[:, -1].argmax(-1)
        return run

    def bare(x, m, cache):
        pos = (m.cumsum(-1) - 1)[:, -x.shape[1]:]
        o = network(input_ids=x, attention_mask=m, position_ids=pos, use_cache=True, past_key_values=cache,
                    logits_to_keep=1)
        return o.logits, o.past_key_values

    def through_adapter(x, m, cache):
        return adapter.forward(x, m, None, cache, keep=1, use_cache=True)

    with torch.no_grad(), trainer.actor.sampling_policy():
        for name, fn in [("lora", bare), ("polyrl", through_adapter)]:
            run = decode_loop(fn)
            run(4)
            out[name] = timed(run, a.steps)
        from peft.tuners.tuners_utils import BaseTunerLayer

        lora_layers = [m for m in network.modules() if isinstance(m, BaseTunerLayer)]
        for m in lora_layers:
            m.enable_adapters(False)
        run = decode_loop(bare)
        run(4)
        out["hf (LoRA disabled)"] = timed(run, a.steps)
        for m in lora_layers:
            m.enable_adapters(True)
        plan = TokenPlan(max_new_tokens=a.steps, temperature=1.0, top_p=1.0, batch_size=64)
        u = torch.rand(64, a.steps, dtype=torch.float64)
        sample_tokens(adapter, ids, {}, TokenPlan(max_new_tokens=4, batch_size=64), u[:, :4])
        out["sampler"] = timed(lambda s: sample_tokens(adapter, ids, {}, plan, u), a.steps)
        logits = torch.randn(64, adapter.network.config.vocab_size, device=dev)
        from polyrl.sampling.tokens import sample_next

        uu = torch.rand(64, device=dev, dtype=torch.float64)
        out["sample_next only"] = timed(lambda s: [sample_next(logits, uu, plan) for _ in range(s)], a.steps)
    for k, v in out.items():
        print(f"{k:24s} {v:8.2f} ms/step")
    trainer.close()


if __name__ == "__main__":
    main()
