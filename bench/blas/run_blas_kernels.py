#!/usr/bin/env python3
"""OpenBLAS's generic kernel against the one dtrain chooses (issue 77), side by side in
alternated rounds: a 2048 x 2048 float32 matrix product in Debian's PyTorch 1.13 (the same
OpenBLAS 0.3.21 as Debian's LibTorch), the GPT of `dtrain train --model gpt --dataset text` on one
process (20 steps) and one epoch of the quick start's job (the CNN on Fashion-MNIST, ddp on 2
ranks).

Sides:
  generic  OPENBLAS_CORETYPE=Prescott: the kernel OpenBLAS 0.3.21 falls back to on a CPU newer
           than it (Sapphire Rapids: `OPENBLAS_VERBOSE=2` prints "Core: Prescott")
  dtrain   OpenBLAS made to detect Prescott (DTRAIN_SIMULATE_OPENBLAS_CORE=Prescott, no
           OPENBLAS_CORETYPE): what dtrain then does (its launcher and one-process runs start
           with the kernel the CPU's instructions guarantee); the matrix product runs that kernel
  native   OpenBLAS left to detect this CPU (nothing set; on a CPU it knows, its own choice)

Usage: bench/blas/run_blas_kernels.py [--rounds 2] [--workloads mm,gpt,quickstart]
       [--records bench/results/blas/kernels.jsonl] [--markdown FILE]
Each raw record is stamped (bench/report.py) and names the kernel the run reported.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import report  # noqa: E402

ROOT = report.ROOT
PYTHON = "/usr/bin/python3"  # Debian's PyTorch 1.13: Debian's OpenBLAS
MM = ("import torch, time\n"
      "torch.set_num_threads(2)\n"
      "a = torch.randn(2048, 2048); b = torch.randn(2048, 2048)\n"
      "for _ in range(3): torch.mm(a, b)\n"
      "n = 10; t = time.perf_counter()\n"
      "for _ in range(n): torch.mm(a, b)\n"
      "print(n * 2 * 2048 ** 3 / (time.perf_counter() - t) / 1e9)\n")


def better_core():
    """The kernel dtrain chooses here for a generic one (tests/cli_faults_test.cpp's rule),
    read from the launcher's line."""
    env = dict(os.environ, DTRAIN_SIMULATE_OPENBLAS_CORE="Prescott")
    env.pop("OPENBLAS_CORETYPE", None)
    out = subprocess.run([os.path.join(report.default_build(), "dtrain"), "launch",
                          "--nproc-per-node", "1", "--", "true"],
                         capture_output=True, text=True, env=env)
    found = re.search(r"OPENBLAS_CORETYPE=(\w+)", out.stderr)
    return found.group(1) if found else ""


def environment(side, better):
    env = dict(os.environ)
    env.pop("OPENBLAS_CORETYPE", None)
    env.pop("DTRAIN_SIMULATE_OPENBLAS_CORE", None)
    if side == "generic":
        env["OPENBLAS_CORETYPE"] = "Prescott"
    elif side == "dtrain":
        env["DTRAIN_SIMULATE_OPENBLAS_CORE"] = "Prescott"
    return env


def kernel_of(env):
    out = subprocess.run([PYTHON, "-c", "import torch; torch.mm(torch.ones(2, 2), torch.ones(2, 2))"],
                         capture_output=True, text=True, env=dict(env, OPENBLAS_VERBOSE="2"))
    found = re.search(r"Core: (\S+)", out.stdout + out.stderr)
    return found.group(1) if found else "?"


def run_one(workload, side, better):
    env = environment(side, better)
    dtrain = os.path.join(report.default_build(), "dtrain")
    if workload == "mm":
        if side == "dtrain":  # the kernel dtrain's ranks get
            env.pop("DTRAIN_SIMULATE_OPENBLAS_CORE", None)
            env["OPENBLAS_CORETYPE"] = better
        out = subprocess.run([PYTHON, "-c", MM], capture_output=True, text=True, env=env,
                             check=True)
        return {"workload": workload, "side": side, "kernel": kernel_of(env),
                "gflops": float(out.stdout.strip())}
    with tempfile.TemporaryDirectory() as folder:
        metrics = os.path.join(folder, "m.jsonl")
        if workload == "gpt":
            command = [dtrain, "train", "--model", "gpt", "--dataset", "text", "--nproc", "1",
                       "--max-steps", "20", "--no-progress", "--metrics", metrics]
        else:
            command = [dtrain, "train", "--config", os.path.join(ROOT, "configs",
                       "fashion-mnist-ddp.toml"), "--epochs", "1", "--no-progress",
                       "--metrics", metrics, "--checkpoint-dir", os.path.join(folder, "ckpt")]
        start = time.perf_counter()
        out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=folder)
        seconds = time.perf_counter() - start
        if out.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{out.stdout}\n{out.stderr}")
        evals = [json.loads(line) for line in open(metrics) if '"eval"' in line]
        last = evals[-1] if evals else {}
        chosen = re.search(r"OPENBLAS_CORETYPE=(\w+)", out.stderr)
        return {"workload": workload, "side": side, "seconds": seconds,
                "kernel": (chosen.group(1) if chosen else env.get("OPENBLAS_CORETYPE", "native")),
                "val_loss": last.get("val_loss"), "val_accuracy": last.get("val_accuracy")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", default="mm,gpt,quickstart")
    parser.add_argument("--sides", default="generic,dtrain")
    parser.add_argument("--records", default=os.path.join(ROOT, "bench/results/blas/kernels.jsonl"))
    parser.add_argument("--markdown")
    args = parser.parse_args()
    better = better_core()
    if not better:
        raise SystemExit("dtrain chooses no other kernel on this CPU (no AVX2 + FMA, or not "
                         "OpenBLAS): nothing to compare")
    sides = tuple(args.sides.split(","))
    lines = [f"Better kernel here: {better}; {report.stamp()['machine']}", "",
             "| workload | " + " | ".join(sides) + " | ratio (per-round median) |",
             "| --- |" + " --- |" * (len(sides) + 1)]
    with report.Records(args.records) as records:
        for workload in args.workloads.split(","):
            def describe(r):
                if workload == "mm":
                    return f"{r['gflops']:.1f} GFLOPS ({r['kernel']})"
                return (f"{r['seconds']:.1f} s ({r['kernel']}), val loss {r['val_loss']}, "
                        f"accuracy {r['val_accuracy']}")
            rounds = report.alternated_rounds(sides, args.rounds,
                                              lambda side: run_one(workload, side, better),
                                              records, describe)
            key = "gflops" if workload == "mm" else "seconds"
            cells = []
            for side in sides:
                values = [r[side][key] for r in rounds]
                cells.append(f"{statistics.median(values):.1f} "
                             f"{'GFLOPS' if key == 'gflops' else 's'}")
            a, b = sides[0], sides[-1]
            ratios = [(r[b][key] / r[a][key]) if key == "gflops" else (r[a][key] / r[b][key])
                      for r in rounds]
            lines.append(f"| {workload} | " + " | ".join(cells) +
                         f" | {statistics.median(ratios):.2f}x faster |")
    report.table(lines, args.markdown)


if __name__ == "__main__":
    main()
