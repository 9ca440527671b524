#!/usr/bin/env python3
"""SecAgg+'s degree sized for the dropout rate (`--secagg-graph auto`) against the log degree
(`--secagg-graph log`, the smallest even k >= 2 log2 n) at 30% dropouts and a threshold of 0.4
of a neighbourhood: how many round attempts could not be unmasked (aborted and retried), the
degree each used, the server's and a client's time per applied round (the simulation's clocks
around the protocol's work), and the run's seconds (every attempt's, training included) per
applied round. Model and settings as bench/fl/run_fl_secaggplus.py: MLP
784-128-10, all n clients a round, E = 1 full batch, `--threads 2`.

  bench/fl/run_fl_secagg_auto.py [--sizes 500,1000] [--rounds 8] [--markdown FILE]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os
import statistics
import tempfile

from fl_bench import DTRAIN, ROOT, run_logged
from report import table, Records, open_log


def run(dtrain, n, graph, args, log):
    """All round records of one run (aborted attempts included) and its stderr's auto line."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        run_logged([dtrain, "fl", "simulate", "--no-progress", "--metrics-file", metrics,
                    "--clients", str(n), "--fraction", "1", "--hidden", "128",
                    "--local-epochs", "1", "--local-batch", "0", "--rounds", str(args.rounds),
                    "--dropout", str(args.dropout), "--threads", "2", "--eval-every", "1000",
                    "--secure-aggregation", "--secagg-graph", graph,
                    "--secagg-threshold", str(args.threshold), "--seed", str(args.seed)], log)
        return [json.loads(line) for line in open(metrics) if '"round"' in line]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=DTRAIN)
    parser.add_argument("--sizes", default="500,1000")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--dropout", type=float, default=0.3)
    parser.add_argument("--threshold", type=float, default=0.4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default=os.path.join(ROOT, "bench", "results/fl/secagg-auto.log"))
    parser.add_argument("--records",
                        default=os.path.join(ROOT, "bench", "results/fl/secagg-auto.jsonl"))
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args()
    lines = ["| n | graph | degree | attempts | aborted | applied | server s | client ms | "
             "server masks | run s per applied round |", "|---|---|---|---|---|---|---|---|---|---|"]
    with open_log(args.log, "w") as log, Records(args.records, "w") as records:
        for n in [int(s) for s in args.sizes.split(",")]:
            for graph in ("log", "auto"):
                rounds = run(args.dtrain, n, graph, args, log)
                for r in rounds:
                    records.write({"n": n, "graph": graph, "dropout": args.dropout,
                                              "threshold": args.threshold, **r})
                applied = [r for r in rounds if r.get("applied")]
                degree = int(statistics.median(r["client_masks"] for r in applied)) - 1
                lines.append(
                    f"| {n} | {graph} | {degree} | {len(rounds)} | {len(rounds) - len(applied)} | "
                    f"{len(applied)} | "
                    f"{statistics.median(r['server_aggregation_s'] for r in applied):.3f} | "
                    f"{1000 * statistics.median(r['client_aggregation_s'] for r in applied):.1f} | "
                    f"{statistics.median(r['server_masks'] for r in applied):.0f} | "
                    f"{sum(r['round_s'] for r in rounds) / len(applied):.1f} |")
                print(lines[-1], flush=True)
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
