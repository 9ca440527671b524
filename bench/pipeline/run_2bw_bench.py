#!/usr/bin/env python3
"""PipeDream (2BW, eager and async) against 1F1B (issues 52, 77): dtrain's pipeline on P = 2 ranks (1 thread
each, started by dtrain launch) over the MLP of bench/pipeline/pipeline_bench.cpp (8 equal
Linear(2048, 2048) + ReLU layers, 4 per stage), at a FIXED global batch cut into M
micro-batches, --pipeline-sync flush (1F1B: every step drains), 2bw, eager and async (no flush). All
run in the benchmark's --continuous mode: the measured steps back to back with nothing between
them (a pipeline without a flush overlaps a step with the next; a barrier per step would undo
it), throughput = the measured steps' wall time / steps, bubble = idle share of each rank's
compute window over the whole run (the optimizer's time counts as idle). Per round they run one
after the other (reversed on odd rounds); the ratios to flush are taken within a round, medians
over rounds.

  bench/pipeline/run_2bw_bench.py [--build build-unity] [--rounds 5] [--markdown FILE]
Raw records: bench/results/pipeline/pipedream_2bw.jsonl (stamped).
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the zero-bubble driver
import argparse
import statistics

import report  # noqa: E402
from report import table
from run_zero_bubble_bench import run  # the two-rank launch of pipeline_bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYNCS = ("flush", "2bw", "eager", "async")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--markdown")
    parser.add_argument("--records",
                        default=os.path.join(ROOT, "bench", "results", "pipeline",
                                             "pipedream_2bw.jsonl"))
    args = parser.parse_args()
    report.record_runs(args.records, os.path.join(args.build, "dtrain"))
    configs = [(sync, m) for m in args.micro_batches for sync in SYNCS]
    results, ratios = {}, {}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else list(reversed(configs))
        this_round = {}
        for sync, m in order:
            out = run(args.build, ["--continuous", "--pipeline-sync", sync, "--micro-batches",
                                   str(m), "--global-batch", str(args.global_batch), "--steps",
                                   str(args.steps), "--warmup", "2"])
            results.setdefault((sync, m), []).append(out)
            this_round[(sync, m)] = out["samples_per_s"]
            print(f"round {r + 1}/{args.rounds} {sync} M={m}: {out['step_ms']:.1f} ms/step, "
                  f"bubble {100 * out['bubble']:.1f}%", flush=True)
        for sync, m in configs:
            ratios.setdefault((sync, m), []).append(this_round[(sync, m)] /
                                                    this_round[("flush", m)])

    def med(label, key):
        return statistics.median(x[key] for x in results[label])

    lines = [f"P = 2 (1 thread per rank), global batch {args.global_batch}, {args.steps} steps "
             f"back to back, {args.rounds} rounds:", "",
             "| sync | M | ms per step | throughput vs 1F1B (median of per-round ratios) | "
             "bubble | memory held at peak MB stage 0 / stage 1 |",
             "|---|---|---|---|---|---|"]
    for sync, m in configs:
        label = (sync, m)
        lines.append(
            f"| {sync} | {m} | {med(label, 'step_ms'):.0f} | "
            f"{statistics.median(ratios[label]):.3f}x | {100 * med(label, 'bubble'):.1f}% | "
            f"{med(label, 'held_peak_mb_first'):.0f} / {med(label, 'held_peak_mb_last'):.0f} |")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
