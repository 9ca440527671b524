#!/usr/bin/env python3
"""A/B of two dtrain builds on dtrain's side of the DDP and tensor-parallel benchmarks and on a
short `dtrain train` run: for a change that should not move speed (a refactor), run both builds
alternately (A B, then B A), each configuration once per round, and report the median of the
per-round ratios B/A with the raw per-run records kept (JSON lines).

  bench/builds/ab_builds.py --a /tmp/base --b build --rounds 5 [--records FILE] [--markdown FILE]

A build directory holds dtrain, libdtrain.so and bench/{ddp_bench,tp_bench}; each side runs
with LD_LIBRARY_PATH set to its own directory, so a copied build uses its own library.
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
import tempfile

import report
from ddp.run_ddp_bench import run_json
from report import Records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def configs(build):
    dtrain = os.path.join(build, "dtrain")
    launch = lambda n, threads: [dtrain, "launch", "--no-prefix", "--nproc-per-node", str(n),
                                 "--threads", str(threads), "--"]
    ddp = os.path.join(build, "bench", "ddp_bench")
    tp = os.path.join(build, "bench", "tp_bench")
    ddp_args = lambda model, steps: ["--model", model, "--batch", "64", "--steps", str(steps),
                                     "--bucket-cap-mb", "25"]
    return {
        "ddp mlp x1 (ms/step)": ("step_ms", launch(1, 2) + [ddp] + ddp_args("mlp", 200)),
        "ddp mlp x2 (ms/step)": ("step_ms", launch(2, 1) + [ddp] + ddp_args("mlp", 200)),
        "ddp cnn x2 (ms/step)": ("step_ms", launch(2, 1) + [ddp] + ddp_args("cnn", 40)),
        "tp T=2 (ms/step)": ("step_ms", launch(2, 1) + [tp, "--steps", "3", "--warmup", "1",
                                                        "--layers", "2", "--batch", "4"]),
        "train mlp x2 (s/sample)": ("train", [dtrain, "train", "--model", "mlp", "--dataset",
                                              "synthetic", "--synthetic-examples", "8192",
                                              "--epochs", "1", "--max-steps", "60", "--nproc",
                                              "2", "--no-progress", "--eval-every", "0"]),
        # A 2-stage pipeline (1F1B, 4 micro-batches): the schedule's lists and the executor.
        "train mlp pp2 (s/sample)": ("train", [dtrain, "train", "--model", "mlp", "--dataset",
                                               "synthetic", "--synthetic-examples", "8192",
                                               "--epochs", "1", "--max-steps", "60", "--nproc",
                                               "2", "--pipeline-parallel", "2",
                                               "--micro-batches", "4", "--no-progress",
                                               "--eval-every", "0"]),
        # The quick start's job (configs/fashion-mnist-ddp.toml), its first 150 steps.
        "quick start cnn x2 (s/sample)": ("train", [dtrain, "train", "--config",
                                                    os.path.join(ROOT, "configs",
                                                                 "fashion-mnist-ddp.toml"),
                                                    "--max-steps", "150", "--no-progress",
                                                    "--no-resume", "--eval-every", "0"]),
    }


def run(build, label, kind, command):
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.abspath(build))
    if kind != "train":
        record = run_json(command, env)
        return record[kind], record
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        out = subprocess.run(command + ["--metrics", metrics], capture_output=True, text=True,
                             timeout=900, env=env)
        if out.returncode != 0:
            sys.exit(f"failed: {' '.join(command)}\n{out.stderr[-2000:]}")
        summary = [json.loads(l) for l in open(metrics) if '"summary"' in l][-1]
        return 1.0 / summary["samples_per_s"], summary


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="the baseline build directory")
    parser.add_argument("--b", required=True, help="the build under test")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", help="comma-separated labels' prefixes to run")
    parser.add_argument("--records", help="append every run as a JSON line here")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    labels = list(configs(args.a))
    if args.only:
        labels = [l for l in labels if any(l.startswith(p) for p in args.only.split(","))]
    values = {(side, l): [] for side in "ab" for l in labels}
    records = Records(args.records, "a") if args.records else None
    for r in range(args.rounds):
        for label in labels:
            order = ["a", "b"] if r % 2 == 0 else ["b", "a"]
            for side in order:
                build = args.a if side == "a" else args.b
                kind, command = configs(build)[label]
                value, record = run(build, label, kind, command)
                values[(side, label)].append(value)
                if records:
                    records.write({"round": r, "side": side, "build": build,
                                              "label": label, "value": value,
                                              "record": record,
                                              **report.stamp(os.path.join(build, "dtrain"))})
                    records.flush()
            a, b = values[("a", label)][-1], values[("b", label)][-1]
            print(f"round {r + 1}/{args.rounds} {label}: A {a:.4g} B {b:.4g} B/A {b / a:.3f}",
                  flush=True)
    lines = ["| configuration | A median | B median | B/A (median of per-round ratios) | "
             "B/A range |", "|---|---|---|---|---|"]
    for label in labels:
        a, b = values[("a", label)], values[("b", label)]
        ratios = [y / x for x, y in zip(a, b)]
        lines.append(f"| {label} | {statistics.median(a):.4g} | {statistics.median(b):.4g} | "
                     f"{statistics.median(ratios):.3f} | {min(ratios):.3f} - {max(ratios):.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
