"""The block-stack twin over seeds (benches/block_twin_seeds.sh): per level and quantity, the root
mean square over seeds of mixprec's and PyTorch's relative error from the f64 reference, their
ratio, and in how many seeds mixprec's error was within PyTorch's x 1.02 (the per-seed criterion
of benches/torch_block_twin.py).

    python3 benches/block_twin_table.py DIR/seed*.jsonl
    python3 benches/block_twin_table.py FILE.jsonl     (one file of many seeds' rows)
"""
import json
import math
import sys
from collections import defaultdict


def main():
    rows = defaultdict(list)
    seeds = set()
    for path in sys.argv[1:]:
        lines = [json.loads(l) for l in open(path) if l.startswith("{")]
        for r in lines:
            # A file per seed (block_twin_seeds.sh), or one file of many (--seeds, --loss-only).
            seeds.add((path, r.get("seed", "")))
            rows[(r["level"], r["quantity"])].append(r)
    seeds = len(seeds)
    if not rows:
        print("no rows: did every seed fail?", file=sys.stderr)
        sys.exit(1)
    rms = lambda xs: math.sqrt(sum(x * x for x in xs) / len(xs))
    print(f"block-stack twin over {seeds} seeds: RMS of the relative error from the f64 reference")
    print(f"{'level':<8} {'quantity':<12} {'seeds':>5} {'ours RMS':>10} {'torch RMS':>10} {'ratio':>7} {'seeds ours <= torch x 1.02':>27}")
    for (level, what), rs in rows.items():
        o, t = rms([r["ours_rel_err"] for r in rs]), rms([r["torch_rel_err"] for r in rs])
        wins = sum(r["ours_rel_err"] <= r["torch_rel_err"] * 1.02 for r in rs)
        ratio = o / t if t else float("nan")
        print(f"{level:<8} {what:<12} {len(rs):>5} {o:>10.3e} {t:>10.3e} {ratio:>7.3f} {wins:>20} of {len(rs)}")
        print(json.dumps(dict(level=level, quantity=what, seeds=len(rs), ours_rms=o, torch_rms=t,
                              ratio=ratio, seeds_within=wins)), file=sys.stderr)
    # The loss's signed errors per seed (rows of torch_block_twin.py that carry them): a shared
    # sign across seeds, or token errors whose mean sits many standard errors from zero, is a
    # bias rather than chance.
    signed = [(lv, r) for (lv, what), rs in rows.items() if what == "loss" for r in rs
              if "ours_loss_err" in r]
    if signed:
        print("\nthe loss's signed error per level: mean over seeds (ours / torch), seeds with ours > 0,"
              " mean z of the token errors' mean (ours / torch), mean correlation of the token errors")
        for level in dict.fromkeys(lv for lv, _ in signed):
            rs = [r for lv, r in signed if lv == level]
            mean = lambda k: sum(r[k] for r in rs) / len(rs)
            pos = sum(r["ours_loss_err"] > 0 for r in rs)
            print(f"{level:<8} {mean('ours_loss_err'):>+10.3e} / {mean('torch_loss_err'):>+10.3e}  "
                  f"{pos:>2} of {len(rs)}  z {mean('ours_token_z'):>+6.2f} / {mean('torch_token_z'):>+6.2f}  "
                  f"corr {mean('token_err_corr'):.3f}")

    # Where the loss's error comes from, through the logits (rows that carry the parts): per
    # part, the RMS over seeds on each side and the RMS of ours minus torch's.
    parts = [(lv, r) for lv, r in signed if "ours_lse_part" in r]
    if parts:
        print("\nthe loss's error through the logits, RMS over seeds: ours / torch / (ours - torch)")
        names = ["from_logits", "lse_part", "target_part", "second_order", "scale_part"]
        for level in dict.fromkeys(lv for lv, _ in parts):
            rs = [r for lv, r in parts if lv == level]
            cells = []
            for n in names:
                o = rms([r["ours_" + n] for r in rs])
                t = rms([r["torch_" + n] for r in rs])
                d = rms([r["ours_" + n] - r["torch_" + n] for r in rs])
                cells.append(f"{n} {o:.2e} / {t:.2e} / {d:.2e}")
            print(f"{level:<8} " + "\n         ".join(cells))
            sc = rms([r["ours_scale"] for r in rs]), rms([r["torch_scale"] for r in rs])
            print(f"         logit stretch (RMS over seeds) {sc[0]:.2e} / {sc[1]:.2e}")


if __name__ == "__main__":
    main()
