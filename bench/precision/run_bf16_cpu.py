#!/usr/bin/python3
"""bf16-mixed against fp32 on this machine's CPU: the quick start's job (configs/
fashion-mnist-ddp.toml: the CNN on Fashion-MNIST, DDP on 2 local ranks) for a fixed number of
steps in each precision, alternated round by round; prints each round's samples/s, the median of
the per-round ratios bf16-mixed / fp32, and appends every run, stamped, to the records file.
Whether bf16 pays depends on the CPU's bf16 instructions (README, "Precision on a CPU").

  bench/precision/run_bf16_cpu.py [--rounds 3] [--steps 150]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os
import statistics
import subprocess
import sys

import report  # noqa: E402
from report import Records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def samples_per_second(dtrain, precision, steps, metrics):
    subprocess.run([dtrain, "train", "--config", os.path.join(ROOT, "configs",
                                                              "fashion-mnist-ddp.toml"),
                    "--max-steps", str(steps), "--precision", precision, "--no-progress",
                    "--no-resume", "--metrics", metrics],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    return next(r for r in records if r.get("event") == "summary")["samples_per_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=os.path.join(ROOT, "build", "dtrain"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--records", default=os.path.join(ROOT, "bench", "results/precision/bf16-cpu.jsonl"))
    args = parser.parse_args()
    stamp = report.stamp(args.dtrain)
    print(f"{stamp['machine']}; {stamp.get('dtrain_version', '')}")
    ratios = []
    with Records(args.records, "a") as out:
        for round_ in range(args.rounds):
            figures = {}
            # Alternated: fp32 first in even rounds, bf16-mixed first in odd ones.
            order = ["fp32", "bf16-mixed"] if round_ % 2 == 0 else ["bf16-mixed", "fp32"]
            for precision in order:
                figures[precision] = samples_per_second(args.dtrain, precision, args.steps,
                                                        f"/tmp/bf16-cpu-{precision}.jsonl")
                record = {"round": round_, "precision": precision, "steps": args.steps,
                          "samples_per_s": figures[precision], **stamp}
                out.write(record)
            ratios.append(figures["bf16-mixed"] / figures["fp32"])
            print(f"round {round_}: fp32 {figures['fp32']:.0f} samples/s, bf16-mixed "
                  f"{figures['bf16-mixed']:.0f} samples/s, ratio {ratios[-1]:.3f}", flush=True)
    print(f"bf16-mixed / fp32 samples/s, median of per-round ratios: "
          f"{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
