#!/usr/bin/python3
"""DiLoCo against DDP across the network lab (issue 33's first figures): 2 lab hosts x 1 rank,
the same job (--model, steps, global batch) under each strategy, rounds alternated; per run the
wall time of training, the loss and test accuracy at the end, and the bytes each rank sent across
hosts per step (DDP: its gradient allreduce; DiLoCo: the outer allreduce, from its metrics).
Records go to bench/results/netlab/diloco-lab.jsonl. Root (scripts/netlab); build/dtrain built.

  bench/netlab/run_diloco_lab.py --profile wan --rounds 3 --steps 200 --outer-steps 50"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os
import sys

from labrun import DTRAIN, ROOT, across_lab, run_and_read
from report import Records


def run(profile, strategy, args, round_index):
    metrics = f"/tmp/diloco-lab-{strategy}.jsonl"
    if os.path.exists(metrics):
        os.remove(metrics)
    train = [DTRAIN, "train", "--strategy", strategy, "--model", args.model, "--max-steps",
             str(args.steps), "--threads", "1", "--no-progress", "--seed", str(round_index),
             "--metrics", metrics]
    if strategy == "diloco":
        train += ["--island-size", "1", "--outer-steps", str(args.outer_steps),
                  "--outer-compression", args.outer_compression]
    wall, summary, steps, _ = run_and_read(across_lab(profile, train), metrics)
    params = 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10 if args.model == "mlp" else None
    if strategy == "diloco":
        sent = steps[-1]["outer_bytes"] / summary["steps"]
    else:  # one allreduce of every gradient per step (fp32)
        sent = params * 4 if params else -1
    return {"profile": profile, "strategy": strategy, "round": round_index,
            "model": args.model, "steps": summary["steps"],
            "global_batch": summary["global_batch"], "train_seconds": summary["seconds"],
            "wall_seconds": wall, "final_loss": summary.get("final_loss"),
            "val_accuracy": summary.get("val_accuracy"), "allreduced_bytes_per_step": sent,
            "outer_steps": args.outer_steps if strategy == "diloco" else None,
            "outer_compression": args.outer_compression if strategy == "diloco" else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="wan")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--outer-steps", type=int, default=50)
    parser.add_argument("--outer-compression", default="none")
    parser.add_argument("--model", default="mlp", choices=["mlp"])
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results/netlab/diloco-lab.jsonl"))
    args = parser.parse_args()
    with Records(args.out, "a", DTRAIN) as out:
        for r in range(args.rounds):
            for strategy in (("ddp", "diloco") if r % 2 == 0 else ("diloco", "ddp")):
                record = run(args.profile, strategy, args, r)
                print(json.dumps(record))
                out.write(record)
                out.flush()


if __name__ == "__main__":
    sys.exit(main())
