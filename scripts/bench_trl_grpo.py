"""TRL's `GRPOTrainer` on `polyrl bench --workload grpo_lm`'s model and prompts: the peer side of that benchmark.

    polyrl bench --workload grpo_lm --out runs/bench/lm            # writes runs/bench/lm/{grpo_lm_random,prompts.jsonl}
    python scripts/bench_trl_grpo.py --model runs/bench/lm/grpo_lm_random --prompts runs/bench/lm/prompts.jsonl

The same algorithmic work per epoch as polyrl's recipe `causal_lm_grpo` at the workload's overrides: 8 prompts ×
8 samples generated at temperature 1 (top-p 1) with TRL's default generation (transformers `generate`), 512 new
tokens, a rule reward that reads the text, group-normalised advantages, no KL (β = 0), the token clip ε = 0.2 with
each sequence's token mean (`loss_type="grpo"`), LoRA r=32 α=64 on every attention and MLP projection, 4 optimizer
steps per generation (`steps_per_generation=4`, 16 completions each), bf16 weights, no gradient checkpointing.
TRL recomputes the old log-probs with one extra forward (polyrl keeps the rollout's); that is part of its loop.

An epoch is one generation and its 4 optimizer steps. Times come from a callback at each optimizer step's end and
from TRL's own `profiling_context` blocks (generation, reward), which this script records in place of a logger.
Prints a JSON summary like `polyrl bench`'s: samples/s, rollout tokens/s, training tokens/s, peak memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--epochs", type=int, default=2, help="measured epochs (generations) after the warm-up")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--out", default="runs/bench/trl")
    a = p.parse_args()

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    cuda = torch.cuda.is_available()
    rows = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if cuda else torch.float32)

    def reward(completions, **_):  # polyrl's math_answer against "1": random weights never match (all zeros)
        return [float(c.strip().endswith("1")) for c in completions]

    blocks: list[tuple[float, str, float]] = []  # (end time, block name, seconds)
    profiling.ProfilingContext._log_metrics = lambda self, d: blocks.append((time.perf_counter(), self.name, d))

    class Clock(TrainerCallback):
        def __init__(self):
            self.step_end: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.step_end.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(dict(logs or {}))

    steps_per_generation = 4
    config = GRPOConfig(
        output_dir=a.out, per_device_train_batch_size=16, steps_per_generation=steps_per_generation,
        num_generations=8, max_completion_length=a.max_new_tokens, temperature=1.0, top_p=1.0, learning_rate=1e-5,
        beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group", num_iterations=1,
        max_steps=(a.warmup + a.epochs) * steps_per_generation, bf16=cuda, use_cpu=not cuda,
        gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0,
    )
    lora = LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora, callbacks=[clock])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()

    samples = 64
    ends = [clock.start] + clock.step_end[steps_per_generation - 1::steps_per_generation]
    epochs = []
    for i in range(len(ends) - 1):
        lo, hi = ends[i], ends[i + 1]
        inside = [(n, d) for t, n, d in blocks if lo < t <= hi]
        generate = sum(d for n, d in inside if "generate" in n)
        scoring = sum(d for n, d in inside if n == "reward")
        logs = [g for g in clock.logs if "completions/mean_length" in g]  # logged once per generation
        length = float(logs[i]["completions/mean_length"])
        epochs.append({"seconds": hi - lo, "generate_s": generate, "reward_s": scoring,
                       "train_s": hi - lo - generate - scoring, "mean_length": length})
    measured = epochs[a.warmup:]
    med = lambda k: statistics.median(e[k] for e in measured)
    response = samples * med("mean_length")
    summary = {
        "peer": "trl.GRPOTrainer", "trl_epochs": epochs, "samples_per_epoch": samples,
        "seconds_per_epoch": med("seconds"), "samples_per_s": samples / med("seconds"),
        "first_epoch_s": epochs[0]["seconds"], "generate_s": med("generate_s"), "train_s": med("train_s"),
        "response_tokens_per_epoch": response, "rollout_tokens_per_s": response / med("generate_s"),
        "train_tokens_per_s": (response + samples * a.prompt_tokens) / med("train_s"),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "trl_bench.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "trl_epochs"}, indent=2))


if __name__ == "__main__":
    main()
