#!/usr/bin/env bash
# GPT-2's whole training step on the GPU machine, mixprec and PyTorch in the same call, one
# process per configuration (each peak memory its own), then the table.
# Stage here:  scripts/gpu-stage --no-tests --bench gpt_throughput
# Run there:   bash benches/gpt_throughput.sh [MODELS] [MODES]   (defaults: gpt2, bf16 and f16)
#   e.g.       bash benches/gpt_throughput.sh "gpt2 gpt2-medium" "o2-bf16"
# mixprec runs eager and captured; PyTorch eager with flash SDPA, and with $COMPILE=1 also
# torch.compile. Extra arguments for both sides go in $GPT_ARGS (e.g. "--batch 8 --steps 30").
# With $CHECKPOINT=1 mixprec also runs eager and captured with every block checkpointed
# (--checkpoint-activations), beside the plain rows. The JSON lines go to $OUT/gpt.jsonl.
set -u
cd "$(dirname "$0")/.."
models=${1:-"gpt2"}
modes=${2:-"o2-bf16 o2-f16"}
out=${OUT:-/tmp}
log=$out/gpt.jsonl
: > "$log"
declare -A twin=([o0]=fp32 [o1-bf16]=bf16 [o1-f16]=fp16 [o2-bf16]=bf16 [o2-f16]=fp16)
for model in $models; do for mode in $modes; do
  .gpu/bin/bench-gpt_throughput --model $model --mode $mode ${GPT_ARGS:-} 2>>"$out/gpt.err" | tee -a "$log"
  .gpu/bin/bench-gpt_throughput --model $model --mode $mode --captured ${GPT_ARGS:-} 2>>"$out/gpt.err" | tee -a "$log"
  if [ "${CHECKPOINT:-0}" = 1 ]; then
    for how in "" --captured; do
      .gpu/bin/bench-gpt_throughput --model $model --mode $mode $how --checkpoint-activations ${GPT_ARGS:-} 2>>"$out/gpt.err" | tee -a "$log"
    done
  fi
  python3 benches/torch_gpt_throughput.py --model $model --mode ${twin[$mode]} ${GPT_ARGS:-} 2>>"$out/gpt.err" | tee -a "$log"
  if [ "${COMPILE:-0}" = 1 ]; then
    python3 benches/torch_gpt_throughput.py --model $model --mode ${twin[$mode]} --compile ${GPT_ARGS:-} 2>>"$out/gpt.err" | tee -a "$log"
  fi
done; done
python3 benches/gpt_table.py "$log"
