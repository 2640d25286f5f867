#!/bin/bash
# One device call: install the carried wheels, then run each command given (polyrl bench builds its own pipeline).
#   bash scripts/gpu_session.sh "<command 1>" "<command 2>" ...   (each command's output goes to $OUT/logN.txt)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,memory.used --format=csv | tee $OUT/gpu.txt
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" | tee -a $OUT/gpu.txt
T0=$(date +%s)
i=0
for c in "$@"; do
  i=$((i+1)); echo "=== [$i] $c (t=$(( $(date +%s) - T0 )) s)" | tee -a $OUT/summary.txt
  bash -c "$c" > $OUT/log$i.txt 2>&1; echo "rc=$?" >> $OUT/log$i.txt
  grep -v -E "it/s|Loading|Writing" $OUT/log$i.txt | tail -25 | tee -a $OUT/summary.txt
done
