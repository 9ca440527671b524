#!/usr/bin/env python3
"""Personalization on non-IID clients: FedAvg (E = 5, B = 10, lr 0.05) trains the 2NN on
Fashion-MNIST cut into 100 clients (McMahan's shards:2, and Dirichlet(0.3) label skew) for
--rounds rounds, C = 0.1; then every client fine-tunes the final global model on its own
training examples (all layers, or only the last one) and both models are tested on the
client's own held-out 20%. Reports the mean per-client test accuracy of the global model and
of the personalized ones. The fine-tuning runs reuse the trained server's checkpoint (a rerun
with the same --checkpoint-dir resumes at the last round and only personalizes). Accuracies do
not depend on the machine's speed.

  bench/fl/run_fl_personalization.py [--rounds 50 --markdown FILE]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import os
import re
import tempfile

from fl_bench import DTRAIN, ROOT, run_logged
from report import table, open_log


def simulate(dtrain, partition, args, checkpoint, extra, log):
    command = [dtrain, "fl", "simulate", "--clients", "100", "--fraction", "0.1",
               "--partition", partition, "--local-epochs", "5", "--local-batch", "10",
               "--lr", "0.05", "--rounds", str(args.rounds), "--eval-every", str(args.rounds),
               "--no-progress", "--checkpoint-dir", checkpoint] + extra
    return run_logged(command, log)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=DTRAIN)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--partitions", nargs="+", default=["shards:2", "dirichlet:0.3"])
    parser.add_argument("--log", default=os.path.join(ROOT, "bench", "results/fl/personalization.log"))
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args()

    lines = ["| partition | global model's test accuracy (centralized test set) | fine-tuning | "
             "mean client accuracy, global model | mean client accuracy, personalized |",
             "|---|---|---|---|---|"]
    with open_log(args.log, "w") as log, tempfile.TemporaryDirectory() as tmp:
        for partition in args.partitions:
            checkpoint = os.path.join(tmp, partition.replace(":", "-"))
            trained = simulate(args.dtrain, partition, args, checkpoint, [], log)
            accuracy = float(re.search(r"test accuracy ([0-9.]+)", trained).group(1))
            for epochs, layers in ((1, 0), (5, 0), (5, 1)):
                out = simulate(args.dtrain, partition, args, checkpoint,
                               ["--personalize-epochs", str(epochs), "--personalize-layers",
                                str(layers)], log)
                found = re.search(r"global model ([0-9.]+), personalized ([0-9.]+)", out)
                what = f"{epochs} epoch{'s' if epochs > 1 else ''}, " + (
                    "all layers" if layers == 0 else f"last {layers} layer")
                line = (f"| {partition} | {100 * accuracy:.2f}% | {what} | "
                        f"{100 * float(found.group(1)):.2f}% | {100 * float(found.group(2)):.2f}% |")
                print(line, flush=True)
                lines.append(line)
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
