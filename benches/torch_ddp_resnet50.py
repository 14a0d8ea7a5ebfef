"""PyTorch's side of benches/ddp_resnet50.rs: the ResNet-50 training step (batch 256 by default,
synthetic 224x224 images on the GPU, NCHW, f16 autocast + GradScaler, fused SGD with momentum)
unwrapped and wrapped in DistributedDataParallel over NCCL, timed in alternating rounds, one
synchronisation per round. Run it at world size 1:

    python3 -m torch.distributed.run --standalone --nproc_per_node=1 benches/torch_ddp_resnet50.py

Prints one JSON line (rank 0). Environment: BATCH (256), ROUNDS (7), STEPS per round (6),
WARMUP steps (5), as the Rust bench.
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
    batch = int(os.environ.get("BATCH", 256))
    rounds = int(os.environ.get("ROUNDS", 7))
    steps = int(os.environ.get("STEPS", 6))
    warmup = int(os.environ.get("WARMUP", 5))
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    x = torch.randn(batch, 3, 224, 224, device=dev)
    y = torch.randint(0, 1000, (batch,), device=dev)

    def build(wrap):
        torch.manual_seed(0)
        net = torchvision.models.resnet50().to(dev)
        model = nn.parallel.DistributedDataParallel(
            net, device_ids=[local], bucket_cap_mb=25, gradient_as_bucket_view=True
        ) if wrap else net
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
        scaler = torch.amp.GradScaler("cuda")
        return model, opt, scaler

    def step(model, opt, scaler):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    runs = {"unwrapped": build(False), "ddp": build(True)}
    for _ in range(warmup):
        for r in runs.values():
            step(*r)
    torch.cuda.synchronize()
    times = {k: [] for k in runs}
    for i in range(rounds):
        order = ["unwrapped", "ddp"] if i % 2 == 0 else ["ddp", "unwrapped"]
        for k in order:
            t0 = time.perf_counter()
            for _ in range(steps):
                step(*runs[k])
            torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t0) / steps)
    p, d = statistics.median(times["unwrapped"]), statistics.median(times["ddp"])
    if rank == 0:
        print(json.dumps({
            "check": "torch-ddp-world1", "world": world, "batch": batch,
            "unwrapped_ms": round(1e3 * p, 2), "ddp_ms": round(1e3 * d, 2),
            "ratio": round(d / p, 4),
            "unwrapped_img_per_s": round(batch / p, 1), "ddp_img_per_s": round(batch / d, 1),
            "rounds_ms": {k: [round(1e3 * t, 2) for t in v] for k, v in times.items()},
            "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
