#!/usr/bin/env python3
"""Compressed updates in federated learning: uplink bytes per round and test accuracy after a
fixed number of rounds, FedAvg (E = 5, B = 10, lr 0.05) on Fashion-MNIST with 100 IID clients
and C = 0.1, McMahan's 2NN. Encodings: none (float32), q8 (8-bit, stochastic rounding), top-1%
with error feedback, and top-1% without it for comparison. The bytes are those of the upload
messages each client's encoded update travels in (measured by serializing them, as the gRPC
client sends them), summed over the round's clients; the accuracy is the mean of the last 5
rounds' evaluations (one round's figure moves by ~0.5 point). Medians over --seeds. Byte counts
and accuracies do not depend on the machine's speed, so runs need not alternate.

  bench/run_fl_compression.py [--rounds 50 --seeds 0 1 --markdown FILE]
"""
import argparse
import os
import statistics

from fl_bench import DTRAIN, ROOT, simulate, table

CONFIGS = [("none", ["--compression", "none"]),
           ("q8", ["--compression", "q8"]),
           ("top-1% + error feedback", ["--compression", "topk:0.01"]),
           ("top-1%, no error feedback", ["--compression", "topk:0.01", "--no-error-feedback"])]


def run(dtrain, extra, seed, args, log):
    rounds, _ = simulate(dtrain, ["--clients", "100", "--fraction", "0.1", "--partition", "iid",
                                  "--local-epochs", "5", "--local-batch", "10", "--lr", "0.05",
                                  "--rounds", str(args.rounds), "--seed", str(seed)] + extra, log)
    accuracy = statistics.mean(r["test_accuracy"] for r in rounds[-5:])
    uplink = statistics.median(r["uplink_bytes"] for r in rounds)
    return uplink, accuracy


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=DTRAIN)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--log", default=os.path.join(ROOT, "bench", "results-fl-compression.log"))
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args()

    results = {}
    with open(args.log, "w") as log:
        for seed in args.seeds:
            for name, extra in CONFIGS:
                uplink, accuracy = run(args.dtrain, extra, seed, args, log)
                line = f"seed {seed} {name}: uplink {uplink:.0f} bytes/round, accuracy {accuracy:.4f}"
                print(line, flush=True)
                log.write("# " + line + "\n")
                results.setdefault(name, []).append((uplink, accuracy))

    base_bytes = statistics.median(u for u, _ in results["none"])
    base_accuracy = statistics.median(a for _, a in results["none"])
    lines = [f"| encoding | uplink bytes / round | fewer bytes | accuracy after {args.rounds} "
             f"rounds | points vs none |", "|---|---|---|---|---|"]
    for name, _ in CONFIGS:
        uplink = statistics.median(u for u, _ in results[name])
        accuracy = statistics.median(a for _, a in results[name])
        lines.append(f"| {name} | {uplink:,.0f} | {base_bytes / uplink:.2f}x | "
                     f"{100 * accuracy:.2f}% | {100 * (accuracy - base_accuracy):+.2f} |")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
