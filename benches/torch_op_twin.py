"""PyTorch's side of the per-op twin (issue 42's first acceptance check); runs FIRST, then
examples/op_twin.rs reads what it wrote and compares.

    python3 benches/torch_op_twin.py DIR [--device cuda|cpu] [--small] [--ops a,b,...]
    cargo run --release --example op_twin -- DIR [cuda|cpu]        (or .gpu/bin/op_twin DIR)

For each op it writes DIR/OP.safetensors holding, for each dtype DT in f32, f16, bf16:
  DT.in.NAME         the op's seeded inputs in DT (integer ids and the SDPA mask as they are used)
  DT.gy.OUT          the upstream gradient of each output, in the output's dtype
  DT.torch.OUT       PyTorch's output in DT, stored as f32 (exact)
  DT.torch.grad.NAME PyTorch's gradient of each differentiable input, stored as f32 (exact)
  DT.ref.OUT, DT.ref.grad.NAME   the same computed by torch in f64 from DT's inputs (so the
                     reference measures the op's own error, not the rounding of its inputs)
and in the header's metadata: the op, its options, the differentiable inputs and outputs, the
length of its longest reduction, torch's version and device. GPT-2-like shapes by default;
--small shrinks them for a CPU run. TF32 is off (torch.backends.*.allow_tf32 = False).

How torch runs each op in a half dtype: the op itself on the half tensors (layer_norm's
parameters in the input's dtype), except cross-entropy, which runs as autocast runs it (the
logits cast to f32, the gradient cast back to the logits' dtype)."""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def shapes(small):
    if small:
        return dict(rows=64, c=48, hidden=96, vocab=300, ids=256, b=2, t=64, h=3, d=16, sm=80,
                    ce_rows=96)
    return dict(rows=4096, c=768, hidden=3072, vocab=50304, ids=4096, b=4, t=256, h=12, d=64,
                sm=1024, ce_rows=2048)


def specs(s, gen):
    """Each op: its inputs (f64 masters), the differentiable ones, options, and its function
    of (inputs, dtype) giving the named outputs."""

    def randn(*shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * std + mean

    R, C = s["rows"], s["c"]
    out = {}
    x = randn(R, C, std=2.0, mean=0.5)
    out["layer_norm"] = dict(
        inputs=dict(x=x, weight=randn(C, std=0.2, mean=1.0), bias=randn(C, std=0.2)),
        grads=["x", "weight", "bias"], opts=dict(eps=1e-5), reduce=R,
        fn=lambda i, dt: dict(y=F.layer_norm(i["x"], (C,), i["weight"], i["bias"], 1e-5)))
    out["rms_norm"] = dict(
        inputs=dict(x=randn(R, C, std=2.0, mean=0.5), weight=randn(C, std=0.2, mean=1.0)),
        grads=["x", "weight"], opts=dict(eps=1e-5), reduce=R,
        fn=lambda i, dt: dict(y=F.rms_norm(i["x"], (C,), i["weight"], 1e-5)))
    for name, f in [("gelu", lambda v: F.gelu(v)),
                    ("gelu_tanh", lambda v: F.gelu(v, approximate="tanh")),
                    ("silu", F.silu)]:
        out[name] = dict(inputs=dict(x=randn(R, C, std=2.0)), grads=["x"], opts={}, reduce=1,
                         fn=lambda i, dt, f=f: dict(y=f(i["x"])))
    out["softmax"] = dict(inputs=dict(x=randn(R // 2, s["sm"], std=3.0)), grads=["x"],
                          opts=dict(dim=-1), reduce=s["sm"],
                          fn=lambda i, dt: dict(y=F.softmax(i["x"], -1)))
    out["log_softmax"] = dict(inputs=dict(x=randn(R // 2, s["sm"], std=3.0)), grads=["x"],
                              opts=dict(dim=-1), reduce=s["sm"],
                              fn=lambda i, dt: dict(y=F.log_softmax(i["x"], -1)))
    ids = torch.randint(0, s["vocab"], (s["ids"],), generator=gen)
    ids[: s["ids"] // 8] = ids[s["ids"] // 8: s["ids"] // 4]  # repeated rows: sums in the backward
    out["embedding"] = dict(
        inputs=dict(ids=ids, weight=randn(s["vocab"], C, std=0.02)), grads=["weight"], opts={},
        reduce=s["ids"], fn=lambda i, dt: dict(y=F.embedding(i["ids"], i["weight"])))
    B, T = s["b"], s["ids"] // s["b"]
    out["linear"] = dict(
        inputs=dict(x=randn(B, T, C), weight=randn(s["hidden"], C, std=0.02),
                    bias=randn(s["hidden"], std=0.02)),
        grads=["x", "weight", "bias"], opts={}, reduce=B * T,
        fn=lambda i, dt: dict(y=F.linear(i["x"], i["weight"], i["bias"])))
    b, h, t, d = s["b"], s["h"], s["t"], s["d"]
    out["bmm"] = dict(
        inputs=dict(a=randn(b, h, t, d), b=randn(b, h, d, t)), grads=["a", "b"], opts={},
        reduce=t, fn=lambda i, dt: dict(y=torch.matmul(i["a"], i["b"])))
    qkv = lambda: dict(q=randn(b, h, t, d), k=randn(b, h, t, d), v=randn(b, h, t, d))
    out["sdpa_causal"] = dict(
        inputs=qkv(), grads=["q", "k", "v"], opts=dict(causal=True), reduce=t,
        fn=lambda i, dt: dict(y=F.scaled_dot_product_attention(i["q"], i["k"], i["v"],
                                                               is_causal=True)))
    out["sdpa"] = dict(
        inputs=qkv(), grads=["q", "k", "v"], opts=dict(causal=False), reduce=t,
        fn=lambda i, dt: dict(y=F.scaled_dot_product_attention(i["q"], i["k"], i["v"])))
    mask = randn(b, 1, t, t)
    drop = torch.rand(b, 1, t, t, generator=gen, dtype=torch.float64) < 0.2
    drop &= ~torch.eye(t, dtype=torch.bool)  # no row masked out entirely
    mask[drop] = float("-inf")
    m = dict(qkv(), mask=mask)
    out["sdpa_mask"] = dict(
        inputs=m, grads=["q", "k", "v"], opts=dict(causal=False, mask="[B, 1, T, T], -inf at ~20%"),
        reduce=t,
        fn=lambda i, dt: dict(y=F.scaled_dot_product_attention(i["q"], i["k"], i["v"],
                                                               attn_mask=i["mask"])))
    n, v = s["ce_rows"], s["vocab"]
    tg = torch.randint(0, v, (n,), generator=gen)
    tg[torch.rand(n, generator=gen) < 0.1] = -100

    def ce(i, dt):
        logits = i["logits"]
        if dt != torch.float64:
            logits = logits.float()  # autocast's class for cross_entropy: f32
        return dict(loss=F.cross_entropy(logits, i["targets"], ignore_index=-100,
                                         label_smoothing=0.1))

    out["cross_entropy"] = dict(
        inputs=dict(logits=randn(n, v, std=2.0), targets=tg), grads=["logits"],
        opts=dict(ignore_index=-100, label_smoothing=0.1, reduction="mean"), reduce=v, fn=ce)
    return out


def run(spec, inputs, dt, dev, gys=None, gen=None):
    """The op on `inputs` cast to dt (float ones): outputs, gradients, inputs and upstream grads."""
    ins = {}
    for k, t in inputs.items():
        t = t.to(dev)
        if t.is_floating_point():
            t = t.to(dt).detach().requires_grad_(k in spec["grads"])
        ins[k] = t
    outs = spec["fn"](ins, dt)
    if gys is None:  # seeded upstream gradients in each output's dtype
        gys = {k: torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype).to(dev)
               for k, o in outs.items()}
    torch.autograd.backward([outs[k] for k in outs], [gys[k].to(dev).to(outs[k].dtype)
                                                     for k in outs])
    grads = {k: ins[k].grad for k in spec["grads"]}
    return ins, outs, grads, gys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="small shapes (a CPU run)")
    ap.add_argument("--ops", default="", help="comma-separated subset")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(a.dir, exist_ok=True)
    gen = torch.Generator().manual_seed(42)
    all_specs = specs(shapes(a.small), gen)
    chosen = [o for o in a.ops.split(",") if o] or list(all_specs)
    for op in chosen:
        spec = all_specs[op]
        tensors = {}
        for name, dt in DTYPES.items():
            ins, outs, grads, gys = run(spec, spec["inputs"], dt, a.device, gen=gen)
            # The reference: f64 from the same (rounded) inputs and the same upstream gradients.
            rounded = {k: v.detach().cpu().to(torch.float64) if v.is_floating_point() else v.cpu()
                       for k, v in ins.items()}
            _, routs, rgrads, _ = run(spec, rounded, torch.float64, a.device,
                                      gys={k: g.to(torch.float64) for k, g in gys.items()})
            cpu = lambda t: t.detach().cpu().contiguous().clone()
            for k, v in ins.items():
                tensors[f"{name}.in.{k}"] = cpu(v)
            for k, g in gys.items():
                tensors[f"{name}.gy.{k}"] = cpu(g)
            for k, o in outs.items():
                tensors[f"{name}.torch.{k}"] = cpu(o).float()
                tensors[f"{name}.ref.{k}"] = cpu(routs[k])
            for k, g in grads.items():
                tensors[f"{name}.torch.grad.{k}"] = cpu(g).float()
                tensors[f"{name}.ref.grad.{k}"] = cpu(rgrads[k])
        meta = dict(op=op, opts=json.dumps(spec["opts"]), grads=",".join(spec["grads"]),
                    outputs=",".join(outs), reduce=str(spec["reduce"]), torch=torch.__version__,
                    device=str(torch.cuda.get_device_name() if a.device == "cuda" else "cpu"))
        save_file(tensors, os.path.join(a.dir, f"{op}.safetensors"), metadata=meta)
        print(f"wrote {op}.safetensors ({sum(t.numel() * t.element_size() for t in tensors.values()) >> 20} MiB)",
              flush=True)


if __name__ == "__main__":
    main()
