#!/usr/bin/env bash
# The cuDNN convolution plan choice inside whole networks (issue 14): the training step of
# benches/train_throughput.rs with the default choice (both APIs' candidates, timed together)
# against each API forced (MIXPREC_CUDNN_API=graph|legacy), one process per run, each setting with
# a plan cache of its own that starts empty; then the default once more on its now-warm cache,
# as a second process would start.
#
# Stage here:  scripts/gpu-stage --no-tests --bench train_throughput
# Run there:   bash benches/conv_choice.sh [NETS] [MODES] [SETTINGS]
#   NETS      default "resnet50 resnet18-cifar"
#   MODES     default "o0 o2-f16 o2-bf16"
#   SETTINGS  default "both graph legacy"; "rtc" adds both APIs with runtime-compiled engines
#             admitted (MIXPREC_CUDNN_RUNTIME_COMPILED=1)
#   e.g.      bash benches/conv_choice.sh resnet50 "o2-f16 o2-bf16"
# Extra arguments for the bench go in $TRAIN_ARGS (e.g. "--steps 30"). JSON lines go to
# $OUT/conv_choice.jsonl, stderr to $OUT/conv_choice.err; RUST_LOG=mixprec=debug there logs every
# candidate's time. The table says, per network and mode:
#   - default against the better forced API (PASS: >= 0.98 of it, the timing noise allowed);
#   - the warm (second-process) first step: PASS when it made no timing run and took every plan
#     from the cache.
set -u
cd "$(dirname "$0")/.."
nets=${1:-"resnet50 resnet18-cifar"}
modes=${2:-"o0 o2-f16 o2-bf16"}
settings=${3:-"both graph legacy"}
out=${OUT:-/tmp}
log=$out/conv_choice.jsonl
: > "$log"
caches=$(mktemp -d)
bench=.gpu/bin/bench-train_throughput
[ -x $bench ] || { echo "conv_choice: $bench missing (stage with gpu-stage --bench train_throughput)" >&2; exit 1; }

# run NET MODE SETTING CACHE-STATE: one bench process, its JSON line tagged.
run() {
  local api=$3 rtc=0
  [ "$3" = rtc ] && { api=both; rtc=1; }
  MIXPREC_CUDNN_API=$api MIXPREC_CUDNN_RUNTIME_COMPILED=$rtc \
    MIXPREC_CUDNN_PLAN_CACHE="$caches/$1-$2-$3" \
    $bench --net "$1" --mode "$2" ${TRAIN_ARGS:-} 2>>"$out/conv_choice.err" \
    | grep '^{' | sed "s/}\$/, \"setting\": \"$3\", \"cache\": \"$4\"}/" | tee -a "$log"
}

for net in $nets; do for mode in $modes; do
  for s in $settings; do run "$net" "$mode" "$s" cold; done
  case " $settings " in *" both "*) run "$net" "$mode" both warm ;; esac
done; done
rm -rf "$caches"

python3 - "$log" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
by = {}
for r in rows:
    by.setdefault((r["net"], r["mode"]), {})[(r["setting"], r["cache"])] = r
def ips(r):
    return f"{r['img_per_s']:.0f}" if r else "-"
print("| net | mode | default img/s | graph | legacy | rtc | default / better forced | "
      "first step cold / warm s | warm: plans cached, timing runs | plan choice cold s | max workspace MiB |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
ok = True
for (net, mode), d in by.items():
    dflt, warm = d.get(("both", "cold")), d.get(("both", "warm"))
    g, l, rtc = d.get(("graph", "cold")), d.get(("legacy", "cold")), d.get(("rtc", "cold"))
    forced = [x["img_per_s"] for x in (g, l) if x]
    verdict = ratio = "-"
    if dflt and forced:
        q = dflt["img_per_s"] / max(forced)
        ratio = f"{q:.3f} {'PASS' if q >= 0.98 else 'FAIL'}"
        ok &= q >= 0.98
    w = "-"
    if warm:
        good = warm["conv_timing_runs"] == 0 and warm["conv_plans_from_cache"] == warm["conv_plans"]
        w = f"{warm['conv_plans_from_cache']}/{warm['conv_plans']}, {warm['conv_timing_runs']} {'PASS' if good else 'FAIL'}"
        ok &= good
    first = f"{dflt['first_step_s']:.1f} / {warm['first_step_s']:.1f}" if dflt and warm else "-"
    print(f"| {net} | {mode} | {ips(dflt)} | {ips(g)} | {ips(l)} | {ips(rtc)} | {ratio} | {first} | {w} | "
          f"{dflt['conv_choice_s'] if dflt else '-'} | {dflt['conv_workspace_max_mib'] if dflt else '-'} |")
print("conv_choice:", "all PASS" if ok else "FAILURES (see the table)")
PY
