"""Where a training step's device time goes, mixprec beside PyTorch, grouped by what the time is
spent on (issue 46's profile table).

    python3 benches/profile_table.py FILE...

Each FILE is the stderr of `bench-train_throughput --profile` (its "profile NET MODE LAYOUT:"
header and "  op NAME N calls/step MS ms/step" rows: mixprec's per-op device time) or of
`benches/torch_train_throughput.py --profile` (one {"profile_kernel": ...} JSON line per kernel,
from the PyTorch profiler). The groups are named from the op (mixprec) or the kernel (PyTorch):
cuDNN's convolution kernels say fprop / dgrad / wgrad, Inductor's Triton kernels carry the aten
ops they fuse. Prints one markdown table, ms per step, a column per configuration, and each
column's largest uncategorised names, so that a new kernel name is seen rather than lost."""
import json, re, sys
from collections import defaultdict

GROUPS = [
    "conv forward", "conv data grad", "conv weight grad", "conv layout/other",
    "batch norm (+act, +add) forward", "batch norm (+act, +add) backward",
    "relu / add (separate)", "pooling", "classifier + loss", "optimizer + scaler",
    "casts / copies", "other",
]


def group_of_op(op):
    """mixprec's op names (tensor/storage.rs, multi_tensor.rs, fuse)."""
    if op == "conv2d":
        return "conv forward"
    if op in ("conv2d_backward_input", "conv2d_backward_input_add"):
        return "conv data grad"
    if op == "conv2d_backward_weight":
        return "conv weight grad"
    if op.startswith("batch_norm"):
        return ("batch norm (+act, +add) backward" if "backward" in op
                else "batch norm (+act, +add) forward")
    if op in ("relu_backward", "unary", "binary", "affine", "add"):
        return "relu / add (separate)"
    if "pool" in op:
        return "pooling"
    if op.startswith(("linear", "matmul", "cross_entropy", "softmax", "reduce", "argmax")):
        return "classifier + loss"
    if op.startswith(("multi_tensor", "Fused")) or op == "fuse":
        return "optimizer + scaler"
    if op in ("to_dtype", "copy_strided", "contiguous"):
        return "casts / copies"
    return "other"


def group_of_kernel(name):
    """PyTorch's kernel names (cuDNN, cuBLAS, ATen, Inductor's Triton)."""
    n = name.lower()
    if "dgrad" in n:
        return "conv data grad"
    if "wgrad" in n or "splitkreduce" in n:
        return "conv weight grad"
    if "fprop" in n:
        return "conv forward"
    # Before "conv": Inductor names a fused kernel after every aten op in it, and a batch norm's
    # backward fused with the residual's often carries "convolution_backward" in its name.
    if "batch_norm" in n or "batchnorm" in n or "bn_" in n or "welford" in n:
        return ("batch norm (+act, +add) backward"
                if "backward" in n or "bwd" in n or "bw_" in n or "bwtr" in n
                else "batch norm (+act, +add) forward")
    if "nchwtonhwc" in n or "nhwctonchw" in n or "conv" in n:
        return "conv layout/other"
    if "pool" in n:
        return "pooling"
    if ("multi_tensor" in n or "foreach" in n or "fused_sgd" in n or "amp_update_scale" in n
            or "non_finite" in n):
        return "optimizer + scaler"
    if "gemm" in n or "softmax" in n or "nll" in n or "cross_entropy" in n or "cutlass" in n:
        return "classifier + loss"
    if "relu" in n or "threshold" in n or "add" in n:
        return "relu / add (separate)"
    if "copy" in n or "cast" in n or "convert" in n:
        return "casts / copies"
    return "other"


def read(path):
    """{config: [(name, group, calls, ms)]} from one file."""
    out = defaultdict(list)
    config = None
    for line in open(path, errors="replace"):
        m = re.match(r"profile (\S+) (\S+) (\S+):", line)
        if m:
            config = f"mixprec {m.group(2)} {m.group(3)}"
            continue
        m = re.match(r"\s+op (\S+)\s+(\d+) calls/step\s+([\d.]+) ms/step", line)
        if m and config:
            op = m.group(1)
            out[config].append((op, group_of_op(op), int(m.group(2)), float(m.group(3))))
            continue
        if line.startswith("{") and "profile_kernel" in line:
            r = json.loads(line)
            c = f"{r['side']} {r['mode']} {r['layout']}"
            k = r["profile_kernel"]
            out[c].append((k, group_of_kernel(k), r["calls_per_step"], r["ms_per_step"]))
    return out


def main():
    configs = {}
    for p in sys.argv[1:]:
        configs.update(read(p))
    if not configs:
        sys.exit("profile_table.py: no profile rows in " + " ".join(sys.argv[1:]))
    names = list(configs)
    sums = {c: defaultdict(float) for c in names}
    for c, rows in configs.items():
        for _, g, _, ms in rows:
            sums[c][g] += ms
    print("| ms per step | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for g in GROUPS:
        if any(sums[c][g] for c in names):
            print(f"| {g} | " + " | ".join(f"{sums[c][g]:.2f}" for c in names) + " |")
    print("| **device busy** | " + " | ".join(f"**{sum(sums[c].values()):.2f}**" for c in names) + " |")
    for c in names:
        other = sorted((r for r in configs[c] if r[1] == "other"), key=lambda r: -r[3])[:6]
        if other:
            print(f"\n{c}, largest 'other': " + "; ".join(f"{n[:70]} {ms:.2f}" for n, _, _, ms in other))
        top = sorted(configs[c], key=lambda r: -r[3])[:12]
        print(f"{c}, largest: " + "; ".join(f"{n[:60]} [{g}] {ms:.2f}" for n, g, _, ms in top))


if __name__ == "__main__":
    main()
