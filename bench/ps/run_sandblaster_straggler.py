#!/usr/bin/env python3
"""Sandblaster L-BFGS with a straggler: time per L-BFGS iteration (and per evaluation of the
loss, a pass over the training set) with --workers workers (default 4) on Fashion-MNIST, the
MLP, --work-units units per evaluation, 2 parameter-server shards. Four configurations:
no straggler; the last rank slowed 3x (--simulate-slowdown) with backup tasks and tapered units
(the defaults); the same with uniform units (--work-unit-sizing uniform); the straggler without
backup tasks (--no-backup-tasks). --slowdown-mode spin makes the straggler keep its core busy
for the extra time (a slow machine's capacity is lost to the job) instead of sleeping (which
leaves its core to the others on this shared machine). The figures are the coordinator's own
clock (seconds_per_iteration / seconds_per_evaluation in the metrics' "strategy" record: the
run without start-up and the final evaluation). Runs alternate within a round (reversed on odd
rounds); the ratios are medians of per-round ratios to that round's straggler-free run. Prints
one line per run, then the table; every run's record is appended to --records (JSONL).

  bench/ps/run_sandblaster_straggler.py --rounds 3 [--iterations 15 --slowdown-mode spin]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os
import statistics
import subprocess
import tempfile

from report import table, Records, open_log

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(dtrain, extra, args, log):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        command = [dtrain, "train", "--strategy", "sandblaster", "--ps-shards", "2",
                   "--nproc", str(args.workers), "--model", args.model,
                   "--max-steps", str(args.iterations), "--work-units", str(args.units),
                   "--no-progress", "--metrics", metrics] + extra
        out = subprocess.run(command, capture_output=True, text=True)
        log.write(" ".join(command) + "\n" + out.stdout + out.stderr)
        if out.returncode != 0:
            raise SystemExit(f"failed: {' '.join(command)}\n{out.stdout}{out.stderr}")
        records = [json.loads(line) for line in open(metrics)]
    return [r for r in records if r.get("event") == "strategy"][-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=os.path.join(ROOT, "build", "dtrain"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=15)
    parser.add_argument("--units", type=int, default=40)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--slowdown-mode", choices=["sleep", "spin"], default="sleep")
    parser.add_argument("--log", default=os.path.join(ROOT, "bench", "results/ps/sandblaster.log"))
    parser.add_argument("--records", help="JSONL file each run's record is appended to")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    mode = ":spin" if args.slowdown_mode == "spin" else ""
    slow = ["--simulate-slowdown", f"{args.workers - 1}:3{mode}"]
    configs = [("no straggler", []), ("3x straggler, backup tasks", slow),
               ("3x straggler, backups, uniform units", slow + ["--work-unit-sizing", "uniform"]),
               ("3x straggler, no backup tasks", slow + ["--no-backup-tasks"])]
    results = {name: [] for name, _ in configs}
    with open_log(args.log, "w") as log:
        for round_ in range(args.rounds):
            order = configs if round_ % 2 == 0 else list(reversed(configs))
            for name, extra in order:
                r = run(args.dtrain, extra, args, log)
                results[name].append(r)
                if args.records:
                    with Records(args.records, "a") as records:
                        records.write({"round": round_ + 1, "configuration": name,
                                                  "workers": args.workers, "units": args.units,
                                                  "slowdown_mode": args.slowdown_mode,
                                                  "record": r})
                print(f"round {round_ + 1} {name:32s} {r['seconds_per_iteration']:.3f} s/iteration "
                      f"{r['seconds_per_evaluation']:.3f} s/evaluation ({int(r['iterations'])} "
                      f"iterations, {int(r['evaluations'])} evaluations, "
                      f"{int(r.get('backups_issued', 0))} backups, "
                      f"{int(r.get('backups_won', 0))} won; units by worker "
                      + ", ".join(str(int(r.get(f"worker{w}_units", 0))) for w in range(args.workers))
                      + ")", flush=True)
    base = results[configs[0][0]]
    lines = ["| configuration | s / iteration (median) | ratio (median of rounds) | s / evaluation "
             "(median) | ratio | backups issued / won (median) |",
             "|---|---|---|---|---|---|"]
    for name, _ in configs:
        runs = results[name]
        it = statistics.median(r["seconds_per_iteration"] for r in runs)
        ev = statistics.median(r["seconds_per_evaluation"] for r in runs)
        it_ratio = statistics.median(r["seconds_per_iteration"] / b["seconds_per_iteration"]
                                     for r, b in zip(runs, base))
        ev_ratio = statistics.median(r["seconds_per_evaluation"] / b["seconds_per_evaluation"]
                                     for r, b in zip(runs, base))
        issued = statistics.median(r.get("backups_issued", 0) for r in runs)
        won = statistics.median(r.get("backups_won", 0) for r in runs)
        lines.append(f"| {name} | {it:.3f} | {it_ratio:.2f} | {ev:.3f} | {ev_ratio:.2f} | "
                     f"{issued:.0f} / {won:.0f} |")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
