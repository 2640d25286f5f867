#!/bin/bash
# One device call: install the carried wheels, then run each command given (polyrl bench builds its own pipeline).
#   bash scripts/gpu_session.sh "<command 1>" "<command 2>" ...
# Each command's whole output goes to $OUT/logN.txt, the GPU line and each command's filtered tail to
# $OUT/summary.txt (the device returns at most 8 files from $OUT: N commands use N + 1 of them).
# Time: the session stops by GPU_SESSION_DEADLINE seconds after its start (default 530, under a 540-600 s call
# limit): each command runs under `timeout` for what is left, or for CMD_TIMEOUT seconds if that is less; a command
# is not started with less than 20 s left. A command stopped at its limit logs rc=124 and the next one starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
export PYTHONUNBUFFERED=1
DEADLINE=${GPU_SESSION_DEADLINE:-530}
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import diffusers, hydra, omegaconf" || { echo "gpu_session: the carried wheels do not import" | tee -a $OUT/summary.txt; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,memory.used --format=csv | tee -a $OUT/summary.txt
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" | tee -a $OUT/summary.txt
echo "setup $(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt
i=0
for c in "$@"; do
  i=$((i+1)); left=$(( DEADLINE - ($(date +%s) - T0) ))
  limit=$left; [ -n "$CMD_TIMEOUT" ] && [ "$CMD_TIMEOUT" -lt "$limit" ] && limit=$CMD_TIMEOUT
  if [ "$left" -lt 20 ]; then
    echo "=== [$i] not started ($left s left before the session's deadline): $c" | tee -a $OUT/summary.txt; continue
  fi
  echo "=== [$i] $c (t=$(( $(date +%s) - T0 )) s, limit ${limit} s)" | tee -a $OUT/summary.txt
  timeout -k 10 "$limit" bash -c "$c" > $OUT/log$i.txt 2>&1; rc=$?
  echo "rc=$rc ($(( $(date +%s) - T0 )) s since the start)" >> $OUT/log$i.txt
  grep -v -E "it/s|Loading|Writing|s/it" $OUT/log$i.txt | tail -25 | tee -a $OUT/summary.txt
done
echo "gpu_session: done at $(( $(date +%s) - T0 )) s" | tee -a $OUT/summary.txt
