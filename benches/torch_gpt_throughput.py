"""PyTorch's side of benches/gpt_throughput.rs: the same GPT-2 training step, one configuration
per process, one JSON line with the same fields.

    python3 benches/torch_gpt_throughput.py [--model gpt2|gpt2-medium] [--mode bf16|fp16|fp32]
        [--compile] [--attention flash|math] [--batch 16] [--seq 1024] [--steps 20] [--warmup 5]
        [--profile]
    python3 -m torch.distributed.run --standalone --nproc_per_node=N \
        benches/torch_gpt_throughput.py --ddp [...]

The model is GPT-2 as nanoGPT and Hugging Face build it (pre-norm blocks, fused QKV, GELU-tanh,
head tied to the token embedding, vocabulary padded to 50304, GPT-2's init); the step is
autocast forward, cross-entropy in f32, (scaled) backward, clip 1.0, fused AdamW (lr 6e-4,
betas 0.9/0.95, weight decay 0.1 on every parameter), GradScaler update for fp16; random tokens on
the device; TF32 off. Skipped steps (fp16) are counted from the scale's history, read once at the
end.

--ddp (under torchrun): one rank per GPU, each on its own batch of --batch sequences, the model in
DistributedDataParallel(gradient_as_bucket_view=True) over NCCL (PyTorch's best eager DDP with
bf16 autocast, flash SDPA and fused AdamW); rank 0 prints, with "world", tokens_per_s counting
every rank's tokens over the slowest rank's time."""
import argparse, json, math, os, time

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {"tiny": (4, 4, 128), "small": (6, 6, 384), "gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024)}
VOCAB = 50304

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="gpt2", choices=sorted(SIZES))
ap.add_argument("--mode", default="bf16", choices=["bf16", "fp16", "fp32"])
ap.add_argument("--compile", action="store_true")
ap.add_argument("--attention", default="flash", choices=["flash", "math"])
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--seq", type=int, default=1024)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--warmup", type=int, default=5)
ap.add_argument("--profile", action="store_true", help="after timing, print the kernel table of 3 steps")
ap.add_argument("--ddp", action="store_true")
args = ap.parse_args()
if args.ddp and args.profile:
    ap.error("--profile runs steps on rank 0 alone: not with --ddp")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
start = time.perf_counter()


class Attention(nn.Module):
    def __init__(self, d, heads, std_proj):
        super().__init__()
        self.heads = heads
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        nn.init.normal_(self.c_attn.weight, 0.0, 0.02)
        nn.init.normal_(self.c_proj.weight, 0.0, std_proj)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if args.attention == "flash":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
            keep = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = s.masked_fill(~keep, float("-inf")).softmax(-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d, heads, layers):
        super().__init__()
        std_proj = 0.02 / math.sqrt(2 * layers)
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, std_proj)
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        nn.init.normal_(self.c_fc.weight, 0.0, 0.02)
        nn.init.normal_(self.c_proj.weight, 0.0, std_proj)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, layers, heads, d, context):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(context, d)
        nn.init.normal_(self.wte.weight, 0.0, 0.02)
        nn.init.normal_(self.wpe.weight, 0.0, 0.02)
        self.h = nn.ModuleList(Block(d, heads, layers) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe.weight[: idx.size(1)]
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def main():
    layers, heads, d = SIZES[args.model]
    b, t = args.batch, args.seq
    world, rank = 1, 0
    if args.ddp:
        import torch.distributed as dist
        dist.init_process_group("nccl")
        world, rank = dist.get_world_size(), dist.get_rank()
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    model = Gpt(layers, heads, d, t).cuda()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    run = model
    if args.ddp:
        run = nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()],
                                                  gradient_as_bucket_view=True)
    run = torch.compile(run) if args.compile else run
    # Each rank its own batch.
    torch.manual_seed(1 + rank)
    x = torch.randint(0, 50257, (b, t), device="cuda")
    y = torch.randint(0, 50257, (b, t), device="cuda")
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mode)
    scaler = torch.amp.GradScaler("cuda", enabled=args.mode == "fp16")
    scales = []

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=half or torch.float32, enabled=half is not None):
            loss = run(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        if scaler.is_enabled():
            scales.append(scaler._scale.clone())
        scaler.update()
        return loss

    loss_first = step().item()
    first_step_s = time.perf_counter() - start
    for _ in range(max(args.warmup, 1) - 1):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    scales.clear()
    if args.ddp:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if args.ddp:
        # The run's time is its slowest rank's.
        walls = [None] * world
        dist.all_gather_object(walls, wall)
        wall = max(walls)
        if rank != 0:
            dist.destroy_process_group()
            return
    # A skipped step lowers the scale that the next step uses.
    s = [float(v) for v in scales] + ([float(scaler._scale)] if scales else [])
    skipped = sum(1 for a, c in zip(s, s[1:]) if c < a)
    step_s = wall / args.steps
    flops = (6 * params + 12 * layers * d * t) * b * t
    print(json.dumps({
        "side": "torch", "model": args.model, "mode": args.mode, "compile": args.compile,
        "attention": args.attention, "world": world, "ddp": args.ddp, "batch": b, "seq": t, "params": params, "steps": args.steps,
        "tokens_per_s": round(world * b * t / step_s), "step_ms": round(1e3 * step_s, 2),
        "tflops": round(flops / step_s / 1e12, 1), "first_step_s": round(first_step_s, 2),
        "peak_alloc_mib": round(torch.cuda.max_memory_allocated() / 2**20),
        "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20),
        "skipped": skipped, "loss_first": round(loss_first, 4), "loss_last": round(float(loss), 4),
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}), flush=True)
    if args.profile:
        profile_kernels(step, 3)
    if args.ddp:
        dist.destroy_process_group()


def kernel_group(name):
    """What a kernel's time is spent on, from its name (a diagnostic grouping)."""
    n = name.lower()
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas")):
        return "matmul"
    if any(k in n for k in ("flash", "fmha", "attention")):
        return "attention"
    if "adam" in n or "multi_tensor" in n or "foreach" in n:
        return "optimizer"
    if "triton" in n:
        return "fused (triton)"
    if "norm" in n:
        return "layer norm"
    if "softmax" in n or "cross_entropy" in n or "nll" in n:
        return "cross-entropy"
    return "other"


def profile_kernels(step, steps):
    """The PyTorch profiler's kernel table per step: by group, then the 30 largest kernels."""
    from torch.profiler import profile, ProfilerActivity
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3 / steps, e.count // steps) for e in prof.key_averages()
            if e.device_time_total > 0]
    groups = {}
    for name, ms, _ in rows:
        g = kernel_group(name)
        groups[g] = groups.get(g, 0.0) + ms
    print(json.dumps({"profile": "groups", "ms_per_step": {g: round(v, 2) for g, v in
                      sorted(groups.items(), key=lambda kv: -kv[1])},
                      "total_ms": round(sum(groups.values()), 2)}), flush=True)
    for name, ms, count in sorted(rows, key=lambda r: -r[1])[:30]:
        print(f"  {ms:8.3f} ms  x{count:<4} {kernel_group(name):14} {name[:110]}", flush=True)


main()
