#!/usr/bin/env python3
"""Time to a test accuracy on Fashion-MNIST with --workers workers (default 4): Downpour (Adagrad on 2 shards)
against synchronous DDP, with equal workers and with one worker slowed 3x
(--simulate-slowdown RANK:3, the last rank unless --slow-rank). Every run is the main job's CNN
for --epochs epochs with an evaluation point every --eval-every global steps (a Downpour worker
makes about 1/workers of the global steps, so its rank 0 marks one every eval-every / workers
of its own steps). By default the runs use --defer-eval: at each point rank 0 copies the
parameters and the copies are evaluated (whole test set) after training, each with the clock
of its moment, so both sides' times leave evaluation out; --inline-eval evaluates during
training instead (Downpour's rank 0 then pauses its own training for every evaluation while
the others train on). Two clocks at the first evaluation at or above the target: wall seconds
from the start, and rank 0's training seconds. Runs alternate within a round (reversed on odd
rounds). Prints one line per run, then a table with medians and the Downpour / DDP ratios, and
Downpour's staleness histogram.

  bench/ps/run_ps_time_to_accuracy.py --rounds 1 [--epochs 3 --target 0.88 --markdown FILE]
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

from report import emit, Records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(dtrain, extra, epochs, eval_every, log, workers, inline_eval):
    if "downpour" in extra:
        eval_every = max(1, eval_every // workers)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        command = [dtrain, "train", "--nproc", str(workers), "--epochs", str(epochs), "--no-progress",
                   "--eval-every", str(eval_every), "--metrics", metrics] + extra
        if not inline_eval:
            command.append("--defer-eval")
        out = subprocess.run(command, capture_output=True, text=True)
        log.write(" ".join(command) + "\n" + out.stdout + out.stderr)
        if out.returncode != 0:
            raise SystemExit(f"failed: {' '.join(command)}\n{out.stdout}{out.stderr}")
        records = [json.loads(line) for line in open(metrics)]
    evals = sorted((r for r in records if r.get("event") == "eval"), key=lambda r: r["seconds"])
    summary = [r for r in records if r.get("event") == "summary"][-1]
    strategy = [r for r in records if r.get("event") == "strategy"]
    return evals, summary, strategy[-1] if strategy else {}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=os.path.join(ROOT, "build", "dtrain"))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--target", type=float, default=0.88)
    parser.add_argument("--log", default=os.path.join(ROOT, "bench", "results/ps/accuracy.log"))
    parser.add_argument("--markdown")
    parser.add_argument("--inline-eval", action="store_true",
                        help="evaluate during training (default: --defer-eval, evaluation off the clock)")
    parser.add_argument("--ps-lr", type=float)
    parser.add_argument("--slow-rank", type=int, help="the straggler (default: the last rank)")
    args = parser.parse_args()
    downpour = ["--strategy", "downpour", "--ps-shards", "2"]
    last = args.workers - 1 if args.slow_rank is None else args.slow_rank
    if args.ps_lr is not None:
        downpour += ["--ps-lr", str(args.ps_lr)]
    slow = ["--simulate-slowdown", f"{last}:3"]
    slowed = f"rank {last} slowed 3x"
    configs = [("ddp", []), ("downpour", downpour), (f"ddp, {slowed}", slow),
               (f"downpour, {slowed}", downpour + slow)]
    times, train_times, finals, strategies = {}, {}, {}, {}
    with Records(args.log, "a") as log:
        for r in range(args.rounds):
            order = configs if r % 2 == 0 else list(reversed(configs))
            for label, extra in order:
                evals, summary, strategy = run(args.dtrain, extra, args.epochs, args.eval_every, log,
                                               args.workers, args.inline_eval)
                hit = next((e["seconds"] for e in evals if e["val_accuracy"] >= args.target), None)
                hit_train = next((e["train_seconds"] for e in evals
                                  if e["val_accuracy"] >= args.target), None)
                times.setdefault(label, []).append(hit)
                train_times.setdefault(label, []).append(hit_train)
                finals.setdefault(label, []).append((summary.get("val_accuracy"), summary["seconds"]))
                if strategy:
                    strategies[label] = strategy
                line = {"round": r, "run": label, "seconds_to_target": hit,
                        "train_seconds_to_target": hit_train,
                        "final_accuracy": summary.get("val_accuracy"), "seconds": summary["seconds"],
                        "evals": [(round(e["seconds"], 1), round(e["train_seconds"], 1),
                                   e["val_accuracy"]) for e in evals]}
                print(json.dumps(line), flush=True)
                log.write(line)
                log.flush()

    def med(label, table):
        values = [t for t in table[label] if t is not None]
        return statistics.median(values) if len(values) == len(table[label]) else None

    def show(t):
        return "not reached" if t is None else f"{t:.1f}"

    rows = [f"| run | wall s to {args.target:.0%} | training s to {args.target:.0%} | final accuracy | "
            "run wall s |", "|---|---|---|---|---|"]
    for label, _ in configs:
        acc = statistics.median(a for a, _ in finals[label])
        secs = statistics.median(s for _, s in finals[label])
        rows.append(f"| {label} | {show(med(label, times))} | {show(med(label, train_times))} | "
                    f"{acc:.2%} | {secs:.1f} |")
    for a, b in [("downpour", "ddp"), (f"downpour, {slowed}", f"ddp, {slowed}")]:
        ratios = []
        for table in (times, train_times):
            ta, tb = med(a, table), med(b, table)
            ratios.append("-" if ta is None or tb is None else f"**{ta / tb:.2f}**")
        rows.append(f"| **{a} / {b}** | {ratios[0]} | {ratios[1]} | | |")
    histogram = {k: v for k, v in strategies.get(f"downpour, {slowed}", {}).items()
                 if k.startswith("staleness_")}
    text = "\n".join(rows) + f"\n\nStaleness of the pushes (downpour, {slowed}, last round): " + \
        ", ".join(f"{k[len('staleness_'):]}: {v:g}" for k, v in
                  sorted(histogram.items(), key=lambda kv: int(kv[0].split("_")[1]))) + "\n"
    emit(text, args.markdown)


if __name__ == "__main__":
    main()
