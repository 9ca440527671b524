#!/usr/bin/env python3
"""Rounds to a test accuracy (default 85%) on Fashion-MNIST with 100 clients and C = 0.1:
FedAvg (E = 5, B = 10) against FedSGD (E = 1, the full local batch), on an IID partition and on
McMahan et al.'s pathological non-IID one (shards:2, each client about 2 classes), McMahan's
2NN (MLP 200-200), with --model cnn a small CNN (conv 3x3 32 and 64, each with 2x2 max
pooling, a 128-unit layer), or with --model fedavg-cnn McMahan et al.'s own CNN (5x5
convolutions, a 512-unit layer; their Table 2, for E = 5 and B = 10, is for it). As in the
paper, each method gets its best local learning rate from a small grid (--fedavg-lrs,
--fedsgd-lrs); every run uses the same seeds. A run stops at the target or at --max-rounds
(then it counts as "not reached"). Round counts do not depend on the machine's speed, so runs
need not alternate, and --jobs 2 --threads 1 runs two at once. Prints a line per run, then a
table of the best rate per method and partition (median over --seeds) and FedSGD / FedAvg,
for the target and for the lower --also accuracies the same runs passed on the way.

  bench/fl/run_fl_rounds.py [--model mlp|cnn|fedavg-cnn --seeds 0 1 --max-rounds 3000
                          --jobs 2 --threads 1 --markdown FILE]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import os
import statistics
from concurrent.futures import ThreadPoolExecutor

from fl_bench import DTRAIN, ROOT, simulate
from report import table, open_log


def run(dtrain, algorithm, partition, lr, seed, args, log):
    """The first round whose evaluation reached each threshold (None: not within the cap)."""
    flags = ["--algorithm", algorithm, "--partition", partition, "--lr", str(lr), "--seed",
             str(seed), "--model", args.model, "--clients", "100", "--fraction", "0.1",
             "--rounds", str(args.max_rounds),
             "--target-accuracy", str(args.target), "--eval-every", "1",
             "--local-test-fraction", str(args.local_test_fraction), "--threads", str(args.threads)]
    if algorithm == "fedavg":
        flags += ["--local-epochs", "5", "--local-batch", "10"]
    # A rate too high for a method diverges: its run stops, counting as not reached.
    rounds, _ = simulate(dtrain, flags, log, allow_failure=True)
    return {t: next((r["round"] for r in rounds if r.get("test_accuracy", 0) >= t), None)
            for t in args.thresholds}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=DTRAIN)
    parser.add_argument("--model", default="mlp", choices=["mlp", "cnn", "fedavg-cnn"])
    parser.add_argument("--local-test-fraction", type=float, default=0.2,
                        help="each client's held-out share (0: all its examples train, as in "
                        "McMahan et al.)")
    parser.add_argument("--threads", type=int, default=0,
                        help="LibTorch threads per run (default: the cores)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time (e.g. 2 with --threads 1 on two cores)")
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--also", type=float, nargs="*", default=[0.80])
    parser.add_argument("--max-rounds", type=int, default=3000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--partitions", nargs="+", default=["iid", "shards:2"])
    parser.add_argument("--fedavg-lrs", type=float, nargs="+", default=[0.02, 0.05, 0.1])
    parser.add_argument("--fedsgd-lrs", type=float, nargs="+", default=[0.2, 0.3, 0.5])
    parser.add_argument("--log", help="raw runs (default: bench/results/fl/rounds.log, "
                        "-cnn.log for the CNN)")
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args()

    if not args.log:
        suffix = "" if args.model == "mlp" else "-" + args.model
        args.log = os.path.join(ROOT, "bench", f"results/fl/rounds{suffix}.log")
    args.thresholds = sorted(set(args.also + [args.target]))
    best = {}
    grid = [(partition, algorithm, lr) for partition in args.partitions
            for algorithm, lrs in (("fedavg", args.fedavg_lrs), ("fedsgd", args.fedsgd_lrs))
            for lr in lrs]
    with open_log(args.log, "w") as log, ThreadPoolExecutor(args.jobs) as pool:
        # Every run at once in the pool (round counts do not depend on speed); read in order.
        futures = {(p, a, lr, seed): pool.submit(run, args.dtrain, a, p, lr, seed, args, log)
                   for p, a, lr in grid for seed in args.seeds}
        for partition, algorithm, lr in grid:
            runs = [futures[(partition, algorithm, lr, seed)].result() for seed in args.seeds]
            for t in args.thresholds:
                counts = [r[t] for r in runs]
                # Not reached counts as more than the cap.
                median = statistics.median(c if c else args.max_rounds + 1 for c in counts)
                line = f"{partition} {algorithm} lr {lr}: rounds to {t} {counts}"
                print(line, flush=True)
                log.write("# " + line + "\n")
                key = (partition, algorithm, t)
                if key not in best or median < best[key][0]:
                    best[key] = (median, lr, counts)

    def shown(median):
        return f"not within {args.max_rounds}" if median > args.max_rounds else f"{median:g}"

    lines = ["| partition | accuracy | FedAvg (E = 5, B = 10): rounds (lr) | FedSGD: rounds (lr) "
             "| FedSGD / FedAvg |", "|---|---|---|---|---|"]
    for partition in args.partitions:
        for t in args.thresholds:
            avg, sgd = best[(partition, "fedavg", t)], best[(partition, "fedsgd", t)]
            ratio = f"{sgd[0] / avg[0]:.1f}x" if avg[0] <= args.max_rounds else "-"
            if sgd[0] > args.max_rounds and avg[0] <= args.max_rounds:
                ratio = f"> {args.max_rounds / avg[0]:.0f}x"
            lines.append(f"| {partition} | {100 * t:g}% | {shown(avg[0])} ({avg[1]:g}) | "
                         f"{shown(sgd[0])} ({sgd[1]:g}) | **{ratio}** |")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
