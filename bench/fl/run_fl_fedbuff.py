#!/usr/bin/env python3
"""FedBuff (asynchronous buffered aggregation) against synchronous FedAvg in simulated wall time
to a target test accuracy, on the virtual clock: 1,000 clients of Fashion-MNIST (60 examples
each, dealt), devices of heavy-tailed speed (log-normal slowness, sigma --sigma, median
--step-seconds per local step) and diurnal availability (each client, in its own time zone,
available --hours a day; a client whose window closes mid-training leaves). The same MLP, plan
(E, B, rate) and seeds for both; only the aggregation differs:

  synchronous   C = --fraction of the clients a round (100); a round lasts until its slowest
                selected client is done (or has left); also with --round-deadline (the slower
                ones dropped) as the usual remedy, and with as many clients a round as FedBuff's
                buffer (10: shorter rounds, the max of fewer devices)
  fedbuff       --concurrency clients training at once, a server step every --buffer updates,
                each weighted by its staleness (poly:0.5, FedBuff's default)

Simulated minutes do not depend on the machine; the records (one per round/step, with
sim_minutes and the test accuracy) are kept in bench/results/fl/fedbuff.jsonl.

  bench/fl/run_fl_fedbuff.py [--seeds 0,1] [--target 0.85] [--markdown FILE]
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


def configurations(args):
    common = ["--clients", str(args.clients), "--partition", args.partition,
              "--local-epochs", str(args.epochs), "--local-batch", "10", "--lr", str(args.lr),
              "--client-speed", f"lognormal:{args.sigma}", "--step-seconds",
              str(args.step_seconds), "--availability", f"diurnal:{args.hours}",
              "--target-accuracy", str(args.target), "--threads", str(args.threads),
              "--eval-every", "1"]
    sync = common + ["--fraction", str(args.fraction), "--rounds", str(args.max_rounds)]
    buffered = common + ["--buffer-size", str(args.buffer), "--concurrency",
                         str(args.concurrency), "--staleness", args.staleness, "--rounds",
                         str(args.max_steps)]
    small = [f if f != str(args.fraction) else str(args.buffer / args.clients) for f in sync]
    return [("synchronous", sync),
            (f"synchronous, deadline {args.deadline:g} min",
             sync + ["--round-deadline", str(args.deadline)]),
            (f"synchronous, {args.buffer} a round", small),
            ("fedbuff", buffered)]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=DTRAIN)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--partition", default="iid")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--buffer", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--staleness", default="poly:0.5")
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--step-seconds", type=float, default=2.0)
    parser.add_argument("--hours", type=float, default=8)
    parser.add_argument("--deadline", type=float, default=5.0)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--max-rounds", type=int, default=300)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--records", default=os.path.join(ROOT, "bench",
                                                          "results/fl/fedbuff.jsonl"))
    parser.add_argument("--log", default=os.path.join(ROOT, "bench", "results/fl/fedbuff.log"))
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args()

    seeds = [int(s) for s in args.seeds.split(",")]
    results = {}
    with open_log(args.log, "w") as log, Records(args.records, "w") as records:
        for seed in seeds:
            for name, flags in configurations(args):  # alternated within each seed
                rounds, _ = simulate(args.dtrain, flags + ["--seed", str(seed)], log)
                reached = [r for r in rounds if r.get("test_accuracy", 0) >= args.target]
                minutes = reached[0]["sim_minutes"] if reached else None
                steps = reached[0]["round"] if reached else None
                updates = sum(r["finished"] for r in rounds[:steps] if steps)
                for r in rounds:
                    records.write({"config": name, "seed": seed, **r})
                results.setdefault(name, []).append((minutes, steps, updates))
                print(f"seed {seed} {name}: {minutes} simulated minutes, {steps} rounds/steps, "
                      f"{updates} updates", flush=True)

    # Per seed, the best synchronous configuration is the baseline.
    synchronous = [name for name in results if name.startswith("synchronous")]
    best = [min((results[name][i][0] for name in synchronous if results[name][i][0]),
                default=None) for i in range(len(seeds))]
    base = results["synchronous"]
    lines = ["| aggregation | simulated minutes to "
             f"{args.target:.0%} (per seed) | median | rounds or steps | client updates | "
             "vs synchronous (median of per-seed ratios) | vs the best synchronous |",
             "|---|---|---|---|---|---|---|"]
    for name, rows in results.items():
        minutes = [m for m, _, _ in rows]
        done = [m for m in minutes if m is not None]
        ratios = [b[0] / m for b, (m, _, _) in zip(base, rows) if m and b[0]]
        best_ratios = [b / m for b, (m, _, _) in zip(best, rows) if m and b]
        lines.append(
            f"| {name} | {', '.join('-' if m is None else f'{m:.0f}' for m in minutes)} | "
            f"{statistics.median(done):.0f} | "
            f"{', '.join('-' if s is None else str(s) for _, s, _ in rows)} | "
            f"{', '.join(str(u) for _, _, u in rows)} | "
            f"{statistics.median(ratios):.2f}x | {statistics.median(best_ratios):.2f}x |"
            if done and ratios else f"| {name} | not reached | | | | | |")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
