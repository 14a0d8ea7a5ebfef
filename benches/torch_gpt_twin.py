"""PyTorch's side of examples/gpt_twin.rs: the same GPT, the same initial weights and batch (read
from DIR/init.safetensors, which the example wrote), the same steps (AdamW lr as the example's,
betas 0.9/0.95, weight decay 0.1, clip 1.0); one loss per step, to set beside the example's.

    python3 benches/torch_gpt_twin.py DIR STEPS [cpu|cuda] [bf16]

bf16 runs the forward under torch.autocast (the twin of mixprec's O2 bf16); without it, f32."""
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

root, steps = sys.argv[1], int(sys.argv[2])
dev = sys.argv[3] if len(sys.argv) > 3 else "cpu"
half = len(sys.argv) > 4 and sys.argv[4] == "bf16"
w = load_file(root + "/init.safetensors")
x, y = w.pop("x").to(dev), w.pop("y").to(dev)
layers = 1 + max(int(k.split(".")[2]) for k in w if k.startswith("transformer.h."))
heads = 12 if layers == 12 else 2  # the example's two sizes: GPT-2 124M, or 2 layers of 2 heads
p = {k: torch.nn.Parameter(v.clone().to(dev)) for k, v in w.items()}


def ln(h, name):
    return F.layer_norm(h, (h.shape[-1],), p[name + ".weight"], p[name + ".bias"], 1e-5)


def lin(h, name):
    return F.linear(h, p[name + ".weight"], p[name + ".bias"])


def loss_of():
    b, t = x.shape
    h = p["transformer.wte.weight"][x] + p["transformer.wpe.weight"][:t]
    for i in range(layers):
        pre = f"transformer.h.{i}."
        qkv = lin(ln(h, pre + "ln_1"), pre + "attn.c_attn")
        c = qkv.shape[-1] // 3
        q, k, v = qkv.view(b, t, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        h = h + lin(o, pre + "attn.c_proj")
        h = h + lin(F.gelu(lin(ln(h, pre + "ln_2"), pre + "mlp.c_fc"), approximate="tanh"), pre + "mlp.c_proj")
    logits = F.linear(ln(h, "transformer.ln_f"), p["transformer.wte.weight"])
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))


opt = torch.optim.AdamW(list(p.values()), lr=6e-4 if layers == 12 else 1e-2, betas=(0.9, 0.95), weight_decay=0.1)
for s in range(steps):
    opt.zero_grad()
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=half):
        loss = loss_of()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(p.values()), 1.0)
    opt.step()
    print(f"step {s} loss {loss.item():.6f}")
