# Diagnostic: device time per kernel of PyTorch's ResNet-50 fp16 step (as benches/torch_train_throughput.py
# runs it), over 2 steps, by kernel name. Usage: python3 benches/torch_profile_step.py [cl|nchw]
import sys, torch, torchvision, torch.nn as nn
from torch.profiler import profile, ProfilerActivity
layout = sys.argv[1] if len(sys.argv) > 1 else "cl"
torch.backends.cudnn.benchmark = True
torch.backends.cudnn.allow_tf32 = False
m = torchvision.models.resnet50(num_classes=1000).cuda()
x = torch.randn(256, 3, 224, 224, device="cuda")
if layout == "cl":
    m = m.to(memory_format=torch.channels_last); x = x.to(memory_format=torch.channels_last)
y = (torch.arange(256, device="cuda") * 7919) % 1000
opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9, foreach=True)
scaler = torch.amp.GradScaler("cuda")
def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = nn.functional.cross_entropy(m(x), y)
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
for _ in range(6): step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(2): step()
    torch.cuda.synchronize()
rows = {}
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        k = e.name[:90]
        n, t = rows.get(k, (0, 0.0)); rows[k] = (n + 1, t + e.device_time / 1000.0)
tot = sum(t for _, t in rows.values()) / 2
print(f"torch {layout}: device busy {tot:.2f} ms per step")
for k, (n, t) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:28]:
    print(f"  {t/2:8.3f} ms {n//2:5d}x  {k}")
