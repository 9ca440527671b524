#!/usr/bin/python3
"""Validation loss against wall time for several `dtrain train --metrics` files of language-model
runs (eval records carry "seconds" since the start), one line per file, into one PNG.

  bench/lm/plot_lm_curves.py -o curves.png LABEL=runs/a/metrics.jsonl LABEL=runs/b/metrics.jsonl

Runs under Debian's /usr/bin/python3 with python3-matplotlib."""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="LABEL=metrics.jsonl")
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--target", type=float, help="draw a horizontal target line (nats)")
    args = parser.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in args.runs:
        label, path = run.split("=", 1)
        seconds, losses = [], []
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if record.get("event") == "eval" and "seconds" in record:
                    seconds.append(record["seconds"] / 60.0)
                    losses.append(record["val_loss"])
        ax.plot(seconds, losses, marker="o", label=label)
        for s, l in zip(seconds, losses):
            print(f"{label}\t{s:.2f} min\t{l:.4f} nats")
    if args.target:
        ax.axhline(args.target, color="gray", linestyle="--", label=f"target {args.target}")
    ax.set_xlabel("wall time (minutes)")
    ax.set_ylabel("validation loss (nats/char)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)


if __name__ == "__main__":
    main()
