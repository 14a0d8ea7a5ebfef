"""The learning check's PyTorch half: trains the GPT of a `train_gpt` run in PyTorch on the same
tokens from the same initial weights (what `examples/train_gpt_twin.rs` exported into RUN/twin),
with the run's recipe (RUN/config.json): AdamW (betas 0.9/0.95, eps 1e-8, decay on the matrices
only: none on biases, norms and embeddings), linear warm-up then cosine to min_lr, clipping,
gradient accumulation, dropout on attention probabilities and residual branches, bf16 autocast
(f16 with a GradScaler, or f32 at O0), and the val loss on the run's val batches at every
evaluation. Prints one JSON line per evaluation, then the table beside the run's own val losses
(RUN/metrics.jsonl).

    python3 benches/torch_train_gpt_twin.py RUN [--device cuda]
"""
import argparse, json, math, os, time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

ap = argparse.ArgumentParser()
ap.add_argument("run")
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = ap.parse_args()
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = args.device
r = json.load(open(os.path.join(args.run, "config.json")))
g = r["gpt"]
B, T, K = r["batch_size"], r["context"], r["grad_accum"]
heads, drop = g["n_head"], g["dropout"]
twin = os.path.join(args.run, "twin")
train = torch.from_numpy(np.fromfile(os.path.join(twin, "train.u16"), dtype="<u2").astype(np.int64))
val = torch.from_numpy(np.fromfile(os.path.join(twin, "val.u16"), dtype="<u2").astype(np.int64))
train, val = train.view(-1, B, T + 1), val.view(-1, B, T + 1)
assert train.shape[0] == r["steps"] * K, f"{train.shape[0]} train batches for {r['steps']} x {K}"
w = load_file(os.path.join(twin, "init.safetensors"))
p = {k: torch.nn.Parameter(v.float().to(dev)) for k, v in w.items()}
layers = g["n_layer"]


def ln(h, name):
    return F.layer_norm(h, (h.shape[-1],), p[name + ".weight"], p[name + ".bias"], 1e-5)


def lin(h, name):
    return F.linear(h, p[name + ".weight"], p[name + ".bias"])


def loss_of(x, y, training):
    d = drop if training else 0.0
    b, t = x.shape
    h = p["transformer.wte.weight"][x] + p["transformer.wpe.weight"][:t]
    for i in range(layers):
        pre = f"transformer.h.{i}."
        qkv = lin(ln(h, pre + "ln_1"), pre + "attn.c_attn")
        c = qkv.shape[-1] // 3
        q, k, v = qkv.view(b, t, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=d)
        o = o.transpose(1, 2).reshape(b, t, c)
        h = h + F.dropout(lin(o, pre + "attn.c_proj"), d, training)
        m = F.gelu(lin(ln(h, pre + "ln_2"), pre + "mlp.c_fc"), approximate="tanh")
        h = h + F.dropout(lin(m, pre + "mlp.c_proj"), d, training)
    logits = F.linear(ln(h, "transformer.ln_f"), p["transformer.wte.weight"])
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))


# GPT-2's rule, as ParamGroups::weight_decay_split: decay on matrices, not on embeddings.
decay = [v for k, v in p.items() if v.dim() >= 2 and "wte" not in k and "wpe" not in k]
no_decay = [v for k, v in p.items() if not (v.dim() >= 2 and "wte" not in k and "wpe" not in k)]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": r["weight_decay"]},
                         {"params": no_decay, "weight_decay": 0.0}],
                        lr=r["lr"], betas=(0.9, 0.95), eps=1e-8, fused=dev == "cuda")
half = None if r["opt_level"] == "O0" else {"bf16": torch.bfloat16, "f16": torch.float16}[r["half"]]
scaler = torch.amp.GradScaler(dev, enabled=half == torch.float16)


def lr_at(step):
    base, low, warm, total = r["lr"], r["min_lr"], r["warmup"], r["steps"]
    if step < warm:
        return base * (step + 1) / warm
    if total == warm:
        return low
    pct = (min(step, total) - warm) / (total - warm)
    return low + (base - low) / 2 * (math.cos(math.pi * pct) + 1)


def evaluate():
    with torch.no_grad(), torch.autocast(dev, dtype=half or torch.float32, enabled=half is not None):
        ls = [loss_of(v[:, :-1].to(dev), v[:, 1:].to(dev), False).item() for v in val]
    return sum(ls) / len(ls)


ours = {}
mpath = os.path.join(args.run, "metrics.jsonl")
if os.path.exists(mpath):
    for line in open(mpath):
        rec = json.loads(line)
        ours[rec["step"]] = rec.get("test_loss")
rows, start = [], time.perf_counter()
for step in range(r["steps"]):
    for grp in opt.param_groups:
        grp["lr"] = lr_at(step)
    opt.zero_grad(set_to_none=True)
    for j in range(K):
        batch = train[step * K + j]
        x, y = batch[:, :-1].to(dev), batch[:, 1:].to(dev)
        with torch.autocast(dev, dtype=half or torch.float32, enabled=half is not None):
            loss = loss_of(x, y, True) / K
        scaler.scale(loss).backward()
    scaler.unscale_(opt)
    if r["clip"] > 0:
        torch.nn.utils.clip_grad_norm_(list(p.values()), r["clip"])
    scaler.step(opt)
    scaler.update()
    done = step + 1
    if done % r["eval_every"] == 0 or done == r["steps"]:
        v = evaluate()
        mine = ours.get(done)
        row = {"side": "torch", "step": done, "val_loss": round(v, 4), "mixprec_val_loss": mine,
               "diff_pct": None if mine is None else round(100 * (mine - v) / v, 2),
               "seconds": round(time.perf_counter() - start, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
print(f"\n| step | mixprec val | PyTorch val | difference |\n|---|---|---|---|")
for row in rows:
    m = row["mixprec_val_loss"]
    print(f"| {row['step']} | {m if m is None else f'{m:.4f}'} | {row['val_loss']:.4f} | "
          + ("" if m is None else f"{row['diff_pct']:+.2f}%") + " |")
