#!/usr/bin/python3
"""Compressed against uncompressed communication across the network lab (issue 33): 2 lab hosts x
1 rank, the same job (model, steps, global batch, seed, --strategy) with `--grad-compression
none` and with the given compression (PowerSGD), or without and with --zero-quantized (zero2,
zero3: `--compression zero-quantized`), rounds alternated. Per run: wall time of training, median step time, the bytes this
rank sent per step (the step records' wire_bytes: the Communicator's count of every collective,
ring estimate), the loss at the end (mean of the last 10% of step records) and the validation
accuracy or loss. Records go to bench/results/netlab/compression-lab.jsonl. Root (scripts/netlab);
build/dtrain built.

  bench/netlab/run_compression_lab.py --profile wan --model cnn --steps 300 --rounds 2
  bench/netlab/run_compression_lab.py --profile lan --model gpt --steps 300 --rounds 2
  bench/netlab/run_compression_lab.py --profile lan --model gpt --strategy zero3 \
      --compression zero-quantized"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os
import statistics
import sys

from labrun import DTRAIN, GPT, ROOT, across_lab, run_and_read
from report import Records

# The models' flags: the quick start's CNN on Fashion-MNIST, and configs/fortunes-gpt.toml's GPT.
MODELS = {
    "cnn": ["--model", "cnn", "--dataset", "fashion-mnist", "--batch-size", "32"],
    "gpt": GPT,
}


def run(args, compression, round_index, freeze=0):
    metrics = (f"/tmp/compression-lab-{args.model}-{args.strategy}-"
               f"{compression.replace(':', '_')}-f{freeze}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    train = [DTRAIN, "train", *MODELS[args.model], "--strategy", args.strategy,
             *(["--zero-quantized"] if compression == "zero-quantized" else
               ["--grad-compression", compression]),
             "--max-steps", str(args.steps), "--eval-every", str(args.steps),
             "--threads", str(args.threads), "--no-progress", "--seed", str(round_index + 1),
             "--metrics", metrics, "--log-every", "1"]
    if freeze:
        train += ["--freeze-variance-after", str(freeze)]
    wall, summary, steps, evals = run_and_read(across_lab(args.profile, train), metrics)
    tail = steps[-max(1, len(steps) // 10):]
    return {"profile": args.profile, "model": args.model, "strategy": args.strategy,
            "compression": compression, "freeze_variance_after": freeze,
            "round": round_index, "steps": summary["steps"],
            "global_batch": summary["global_batch"], "threads": args.threads,
            "train_seconds": summary["seconds"], "wall_seconds": wall,
            "median_step_ms": statistics.median(r["step_ms"] for r in steps),
            "wire_bytes_per_step": statistics.median(r["wire_bytes"] for r in steps),
            "final_loss": statistics.mean(r["loss"] for r in tail),
            "val_loss": evals[-1].get("val_loss") if evals else None,
            "val_accuracy": evals[-1].get("val_accuracy") if evals else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="wan")
    parser.add_argument("--model", default="cnn", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--compression", default="powersgd:4",
                        help="a --grad-compression value, or zero-quantized")
    parser.add_argument("--freeze-variance-after", type=int, default=0,
                        help="the compressed run only: Adam's second moment fixed after this "
                        "many steps (the baseline keeps the model's optimizer as it is)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="run only the compressed variant (a grid over its settings)")
    parser.add_argument("--out",
                        default=os.path.join(ROOT, "bench", "results/netlab/compression-lab.jsonl"))
    args = parser.parse_args()
    with Records(args.out, "a", DTRAIN) as out:
        for r in range(args.rounds):
            order = ("none", args.compression) if r % 2 == 0 else (args.compression, "none")
            if args.no_baseline:
                order = (args.compression,)
            for compression in order:
                freeze = args.freeze_variance_after if compression == args.compression else 0
                record = run(args, compression, r, freeze)
                print(json.dumps(record), flush=True)
                out.write(record)
                out.flush()


if __name__ == "__main__":
    sys.exit(main())
