"""PyTorch beside benches/capture_speed.rs: images/s of one whole AMP training step (f16
autocast + GradScaler, fused SGD with Nesterov momentum, a learning rate set every step) on the
same three nets and batches, synthetic data on the device, three ways:

  eager            the usual loop;
  reduce-overhead  torch.compile(model, mode="reduce-overhead") (CUDA graphs of forward and
                   backward; the scaler and the optimizer step stay eager);
  hand-captured    the whole step (zero_grad, forward, scaled backward, scaler.step, scaler.update)
                   captured with torch.cuda.graph after warm-up on a side stream, replayed with
                   static inputs; the learning rate is a device tensor the replay reads. When
                   PyTorch refuses to capture the scaler's step, the line says why.

  python3 benches/torch_capture_speed.py [--layout nchw|cl] [NET ...]   -> one JSON line each
  (NET: main-job-resnet-16-32-64, resnet18-cifar, resnet50; default all; layout default nchw,
  cl: model and input in torch.channels_last)
  --profile-replays N: hand-captured only, for a kernel profiler (`ncu --profile-from-start off`):
  after warm-up and capture, N replays inside a profiler range, with no timing.
Timing: the median of 5 rounds of back-to-back steps, one synchronisation per round (as the
Rust side)."""
import json, math, statistics, time

import torch
import torch.nn as nn
import torchvision
from torchvision.models.resnet import BasicBlock

dev = "cuda"
torch.backends.cudnn.benchmark = True
memory_format = torch.contiguous_format


def main_job():  # ResNet 16-32-64, one basic block per stage, 3x3 stem, 1 channel in
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))

            def stage(cin, cout, stride):
                down = None
                if stride != 1 or cin != cout:
                    down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                return BasicBlock(cin, cout, stride, down)

            self.layers = nn.Sequential(stage(16, 16, 1), stage(16, 32, 2), stage(32, 64, 2))
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(64, 10)

        def forward(self, x):
            return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))

    return Net()


def resnet18_cifar():
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def resnet50():
    return torchvision.models.resnet50(num_classes=1000)


NETS = [
    ("main-job-resnet-16-32-64", main_job, [128], (1, 28, 28), 10, 100),
    ("resnet18-cifar", resnet18_cifar, [128], (3, 32, 32), 10, 50),
    ("resnet50", resnet50, [256, 128], (3, 224, 224), 1000, 10),
]


def one_cycle(i, total, peak=0.1):
    # torch's OneCycleLR (cosine), pct_start 0.3, div 25, final div 1e4: a new value every step
    up = 0.3 * total - 1
    lo, hi, end = peak / 25, peak, peak / 25 / 1e4
    if i <= up:
        p = i / up
        return hi + (lo - hi) / 2 * (math.cos(math.pi * p) + 1)
    p = (i - up) / (total - 1 - up)
    return end + (hi - end) / 2 * (math.cos(math.pi * p) + 1)


def setup(make, batch, shape, classes, lr_tensor):
    torch.manual_seed(0)
    m = make().to(dev, memory_format=memory_format)
    lr = torch.tensor(0.1, device=dev) if lr_tensor else 0.1
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(batch, *shape, device=dev).to(memory_format=memory_format)
    y = (torch.arange(batch, device=dev) * 7) % classes
    return m, opt, scaler, x, y


def timed(step, steps, total):
    i = 0
    for _ in range(5):  # warm-up
        step(i, total)
        i += 1
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(steps):
            step(i, total)
            i += 1
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def eager(make, batch, shape, classes, steps, compiled):
    m, opt, scaler, x, y = setup(make, batch, shape, classes, False)
    fwd = torch.compile(m, mode="reduce-overhead") if compiled else m

    def step(i, total):
        for g in opt.param_groups:
            g["lr"] = one_cycle(i, total)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(fwd(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return timed(step, steps, 5 + 5 * steps), None


def hand_captured(make, batch, shape, classes, steps, profile_replays=None):
    m, opt, scaler, x, y = setup(make, batch, shape, classes, True)
    lr = opt.param_groups[0]["lr"]
    static_x, static_y = x.clone(), y.clone()

    def body():
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(m(static_x), static_y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    note = None
    with torch.cuda.graph(g):
        static_loss = body()
    if profile_replays is not None:
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for _ in range(profile_replays):
            g.replay()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return None, None

    def step(i, total):
        lr.fill_(one_cycle(i, total))
        static_x.copy_(x)
        static_y.copy_(y)
        g.replay()

    t = timed(step, steps, 5 + 5 * steps)
    if not torch.isfinite(static_loss).item():
        note = "non-finite loss after replays"
    return t, note


def main():
    import sys
    global memory_format
    args = sys.argv[1:]
    layout = "nchw"
    if "--layout" in args:
        k = args.index("--layout")
        layout = args[k + 1]
        del args[k : k + 2]
        if layout not in ("nchw", "cl"):
            sys.exit(f"--layout {layout}: expected nchw or cl")
    memory_format = torch.channels_last if layout == "cl" else torch.contiguous_format
    profile_replays = None
    if "--profile-replays" in args:
        k = args.index("--profile-replays")
        profile_replays = int(args[k + 1])
        del args[k : k + 2]
    only = set(args)
    for name, make, batches, shape, classes, steps in NETS:
        if only and name not in only:
            continue
        if profile_replays is not None:
            hand_captured(make, batches[0], shape, classes, steps, profile_replays)
            print(json.dumps({"check": "torch-capture-profile", "net": name, "layout": layout, "batch": batches[0], "replays": profile_replays}), flush=True)
            continue
        for batch in batches:
            ok = False
            for mode in ["eager", "reduce-overhead", "hand-captured"]:
                rec = {"check": "torch-capture", "net": name, "layout": layout, "batch": batch, "mode": mode, "torch": torch.__version__}
                try:
                    if mode == "hand-captured":
                        t, note = hand_captured(make, batch, shape, classes, steps)
                    else:
                        t, note = eager(make, batch, shape, classes, steps, mode == "reduce-overhead")
                    rec.update({"img_per_s": batch / t, "step_ms": 1e3 * t})
                    if note:
                        rec["note"] = note
                    ok = True
                except Exception as e:  # report and go on: one failing mode must not hide the others
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                torch.cuda.empty_cache()
                print(json.dumps(rec), flush=True)
            if ok:
                break


if __name__ == "__main__":
    main()
