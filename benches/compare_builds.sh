#!/usr/bin/env bash
# Two builds of mixprec and PyTorch on the same work, per configuration, in one call: the way to
# show a change moves no speed. OLD and NEW are two `bench-train_throughput` binaries (stage each
# with scripts/gpu-stage --no-tests --bench train_throughput and keep the first .gpu/bin copy).
#   bash benches/compare_builds.sh OLD NEW "NETS" "MODES" "LAYOUTS"
#   e.g.  bash benches/compare_builds.sh .old/bench-train_throughput .gpu/bin/bench-train_throughput \
#           "resnet50 resnet18-cifar" "o2-f16 o2-bf16" "cl nchw"
# The JSON lines (ours tagged "build": "old" / "new") go to $OUT/compare.jsonl.
set -u
cd "$(dirname "$0")/.."
old=$1; new=$2; nets=$3; modes=$4; layouts=$5
out=${OUT:-/tmp}; log=$out/compare.jsonl; : > "$log"
declare -A twin=([o0]=fp32 [o2-f16]=fp16 [o2-bf16]=bf16)
for net in $nets; do for mode in $modes; do for layout in $layouts; do
  for b in old new; do
    bin=$old; [ $b = new ] && bin=$new
    "$bin" --net $net --mode $mode --layout $layout 2>>"$out/compare.err" \
      | sed "s/\"side\": \"mixprec\"/\"side\": \"mixprec\", \"build\": \"$b\"/" | tee -a "$log"
  done
  python3 benches/torch_train_throughput.py --net $net --mode ${twin[$mode]} --layout $layout \
    2>>"$out/compare.err" | tee -a "$log"
done; done; done
