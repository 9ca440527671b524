#!/usr/bin/env python3
"""Activation recomputation on the GPT (issue 54, part 1): `dtrain train --model gpt` on Debian's
fortunes, with no recomputation, selective recomputation of attention's core
(`--checkpointing selective`) and whole blocks recomputed (`--checkpointing <layers>`), sides
alternated over rounds; per run the median step time of the measured steps (after 3 warm-up
steps) and the process's peak resident set (the kernel's, via wait4). Reported: medians over
rounds of each side's time and peak against no recomputation in the same round.

Selective recomputation runs attention's core (the score matmul, mask, softmax, dropout and
the weighted sum) again in backward: in flops 4 b s^2 h per block, against 3 x (24 b s h^2 +
4 b s^2 h) for the block's step, i.e. 4 s / (72 h + 12 s) (plus the softmax's memory passes).

  bench/lm/run_recompute.py --rounds 3 [--markdown FILE]
"""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import statistics
import subprocess
import tempfile

import report

ROOT = report.ROOT


def run_side(dtrain, side, args, workdir):
    metrics = os.path.join(workdir, f"{side}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    checkpointing = {"none": "none", "selective": "selective", "blocks": str(args.layers)}[side]
    command = [dtrain, "train", "--model", "gpt", "--dataset", "text", "--threads",
               str(args.threads), "--layers", str(args.layers), "--heads", str(args.heads),
               "--width", str(args.width), "--context", str(args.context), "--batch-size",
               str(args.batch), "--dropout", str(args.dropout), "--max-steps", str(args.steps),
               "--validation-fraction", "0.002", "--log-every", "1", "--metrics", metrics,
               "--no-progress", "--checkpointing",
               checkpointing]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    _, status, usage = os.wait4(process.pid, 0)
    stderr = process.stderr.read()
    if status != 0:
        raise SystemExit(f"{' '.join(command)} failed: {stderr}")
    steps = [json.loads(line) for line in open(metrics)]
    step_ms = [r["step_ms"] for r in steps if r["event"] == "step"][3:]
    return {"side": side, "command": " ".join(command),
            "median_step_ms": statistics.median(step_ms), "steps": len(step_ms),
            "peak_rss_mb": usage.ru_maxrss / 1024}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=report.default_build())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--markdown")
    parser.add_argument("--records", default=os.path.join(ROOT, "bench", "results", "lm",
                                                          "recompute.jsonl"))
    args = parser.parse_args()
    dtrain = os.path.join(args.build, "dtrain")
    sides = ("none", "selective", "blocks")
    with report.Records(args.records, "a", dtrain) as records, \
            tempfile.TemporaryDirectory(prefix="dtrain-recompute-") as workdir:
        rounds = report.alternated_rounds(
            sides, args.rounds, lambda side: run_side(dtrain, side, args, workdir), records,
            lambda r: f"step {r['median_step_ms']:.0f} ms, peak {r['peak_rss_mb']:.0f} MB")
    s, h = args.context, args.width
    lines = [f"GPT {args.layers} x {args.width} wide, {args.heads} heads, context {args.context}, "
             f"batch {args.batch}, dropout {args.dropout}, {args.threads} threads; medians of "
             f"{args.rounds} rounds (per-round ratios); the core's share of a block's flops "
             f"4s/(72h+12s) = {4 * s / (72 * h + 12 * s) * 100:.1f}%:",
             "",
             "| recomputation | step (ms) | step / none | peak RSS (MB) | peak above none (MB) |",
             "|---|---|---|---|---|"]
    for side in sides:
        step = statistics.median(r[side]["median_step_ms"] for r in rounds)
        ratio = statistics.median(r[side]["median_step_ms"] / r["none"]["median_step_ms"]
                                  for r in rounds)
        peak = statistics.median(r[side]["peak_rss_mb"] for r in rounds)
        above = statistics.median(r[side]["peak_rss_mb"] - r["none"]["peak_rss_mb"]
                                  for r in rounds)
        lines.append(f"| {side} | {step:.0f} | {ratio:.3f} | {peak:.0f} | {above:+.0f} |")
    report.table(lines, args.markdown)


if __name__ == "__main__":
    main()
