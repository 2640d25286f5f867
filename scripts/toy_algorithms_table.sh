#!/usr/bin/env bash
# Every algorithm on the toy task at the same budget (recipes toy_<algo>: 30 steps, 64 samples/step, 64 held-out
# samples), 2 seeds run side by side with one thread each. Writes runs/algos/<algo>_s<seed>/ and a log per run;
# then `python scripts/toy_algorithms_table.py` prints the table of docs/algorithms.md.
set -u
export OMP_NUM_THREADS=1
ROOT=${ROOT:-runs/algos}
mkdir -p "$ROOT"
run() {  # algo seed [overrides...]
  local algo=$1 seed=$2; shift 2
  local out="$ROOT/${algo}_s${seed}"
  [ -f "$out/reward_curve.png" ] && return 0  # done already
  rm -rf "$out"
  /usr/bin/time -f "%e" -o "$out.wall" polyrl train recipe=toy_$algo trainer.seed=$seed trainer.output_dir=$out \
    trainer.progress=false trainer.tensorboard=false "$@" > "$out.log" 2>&1
}
pair() { run "$1" 0 "${@:2}" & run "$1" 1 "${@:2}" & wait; }
pair flow_grpo
TEACHER="$ROOT/flow_grpo_s0/checkpoints/step_000030"
for algo in flow_grpo_cps flow_dppo grpo_guard dance_grpo mix_grpo diffusion_nft diffusion_dpo dgpo awm; do pair $algo; done
pair diffusion_opd algorithm.teacher_path=$TEACHER
