#!/usr/bin/env python3
"""Fashion-MNIST as JPEG files against its IDX files (issue 50): the ResNet-style model trained
the same way on both (2 ranks, DDP, the model's recipe, --epochs 5), the JPEG path through
`--dataset images` (`dtrain data export-fashion-mnist`, quality 90, --image-size 28,
--augment none: each image whole, as the IDX path sees it). The question: does reading a folder
of JPEGs cost accuracy? Target: within 0.5 points of the IDX path's test accuracy. Seeds
alternate the two paths; the difference per seed is reported.

  python3 bench/data/run_fmnist_jpeg.py [--build build-unity] [--seeds 1 2] [--epochs 5]
      [--markdown FILE]
Raw records: bench/results/data/fmnist_jpeg.jsonl (stamped).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from report import ROOT, Records, table  # noqa: E402


def train(dtrain, dataset_flags, seed, epochs, model):
    command = [dtrain, "train", "--model", model, "--nproc", "2", "--threads", "1",
               "--epochs", str(epochs), "--seed", str(seed)] + dataset_flags
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    accuracy = re.findall(r"test accuracy: ([0-9.]+)%", done.stdout + done.stderr)
    if not accuracy:
        sys.exit(f"{' '.join(command)}: no test accuracy in its output")
    return float(accuracy[-1]), seconds, " ".join(command[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build-unity"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--model", default="resnet")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    dtrain = os.path.join(args.build, "dtrain")
    root = tempfile.mkdtemp(prefix="dtrain-fmnist-jpeg-")
    subprocess.run([dtrain, "data", "export-fashion-mnist", "--output", root, "--quality", "90"],
                   check=True, capture_output=True)
    paths = {"idx": ["--dataset", "fashion-mnist"],
             "jpeg": ["--dataset", "images:" + root, "--image-size", "28", "--augment", "none"]}
    rows, differences = [], []
    with Records(os.path.join(ROOT, "bench", "results", "data", "fmnist_jpeg.jsonl"), "a",
                 dtrain) as records:
        for i, seed in enumerate(args.seeds):
            order = ["idx", "jpeg"] if i % 2 == 0 else ["jpeg", "idx"]
            accuracy = {}
            for path in order:
                accuracy[path], seconds, command = train(dtrain, paths[path], seed, args.epochs,
                                                         args.model)
                records.write({"bench": "fmnist_jpeg", "path": path, "seed": seed,
                               "model": args.model, "epochs": args.epochs, "ranks": 2,
                               "threads": 1, "test_accuracy": accuracy[path],
                               "seconds": seconds, "command": command})
                print(f"seed {seed} {path}: {accuracy[path]:.2f}% in {seconds:.0f} s", flush=True)
            differences.append(accuracy["jpeg"] - accuracy["idx"])
            rows.append(f"| {seed} | {accuracy['idx']:.2f}% | {accuracy['jpeg']:.2f}% | "
                        f"{differences[-1]:+.2f} |")
    table([f"| seed | IDX files | JPEG files (--augment none) | JPEG - IDX (points) |",
           "|---|---|---|---|"] + rows +
          [f"| median | | | {statistics.median(differences):+.2f} |"], args.markdown)


if __name__ == "__main__":
    main()
