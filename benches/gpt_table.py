"""Joins benches/gpt_throughput.sh's JSON lines into one markdown table: per model and half
type, each mixprec row against PyTorch eager (flash SDPA) of the same model and type.
    python3 benches/gpt_table.py gpt.jsonl"""
import json, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
half = lambda r: {"o2-bf16": "bf16", "o1-bf16": "bf16", "o2-f16": "fp16", "o1-f16": "fp16", "o0": "fp32"}.get(r["mode"], r["mode"])
base = {(r["model"], half(r)): r for r in rows if r.get("side") == "torch" and not r.get("compile")}
print("| model | side | mode | step | tokens/s | vs torch eager | step ms | peak MiB | first step s | skipped | loss last |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    if "tokens_per_s" not in r:
        print(f"| {r.get('model')} | {r.get('side')} | {r.get('mode')} | error: {r.get('error', '?')} |")
        continue
    b = base.get((r["model"], half(r)))
    how = ("captured" if r.get("captured") else "eager") if r["side"] == "mixprec" else ("compile" if r.get("compile") else "eager")
    if r["side"] == "mixprec":
        how += f", {r.get('attention', '?').lower()} attention"
        if r.get("checkpoint_activations"):
            how += ", checkpointed"
    ratio = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if b else "-"
    print(f"| {r['model']} | {r['side']} | {r['mode']} | {how} | {r['tokens_per_s']:,.0f} | {ratio} | {r['step_ms']:.1f} | "
          f"{r['peak_alloc_mib']:,.0f} | {r['first_step_s']:.1f} | {r.get('skipped', '-')} | {r.get('loss_last', float('nan')):.3f} |")
