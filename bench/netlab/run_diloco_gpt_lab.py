#!/usr/bin/python3
"""DiLoCo against DDP on the fortunes GPT across the network lab (issue 33's benchmark): 2 lab
hosts x 1 rank (islands of 1), configs/fortunes-gpt.toml's model and recipe at its global batch
(64 windows of 64 characters), the same steps and seed for every run; DDP over the lab link, DDP
on loopback (2 local ranks, no lab), DiLoCo at each H and streaming DiLoCo
(diloco:H:FRAGMENTS:OVERLAP:ALPHA). Each run evaluates every --eval-every
steps; its metrics file (every step's loss, step time and wire_bytes; the evaluations' loss and
seconds) is kept under --keep, and one summary record per run goes to
bench/results/netlab/diloco-gpt-lab.jsonl. Root (scripts/netlab); build/dtrain built.

  bench/netlab/run_diloco_gpt_lab.py --profile wan --steps 960 --runs ddp,diloco:100,diloco:500,ddp@loopback
  bench/netlab/run_diloco_gpt_lab.py --profile wan --steps 1000 --eval-every 100 \
      --runs diloco:100,diloco:100:4:5:0.5,diloco:100:16:5:0.5

Plot: bench/netlab/plot_diloco_lab.py."""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os
import sys

from labrun import DTRAIN, GPT, ROOT, across_lab, run_and_read
from report import Records


def run(args, spec):
    label = spec.replace(":", "-").replace("@", "-")
    if args.outer_lr is not None:
        label += f"-olr{args.outer_lr}"
    if args.outer_compression != "none":
        label += f"-{args.outer_compression.replace(':', '')}"
    if args.tag:
        label += f"-{args.tag}"
    metrics = os.path.join(args.keep, f"{args.profile}-{args.steps}-{label}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    strategy, _, h = spec.partition(":")
    h, *streaming = h.split(":") if h else [h]
    loopback = strategy.endswith("@loopback")
    strategy = strategy.split("@")[0]
    train = [DTRAIN, "train", *GPT, "--strategy", strategy, "--max-steps", str(args.steps),
             "--eval-every", str(args.eval_every), "--threads", "1", "--no-progress",
             "--seed", str(args.seed), "--metrics", metrics, "--log-every", "1"]
    if strategy == "diloco":
        train += ["--island-size", "1", "--outer-steps", h]
        if args.outer_lr is not None:
            train += ["--outer-lr", str(args.outer_lr)]
        if args.outer_compression != "none":
            train += ["--outer-compression", args.outer_compression]
        if streaming:
            fragments, overlap, alpha = streaming
            train += ["--streaming-fragments", fragments, "--overlap-steps", overlap,
                      "--merge-alpha", alpha]
    if loopback:
        command = [DTRAIN, "launch", "--nproc-per-node", "2", "--master-port", "29511", "--",
                   *train]
    else:
        command = across_lab(args.profile, train)
    wall, summary, steps, evals = run_and_read(command, metrics)
    body = steps[:-1]  # DiLoCo's final outer step sends what every fragment has left
    sending = sorted(r["step_ms"] for r in body if r.get("wire_bytes", 0) > 0)
    return {"profile": "loopback" if loopback else args.profile, "run": spec,
            "outer_lr": args.outer_lr, "outer_compression": args.outer_compression,
            "steps": summary["steps"], "global_batch": summary["global_batch"],
            "train_seconds": summary["seconds"], "wall_seconds": wall,
            "bytes_sent": sum(r.get("wire_bytes", 0) for r in steps),
            # the busiest step's bytes (the link's peak demand) and the slowest step, before
            # the last
            "peak_step_bytes": max((r.get("wire_bytes", 0) for r in body), default=0),
            "last_step_bytes": steps[-1].get("wire_bytes", 0),
            "steps_sending": len(sending),
            "median_step_ms": sorted(r["step_ms"] for r in steps)[len(steps) // 2],
            "median_sending_step_ms": sending[len(sending) // 2] if sending else None,
            "max_step_ms": max(r["step_ms"] for r in body),
            "val_loss": evals[-1]["val_loss"] if evals else None,
            "evals": [[r["step"], r.get("seconds"), r["val_loss"]] for r in evals],
            "metrics": os.path.relpath(metrics, ROOT)}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="wan")
    parser.add_argument("--steps", type=int, default=960)
    parser.add_argument("--eval-every", type=int, default=120)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--outer-lr", type=float, default=None,
                        help="DiLoCo runs: the outer learning rate (default dtrain's, 0.7)")
    parser.add_argument("--outer-compression", default="none",
                        help="DiLoCo runs: q8 or topk:F for the outer gradients")
    parser.add_argument("--tag", default="",
                        help="appended to the metrics files' names (keeps earlier runs' files)")
    parser.add_argument("--runs", default="ddp,diloco:100,diloco:500,ddp@loopback")
    parser.add_argument("--keep", default=os.path.join(ROOT, "bench", "results/lm", "diloco-lab"))
    parser.add_argument("--out",
                        default=os.path.join(ROOT, "bench", "results/netlab/diloco-gpt-lab.jsonl"))
    args = parser.parse_args()
    os.makedirs(args.keep, exist_ok=True)
    with Records(args.out, "a", DTRAIN) as out:
        for spec in args.runs.split(","):
            record = run(args, spec)
            print(json.dumps(record), flush=True)
            out.write(record)
            out.flush()


if __name__ == "__main__":
    sys.exit(main())
