"""PyTorch's side of the block-stack twin (issue 42's second acceptance check); runs AFTER
examples/block_twin.rs, which wrote DIR/init.safetensors (the GPT's initial weights under
Hugging Face GPT-2 names, as examples/gpt_twin.rs writes them, plus the batch x, y) and, per
level, DIR/ours_LEVEL.safetensors (its logits, loss and each token's loss as f32 and every
parameter's gradient, unscaled, as f32; the loss scale it used in the metadata).

    .gpu/bin/block_twin DIR [cuda|cpu] [--small]
    python3 benches/torch_block_twin.py DIR [--device cuda|cpu]

Many seeds in one process each (the scalar loss over hundreds of draws):

    .gpu/bin/block_twin DIR cuda --seeds 1-200 --loss-only --levels O2-bf16
    python3 benches/torch_block_twin.py DIR/seed* --loss-only --remove > rows.jsonl
    python3 benches/block_twin_table.py rows.jsonl

For each level it runs the same forward/backward in PyTorch:
  O0       f32, TF32 off
  O1-*     f32 weights, torch.autocast(half), the loss scaled by the scale mixprec used
           (GradScaler-like; 65536 unless mixprec's scaler said otherwise), gradients unscaled
  O2-*     the weights cast to the half type except the layer norms' (kept f32, as mixprec's
           keep_norm_fp32), autocast on, scaled likewise
and once in f64 (the reference, from the f32 weights). Per level it prints the relative L2 error
against the f64 reference of the logits, the loss, the vector of each token's loss (the loss
before its mean: a better-conditioned comparison than the scalar, whose error is a signed sum of
the tokens' that one draw decides) and the gradients (the largest over the
parameters, with that parameter's name), mixprec's beside PyTorch's, and the verdict: at O0,
within fp32 rounding (relative error <= 2^-14, as examples/op_twin.rs); at the half levels,
mixprec's error <= PyTorch's x 1.02 (ratio printed). One JSON line per row, then a table; exit
status 1 when a row fails."""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, safe_open

LEVELS = ["O0", "O1-bf16", "O1-f16", "O2-bf16", "O2-f16"]
HALF = {"bf16": torch.bfloat16, "f16": torch.float16}
F32_BOUND = 2.0 ** -14
HALF_SLACK = 0.02


def forward(p, x, y, heads, layers):
    def ln(h, name):
        return F.layer_norm(h, (h.shape[-1],), p[name + ".weight"], p[name + ".bias"], 1e-5)

    def lin(h, name):
        return F.linear(h, p[name + ".weight"], p[name + ".bias"])

    b, t = x.shape
    h = F.embedding(x, p["transformer.wte.weight"]) + p["transformer.wpe.weight"][:t]
    for i in range(layers):
        pre = f"transformer.h.{i}."
        qkv = lin(ln(h, pre + "ln_1"), pre + "attn.c_attn")
        c = qkv.shape[-1] // 3
        q, k, v = qkv.view(b, t, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        h = h + lin(o, pre + "attn.c_proj")
        h = h + lin(F.gelu(lin(ln(h, pre + "ln_2"), pre + "mlp.c_fc"), approximate="tanh"),
                    pre + "mlp.c_proj")
    logits = F.linear(ln(h, "transformer.ln_f"), p["transformer.wte.weight"])
    rows = logits.float().view(-1, logits.shape[-1])
    loss = F.cross_entropy(rows, y.view(-1))
    with torch.no_grad():
        token_loss = F.cross_entropy(rows, y.view(-1), reduction="none")
    return logits, loss, token_loss


def run(w, x, y, heads, layers, level, scale, dev, backward=True):
    """logits (f32), loss, each token's loss, {name: unscaled f32 gradient} at `level` ("ref" =
    f64); without `backward`, the forward only and no gradients."""
    half = HALF.get(level.split("-")[-1])
    p = {}
    for k, v in w.items():
        v = v.to(dev)
        if level == "ref":
            v = v.double()
        elif level.startswith("O2") and ".ln_" not in k:
            v = v.to(half)
        p[k] = v.detach().requires_grad_(backward)
    with torch.autocast(dev, dtype=half or torch.bfloat16, enabled=level.startswith(("O1", "O2"))):
        with torch.set_grad_enabled(backward):
            logits, loss, token_loss = forward(p, x, y, heads, layers)
    if not backward:
        return logits.detach().double(), loss.detach().double(), token_loss.double(), {}
    (loss * scale).backward()
    grads = {k: (v.grad.double() / scale) for k, v in p.items()}
    return logits.detach().double(), loss.detach().double(), token_loss.double(), grads


def loss_parts(side, logits, ref_logits, y, ref_tokens):
    """Where one side's loss error comes from, through its logits (f64 throughout): the loss
    recomputed from its logits minus the reference, split to first order into the
    log-sum-exp's part (sum_v p_v dz_v, p the reference softmax) and the target logit's
    (-dz_y), each a mean over tokens; the rest is second order. `scale` is the least-squares
    factor of the token-centred logit error on the token-centred reference logits (a shared
    stretch of every token's logits moves every token's loss the same way), and `scale_part`
    the loss it moves."""
    v = ref_logits.shape[-1]
    ref = ref_logits.reshape(-1, v)
    d = logits.double().reshape(-1, v) - ref
    yy = y.reshape(-1, 1)
    p = torch.softmax(ref, dim=1)
    lse = (p * d).sum(1)
    tgt = -d.gather(1, yy).squeeze(1)
    from_logits = F.cross_entropy(logits.double().reshape(-1, v), y.reshape(-1), reduction="none")
    total = (from_logits - ref_tokens.flatten()).mean().item()
    zc = ref - ref.mean(1, keepdim=True)
    dc = d - d.mean(1, keepdim=True)
    scale = ((dc * zc).sum() / (zc * zc).sum()).item()
    stretch = ((p * zc).sum(1) - zc.gather(1, yy).squeeze(1)).mean().item()
    out = {f"{side}_from_logits": total, f"{side}_lse_part": lse.mean().item(),
           f"{side}_target_part": tgt.mean().item(),
           f"{side}_second_order": total - lse.mean().item() - tgt.mean().item(),
           f"{side}_scale": scale, f"{side}_scale_part": scale * stretch}
    del d, p, zc, dc
    return out


def rel(a, r):
    a, r = a.double().flatten(), r.double().flatten()
    den = torch.linalg.vector_norm(r).item()
    num = torch.linalg.vector_norm(a - r).item()
    return num / den if den else num


def compare(directory, dev, loss_only):
    """The rows of one seed's directory (printed as JSON lines as they come) and the shape."""
    path = os.path.join(directory, "init.safetensors")
    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
    w = load_file(path)
    x, y = w.pop("x").to(dev), w.pop("y").to(dev)
    layers = 1 + max(int(k.split(".")[2]) for k in w if k.startswith("transformer.h."))
    heads = int(meta["n_head"])
    ref_logits, ref_loss, ref_tokens, ref_grads = run(w, x, y, heads, layers, "ref", 1.0, dev,
                                                      backward=not loss_only)
    rows = []
    for level in LEVELS:
        ours_path = os.path.join(directory, f"ours_{level}.safetensors")
        if not os.path.exists(ours_path):
            print(f"{ours_path} missing: {level} skipped", file=sys.stderr)
            continue
        with safe_open(ours_path, "pt") as f:
            ometa = f.metadata() or {}
        ours = load_file(ours_path, device=dev)
        scale = float(ometa.get("loss_scale", "1"))
        t_logits, t_loss, t_tokens, t_grads = run(w, x, y, heads, layers, level, scale, dev,
                                                  backward=not loss_only)

        def grad_err(get):
            worst, name = -1.0, ""
            for k in ref_grads:
                e = rel(get(k), ref_grads[k])
                if e > worst:
                    worst, name = e, k
            return worst, name

        # The loss's error is the mean of the tokens' (signed): how much of it is a shared sign
        # rather than chance shows in each side's mean token error against its spread (a
        # z-score: the mean over the standard error of N independent errors), and in how much
        # the two sides' token errors agree.
        e_ours = ours["token_loss"].double().flatten() - ref_tokens.flatten()
        e_torch = t_tokens.flatten() - ref_tokens.flatten()
        n_tok = e_ours.numel()
        z = lambda e: (e.mean() / (e.std() / n_tok ** 0.5)).item()
        signed = dict(ours_loss_err=(ours["loss"].double() - ref_loss).item(),
                      torch_loss_err=(t_loss - ref_loss).item(),
                      ours_token_mean=e_ours.mean().item(), torch_token_mean=e_torch.mean().item(),
                      ours_token_z=z(e_ours), torch_token_z=z(e_torch),
                      token_err_corr=torch.corrcoef(torch.stack([e_ours, e_torch]))[0, 1].item())
        quantities = [
            ("loss", rel(ours["loss"], ref_loss), rel(t_loss, ref_loss), ""),
            ("token losses", rel(ours["token_loss"], ref_tokens), rel(t_tokens, ref_tokens), ""),
        ]
        if not loss_only:
            signed.update(loss_parts("ours", ours["logits"], ref_logits, y, ref_tokens))
            signed.update(loss_parts("torch", t_logits, ref_logits, y, ref_tokens))
            g_ours, n_ours = grad_err(lambda k: ours["grad." + k])
            g_torch, n_torch = grad_err(lambda k: t_grads[k])
            quantities = [
                ("logits", rel(ours["logits"], ref_logits), rel(t_logits, ref_logits), ""),
                *quantities,
                ("grads (max)", g_ours, g_torch, f"ours worst {n_ours}; torch worst {n_torch}"),
            ]
        for what, eo, et, note in quantities:
            if level == "O0":
                crit, ok = "ours <= 2^-14", eo <= F32_BOUND
            else:
                crit, ok = "ours <= torch x 1.02", eo <= et * (1 + HALF_SLACK)
            ratio = eo / et if et else (1.0 if eo == 0 else float("inf"))
            row = dict(seed=os.path.basename(os.path.normpath(directory)), level=level,
                       quantity=what, ours_rel_err=eo, torch_rel_err=et, ratio=ratio,
                       criterion=crit, pass_=ok and eo == eo, loss_scale=scale,
                       attention=ometa.get("attention", ""), note=note)
            if what == "loss":
                row.update(signed)
            rows.append(row)
            print(json.dumps({k.rstrip("_"): v for k, v in row.items()}), flush=True)
        del ours, t_logits, t_grads
    return rows, (layers, heads, tuple(x.shape))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", help="one directory per seed (block_twin's DIR)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--loss-only", action="store_true",
                    help="the forward only: the loss and each token's loss (block_twin --loss-only)")
    ap.add_argument("--remove", action="store_true",
                    help="delete each directory's .safetensors once compared (many seeds, one disk)")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = a.device
    rows = []
    for d in a.dirs:
        r, (layers, heads, shape) = compare(d, dev, a.loss_only)
        rows += r
        if a.remove:
            for f in os.listdir(d):
                if f.endswith(".safetensors"):
                    os.remove(os.path.join(d, f))
    if len(a.dirs) > 1:
        # Many seeds: the summary is benches/block_twin_table.py's, over the JSON lines.
        failed = sum(not r["pass_"] for r in rows)
        print(f"{len(a.dirs)} seeds, {len(rows)} rows, {len(rows) - failed} pass, {failed} fail")
        sys.exit(0 if rows else 1)
    print()
    print(f"block-stack twin ({layers} layers, {heads} heads, batch {shape}, {dev}): "
          "relative L2 error against torch's f64 reference")
    print(f"{'level':<8} {'quantity':<12} {'ours':>10} {'torch':>10} {'ratio':>7}  {'':<6} criterion / note")
    for r in rows:
        print(f"{r['level']:<8} {r['quantity']:<12} {r['ours_rel_err']:>10.3e} {r['torch_rel_err']:>10.3e} "
              f"{r['ratio']:>7.3f}  {'PASS' if r['pass_'] else 'FAIL':<6} {r['criterion']}"
              f"{'; ' + r['note'] if r['note'] else ''}; scale {r['loss_scale']:g}; attention {r['attention']}")
    failed = sum(not r["pass_"] for r in rows)
    print(f"{len(rows)} rows, {len(rows) - failed} pass, {failed} fail")
    sys.exit(1 if failed or not rows else 0)


if __name__ == "__main__":
    main()
