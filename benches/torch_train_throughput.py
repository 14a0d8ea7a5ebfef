"""PyTorch's side of benches/train_throughput.rs: the same networks, batch, data, optimizer and
step, one configuration per process, one JSON line out (the same fields).

    python3 benches/torch_train_throughput.py --net resnet50|resnet18-cifar \
        --mode fp32|fp16|bf16 [--layout nchw|cl] [--steps 20] [--warmup 5] [--lr 0.001] [--compile]
        [--sgd auto|fused|foreach] [--no-benchmark]

A step: zero_grad(set_to_none), forward under autocast (fp16/bf16), cross-entropy, GradScaler
backward (fp16), SGD momentum (fused; foreach for fp16, see --sgd) through scaler.step,
scaler.update. cudnn.benchmark on, TF32
off (f32 means f32, as in mixprec). Skipped steps are counted from the scaler's scale: a step is
skipped exactly when update() lowers the scale.
"""
import argparse, json, sys, time

t_start = time.perf_counter()
import torch, torch.nn as nn, torchvision

p = argparse.ArgumentParser()
p.add_argument("--net", default="resnet50", choices=["resnet50", "resnet18-cifar"])
p.add_argument("--mode", default="fp16", choices=["fp32", "fp16", "bf16"])
p.add_argument("--layout", default="nchw", choices=["nchw", "cl"])
p.add_argument("--steps", type=int, default=20)
p.add_argument("--warmup", type=int, default=5)
p.add_argument("--lr", type=float, default=0.001)
p.add_argument("--compile", action="store_true")
# The SGD implementation: `auto` is foreach for fp16 and fused otherwise. With fused=True and
# GradScaler, PyTorch 2.11 skipped 24 of 25 fp16 ResNet-50 steps (NaN) on the H200, foreach took
# real steps; the benchmark compares real steps. --no-benchmark: cuDNN's heuristic choice
# instead of cudnn.benchmark's timed one (a diagnostic).
p.add_argument("--sgd", default="auto", choices=["auto", "fused", "foreach"])
p.add_argument("--foreach", action="store_true", help="same as --sgd foreach")
p.add_argument("--no-benchmark", action="store_true")
p.add_argument("--batch", type=int, default=None, help="the net's own batch unless given")
# --profile: after the timed steps, the device time of every kernel over two more steps, one
# JSON line per kernel name on stderr ({"profile_kernel": ...}); benches/profile_table.py groups
# them beside mixprec's --profile rows.
p.add_argument("--profile", action="store_true")
a = p.parse_args()
if a.foreach:
    a.sgd = "foreach"
if a.sgd == "auto":
    a.sgd = "foreach" if a.mode == "fp16" else "fused"

dev = "cuda"
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.backends.cudnn.benchmark = not a.no_benchmark
batch, hw, classes = (256, 224, 1000) if a.net == "resnet50" else (512, 32, 10)
batch = a.batch or batch
torch.manual_seed(0)
if a.net == "resnet50":
    m = torchvision.models.resnet50(num_classes=classes)
else:
    m = torchvision.models.resnet18(num_classes=classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
m = m.to(dev)
cl = a.layout == "cl"
if cl:
    m = m.to(memory_format=torch.channels_last)
opt = torch.optim.SGD(m.parameters(), lr=a.lr, momentum=0.9,
                      **{a.sgd: True})
x = torch.randn(batch, 3, hw, hw, device=dev)
if cl:
    x = x.to(memory_format=torch.channels_last)
y = (torch.arange(batch, device=dev) * 7919) % classes
half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(a.mode)
scaler = torch.amp.GradScaler("cuda", enabled=(a.mode == "fp16"))
fwd = torch.compile(m) if a.compile else m
skipped = 0

def step():
    global skipped
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=half or torch.float32, enabled=half is not None):
        loss = nn.functional.cross_entropy(fwd(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    before = scaler.get_scale() if scaler.is_enabled() else None
    scaler.update()
    return loss, before

def count_skip(before):
    # get_scale() syncs: only used outside the timed loop.
    global skipped
    if before is not None and scaler.get_scale() < before:
        skipped += 1

loss, before = step(); torch.cuda.synchronize(); count_skip(before)
first_step_s = time.perf_counter() - t_start
first_loss = loss.item()  # after the timing: a NaN here is the forward's, not the updates'
for _ in range(1, a.warmup):
    loss, before = step(); count_skip(before)
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
# Timed steps: the scale is read once per step into a device list, compared after the sync.
scales = []
prev = scaler.get_scale() if scaler.is_enabled() else None
t = time.perf_counter()
for _ in range(a.steps):
    loss, _ = step()
    if scaler.is_enabled():
        scales.append(scaler._scale.clone())
enqueue_s = time.perf_counter() - t
torch.cuda.synchronize()
wall_s = time.perf_counter() - t
for s in scales:
    v = s.item()
    if prev is not None and v < prev:
        skipped += 1
    prev = v
if a.profile:
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, ms = kernels.get(e.name, (0, 0.0))
            kernels[e.name] = (n + 1, ms + e.device_time / 1000.0)
    side = "torch" + ("-compile" if a.compile else "")
    for name, (n, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
        print(json.dumps({"profile_kernel": name, "side": side, "net": a.net, "mode": a.mode,
                          "layout": a.layout, "calls_per_step": n / 2, "ms_per_step": ms / 2}),
              file=sys.stderr)
free, total = torch.cuda.mem_get_info()
print(json.dumps({
    "side": "torch" + ("-compile" if a.compile else ""), "net": a.net, "mode": a.mode,
    "layout": a.layout, "batch": batch, "steps": a.steps, "total_steps": a.warmup + a.steps,
    "img_per_s": round(batch * a.steps / wall_s, 1), "step_ms": round(wall_s * 1e3 / a.steps, 3),
    "enqueue_ms": round(enqueue_s * 1e3 / a.steps, 3), "first_step_s": round(first_step_s, 2),
    "device_used_mib": round((total - free) / 2**20),
    "pool_used_high_mib": round(torch.cuda.max_memory_allocated() / 2**20),
    "pool_reserved_high_mib": round(torch.cuda.max_memory_reserved() / 2**20),
    "skipped": skipped, "loss_scale": scaler.get_scale() if scaler.is_enabled() else 1.0,
    "first_loss": round(first_loss, 4), "final_loss": round(loss.item(), 4), "torch": torch.__version__,
    "optimizer": a.sgd, "cudnn_benchmark": not a.no_benchmark}),
    flush=True)
