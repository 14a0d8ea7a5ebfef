"""Joins the JSON lines of benches/train_throughput.rs (mixprec) and
benches/torch_train_throughput.py (PyTorch) into one table: per network, mode and layout, mixprec
against PyTorch measured in the same call (and at the same batch). Usage: python3 benches/train_table.py FILE.jsonl"""
import json, sys

TWIN = {"o0": "fp32", "o2-f16": "fp16", "o2-bf16": "bf16"}
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
ours = [r for r in rows if r["side"] == "mixprec"]
theirs = {(r["net"], r["batch"], r["mode"], r["layout"], r["side"]): r for r in rows if r["side"] != "mixprec"}

def f(v, fmt="{:.0f}"):
    return "-" if v is None else fmt.format(v)

print("| net | mode | layout | mixprec img/s | PyTorch img/s | ratio | torch.compile img/s | ratio | mem mixprec / PyTorch MiB (ratio) | pool peak used MiB | first step s | syncs/step | skipped |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in ours:
    t = theirs.get((r["net"], r["batch"], TWIN[r["mode"]], r["layout"], "torch"))
    ratio = r["img_per_s"] / t["img_per_s"] if t else None
    c = theirs.get((r["net"], r["batch"], TWIN[r["mode"]], r["layout"], "torch-compile"))
    cratio = r["img_per_s"] / c["img_per_s"] if c else None
    mem = f"{r['device_used_mib']:.0f} / {f(t and t['device_used_mib'])}"
    if t:
        mem += f" ({r['device_used_mib'] / t['device_used_mib']:.2f})"
    print(f"| {r['net']} b{r['batch']} | {r['mode']} | {r['layout']} | {r['img_per_s']:.0f} | {f(t and t['img_per_s'])} | "
          f"{f(ratio, '{:.2f}')} | {f(c and c['img_per_s'])} | {f(cratio, '{:.2f}')} | {mem} | {r['pool_used_high_mib']:.0f} / {f(t and t['pool_used_high_mib'])} | "
          f"{r['first_step_s']:.1f} / {f(t and t['first_step_s'], '{:.1f}')} | {r['host_syncs_per_step']:.0f} | "
          f"{r['skipped']}/{r['total_steps']} vs {f(t and t['skipped'])}/{f(t and t['total_steps'])} |")
for k, t in theirs.items():
    if k[4] != "torch":
        print(f"| {t['net']} b{t['batch']} | {t['mode']} | {t['layout']} | ({t['side']}) | | | {t['img_per_s']:.0f} | | "
              f"{t['device_used_mib']:.0f} | | {t['first_step_s']:.1f} | | {t['skipped']} |")
