#!/usr/bin/env python3
"""Robust aggregation against faulty clients: test accuracy after a fixed number of rounds of
FedAvg and of each defence (median, trimmed-mean, krum, multi-krum, clipped-mean) with 10% and
20% of the clients attacking in each way `--byzantine` offers (sign-flip x4, scaled x10,
Gaussian noise of standard deviation 1, label flipping), beside the attack-free runs.
Fashion-MNIST, 100 IID clients, C = 0.1, McMahan's 2NN, E = 1, B = 10, lr 0.05; defences at
`--assumed-faulty 0.2` (what they are told to tolerate, whatever the real share). The accuracy
is the mean of the last 5 rounds' evaluations; medians over --seeds. Accuracies do not depend
on the machine's speed, so runs need not alternate. Raw records: one JSON line per run.

  bench/fl/run_fl_robust.py [--rounds 50 --seeds 0 --markdown FILE]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os
import statistics

from fl_bench import DTRAIN, ROOT, simulate
from report import table, Records, open_log

ALGORITHMS = ["fedavg", "median", "trimmed-mean", "krum", "multi-krum", "clipped-mean"]
ATTACKS = [("sign-flip x4", "sign-flip:4"), ("scaled x10", "scaled:10"),
           ("gaussian 1", "gaussian:1"), ("label-flip", "label-flip")]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=DTRAIN)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2])
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--log", default=os.path.join(ROOT, "bench", "results/fl/robust.log"))
    parser.add_argument("--records",
                        default=os.path.join(ROOT, "bench", "results/fl/robust.jsonl"))
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args()

    results = {}
    with open_log(args.log, "w") as log, Records(args.records, "w") as records:
        runs = [("none", None, 0.0)] + [(name, kind, f) for f in args.fractions
                                        for name, kind in ATTACKS]
        for attack, kind, fraction in runs:
            for algorithm in ALGORITHMS:
                for seed in args.seeds:
                    flags = ["--clients", "100", "--fraction", "0.1", "--partition", "iid",
                             "--local-epochs", "1", "--local-batch", "10", "--lr", "0.05",
                             "--rounds", str(args.rounds), "--seed", str(seed),
                             "--algorithm", algorithm, "--assumed-faulty", "0.2"]
                    if args.threads:
                        flags += ["--threads", str(args.threads)]
                    if kind:
                        flags += ["--byzantine", f"{fraction:g}:{kind}"]
                    rounds, _ = simulate(args.dtrain, flags, log)
                    accuracy = statistics.mean(r["test_accuracy"] for r in rounds[-5:])
                    record = {"attack": attack, "fraction": fraction, "algorithm": algorithm,
                              "seed": seed, "rounds": len(rounds), "accuracy": accuracy,
                              "final_accuracy": rounds[-1]["test_accuracy"],
                              "round_s": statistics.median(r["round_s"] for r in rounds),
                              "flags": flags}
                    records.write(record)
                    records.flush()
                    print(f"{attack} {fraction:g} {algorithm} seed {seed}: {accuracy:.4f}",
                          flush=True)
                    results.setdefault((attack, fraction, algorithm), []).append(accuracy)

    def acc(attack, fraction, algorithm):
        return statistics.median(results[(attack, fraction, algorithm)])

    clean = acc("none", 0.0, "fedavg")
    lines = [f"| attack | faulty | " + " | ".join(ALGORITHMS) + " | best defence vs attack-free "
             "FedAvg |", "|---|---|" + "---|" * len(ALGORITHMS) + "---|"]
    for attack, _, fraction in runs:
        cells = [acc(attack, fraction, a) for a in ALGORITHMS]
        best = max(cells[1:])
        lines.append(f"| {attack} | {100 * fraction:.0f}% | " +
                     " | ".join(f"{100 * c:.2f}%" for c in cells) +
                     f" | {100 * (best - clean):+.2f} |")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
