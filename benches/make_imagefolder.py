#!/usr/bin/env python3
"""Writes a synthetic ImageFolder tree of ImageNet-like JPEGs for benches/data_pipeline.rs and
benches/torch_data_pipeline.py.

    python3 benches/make_imagefolder.py OUT_DIR [--images 10000] [--classes 100] [--workers 16]

Each image is drawn with PIL only (no numpy): a two-colour gradient, random ellipses, rectangles
and polygons, a light blur and grain, then saved as a baseline JPEG at quality 80-95 (what
ImageNet's photos are). Sizes are around ImageNet's typical 500x375: most are 500x375 or 375x500,
the rest between 300 and 640 pixels a side, and 3% are large (1024-1600 px) so that decoding at
reduced scale gets exercised. 1% are grayscale and 0.5% CMYK JPEGs, as in ImageNet. The tree is a
pure function of --seed, so both pipelines read the same files; an existing complete tree is kept.
"""

import argparse
import os
import random
import sys
from multiprocessing import Pool

from PIL import Image, ImageDraw, ImageFilter


def size_for(rng):
    r = rng.random()
    if r < 0.55:
        return (500, 375)
    if r < 0.75:
        return (375, 500)
    if r < 0.97:
        return (rng.randint(300, 640), rng.randint(300, 640))
    w = rng.randint(1024, 1600)
    return (w, int(w * rng.uniform(0.6, 0.9)))


def draw_image(seed):
    rng = random.Random(seed)
    w, h = size_for(rng)
    c0 = tuple(rng.randint(0, 255) for _ in range(3))
    c1 = tuple(rng.randint(0, 255) for _ in range(3))
    # Vertical gradient background, built from a 1-pixel-wide column.
    col = Image.new("RGB", (1, h))
    px = col.load()
    for y in range(h):
        t = y / max(h - 1, 1)
        px[0, y] = tuple(int(a + (b - a) * t) for a, b in zip(c0, c1))
    img = col.resize((w, h))
    d = ImageDraw.Draw(img)
    for _ in range(rng.randint(8, 30)):
        fill = tuple(rng.randint(0, 255) for _ in range(3))
        x0, y0 = rng.randint(-w // 4, w), rng.randint(-h // 4, h)
        x1, y1 = x0 + rng.randint(10, w // 2), y0 + rng.randint(10, h // 2)
        kind = rng.random()
        if kind < 0.4:
            d.ellipse([x0, y0, x1, y1], fill=fill)
        elif kind < 0.7:
            d.rectangle([x0, y0, x1, y1], fill=fill)
        else:
            pts = [(rng.randint(0, w), rng.randint(0, h)) for _ in range(rng.randint(3, 6))]
            d.polygon(pts, fill=fill)
    img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.0)))
    grain = Image.merge("RGB", [Image.effect_noise((w, h), rng.uniform(30, 60)) for _ in range(3)])
    img = Image.blend(img, grain, rng.uniform(0.25, 0.4))
    return img, rng


def write_one(args):
    path, seed = args
    if os.path.exists(path):
        return 0
    img, rng = draw_image(seed)
    r = rng.random()
    if r < 0.01:
        img = img.convert("L")
    elif r < 0.015:
        img = img.convert("CMYK")
    tmp = path + ".tmp"
    img.save(tmp, "JPEG", quality=rng.randint(80, 95))
    os.replace(tmp, path)
    return os.path.getsize(path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--images", type=int, default=10000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.images < 1 or a.classes < 1:
        sys.exit("--images and --classes must be at least 1")
    jobs = []
    for i in range(a.images):
        cls = f"n{i % a.classes:08d}"
        os.makedirs(os.path.join(a.out, cls), exist_ok=True)
        jobs.append((os.path.join(a.out, cls, f"img_{i:07d}.JPEG"), a.seed * 1_000_003 + i))
    with Pool(a.workers) as pool:
        sizes = pool.map(write_one, jobs, chunksize=16)
    new = [s for s in sizes if s]
    print(
        f"{a.out}: {a.images} images in {a.classes} classes"
        + (f" ({len(new)} written, mean {sum(new) / len(new) / 1024:.0f} KiB)" if new else " (all present)")
    )


if __name__ == "__main__":
    main()
