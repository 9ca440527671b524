#!/usr/bin/env python3
"""Population scale in simulation: `dtrain fl simulate` with 1,000 to 1,000,000 clients, 100 a
round (C = 100 / clients), McMahan's 2NN on Fashion-MNIST, FedAvg's default plan (E = 5,
B = 10). Beyond 1,200 clients the 60,000 training images cannot give every client 50, so each
client draws 50 by its seed when selected (ClientPopulation); clients are made when selected and
dropped after. Reports the median round time (evaluation every --eval-every rounds, not in the
median) and the process's peak resident memory (/usr/bin/time). Raw records: one JSON line per
run.

  bench/fl/run_fl_population.py [--clients 1000 1000000 --rounds 20 --threads 2]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile

from fl_bench import DTRAIN, ROOT
from report import table, Records


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=DTRAIN)
    parser.add_argument("--clients", type=int, nargs="+", default=[1000, 100000, 1000000])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--records",
                        default=os.path.join(ROOT, "bench", "results/fl/population.jsonl"))
    parser.add_argument("--markdown")
    args = parser.parse_args()
    lines = ["| clients | per round | median round time | peak resident memory | test accuracy "
             "at the end |", "|---|---|---|---|---|"]
    with Records(args.records, "a") as records:
        for clients in args.clients:
            with tempfile.TemporaryDirectory() as tmp:
                metrics = os.path.join(tmp, "m.jsonl")
                command = ["/usr/bin/time", "-v", args.dtrain, "fl", "simulate", "--clients",
                           str(clients), "--fraction", repr(args.per_round / clients),
                           "--rounds", str(args.rounds), "--eval-every", str(args.eval_every),
                           "--threads", str(args.threads), "--no-progress", "--metrics-file",
                           metrics]
                out = subprocess.run(command, capture_output=True, text=True, check=True)
                rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)",
                                       out.stderr).group(1))
                rounds = [json.loads(l) for l in open(metrics)]
                rounds = [r for r in rounds if r.get("event") == "round"]
            plain = [r["round_s"] for r in rounds if "test_accuracy" not in r]
            accuracy = [r["test_accuracy"] for r in rounds if "test_accuracy" in r][-1]
            record = {"clients": clients, "per_round": args.per_round, "rounds": len(rounds),
                      "median_round_s": statistics.median(plain), "round_s": [r["round_s"] for
                                                                              r in rounds],
                      "peak_rss_mib": rss_kb / 1024, "accuracy": accuracy,
                      "threads": args.threads, "command": command[2:]}
            records.write(record)
            print(record["clients"], record["median_round_s"], record["peak_rss_mib"], flush=True)
            lines.append(f"| {clients:,} | {args.per_round} | {record['median_round_s']:.2f} s | "
                         f"{record['peak_rss_mib']:.0f} MiB | {100 * accuracy:.2f}% |")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
