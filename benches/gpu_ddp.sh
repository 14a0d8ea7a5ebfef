#!/usr/bin/env bash
# Data-parallel GPU checks (issue 17's acceptance on one GPU; steps 4-5 with several), in one call:
#   1. tests/cuda_distributed.rs: NCCL at world size 1 for real (rendezvous, unique id,
#      communicator, every collective on the communication stream), a DDP step bitwise equal to
#      the unwrapped one with no host sync and buckets launched during backward, the overflow
#      check reading the reduced gradients, the captured DDP step bitwise the eager one, with
#      SyncBatchNorm too (and its CUDA pieces against the CPU's batch norm), a graph refused
#      once its group failed (and with several GPUs, a rank on each: the ranks agree eager and
#      captured, with SyncBatchNorm; a rank leaving while the others replay; a rank that never
#      reaches the first collective);
#   2. the ResNet-50 O2 step (batch 256) unwrapped vs in DDP at world size 1 (bound: 3%);
#   3. PyTorch's DDP at world size 1 beside it (torchrun --standalone --nproc_per_node=1).
#   4. with two or more GPUs, the bench on every GPU at once (NET=main-job, then ResNet-50);
#      each bench run also times the DDP step captured into a CUDA graph (its INFO line).
#   5. with two or more GPUs, PyTorch's side of the small net on every GPU: unwrapped, DDP and
#      the DDP step hand-captured (NET=main-job CAPTURE=1 benches/torch_ddp_resnet50.py).
# Stage here:  scripts/gpu-stage --bench ddp_resnet50
# Run there:   bash benches/gpu_ddp.sh     (logs go under $OUT)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mixprec-ddp}
mkdir -p "$out"
# NCCL: the system's libnccl.so.2 when there is one, else the one PyTorch's wheel ships.
nccl_dir=$(python3 -c 'import os, nvidia.nccl as m; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null || true)
if [ -n "$nccl_dir" ] && [ -d "$nccl_dir" ]; then
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$nccl_dir"
  echo "NCCL fallback directory: $nccl_dir"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

echo "== 1. tests/cuda_distributed.rs"
OUT=$out bash .gpu/run.sh cuda_distributed -- --nocapture 2>&1 | tail -40
cp "$out/gpu-tests.log" "$out/cuda_distributed.log" 2>/dev/null || true

echo "== 2. ResNet-50 O2: mixprec unwrapped vs DDP (NCCL, world size 1)"
.gpu/bin/bench-ddp_resnet50 2>&1 | tee "$out/mixprec_ddp.log"

echo "== 3. the same step in PyTorch: unwrapped vs DDP (world size 1)"
python3 -m torch.distributed.run --standalone --nproc_per_node=1 benches/torch_ddp_resnet50.py 2>&1 \
  | grep -v "^W" | tee "$out/torch_ddp.log"

# 4. With several GPUs: every rank runs the bench on its own GPU (the launcher variables set by
#    hand, as torchrun sets them); rank 0 reports, for the small net of the Fashion-MNIST job
#    and for ResNet-50.
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -ge 2 ]; then
  port=29650
  for net in main-job resnet50; do
    port=$((port + 1))
    echo "== 4. mixprec DDP on $gpus ranks, NET=$net"
    for ((r = 0; r < gpus; r++)); do
      NET=$net RANK=$r LOCAL_RANK=$r WORLD_SIZE=$gpus LOCAL_WORLD_SIZE=$gpus \
        MASTER_ADDR=127.0.0.1 MASTER_PORT=$port .gpu/bin/bench-ddp_resnet50 \
        > "$out/ddp_${net}_rank$r.log" 2>&1 &
    done
    wait
    grep -vE "^\[" "$out/ddp_${net}_rank0.log" | tee -a "$out/mixprec_ddp_ranks.log"
  done
  echo "== 5. PyTorch's DDP on $gpus ranks, NET=main-job: unwrapped, DDP, DDP hand-captured"
  NET=main-job CAPTURE=1 python3 -m torch.distributed.run --standalone --nproc_per_node="$gpus" \
    benches/torch_ddp_resnet50.py 2>&1 | grep -v "^W" | tee "$out/torch_ddp_ranks.log"
fi
