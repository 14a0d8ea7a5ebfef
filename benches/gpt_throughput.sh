#!/usr/bin/env bash
# GPT-2's whole training step on the GPU machine, mixprec and PyTorch in the same call, one
# process per configuration (each peak memory its own), then the table.
# Stage here:  scripts/gpu-stage --no-tests --bench gpt_throughput
# Run there:   bash benches/gpt_throughput.sh [MODELS] [MODES]   (defaults: gpt2, bf16 and f16)
#   e.g.       bash benches/gpt_throughput.sh "gpt2 gpt2-medium" "o2-bf16"
# mixprec runs eager and captured; PyTorch eager with flash SDPA, and with $COMPILE=1 also
# torch.compile. Extra arguments for both sides go in $GPT_ARGS (e.g. "--batch 8 --steps 30").
# Several GPUs: NPROC=N (e.g. NPROC=2) adds, after each one-GPU row, the same step data-parallel
# on N GPUs, --batch per GPU: mixprec through `--nproc-per-node N` (DDP over NCCL, eager and
# captured), PyTorch through torchrun with --ddp (DDP, gradient_as_bucket_view=True); tokens/s
# then count every GPU's tokens, and the table shows each N-GPU row against its one-GPU row.
# With $CHECKPOINT=1 mixprec also runs eager and captured with every block checkpointed
# (--checkpoint-activations), beside the plain rows. The JSON lines go to $OUT/gpt.jsonl.
set -u
cd "$(dirname "$0")/.."
models=${1:-"gpt2"}
modes=${2:-"o2-bf16 o2-f16"}
nproc=${NPROC:-1}
out=${OUT:-/tmp}
log=$out/gpt.jsonl
: > "$log"
# NVLink multicast (NVLS) stays off: not every lent machine supports it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "$nproc" -gt 1 ]; then
  # NCCL: the system's libnccl.so.2 when there is one, else the one PyTorch's wheel ships.
  nccl_dir=$(python3 -c 'import os, nvidia.nccl as m; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null || true)
  if [ -n "$nccl_dir" ] && [ -d "$nccl_dir" ]; then
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$nccl_dir"
  fi
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [ "$gpus" -lt "$nproc" ]; then
    echo "gpt_throughput.sh: NPROC=$nproc but $gpus GPU(s) visible" >&2
    exit 1
  fi
fi
declare -A twin=([o0]=fp32 [o1-bf16]=bf16 [o1-f16]=fp16 [o2-bf16]=bf16 [o2-f16]=fp16)
ours() { .gpu/bin/bench-gpt_throughput "$@" ${GPT_ARGS:-} 2>>"$out/gpt.err" | tee -a "$log"; }
torch1() { python3 benches/torch_gpt_throughput.py "$@" ${GPT_ARGS:-} 2>>"$out/gpt.err" | tee -a "$log"; }
torchn() {
  python3 -m torch.distributed.run --standalone --nproc_per_node="$nproc" \
    benches/torch_gpt_throughput.py --ddp "$@" ${GPT_ARGS:-} 2>>"$out/gpt.err" | grep '^{' | tee -a "$log"
}
for model in $models; do for mode in $modes; do
  ours --model $model --mode $mode
  ours --model $model --mode $mode --captured
  if [ "${CHECKPOINT:-0}" = 1 ]; then
    ours --model $model --mode $mode --checkpoint-activations
    ours --model $model --mode $mode --captured --checkpoint-activations
  fi
  torch1 --model $model --mode ${twin[$mode]}
  if [ "${COMPILE:-0}" = 1 ]; then
    torch1 --model $model --mode ${twin[$mode]} --compile
  fi
  if [ "$nproc" -gt 1 ]; then
    ours --model $model --mode $mode --nproc-per-node "$nproc"
    ours --model $model --mode $mode --captured --nproc-per-node "$nproc"
    torchn --model $model --mode ${twin[$mode]}
  fi
done; done
python3 benches/gpt_table.py "$log"
