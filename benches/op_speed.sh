#!/usr/bin/env bash
# Layer norm and causal attention, forward and forward+backward, mixprec and PyTorch in the same
# call on the GPU machine, then the table (issue 42's per-op speed diagnostic).
# Stage here:  scripts/gpu-stage --no-tests --bench op_speed
# Run there:   bash benches/op_speed.sh [--dtypes bf16,f16] [--iters 50] [--warmup 10]
# The arguments go to both sides. The JSON lines go to $OUT/op_speed.jsonl.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
log=$out/op_speed.jsonl
: > "$log"
.gpu/bin/bench-op_speed "$@" 2>>"$out/op_speed.err" | tee -a "$log"
python3 benches/torch_op_speed.py "$@" 2>>"$out/op_speed.err" | tee -a "$log"
python3 - "$log" <<'TABLE'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
by = {}
for r in rows:
    by.setdefault((r["op"], r["dtype"]), {})[r["side"]] = r
print()
print(f"{'op':<22} {'dtype':<5} {'ours fwd':>9} {'torch fwd':>9} {'x':>6} {'ours f+b':>9} {'torch f+b':>9} {'x':>6}  path (ours)")
for (op, dt), s in by.items():
    m, t = s.get("mixprec", {}), s.get("pytorch", {})
    def ms(r, k):
        return f"{r[k]:.3f}" if k in r else "-"
    def speed(k):
        return f"{t[k] / m[k]:.2f}" if k in m and k in t and m[k] else "-"
    print(f"{op:<22} {dt:<5} {ms(m, 'fwd_ms'):>9} {ms(t, 'fwd_ms'):>9} {speed('fwd_ms'):>6} "
          f"{ms(m, 'fwd_bwd_ms'):>9} {ms(t, 'fwd_bwd_ms'):>9} {speed('fwd_bwd_ms'):>6}  {m.get('path', '')}")
print("ms per call (median of 5 rounds); x = torch's time / ours (> 1: ours faster)")
TABLE
