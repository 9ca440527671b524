#!/usr/bin/env python3
"""Compressed updates in federated learning: uplink bytes per round and test accuracy after a
fixed number of rounds, FedAvg (E = 5, B = 10, lr 0.05) on Fashion-MNIST with 100 IID clients
and C = 0.1, McMahan's 2NN. Encodings: none (float32), q8 (8-bit, stochastic rounding), top-1%
with error feedback, and top-1% without it for comparison. The bytes are those of the upload
messages each client's encoded update travels in (measured by serializing them, as the gRPC
client sends them), summed over the round's clients; the accuracy is the mean of the last 5
rounds' evaluations (one round's figure moves by ~0.5 point). Medians over --seeds. With
several --lrs, every encoding (none included) runs at each rate and is reported at its best
(the highest median accuracy), as in the rounds benchmark. Byte counts and accuracies do not
depend on the machine's speed, so runs need not alternate.

  bench/fl/run_fl_compression.py [--rounds 50 --seeds 0 1 --lrs 0.05 0.1 --markdown FILE]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import os
import statistics

from fl_bench import DTRAIN, ROOT, simulate
from report import table, open_log

CONFIGS = [("none", ["--compression", "none"]),
           ("q8", ["--compression", "q8"]),
           ("top-1% + error feedback", ["--compression", "topk:0.01"]),
           ("top-1%, no error feedback", ["--compression", "topk:0.01", "--no-error-feedback"])]


def run(dtrain, extra, seed, lr, args, log):
    rounds, _ = simulate(dtrain, ["--clients", "100", "--fraction", "0.1", "--partition", "iid",
                                  "--local-epochs", "5", "--local-batch", "10", "--lr", str(lr),
                                  "--rounds", str(args.rounds), "--seed", str(seed),
                                  "--threads", str(args.threads)] + extra, log)
    accuracy = statistics.mean(r["test_accuracy"] for r in rounds[-5:])
    uplink = statistics.median(r["uplink_bytes"] for r in rounds)
    return uplink, accuracy


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=DTRAIN)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.05],
                        help="local learning rates; each encoding is reported at its best")
    parser.add_argument("--threads", type=int, default=0,
                        help="client threads per run (default: the cores)")
    parser.add_argument("--log", default=os.path.join(ROOT, "bench", "results/fl/compression.log"))
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args()

    results = {}
    with open_log(args.log, "w") as log:
        for lr in args.lrs:
            for seed in args.seeds:
                for name, extra in CONFIGS:
                    uplink, accuracy = run(args.dtrain, extra, seed, lr, args, log)
                    line = (f"lr {lr:g} seed {seed} {name}: uplink {uplink:.0f} bytes/round, "
                            f"accuracy {accuracy:.4f}")
                    print(line, flush=True)
                    log.write("# " + line + "\n")
                    results.setdefault((name, lr), []).append((uplink, accuracy))

    def best(name):  # (lr, median uplink, median accuracy) at the rate with the best accuracy
        return max(((lr, statistics.median(u for u, _ in results[(name, lr)]),
                     statistics.median(a for _, a in results[(name, lr)])) for lr in args.lrs),
                   key=lambda t: t[2])

    _, base_bytes, base_accuracy = best("none")
    lines = [f"| encoding | lr | uplink bytes / round | fewer bytes | accuracy after {args.rounds} "
             f"rounds | points vs none |", "|---|---|---|---|---|---|"]
    for name, _ in CONFIGS:
        lr, uplink, accuracy = best(name)
        lines.append(f"| {name} | {lr:g} | {uplink:,.0f} | {base_bytes / uplink:.2f}x | "
                     f"{100 * accuracy:.2f}% | {100 * (accuracy - base_accuracy):+.2f} |")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
