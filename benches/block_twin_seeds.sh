#!/usr/bin/env bash
# The block-stack twin (examples/block_twin.rs + benches/torch_block_twin.py) over several seeds
# of the weights and the batch. The scalar loss's error from the f64 reference is one number, a
# signed sum of every logit's rounding: one seed's value is one draw, and either side can come
# out ahead by chance. Over seeds, the root mean square of each side's error compares the two
# roundings; the logits and gradients are compared per seed as before.
#
# Stage here:  scripts/gpu-stage --no-tests --example block_twin
# Run there:   SEEDS="1 2 3 4 5 6 7 8" bash benches/block_twin_seeds.sh [DIR]
#   (DIR default $OUT/block_twin_seeds or /tmp/block_twin_seeds; BLOCK_TWIN_BIN, DEVICE=cuda|cpu,
#   TWIN_ARGS: more flags for block_twin, e.g. --small for a CPU run; DEADLINE: epoch seconds
#   after which no further seed starts)
set -u
cd "$(dirname "$0")/.."
dir=${1:-${OUT:-/tmp}/block_twin_seeds}
bin=${BLOCK_TWIN_BIN:-.gpu/bin/block_twin}
device=${DEVICE:-cuda}
mkdir -p "$dir"
for s in ${SEEDS:-1 2 3 4 5 6 7 8}; do
  # DEADLINE (seconds since the epoch): start no seed after it (a device call has a time limit).
  if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then
    echo "deadline reached: seeds from $s on not run" >&2
    break
  fi
  # shellcheck disable=SC2086
  if ! "$bin" "$dir/seed$s" "$device" --seed "$s" --no-capture ${TWIN_ARGS:-} > "$dir/seed$s.ours.log" 2>&1; then
    echo "seed $s: block_twin failed (see $dir/seed$s.ours.log)" >&2
    continue
  fi
  python3 benches/torch_block_twin.py "$dir/seed$s" --device "$device" 2>>"$dir/torch.err" \
    | grep '^{' > "$dir/seed$s.jsonl"
  rm -f "$dir/seed$s"/*.safetensors
done
python3 benches/block_twin_table.py "$dir"/seed*.jsonl
