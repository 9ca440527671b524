#!/usr/bin/env python3
"""Image decoding and augmentation on one core, side by side (issue 50): dtrain's `images` data
set (libjpeg-turbo decoding only the crop's rows and columns, DCT-scaled when the crop is large;
antialiased bilinear resize) against torchvision's DataLoader with PIL (ImageFolder,
RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize; num_workers=0, one thread),
over the same JPEG files: 500x375 photograph-like images (smooth random fields, edges and noise,
quality 90, ~100 KB each as ImageNet's average). Alternated rounds, median of per-round ratios.

  .venv-torch/bin/python bench/data/run_image_bench.py [--build build-unity] [--rounds 5]
      [--images 256] [--markdown FILE]
Raw records: bench/results/data/images.jsonl (stamped).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from report import ROOT, Records, table  # noqa: E402


def make_images(root, count):
    import numpy
    from PIL import Image
    random = numpy.random.RandomState(0)
    sizes = []
    for i in range(count):
        low = random.rand(12, 16, 3)
        field = numpy.kron(low, numpy.ones((32, 32, 1)))[:375, :500]  # smooth regions
        edges = ((numpy.add.outer(numpy.arange(375) // 41, numpy.arange(500) // 29) % 2) * 0.25)
        pixels = field * 0.7 + edges[..., None] + random.normal(0, 0.08, (375, 500, 3))
        pixels = (numpy.clip(pixels, 0, 1) * 255).astype(numpy.uint8)
        for split in ("train", "val") if i < 4 else ("train",):
            folder = os.path.join(root, split, f"c{i % 4}")
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"{i:05d}.jpg")
            Image.fromarray(pixels).save(path, quality=90)
        sizes.append(os.path.getsize(path))
    return statistics.mean(sizes)


def torchvision_round(root):
    import torch
    import torchvision
    from torchvision import transforms
    torch.set_num_threads(1)
    dataset = torchvision.datasets.ImageFolder(os.path.join(root, "train"), transform=transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]))
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, num_workers=0, shuffle=False)
    start = time.perf_counter()
    count = 0
    for images, _ in loader:
        count += images.shape[0]
    return count / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build-unity"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    bench = os.path.join(args.build, "bench", "data_bench")
    records = Records(os.path.join(ROOT, "bench", "results", "data", "images.jsonl"), "a",
                      os.path.join(args.build, "dtrain"))
    root = tempfile.mkdtemp(prefix="dtrain-image-bench-")
    mean_bytes = make_images(root, args.images)
    print(f"{args.images} JPEGs of 500x375, {mean_bytes / 1e3:.0f} KB on average, in {root}")
    ours, theirs, ratios, limits = [], [], [], []
    for r in range(args.rounds):
        done = subprocess.run([bench, "images", "--folder", root, "--size", "224", "--rounds",
                               "1"], capture_output=True, text=True, check=True)
        result = json.loads(done.stdout.splitlines()[-1])
        mine = result["images_per_s"]
        limits.append(result["decode_only_images_per_s"])
        peer = torchvision_round(root)
        ours.append(mine)
        theirs.append(peer)
        ratios.append(mine / peer)
        records.write({"bench": "images", "round": r, "images": args.images,
                       "mean_jpeg_bytes": mean_bytes, "dtrain_images_per_s": mine,
                       "torchvision_images_per_s": peer, "ratio": ratios[-1], "threads": 1,
                       "decode_only_images_per_s": limits[-1],
                       "transforms": "RandomResizedCrop(224), flip, normalize"})
        print(f"round {r}: dtrain {mine:.0f} images/s, torchvision {peer:.0f} images/s, "
              f"ratio {ratios[-1]:.2f}")
    records.close()
    table(["| one core, 500x375 JPEGs -> 224x224 training crops | dtrain | torchvision + PIL | "
           "ratio (median of rounds) |", "|---|---|---|---|",
           f"| decode + random-resized-crop + flip + normalize | {statistics.median(ours):.0f} "
           f"images/s | {statistics.median(theirs):.0f} images/s | "
           f"{statistics.median(ratios):.2f}x |",
           f"| the limit: libjpeg-turbo decoding each whole file, nothing else | "
           f"{statistics.median(limits):.0f} images/s | | |"], args.markdown)


if __name__ == "__main__":
    main()
