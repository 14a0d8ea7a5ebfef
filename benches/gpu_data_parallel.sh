#!/usr/bin/env bash
# DataParallel GPU checks (issue 47), in one call, on a machine with two or more GPUs:
#   1. tests/cuda_data_parallel.rs: DataParallel on the GPUs equals one GPU on the same global
#      batch (O0, O2), replicas identical, an Inf in one replica skips the step everywhere, no
#      host read for the overflow decision;
#   2. ResNet-50 O2 channels_last b256 per GPU: DataParallel over every GPU vs one GPU
#      (bound: >= 1.9x on 2 GPUs), SCATTER=1 also times the batch scattered from cuda:0;
#   3. our DDP on the same GPUs (one process per GPU, benches/ddp_resnet50.rs; its JSON's
#      ddp_img_per_s per rank x ranks against DataParallel's; bound: DataParallel >= 0.95x);
#   4. PyTorch's nn.DataParallel vs one GPU, the same step.
# Stage here:  scripts/gpu-stage --bench data_parallel_resnet50 --bench ddp_resnet50
# Run there:   bash benches/gpu_data_parallel.sh     (logs go under $OUT)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mixprec-dp}
mkdir -p "$out"
nccl_dir=$(python3 -c 'import os, nvidia.nccl as m; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null || true)
if [ -n "$nccl_dir" ] && [ -d "$nccl_dir" ]; then
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$nccl_dir"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)

echo "== 1. tests/cuda_data_parallel.rs"
OUT=$out bash .gpu/run.sh cuda_data_parallel -- --nocapture --test-threads=1 2>&1 | tail -40

echo "== 2. ResNet-50 O2: DataParallel over $gpus GPU(s) vs one GPU"
SCATTER=1 .gpu/bin/bench-data_parallel_resnet50 2>&1 | tee "$out/mixprec_dp.log"

if [ "$gpus" -ge 2 ]; then
  echo "== 3. our DDP on $gpus ranks (ResNet-50 b256 per rank, O2)"
  for ((r = 0; r < gpus; r++)); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$gpus LOCAL_WORLD_SIZE=$gpus \
      MASTER_ADDR=127.0.0.1 MASTER_PORT=29671 CHANNELS_LAST=1 .gpu/bin/bench-ddp_resnet50 \
      > "$out/ddp_rank$r.log" 2>&1 &
  done
  wait
  grep -vE "^\[" "$out/ddp_rank0.log" | tee "$out/mixprec_ddp_ranks.log"
fi

echo "== 4. PyTorch nn.DataParallel vs one GPU"
python3 benches/torch_data_parallel_resnet50.py 2>&1 | tee "$out/torch_dp.log"
