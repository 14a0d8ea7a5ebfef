#!/usr/bin/env bash
# The largest GPT-2-shaped model that trains, per memory mode: one GPU plain and with activation
# checkpointing, two GPUs with DDP, DDP + checkpointing, ZeRO (ZeroAdam: sharded state and
# masters, gradients reduce-scattered) and ZeRO + checkpointing. Each trial is one
# bench-gpt_throughput run (bf16 O2, T 1024, micro-batch 1 per GPU, eager, fused AdamW, clipping)
# with a few real optimizer steps; it counts as trained when it reports no out-of-memory, no
# skipped step and a finite loss. A row starts at the rung its bytes per parameter predict,
# climbs until the first out-of-memory (or falls until one fits), each trial under a timeout.
#
# Stage here:  scripts/gpu-stage --no-tests --bench gpt_throughput
# Run there:   bash benches/largest_gpt.sh [ROWS]
#   ROWS: some of "plain ckpt ddp ddp-ckpt zero zero-ckpt" (default: every row the visible GPUs
#   allow: on one GPU "plain ckpt", on two or more all six).
# Environment: GPT_BIN (default .gpu/bin/bench-gpt_throughput), MODE (o2-bf16), BATCH (1),
#   SEQ (1024), STEPS (2 timed, after 4 untimed), TRIAL_TIMEOUT (seconds, 180), START (a ladder
#   index for every row instead of the predicted one), OUT (/tmp: largest_gpt.jsonl, the JSON
#   line of every trial, and largest_gpt.err).
set -u
cd "$(dirname "$0")/.."
bin=${GPT_BIN:-.gpu/bin/bench-gpt_throughput}
mode=${MODE:-o2-bf16}
batch=${BATCH:-1}
seq=${SEQ:-1024}
steps=${STEPS:-2}
limit=${TRIAL_TIMEOUT:-180}
out=${OUT:-/tmp}
log=$out/largest_gpt.jsonl
err=$out/largest_gpt.err
: > "$log"
: > "$err"
if [ ! -x "$bin" ]; then
  echo "largest_gpt.sh: no bench binary at $bin (scripts/gpu-stage --no-tests --bench gpt_throughput, or set GPT_BIN)" >&2
  exit 1
fi
# NVLink multicast (NVLS) stays off: not every lent machine supports it.
export NCCL_NVLS_ENABLE=0
nccl_dir=$(python3 -c 'import os, nvidia.nccl as m; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null || true)
if [ -n "$nccl_dir" ] && [ -d "$nccl_dir" ]; then
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$nccl_dir"
fi
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -ge 2 ]; then
  rows=${1:-"plain ckpt ddp ddp-ckpt zero zero-ckpt"}
else
  rows=${1:-"plain ckpt"}
fi

# The ladder: label, layers, width, heads (GPT-2's shape: 4x MLP, tied embeddings, 50304
# tokens; heads of 64 up to 1.5B, of 128 above). Parameters ~ 12 L C^2 + 50304 C.
ladder=(
  "124M 12 768 12"
  "350M 24 1024 16"
  "774M 36 1280 20"
  "1.5B 48 1600 25"
  "2.7B 32 2560 20"
  "4.2B 36 3072 24"
  "6.7B 32 4096 32"
  "9.3B 40 4352 34"
  "13B 40 5120 40"
  "18B 48 5632 44"
  "24B 56 6016 47"
)

# Per row: GPUs, the bench's flags, and the predicted rung. Per parameter at O2 with AdamW:
# 2 (bf16 weight) + 2 (gradient) + 4 (FP32 master) + 8 (moments) = 16 bytes on one GPU; DDP
# adds its 2-byte bucket buffers; ZeRO over 2 keeps 2 + 2 + 2 (bucket buffers) + 14 / 2 = 13.
# 141 GB / 16 ~ 8.8B, / 18 ~ 7.8B, / 13 ~ 10.8B before activations: 6.7B, 6.7B, 9.3B.
declare -A ngpu=([plain]=1 [ckpt]=1 [ddp]=2 [ddp-ckpt]=2 [zero]=2 [zero-ckpt]=2)
declare -A flags=(
  [plain]=""
  [ckpt]="--checkpoint-activations"
  [ddp]="--nproc-per-node 2"
  [ddp-ckpt]="--nproc-per-node 2 --checkpoint-activations"
  [zero]="--nproc-per-node 2 --zero"
  [zero-ckpt]="--nproc-per-node 2 --zero --checkpoint-activations"
)
declare -A start=([plain]=6 [ckpt]=6 [ddp]=6 [ddp-ckpt]=6 [zero]=7 [zero-ckpt]=7)

# One trial: sets $verdict to fit, oom, timeout or fail, and appends its JSON line to the log.
trial() {
  local row=$1 rung=$2 label layers width heads lines rc json t0=$SECONDS
  read -r label layers width heads <<< "${ladder[$rung]}"
  # shellcheck disable=SC2086
  lines=$(timeout --kill-after=20 "$limit" "$bin" --model gpt2 --n-layer "$layers" --n-embd "$width" \
    --n-head "$heads" --mode "$mode" --batch "$batch" --seq "$seq" --steps "$steps" --warmup 1 \
    ${flags[$row]} 2>>"$err")
  rc=$?
  # A rank that ran out of memory says so; otherwise rank 0's line.
  json=$(printf '%s\n' "$lines" | grep '^{' | grep '"oom": true' | head -n1)
  [ -n "$json" ] || json=$(printf '%s\n' "$lines" | grep '^{' | head -n1)
  verdict=$(printf '%s' "$json" | python3 -c '
import json, math, sys
t = sys.stdin.read().strip()
r = json.loads(t) if t else {}
if r.get("oom"):
    print("oom")
elif r and r.get("skipped", 1) == 0 and math.isfinite(r.get("loss_last", float("nan"))):
    print("fit")
else:
    print("fail")')
  if [ "$verdict" != fit ] && [ "$verdict" != oom ] && { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then
    verdict=timeout
  fi
  printf '{"row": "%s", "rung": %d, "label": "%s", "gpus": %d, "verdict": "%s", "rc": %d, "s": %d, "result": %s}\n' \
    "$row" "$rung" "$label" "${ngpu[$row]}" "$verdict" "$rc" $((SECONDS - t0)) "${json:-null}" >> "$log"
  echo "  $row $label: $verdict (exit $rc, $((SECONDS - t0)) s)" >&2
}

for row in $rows; do
  if [ -z "${ngpu[$row]:-}" ]; then
    echo "largest_gpt.sh: unknown row '$row' (plain ckpt ddp ddp-ckpt zero zero-ckpt)" >&2
    exit 2
  fi
  if [ "${ngpu[$row]}" -gt "$gpus" ]; then
    echo "largest_gpt.sh: row $row needs ${ngpu[$row]} GPUs, $gpus visible: skipped" >&2
    continue
  fi
  r=${START:-${start[$row]}}
  trial "$row" "$r"
  if [ "$verdict" = fit ]; then
    # Up until the first rung that does not train.
    while [ "$verdict" = fit ] && [ $((r + 1)) -lt ${#ladder[@]} ]; do
      r=$((r + 1))
      trial "$row" "$r"
    done
  else
    # Down until one trains.
    while [ "$verdict" != fit ] && [ "$r" -gt 0 ]; do
      r=$((r - 1))
      trial "$row" "$r"
    done
  fi
done

# The table: per row, the largest rung that trained and what the next rung up did.
python3 - "$log" "$mode" "$batch" "$seq" <<'PY'
import json, sys
log, mode, batch, seq = sys.argv[1:]
trials = [json.loads(l) for l in open(log) if l.strip()]
names = {"plain": "plain", "ckpt": "activation checkpointing", "ddp": "DDP",
         "ddp-ckpt": "DDP + activation checkpointing", "zero": "ZeRO (ZeroAdam)",
         "zero-ckpt": "ZeRO + activation checkpointing"}
print(f"\nLargest GPT-2-shaped model that trains: {mode}, T {seq}, micro-batch {batch} per GPU, "
      "fused AdamW, eager\n")
print("| mode | GPUs | largest config (layers x width) | params | peak MiB / GPU | tok/s (all GPUs) | next rung up |")
print("|---|---|---|---|---|---|---|")
for row in dict.fromkeys(t["row"] for t in trials):
    ts = [t for t in trials if t["row"] == row]
    fits = [t for t in ts if t["verdict"] == "fit"]
    best = max(fits, key=lambda t: t["rung"]) if fits else None
    up = [t for t in ts if best is None or t["rung"] == best["rung"] + 1]
    nxt = f'{up[0]["label"]}: {up[0]["verdict"]}' if up else "(end of ladder)"
    if best is None:
        print(f'| {names[row]} | {ts[0]["gpus"]} | none | | | | {nxt} |')
        continue
    r = best["result"]
    print(f'| {names[row]} | {best["gpus"]} | {best["label"]} ({r["model"]}) | {r["params"] / 1e9:.2f}B '
          f'| {r["peak_run_mib"]:.0f} | {r["tokens_per_s"]:.0f} | {nxt} |')
PY
