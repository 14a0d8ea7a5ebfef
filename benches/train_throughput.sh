#!/usr/bin/env bash
# The whole-network benchmark on the GPU machine, mixprec and PyTorch in the same call, one
# process per configuration (so that each peak memory is its own), then the table.
# Stage here:  scripts/gpu-stage --no-tests --bench train_throughput
# Run there:   bash benches/train_throughput.sh [NETS] [MODES] [LAYOUTS]   (defaults: all)
#   e.g.       bash benches/train_throughput.sh "resnet50" "o2-f16 o2-bf16" "nchw cl"
# Extra arguments for both sides go in $TRAIN_ARGS (e.g. "--steps 30 --lr 0.001", or "--batch 128"
# for another batch than the net's own); $COMPILE=1 adds
# torch.compile on each net in channels_last, f16 and bf16 (the table gains a column against it).
# The JSON lines go to $OUT/train.jsonl.
set -u
cd "$(dirname "$0")/.."
nets=${1:-"resnet50 resnet18-cifar"}
modes=${2:-"o0 o2-f16 o2-bf16"}
layouts=${3:-"nchw cl"}
out=${OUT:-/tmp}
log=$out/train.jsonl
: > "$log"
declare -A twin=([o0]=fp32 [o2-f16]=fp16 [o2-bf16]=bf16)
for net in $nets; do for mode in $modes; do for layout in $layouts; do
  .gpu/bin/bench-train_throughput --net $net --mode $mode --layout $layout ${TRAIN_ARGS:-} 2>>"$out/train.err" | tee -a "$log"
  python3 benches/torch_train_throughput.py --net $net --mode ${twin[$mode]} --layout $layout ${TRAIN_ARGS:-} 2>>"$out/train.err" | tee -a "$log"
done; done; done
if [ "${COMPILE:-0}" = 1 ]; then
  for net in $nets; do for m in fp16 bf16; do
    python3 benches/torch_train_throughput.py --net $net --mode $m --layout cl --compile ${TRAIN_ARGS:-} 2>>"$out/train.err" | tee -a "$log"
  done; done
fi
python3 benches/train_table.py "$log"
