#!/usr/bin/env python3
"""torchvision's ImageNet training pipeline on an ImageFolder, for benches/data_pipeline.rs.

    python3 benches/torch_data_pipeline.py DIR [--batch 256] [--workers 16] [--batches 30] [--json FILE]

ImageFolder(DIR) with Compose([RandomResizedCrop(224), RandomHorizontalFlip(), ToTensor(),
Normalize(ImageNet mean, std)]), DataLoader(batch, shuffle, num_workers, pin_memory=True,
drop_last=True), each batch copied with .cuda(non_blocking=True) (kept on the CPU without a
GPU). Images per second over --batches batches after 3 warm-up batches (the workers' start-up
excluded), the last copy included: the same measurement as data_pipeline.rs's.
"""

import argparse
import json
import os
import time

import torch
from torchvision import datasets, transforms


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--json")
    a = p.parse_args()
    tf = transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    ds = datasets.ImageFolder(a.data, tf)
    cuda = torch.cuda.is_available()
    loader = torch.utils.data.DataLoader(
        ds, batch_size=a.batch, shuffle=True, num_workers=a.workers, pin_memory=cuda, drop_last=True
    )
    n = len(loader)
    if n < 4:
        raise SystemExit(f"{a.data}: need at least 4 batches of {a.batch}")
    timed = min(a.batches, n - 3)
    it = iter(loader)
    for _ in range(3):
        x, y = next(it)
        if cuda:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    images = 0
    for _ in range(timed):
        x, y = next(it)
        if cuda:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        images += x.shape[0]
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    r = {
        "images_per_s": images / dt,
        "images": images,
        "seconds": dt,
        "batch": a.batch,
        "workers": a.workers,
        "device": "cuda" if cuda else "cpu",
        "torch": torch.__version__,
    }
    print(f"torchvision pipeline: {r['images_per_s']:.0f} images/s ({a.workers} workers, batch {a.batch}, to {r['device']})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f)


if __name__ == "__main__":
    main()
