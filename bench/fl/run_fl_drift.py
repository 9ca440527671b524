#!/usr/bin/env python3
"""Rounds to 85% on Fashion-MNIST under McMahan et al.'s pathological non-IID split (shards:2,
each client about 2 classes), 100 clients, C = 0.1, McMahan's 2NN: the drift-corrected methods
SCAFFOLD (option 2) and FedDyn (alpha --feddyn-alpha) against FedAvg and FedSGD. SCAFFOLD,
FedDyn and FedAvg train E = 5 epochs of B = 10 locally; FedSGD one full-batch step. Each method
at each rate of its grid, every run with the same seeds; a run stops at the target or at
--max-rounds (then it counts as "not reached", i.e. more than the cap). Round counts do not
depend on the machine's speed, so runs need not alternate, and --jobs 2 --threads 1 runs two at
once. Raw records: one JSON line per run (--records).

  bench/fl/run_fl_drift.py [--seeds 0 1 2 3 --max-rounds 300 --jobs 2 --threads 1 --markdown F]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os
import statistics
from concurrent.futures import ThreadPoolExecutor

from fl_bench import DTRAIN, ROOT, simulate
from report import table, Records, open_log


def run(args, method, lr, seed, log):
    flags = ["--algorithm", method, "--partition", "shards:2", "--lr", str(lr), "--seed",
             str(seed), "--clients", "100", "--fraction", "0.1", "--rounds",
             str(args.max_rounds), "--target-accuracy", str(args.target), "--eval-every", "1",
             "--threads", str(args.threads)]
    if method != "fedsgd":
        flags += ["--local-epochs", "5", "--local-batch", "10"]
    if method == "feddyn":
        flags += ["--feddyn-alpha", str(args.feddyn_alpha)]
    rounds, _ = simulate(args.dtrain, flags, log, allow_failure=True)
    reached = next((r["round"] for r in rounds if r.get("test_accuracy", 0) >= args.target), None)
    best = max((r.get("test_accuracy", 0) for r in rounds), default=0)
    return {"method": method, "lr": lr, "seed": seed, "rounds_to_target": reached,
            "rounds_run": len(rounds), "best_accuracy": best, "flags": flags}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=DTRAIN)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--max-rounds", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--feddyn-alpha", type=float, default=0.01)
    parser.add_argument("--grid", nargs="+",
                        default=["scaffold:0.05", "feddyn:0.05", "fedsgd:0.3", "fedavg:0.05"],
                        help="METHOD:LR runs, in the order they start")
    parser.add_argument("--log", default=os.path.join(ROOT, "bench", "results/fl/drift.log"))
    parser.add_argument("--records",
                        default=os.path.join(ROOT, "bench", "results/fl/drift.jsonl"))
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args()

    grid = [(m, float(lr)) for m, lr in (g.split(":") for g in args.grid)]
    results = {}
    with open_log(args.log, "w") as log, Records(args.records, "w") as records, \
            ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run, args, m, lr, seed, log) for m, lr in grid
                   for seed in args.seeds]
        for future in futures:
            record = future.result()
            records.write(record)
            records.flush()
            print(f"{record['method']} lr {record['lr']} seed {record['seed']}: "
                  f"{record['rounds_to_target']} (best {record['best_accuracy']:.4f})", flush=True)
            results.setdefault((record["method"], record["lr"]), []).append(record)

    def median(method, lr):
        return statistics.median(r["rounds_to_target"] or args.max_rounds + 1
                                 for r in results[(method, lr)])

    best = {}
    for (method, lr) in results:
        if method not in best or median(method, lr) < median(*best[method]):
            best[method] = (method, lr)
    fedsgd = median(*best["fedsgd"]) if "fedsgd" in best else None

    def shown(m):
        return f"> {args.max_rounds}" if m > args.max_rounds else f"{m:g}"

    lines = ["| method | lr | rounds to 85% (median of seeds) | each seed | FedSGD / method |",
             "|---|---|---|---|---|"]
    for method in ["fedsgd", "fedavg", "scaffold", "feddyn"]:
        if method not in best:
            continue
        m = median(*best[method])
        each = [r["rounds_to_target"] for r in results[best[method]]]
        ratio = f"{fedsgd / m:.2f}x" if fedsgd and m <= args.max_rounds else "-"
        lines.append(f"| {method} | {best[method][1]:g} | {shown(m)} | {each} | {ratio} |")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
