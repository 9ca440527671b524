#!/usr/bin/env python3
"""Scale: round time of `dtrain fl simulate` with 1000 clients (Fashion-MNIST's 60,000 training
examples cut IID, 48 training examples each), McMahan's 2NN, E = 1, B = 10, two client threads,
C = 0.1 (100 clients a round) and C = 1 (all 1000). Reports the median round time, the
samples/s of local training it implies, and where the two threads' time went (the simulation's
clocks, summed over clients and divided by 2 x the round time): local training, aggregation
(clients encoding, the server reading, checking and averaging), the rest (selection, the
evaluation of the global model, thread start-up). Next to it, alternating (A B A B), the same
model trained at batch 10 on one thread by `dtrain train` (samples/s, doubled for the two
cores): the speed of the same steps outside federated learning.

  bench/fl/run_fl_scale.py [--repeats 3 --rounds 3 --markdown FILE]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os
import statistics
import tempfile

from fl_bench import DTRAIN, ROOT, run_logged, simulate
from report import table, open_log


def simulate_round(dtrain, fraction, args, log):
    return simulate(dtrain, ["--clients", "1000", "--fraction", str(fraction), "--local-epochs",
                             "1", "--local-batch", "10", "--rounds", str(args.rounds),
                             "--threads", "2", "--eval-every", str(args.rounds)], log)[0]


def reference(dtrain, args, log):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        command = [dtrain, "train", "--nproc", "1", "--threads", "1", "--model", "mlp",
                   "--batch-size", "10", "--max-steps", "2000", "--no-progress",
                   "--eval-every", "0", "--metrics", metrics]
        run_logged(command, log)
        summary = [json.loads(line) for line in open(metrics) if '"summary"' in line][-1]
    return summary["samples_per_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=DTRAIN)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log", default=os.path.join(ROOT, "bench", "results/fl/scale.log"))
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args()

    rounds = {0.1: [], 1.0: []}
    limits = []
    with open_log(args.log, "w") as log:
        for repeat in range(args.repeats):
            for fraction in (0.1, 1.0):
                rounds[fraction] += simulate_round(args.dtrain, fraction, args, log)
                limits.append(reference(args.dtrain, args, log))
                print(f"repeat {repeat} C = {fraction}: round s "
                      f"{[round(r['round_s'], 2) for r in rounds[fraction][-args.rounds:]]}, "
                      f"reference {limits[-1]:.0f} samples/s on one thread", flush=True)
    limit = 2 * statistics.median(limits)
    lines = ["| clients a round | round s (median) | local-training samples/s | of 2 x one-thread "
             "`dtrain train` | training | aggregation | rest |", "|---|---|---|---|---|---|---|"]
    for fraction, rows in rounds.items():
        seconds = statistics.median(r["round_s"] for r in rows)
        # E = 1: each finished client's examples are trained once.
        samples = statistics.median(r["finished"] * 48 / r["round_s"] for r in rows)
        training = statistics.median(r["client_training_s"] * r["finished"] / (2 * r["round_s"])
                                     for r in rows)
        aggregation = statistics.median(
            (r.get("server_aggregation_s", 0) + r.get("client_aggregation_s", 0) * r["finished"])
            / (2 * r["round_s"]) for r in rows)
        lines.append(f"| {int(1000 * fraction)} | {seconds:.2f} | {samples:,.0f} | "
                     f"{samples / limit:.2f} | {100 * training:.0f}% | {100 * aggregation:.0f}% | "
                     f"{100 * (1 - training - aggregation):.0f}% |")
    lines.append(f"| `dtrain train`, batch 10, one thread x 2 | | {limit:,.0f} | 1.00 | | | |")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
