"""PyTorch's side of benches/op_speed.rs: layer norm forward and forward+backward at
[16384, 768] (parameters in the input's dtype, and f32) and causal F.scaled_dot_product_attention
at [16, 12, 1024, 64], in bf16 and f16, timed as the Rust side times them (warm-up calls, then
5 rounds of ITERS back-to-back calls with one synchronisation each, the median round; the
forward+backward is (y * gy).sum() and its backward, the inputs' gradients dropped first). One
JSON line a row.

    python3 benches/torch_op_speed.py [--dtypes bf16,f16] [--iters 50] [--warmup 10] [--small]
    python3 benches/torch_op_speed.py --device cpu --small --iters 2    (a smoke test)"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

DT = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def timed(warm, iters, f, sync):
    for _ in range(warm):
        f()
    sync()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            f()
        sync()
        ts.append((time.perf_counter() - t) / iters)
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bf16,f16")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--bench", action="store_true", help="ignored (the Rust side's cargo flag)")
    a = ap.parse_args()
    dev = a.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, dt, mean=0.0, std=1.0, grad=False):
        t = torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * std + mean
        return t.to(dt).requires_grad_(grad)

    def row(op, dt, shape, fwd, fwd_bwd, **extra):
        print(json.dumps(dict(side="pytorch", op=op, dtype=dt, shape=list(shape),
                              fwd_ms=round(fwd * 1e3, 4), fwd_bwd_ms=round(fwd_bwd * 1e3, 4),
                              **extra)), flush=True)

    for name in a.dtypes.split(","):
        dt = DT[name]
        rows, c = (256, 768) if a.small else (16384, 768)
        x = randn(rows, c, dt=dt, grad=True)
        gy = randn(rows, c, dt=dt)
        for pdt in ([dt] if dt == torch.float32 else [dt, torch.float32]):
            w = randn(c, dt=pdt, mean=1.0, std=0.1, grad=True)
            b = randn(c, dt=pdt, std=0.1, grad=True)

            def fwd():
                with torch.no_grad():
                    F.layer_norm(x, (c,), w, b, 1e-5)

            def fwd_bwd():
                x.grad = w.grad = b.grad = None
                (F.layer_norm(x, (c,), w, b, 1e-5) * gy).sum().backward()

            try:
                row("layer_norm" if pdt == dt else "layer_norm_f32_params", name, (rows, c),
                    timed(a.warmup, a.iters, fwd, sync), timed(a.warmup, a.iters, fwd_bwd, sync))
            except RuntimeError as e:  # mixed parameter dtypes are CUDA-only in some versions
                print(json.dumps(dict(side="pytorch", op="layer_norm_f32_params", dtype=name,
                                      error=str(e).splitlines()[0])), flush=True)
        shape = (2, 12, 256, 64) if a.small else (16, 12, 1024, 64)
        # q, k and v as a model holds them: [B, T, H, D] projections seen as [B, H, T, D].
        bthd = (shape[0], shape[2], shape[1], shape[3])
        q, k, v = (randn(*bthd, dt=dt).transpose(1, 2).detach().requires_grad_()
                   for _ in range(3))
        gy = randn(*shape, dt=dt)

        def afwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def afwd_bwd():
            q.grad = k.grad = v.grad = None
            (F.scaled_dot_product_attention(q, k, v, is_causal=True) * gy).sum().backward()

        row("sdpa_causal", name, shape, timed(a.warmup, a.iters, afwd, sync),
            timed(a.warmup, a.iters, afwd_bwd, sync), path="torch default dispatch")


if __name__ == "__main__":
    main()
