#!/usr/bin/python3
"""Validation loss against wall time and against bytes sent per rank for the runs of
bench/netlab/run_diloco_gpt_lab.py (the newest record of each run label), into one PNG of two panels.

  bench/netlab/plot_diloco_lab.py -o docs/images/diloco-gpt-wan.png

Runs under Debian's /usr/bin/python3 with python3-matplotlib."""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def curves(record):
    """(seconds, cumulative bytes, val loss) at each evaluation, from the run's metrics file."""
    sent, by_step = 0, {}
    points = []
    with open(os.path.join(ROOT, record["metrics"])) as f:
        for line in f:
            r = json.loads(line)
            if r.get("event") == "step":
                sent += r.get("wire_bytes", 0)
                by_step[r["step"]] = sent
            elif r.get("event") == "eval":
                points.append((r["seconds"], by_step.get(r["step"], sent), r["val_loss"]))
    return points


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results",
                        default=os.path.join(ROOT, "bench", "results/netlab/diloco-gpt-lab.jsonl"))
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args()
    newest = {}
    for line in open(args.results):
        record = json.loads(line)
        newest[(record["profile"], record["run"])] = record
    fig, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (profile, run), record in sorted(newest.items()):
        points = curves(record)
        label = f"{run.split('@')[0]} ({profile})"
        by_time.plot([p[0] / 60 for p in points], [p[2] for p in points], marker="o", ms=3,
                     label=label)
        sent = [p for p in points if p[1] > 0]  # before its first exchange a run sent nothing
        by_bytes.plot([p[1] / 1e6 for p in sent], [p[2] for p in sent], marker="o", ms=3,
                      label=label)
    by_time.set_xlabel("wall time (minutes, evaluations included)")
    by_bytes.set_xlabel("MB sent per rank (log)")
    by_bytes.set_xscale("log")
    for ax in (by_time, by_bytes):
        ax.set_ylabel("validation loss (nats/char)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("fortunes GPT, 2 lab hosts x 1 rank, global batch 64 x 64 characters")
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)


if __name__ == "__main__":
    main()
