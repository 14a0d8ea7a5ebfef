"""Joins benches/gpt_throughput.sh's JSON lines into one markdown table: per model and half
type, each mixprec row against PyTorch eager (flash SDPA) of the same model, type and number of
GPUs, and each several-GPU row against its own one-GPU row (the scaling; tokens/s count every
GPU's tokens).
    python3 benches/gpt_table.py gpt.jsonl"""
import json, sys

rows = [r for r in (json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")) if "profile" not in r]
half = lambda r: {"o2-bf16": "bf16", "o1-bf16": "bf16", "o2-f16": "fp16", "o1-f16": "fp16", "o0": "fp32"}.get(r["mode"], r["mode"])
world = lambda r: r.get("world", 1)
base = {(r["model"], half(r), world(r)): r for r in rows
        if r.get("side") == "torch" and not r.get("compile") and "tokens_per_s" in r}


def how(r):
    if r["side"] == "mixprec":
        h = ("captured" if r.get("captured") else "eager") + f", {r.get('attention', '?').lower()} attention"
        return h + (", checkpointed" if r.get("checkpoint_activations") else "")
    return "compile" if r.get("compile") else "eager"


# The one-GPU row of the same side, model, mode and step: what a several-GPU row scales.
single = {(r["side"], r["model"], r["mode"], how(r)): r for r in rows if "tokens_per_s" in r and world(r) == 1}
print("| model | side | mode | step | GPUs | tokens/s | vs torch eager | vs 1 GPU | step ms | peak MiB | first step s | skipped | loss last |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    if "tokens_per_s" not in r:
        print(f"| {r.get('model')} | {r.get('side')} | {r.get('mode')} | error: {r.get('error', '?')} |")
        continue
    b = base.get((r["model"], half(r), world(r)))
    ratio = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if b else "-"
    one = single.get((r["side"], r["model"], r["mode"], how(r)))
    scaling = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}x" if one and world(r) > 1 else "-"
    print(f"| {r['model']} | {r['side']} | {r['mode']} | {how(r)} | {world(r)} | {r['tokens_per_s']:,.0f} | {ratio} | {scaling} | "
          f"{r['step_ms']:.1f} | {r['peak_alloc_mib']:,.0f} | {r['first_step_s']:.1f} | {r.get('skipped', '-')} | "
          f"{r.get('loss_last', float('nan')):.3f} |")
