"""PyTorch's side of benches/data_parallel_resnet50.rs: the ResNet-50 training step
(channels_last, batch 256 per GPU by default, synthetic 224x224 images, f16 autocast +
GradScaler, fused SGD with momentum) on one GPU and in nn.DataParallel over every visible GPU
(or GPUS) at GPUS x BATCH images per step, the batch on cuda:0 as nn.DataParallel expects it.
Timed in rotating rounds, one synchronisation per round; prints one JSON line.

nn.DataParallel runs twice: with cudnn.benchmark on (as the one-GPU step) and off. PyTorch keeps
its cuDNN v8 benchmark cache per thread, and DataParallel's replicas run their forwards in new
threads at every step, so with benchmark on every forward searches its convolutions again;
off, it uses cuDNN's heuristics. The better of the two is PyTorch's nn.DataParallel figure.

    python3 benches/torch_data_parallel_resnet50.py

Environment: GPUS, BATCH (256 per GPU), ROUNDS (5), STEPS (5), WARMUP (4), as the Rust bench.
"""
import json
import os
import statistics
import time

import torch
import torch.nn as nn
import torchvision


def main():
    gpus = int(os.environ.get("GPUS", torch.cuda.device_count()))
    batch = int(os.environ.get("BATCH", 256))
    rounds = int(os.environ.get("ROUNDS", 5))
    steps = int(os.environ.get("STEPS", 5))
    warmup = int(os.environ.get("WARMUP", 4))
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda", 0)

    def build(wrap):
        torch.manual_seed(0)
        net = torchvision.models.resnet50().to(dev).to(memory_format=torch.channels_last)
        model = nn.DataParallel(net, device_ids=list(range(gpus))) if wrap else net
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
        return model, opt, torch.amp.GradScaler("cuda")

    def data(n):
        x = torch.randn(n, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (n,), device=dev)
        return x, y

    def stepper(model, opt, scaler, x, y, benchmark=True):
        def step():
            torch.backends.cudnn.benchmark = benchmark
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return step

    runs = {
        "one_gpu": stepper(*build(False), *data(batch)),
        "data_parallel": stepper(*build(True), *data(batch * gpus)),
        "data_parallel_no_benchmark": stepper(*build(True), *data(batch * gpus), benchmark=False),
    }
    for _ in range(warmup):
        for r in runs.values():
            r()
    torch.cuda.synchronize()
    names = list(runs)
    times = {k: [] for k in runs}
    for i in range(rounds):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            for _ in range(steps):
                runs[k]()
            for d in range(gpus):
                torch.cuda.synchronize(d)
            times[k].append((time.perf_counter() - t0) / steps)
    one = batch / statistics.median(times["one_gpu"])
    dp = batch * gpus / statistics.median(times["data_parallel"])
    dp_nb = batch * gpus / statistics.median(times["data_parallel_no_benchmark"])
    print(json.dumps({
        "check": "torch-data-parallel", "gpus": gpus, "batch_per_gpu": batch,
        "one_gpu_img_per_s": round(one, 1), "data_parallel_img_per_s": round(dp, 1),
        "speedup": round(dp / one, 3),
        "data_parallel_no_benchmark_img_per_s": round(dp_nb, 1),
        "speedup_no_benchmark": round(dp_nb / one, 3),
        "rounds_ms": {k: [round(1e3 * t, 2) for t in v] for k, v in times.items()},
        "torch": torch.__version__,
    }), flush=True)


if __name__ == "__main__":
    main()
