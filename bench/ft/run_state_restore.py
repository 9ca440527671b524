#!/usr/bin/env python3
"""Where a replaced replica gets its state (issue 53, part 3's in-memory restore): from a replica
that trains (live recovery: rank 0 pickles its weights, buffers and Adam state and broadcasts
them over the new replica group, the replacement unpickles them into its model and optimizer)
against from disk (the newest checkpoint of the same state: its digests verified, its files read
into the model and optimizer, the random generators; the page cache warm, and cold after
`echo 3 > /proc/sys/vm/drop_caches`). The job is bench/ft/run_replica_failure.py's:
Fashion-MNIST MLP 784-1792-1792-10 with Adam (56 MB), 3 ranks of 1 thread.

Times as each side prints them: the replacement's "its state (X MB) from world rank 0 in Y ms"
(from the admission to the state in place) and rank 0's "verified and read in Y ms" (the
checkpoint's choice, verification and load). Sides alternated over rounds, medians.

  bench/ft/run_state_restore.py --rounds 3 [--markdown FILE]
"""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import re
import shutil
import statistics
import subprocess
import tempfile

import report

SIDES = ("memory", "disk-warm", "disk-cold")
JOB = ["train", "--model", "mlp", "--hidden", "1792", "1792", "--optimizer", "adam",
       "--batch-size", "32", "--nproc", "3", "--threads", "1", "--no-progress"]


def run(command, env=None):
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done.stdout + done.stderr


def run_side(dtrain, side, workdir):
    if side == "memory":
        env = dict(os.environ, DTRAIN_SIMULATE_FAILURE="2:10", DTRAIN_SIMULATE_SLOW_STEP_MS="50")
        command = [dtrain] + JOB + ["--max-steps", "150", "--fault-tolerance", "replicas"]
        text = run(command, env)
        found = re.search(r"its state \(([\d.]+) MB\) from world rank 0 in (\d+) ms", text)
        if not found:
            raise SystemExit(f"no replacement joined:\n{text[-3000:]}")
        return {"side": side, "command": " ".join(command), "mb": float(found.group(1)),
                "ms": float(found.group(2))}
    checkpoints = os.path.join(workdir, "ck")
    if not os.path.exists(checkpoints):
        run([dtrain] + JOB + ["--max-steps", "20", "--checkpoint-dir", checkpoints])
    if side == "disk-cold":
        subprocess.run(["sync"])
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    command = [dtrain] + JOB + ["--max-steps", "21", "--checkpoint-dir", checkpoints]
    text = run(command)
    found = re.search(r"resumed from step 20 .*verified and read in (\d+) ms", text)
    if not found:
        raise SystemExit(f"did not resume from step 20:\n{text[-3000:]}")
    # The resumed run wrote step 21's checkpoint: the next round resumes from step 20 again.
    for name in os.listdir(checkpoints):
        if name.startswith("step-") and name != "step-00000020":
            shutil.rmtree(os.path.join(checkpoints, name))
    with open(os.path.join(checkpoints, "latest"), "w") as f:
        f.write("step-00000020\n")
    return {"side": side, "command": " ".join(command), "ms": float(found.group(1))}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=report.default_build())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown")
    parser.add_argument("--records", default=os.path.join(report.ROOT, "bench", "results", "ft",
                                                          "state-restore.jsonl"))
    args = parser.parse_args()
    dtrain = os.path.join(args.build, "dtrain")
    with report.Records(args.records, "a", dtrain) as records, \
            tempfile.TemporaryDirectory(prefix="dtrain-restore-") as workdir:
        rounds = report.alternated_rounds(SIDES, args.rounds,
                                          lambda side: run_side(dtrain, side, workdir), records,
                                          lambda r: f"{r['ms']:.0f} ms")
    memory = statistics.median(r["memory"]["ms"] for r in rounds)
    lines = [f"3 ranks x 1 thread, the state of the 56 MB job; medians of {args.rounds} rounds:",
             "", "| where the state comes from | ms | / from a replica's memory |",
             "|---|---|---|",
             f"| a replica's memory (live recovery, "
             f"{statistics.median(r['memory']['mb'] for r in rounds):.1f} MB sent) | "
             f"{memory:.0f} | 1.0 |"]
    for side, label in (("disk-warm", "the newest checkpoint, page cache warm"),
                        ("disk-cold", "the newest checkpoint, page cache dropped")):
        ratio = statistics.median(r[side]["ms"] / r["memory"]["ms"] for r in rounds)
        lines.append(f"| {label} | {statistics.median(r[side]['ms'] for r in rounds):.0f} | "
                     f"{ratio:.1f} |")
    report.table(lines, args.markdown)


if __name__ == "__main__":
    main()
