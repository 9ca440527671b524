#!/usr/bin/env python3
"""--precision bf16-master against bf16-mixed (and optionally fp32) on one dtrain train job.

The job: a Llama (2 blocks, width 128, context 64) on a text file, zero1 over 2 local ranks of
one thread each, one epoch at a fixed global batch (64), a fresh checkpoint directory per run.
Sides alternate (A B, B A, ...) over rounds; each run's wall time, samples/s and validation loss
go to the raw records (stamped); the table gives medians and the median of per-round ratios.

  bench/precision/run_master_bench.py [--text FILE] [--rounds 3] [--sides bf16-master,bf16-mixed]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import re
import shutil
import statistics
import subprocess
import tempfile
import time

import report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=report.default_build())
    parser.add_argument("--text", default="",
                        help="the text (default: the first 20000 bytes of Debian's fortunes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sides", default="bf16-master,bf16-mixed")
    parser.add_argument("--strategy", default="zero1")
    parser.add_argument("--markdown")
    parser.add_argument("--records", default=os.path.join(ROOT, "bench", "results", "precision",
                                                          "master.jsonl"))
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="dtrain-master-bench-")
    text = args.text
    if not text:
        text = os.path.join(work, "text.txt")
        with open("/usr/share/games/fortunes/fortunes", "rb") as f, open(text, "wb") as out:
            out.write(f.read(20000))
    dtrain = os.path.join(args.build, "dtrain")

    def run_one(precision):
        checkpoints = os.path.join(work, "ck-" + precision)
        shutil.rmtree(checkpoints, ignore_errors=True)
        command = [dtrain, "train", "--model", "llama", "--dataset", "text", "--text-file", text,
                   "--layers", "2", "--width", "128", "--context", "64", "--precision", precision,
                   "--strategy", args.strategy, "--epochs", "1", "--nproc", "2", "--threads", "1",
                   "--checkpoint-dir", checkpoints]
        start = time.monotonic()
        out = subprocess.run(command, capture_output=True, text=True, timeout=900)
        wall = time.monotonic() - start
        if out.returncode != 0:
            sys.exit(f"failed: {' '.join(command)}\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        trained = re.search(r"trained (\d+) steps .* in ([\d.]+) s, (\d+) samples/s", out.stdout)
        loss = re.search(r"validation loss: ([\d.]+) nats", out.stdout)
        return {"command": " ".join(command), "precision": precision, "wall_s": wall,
                "steps": int(trained.group(1)), "train_s": float(trained.group(2)),
                "samples_per_s": float(trained.group(3)), "validation_loss": float(loss.group(1))}

    sides = tuple(args.sides.split(","))
    with report.Records(args.records, dtrain=dtrain) as records:
        rounds = report.alternated_rounds(
            sides, args.rounds, run_one, records,
            lambda r: f"{r['samples_per_s']:.0f} samples/s, loss {r['validation_loss']:.4f}")
    shutil.rmtree(work, ignore_errors=True)
    base = sides[-1]
    lines = [f"| precision | samples/s (median) | train s (median) | validation loss | "
             f"train time / {base} (median of rounds) |", "|---|---|---|---|---|"]
    for side in sides:
        runs = [r[side] for r in rounds]
        ratio = statistics.median(r[side]["train_s"] / r[base]["train_s"] for r in rounds)
        lines.append(f"| {side} | {statistics.median(x['samples_per_s'] for x in runs):.0f} | "
                     f"{statistics.median(x['train_s'] for x in runs):.1f} | "
                     f"{statistics.median(x['validation_loss'] for x in runs):.4f} | {ratio:.3f} |")
    report.table(lines, args.markdown)


if __name__ == "__main__":
    main()
