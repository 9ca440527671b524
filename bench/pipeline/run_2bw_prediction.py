#!/usr/bin/env python3
"""PipeDream-2BW with and without weight prediction, and eager updates, against 1F1B (issue 77,
item 7): the test accuracy after each given number of epochs of a model's recipe on
Fashion-MNIST, pipelined over 2 ranks (P = 2, M = 4, seed 7), and the training time.

Sides: 1f1b (flushed: the single-process step), 2bw (PipeDream-2BW's rule, W(t+1) = W(t) - lr *
grad f(W(t-1))), 2bw-extrapolate (--weight-prediction extrapolate: the gradient at
2 W(t-1) - W(t-2)), eager (--pipeline-sync eager: each stage updates where its schedule next
needs the weights; only its late micro-batches' gradients are a step stale).

Usage: bench/pipeline/run_2bw_prediction.py [--model mlp] [--epochs 1,2,10]
       [--sides 1f1b,2bw,2bw-extrapolate,eager] [--records bench/results/pipeline/2bw_prediction.jsonl] [--markdown FILE]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import report  # noqa: E402

SIDES = {"1f1b": [], "2bw": ["--pipeline-sync", "2bw"],
         "2bw-extrapolate": ["--pipeline-sync", "2bw", "--weight-prediction", "extrapolate"],
         "eager": ["--pipeline-sync", "eager"]}
MODELS = {"mlp": ["--model", "mlp", "--hidden", "256", "256", "256"], "cnn": ["--model", "cnn"]}


def run_one(model, epochs, side):
    dtrain = os.path.join(report.default_build(), "dtrain")
    with tempfile.TemporaryDirectory() as folder:
        metrics = os.path.join(folder, "m.jsonl")
        command = [dtrain, "train", *MODELS[model], "--pipeline-parallel", "2", "--nproc", "2",
                   "--micro-batches", "4", "--epochs", str(epochs), "--seed", "7",
                   "--no-progress", "--no-run-dir", "--metrics", metrics, *SIDES[side]]
        start = time.perf_counter()
        out = subprocess.run(command, capture_output=True, text=True, cwd=folder)
        seconds = time.perf_counter() - start
        if out.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{out.stdout}\n{out.stderr}")
        evals = [json.loads(line) for line in open(metrics) if '"event":"eval"' in line]
        steps = [json.loads(line) for line in open(metrics) if '"event":"step"' in line]
        return {"model": model, "epochs": epochs, "side": side, "seconds": seconds,
                "val_accuracy": evals[-1]["val_accuracy"], "val_loss": evals[-1]["val_loss"],
                "losses": [s.get("loss") for s in steps], "command": " ".join(command[1:])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS))
    parser.add_argument("--epochs", default="1,2,10")
    parser.add_argument("--sides", default=",".join(SIDES), help="1f1b first")
    parser.add_argument("--records",
                        default=os.path.join(report.ROOT, "bench/results/pipeline/2bw_prediction.jsonl"))
    parser.add_argument("--markdown")
    args = parser.parse_args()
    sides = args.sides.split(",")
    if sides[0] != "1f1b" or any(side not in SIDES for side in sides):
        raise SystemExit(f"--sides: 1f1b first, then any of {', '.join(SIDES)}")
    lines = [f"| {args.model}, epochs | " + " | ".join(sides) + " | " +
             " | ".join(f"{side} - 1f1b" for side in sides[1:]) + " |",
             "| --- |" + " --- |" * (2 * len(sides) - 1)]
    with report.Records(args.records) as records:
        for epochs in (int(e) for e in args.epochs.split(",")):
            results = {}
            for side in sides:
                results[side] = run_one(args.model, epochs, side)
                records.write(results[side])
                print(f"{args.model} {epochs} epochs {side}: "
                      f"{100 * results[side]['val_accuracy']:.2f}% in "
                      f"{results[side]['seconds']:.1f} s", flush=True)
            acc = {side: 100 * r["val_accuracy"] for side, r in results.items()}
            lines.append(f"| {epochs} | " + " | ".join(f"{acc[s]:.2f}%" for s in sides) + " | " +
                         " | ".join(f"{acc[s] - acc['1f1b']:+.2f}" for s in sides[1:]) + " |")
    report.table(lines, args.markdown)


if __name__ == "__main__":
    main()
