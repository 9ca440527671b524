#!/usr/bin/env python3
"""Asynchronous checkpoints against synchronous ones (issue 53's targets): the same `dtrain
train` job (Fashion-MNIST MLP 784-1792-1792-10 with Adam, ~4.6M parameters: a ~54 MB
checkpoint) on 2 ranks of 1 thread each, saving every --every steps, three sides alternated over
rounds: no checkpoints, synchronous ones, --async-checkpoint. From each run's metrics file:

- stall: how long a save held training (the "checkpoint" records' seconds; median per run);
- write: how long the background took to write and publish one ("checkpoint_written");
- dip: the median step time while a background write is in flight (the steps after a save
  until its write time has passed) over the median step time of the run without checkpoints;
- overhead: training time (steps + stalls) over the run without checkpoints.

Ratios are per round (same round's sides), medians over rounds.

  bench/checkpoint/run_async_checkpoint.py --rounds 3 [--markdown FILE]
"""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import shutil
import statistics
import subprocess
import tempfile

import report

ROOT = report.ROOT
SIDES = ("none", "sync", "async")


def run_side(dtrain, side, steps, every, hidden, nproc, workdir):
    metrics = os.path.join(workdir, f"{side}.jsonl")
    checkpoints = os.path.join(workdir, f"ck-{side}")
    shutil.rmtree(checkpoints, ignore_errors=True)
    if os.path.exists(metrics):
        os.remove(metrics)
    command = [dtrain, "train", "--model", "mlp", "--hidden", *hidden, "--optimizer", "adam",
               "--batch-size", "64", "--max-steps", str(steps), "--nproc", str(nproc),
               "--threads", "1", "--log-every", "1", "--metrics", metrics, "--no-progress"]
    if side != "none":
        command += ["--checkpoint-dir", checkpoints, "--checkpoint-every", str(every)]
    if side == "async":
        command.append("--async-checkpoint")
    subprocess.run(command, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in open(metrics)]
    step_ms = {r["step"]: r["step_ms"] for r in records if r["event"] == "step"}
    stalls = [r["seconds"] for r in records if r["event"] == "checkpoint"]
    written = {r["step"]: r["seconds"] for r in records if r["event"] == "checkpoint_written"}
    # Steps with a write in flight: after each save, until its write time has passed.
    during = []
    for saved, seconds in written.items():
        elapsed, step = 0.0, saved + 1
        while step in step_ms and elapsed < seconds:
            during.append(step_ms[step])
            elapsed += step_ms[step] / 1e3
            step += 1
    size = 0
    if side != "none":
        newest = os.path.join(checkpoints, open(os.path.join(checkpoints, "latest")).read().strip())
        size = sum(os.path.getsize(os.path.join(newest, f)) for f in os.listdir(newest))
    shutil.rmtree(checkpoints, ignore_errors=True)
    return {"side": side, "command": " ".join(command),
            "median_step_ms": statistics.median(step_ms.values()),
            "train_s": sum(step_ms.values()) / 1e3 + sum(stalls),
            "stall_s": statistics.median(stalls) if stalls else 0.0,
            "stalls_s": stalls,
            "write_s": statistics.median(written.values()) if written else 0.0,
            "steps_during_writes": len(during),
            "median_step_ms_during_writes": statistics.median(during) if during else None,
            "checkpoint_bytes": size}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=report.default_build())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--every", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden", default="1792,1792")
    parser.add_argument("--markdown")
    parser.add_argument("--records", default=os.path.join(ROOT, "bench", "results", "checkpoint",
                                                          "async.jsonl"))
    args = parser.parse_args()
    dtrain = os.path.join(args.build, "dtrain")
    hidden = args.hidden.split(",")
    with report.Records(args.records, "a", dtrain) as records, \
            tempfile.TemporaryDirectory(prefix="dtrain-async-ckpt-") as workdir:
        rounds = report.alternated_rounds(
            SIDES, args.rounds,
            lambda side: run_side(dtrain, side, args.steps, args.every, hidden, args.nproc,
                                  workdir),
            records,
            lambda r: f"step {r['median_step_ms']:.1f} ms, stall {r['stall_s'] * 1e3:.1f} ms, "
                      f"write {r['write_s'] * 1e3:.0f} ms, during writes "
                      f"{r['median_step_ms_during_writes']} ms ({r['steps_during_writes']} steps)")

    def med(values):
        return statistics.median(values)

    stall_ratio = med([r["async"]["stall_s"] / r["sync"]["stall_s"] for r in rounds])
    dip = med([r["async"]["median_step_ms_during_writes"] / r["none"]["median_step_ms"]
               for r in rounds])
    overhead_async = med([r["async"]["train_s"] / r["none"]["train_s"] for r in rounds])
    overhead_sync = med([r["sync"]["train_s"] / r["none"]["train_s"] for r in rounds])
    mb = rounds[-1]["sync"]["checkpoint_bytes"] / 1e6
    lines = [
        f"Checkpoint of {mb:.0f} MB every {args.every} steps, {args.steps} steps, "
        f"{args.nproc} ranks x 1 thread, medians of {args.rounds} rounds' per-round ratios:",
        "",
        "| measure | synchronous | asynchronous | target |",
        "|---|---|---|---|",
        f"| training held per save (ms) | {med([r['sync']['stall_s'] for r in rounds]) * 1e3:.0f} "
        f"| {med([r['async']['stall_s'] for r in rounds]) * 1e3:.1f} "
        f"({stall_ratio * 100:.1f}% of synchronous) | <= 5% |",
        f"| background write and publish (ms) | - | "
        f"{med([r['async']['write_s'] for r in rounds]) * 1e3:.0f} | |",
        f"| step time while a write is in flight / without checkpoints | - | {dip:.3f} | "
        f"<= 1.10 |",
        f"| training time (steps + stalls) / without checkpoints | {overhead_sync:.3f} | "
        f"{overhead_async:.3f} | |",
    ]
    report.table(lines, args.markdown)


if __name__ == "__main__":
    main()
