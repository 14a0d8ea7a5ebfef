"""PyTorch reference for the main job: the same small-image ResNet, data, optimizer and schedule as
`examples/train_resnet.rs --config configs/run_fashion_mnist_full.toml`, with torch.autocast (f16)
and GradScaler. Run on the GPU machine in the same call as mixprec's run:

    python3 benches/torch_train_fashion_mnist.py --data DIR --epochs 15 --widths 32,64,128 \
        --blocks 2,2,2 --batch-size 128 --lr 0.1 --augment

Prints one line per epoch and a final JSON line (accuracy, seconds, images/s).
"""
import argparse, gzip, json, os, struct, time

import torch
import torch.nn as nn
import torch.nn.functional as F

MEAN, STD = 0.2860, 0.3530  # mixprec's data::fashion_mnist normalisation


def read_idx(path):
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).reshape(dims)


def load(dir_, split):
    stem = "train" if split == "train" else "t10k"
    find = lambda name: next(os.path.join(dir_, n) for n in (name + ".gz", name) if os.path.exists(os.path.join(dir_, n)))
    x = read_idx(find(f"{stem}-images-idx3-ubyte")).float().div(255).sub(MEAN).div(STD).unsqueeze(1)
    y = read_idx(find(f"{stem}-labels-idx1-ubyte")).long()
    return x, y


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class SmallResNet(nn.Module):
    """mixprec's ResNet with Stem::Small: 3x3 stride-1 stem, no max-pool, stages of basic blocks
    (stride 2 from the second stage on), global average pool, linear head."""

    def __init__(self, blocks, widths, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        layers, cin = [], widths[0]
        for i, (n, w) in enumerate(zip(blocks, widths)):
            stage = []
            for j in range(n):
                stage.append(BasicBlock(cin, w, 2 if i > 0 and j == 0 else 1))
                cin = w
            layers.append(nn.Sequential(*stage))
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def augment(x, pad, gen):
    """Random crop with `pad` pixels of padding (pad value: normalised 0) and horizontal flip."""
    n, _, h, w = x.shape
    xp = F.pad(x, (pad, pad, pad, pad), value=(0 - MEAN) / STD)
    dy = torch.randint(0, 2 * pad + 1, (n,), device=x.device, generator=gen)
    dx = torch.randint(0, 2 * pad + 1, (n,), device=x.device, generator=gen)
    rows = (dy[:, None] + torch.arange(h, device=x.device)[None, :])  # n,h
    cols = (dx[:, None] + torch.arange(w, device=x.device)[None, :])  # n,w
    idx_n = torch.arange(n, device=x.device)[:, None, None]
    out = xp[:, 0][idx_n, rows[:, :, None], cols[:, None, :]].unsqueeze(1)
    flip = torch.rand(n, device=x.device, generator=gen) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(3), out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--warmup-fraction", type=float, default=0.25)
    ap.add_argument("--widths", default="32,64,128")
    ap.add_argument("--blocks", default="2,2,2")
    ap.add_argument("--augment", action="store_true")
    ap.add_argument("--amp", choices=["fp16", "bf16", "off"], default="fp16")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    xtr, ytr = load(a.data, "train")
    xte, yte = load(a.data, "test")
    # Host-side batches copied per step, as mixprec's loader does.
    xtr, ytr = xtr.pin_memory() if dev.type == "cuda" else xtr, ytr
    model = SmallResNet([int(v) for v in a.blocks.split(",")], [int(v) for v in a.widths.split(",")]).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    steps = len(xtr) // a.batch_size
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.epochs * steps,
        pct_start=a.warmup_fraction, div_factor=25.0, final_div_factor=1e4, cycle_momentum=False)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[a.amp]
    scaler = torch.amp.GradScaler("cuda", enabled=a.amp == "fp16")
    gen = torch.Generator(device=dev).manual_seed(a.seed)
    start, images, acc = time.time(), 0, 0.0
    for epoch in range(a.epochs):
        t0 = time.time()
        model.train()
        perm = torch.randperm(len(xtr))
        loss_sum = torch.zeros((), device=dev)
        for s in range(steps):
            idx = perm[s * a.batch_size:(s + 1) * a.batch_size]
            x = xtr[idx].to(dev, non_blocking=True)
            y = ytr[idx].to(dev, non_blocking=True)
            if a.augment:
                x = augment(x, 2, gen)
            with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            loss_sum += loss.detach()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        train_s = time.time() - t0
        images += steps * a.batch_size
        model.eval()
        correct = 0
        with torch.no_grad(), torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            for i in range(0, len(xte), 500):
                pred = model(xte[i:i + 500].to(dev)).argmax(1).cpu()
                correct += (pred == yte[i:i + 500]).sum().item()
        acc = correct / len(xte)
        print(f"torch epoch {epoch + 1:>3}/{a.epochs}  train loss {loss_sum.item() / steps:.4f}  "
              f"test accuracy {100 * acc:.2f}%  {steps * a.batch_size / train_s:.0f} images/s  "
              f"loss scale {scaler.get_scale() if a.amp == 'fp16' else 1.0}  ({time.time() - t0:.1f} s)", flush=True)
    total = time.time() - start
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                      "amp": a.amp, "epochs": a.epochs, "test_accuracy": acc, "seconds": total,
                      "images_per_s": images / total}))


if __name__ == "__main__":
    main()
