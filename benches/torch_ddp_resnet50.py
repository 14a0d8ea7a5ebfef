"""PyTorch's side of benches/ddp_resnet50.rs: the ResNet-50 training step (batch 256 by default,
synthetic 224x224 images on the GPU, NCHW, f16 autocast + GradScaler, fused SGD with momentum)
unwrapped and wrapped in DistributedDataParallel over NCCL, timed in alternating rounds, one
synchronisation per round. Run it under torchrun (any number of processes, one GPU each):

    python3 -m torch.distributed.run --standalone --nproc_per_node=1 benches/torch_ddp_resnet50.py

Prints one JSON line (rank 0). Environment: NET (resnet50, or main-job: the Fashion-MNIST job's
ResNet 16-32-64 on 1x28x28, as benches/torch_capture_speed.py builds it), BATCH (256; 128 for
main-job), ROUNDS (7), STEPS per round (6), WARMUP steps (5), as the Rust bench. CAPTURE=1 adds
a third contender, the DDP step captured whole with torch.cuda.graph as PyTorch documents it for
DDP (built and warmed up for 11 iterations on a side stream, then captured; the learning rate a
device tensor); if PyTorch refuses, the JSON says why. SYNC_BN=1 converts the wrapped models'
batch norms to nn.SyncBatchNorm (the unwrapped one keeps BatchNorm2d), as the Rust bench does.
"""
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    small = os.environ.get("NET") == "main-job"
    batch = int(os.environ.get("BATCH", 128 if small else 256))
    rounds = int(os.environ.get("ROUNDS", 7))
    steps = int(os.environ.get("STEPS", 6))
    warmup = int(os.environ.get("WARMUP", 5))
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    if small:
        x = torch.randn(batch, 1, 28, 28, device=dev)
        y = torch.randint(0, 10, (batch,), device=dev)
    else:
        x = torch.randn(batch, 3, 224, 224, device=dev)
        y = torch.randint(0, 1000, (batch,), device=dev)

    def make_net():
        torch.manual_seed(0)
        if small:
            from torch_capture_speed import main_job
            return main_job().to(dev)
        return torchvision.models.resnet50().to(dev)

    def build(wrap, lr=0.01):
        net = make_net()
        if wrap and os.environ.get("SYNC_BN") == "1":
            net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        model = nn.parallel.DistributedDataParallel(
            net, device_ids=[local], bucket_cap_mb=25, gradient_as_bucket_view=True
        ) if wrap else net
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, fused=True)
        scaler = torch.amp.GradScaler("cuda")
        return model, opt, scaler

    def step(model, opt, scaler, xs=x, ys=y, set_to_none=True):
        opt.zero_grad(set_to_none=set_to_none)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(xs), ys)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    runs = {"unwrapped": (lambda r: lambda: step(*r))(build(False)),
            "ddp": (lambda r: lambda: step(*r))(build(True))}
    note = None
    if os.environ.get("CAPTURE") == "1":
        try:
            runs["ddp_captured"] = captured_ddp(build, step, x, y)
        except Exception as e:  # report, do not fail the other contenders
            note = f"captured DDP step refused: {type(e).__name__}: {e}"[:300]
    for _ in range(warmup):
        for r in runs.values():
            r()
    torch.cuda.synchronize()
    times = {k: [] for k in runs}
    names = list(runs)
    for i in range(rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        for k in order:
            t0 = time.perf_counter()
            for _ in range(steps):
                runs[k]()
            torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t0) / steps)
    p, d = statistics.median(times["unwrapped"]), statistics.median(times["ddp"])
    extra = {}
    if "ddp_captured" in times:
        c = statistics.median(times["ddp_captured"])
        extra = {"ddp_captured_ms": round(1e3 * c, 3), "ddp_captured_img_per_s": round(batch / c, 1)}
    if note:
        extra["note"] = note
    if rank == 0:
        print(json.dumps({
            "check": "torch-ddp", "net": "main-job" if small else "resnet50",
            "world": world, "batch": batch, "sync_bn": os.environ.get("SYNC_BN") == "1", **extra,
            "unwrapped_ms": round(1e3 * p, 2), "ddp_ms": round(1e3 * d, 2),
            "ratio": round(d / p, 4),
            "unwrapped_img_per_s": round(batch / p, 1), "ddp_img_per_s": round(batch / d, 1),
            "rounds_ms": {k: [round(1e3 * t, 2) for t in v] for k, v in times.items()},
            "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        }), flush=True)
    dist.destroy_process_group()


def captured_ddp(build, step, x, y):
    """The DDP step captured whole, per PyTorch's notes on CUDA graphs with DDP: the wrapper
    built and warmed up (11 iterations) on a side stream, then the step captured with static
    inputs and gradients kept (zero_grad(set_to_none=False)); the learning rate a device tensor.
    Returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    static_x, static_y = x.clone(), y.clone()
    with torch.cuda.stream(side):
        model, opt, scaler = build(True, lr=torch.tensor(0.01, device=x.device))
        for _ in range(11):
            step(model, opt, scaler, static_x, static_y, set_to_none=False)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(model, opt, scaler, static_x, static_y, set_to_none=False)

    def replay():
        static_x.copy_(x)
        static_y.copy_(y)
        g.replay()

    return replay


if __name__ == "__main__":
    main()
