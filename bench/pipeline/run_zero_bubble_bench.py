#!/usr/bin/env python3
"""Zero-bubble schedules against 1F1B (issue 52): dtrain's pipeline on P = 2 ranks (1 thread
each, started by dtrain launch) over the MLP of bench/pipeline/pipeline_bench.cpp (8 equal
Linear(2048, 2048) + ReLU layers), at a FIXED global batch cut into M micro-batches, under 1f1b,
zb-h1, zb-h2 and zb-v (two chunks of 2 layers per rank in a V). Per round the schedules run one
after another (reversed on odd rounds); the
ratios are taken within a round (throughput of the schedule / 1F1B's), medians over rounds.
Per run: step time (slowest rank, median over steps), the bubble from the trace (mean idle
share of the ranks between the step's first and last compute span), the ideal timeline's bubble
(the simulator's, equal stages), and each stage's activation peak (bytes of live tensors after
any action, above the step's start).

  bench/pipeline/run_zero_bubble_bench.py [--build build-unity] [--rounds 5] [--markdown FILE]
Raw records: bench/results/pipeline/zero_bubble.jsonl (stamped).
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import statistics

from ddp.run_ddp_bench import run_json
import report  # noqa: E402
from report import table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-v")


def run(build, args):
    program = [os.path.join(build, "bench", "pipeline_bench")] + args
    return run_json([os.path.join(build, "dtrain"), "launch", "--no-prefix", "--nproc-per-node",
                     "2", "--threads", "1", "--"] + program)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--markdown")
    parser.add_argument("--records",
                        default=os.path.join(ROOT, "bench", "results", "pipeline", "zero_bubble.jsonl"))
    args = parser.parse_args()
    report.record_runs(args.records, os.path.join(args.build, "dtrain"))
    configs = [(schedule, m) for m in args.micro_batches for schedule in SCHEDULES]
    results, ratios = {}, {}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else list(reversed(configs))
        this_round = {}
        for schedule, m in order:
            out = run(args.build, ["--schedule", schedule, "--micro-batches", str(m),
                                   "--global-batch", str(args.global_batch), "--steps",
                                   str(args.steps), "--warmup", "2"])
            results.setdefault((schedule, m), []).append(out)
            this_round[(schedule, m)] = out["samples_per_s"]
            print(f"round {r + 1}/{args.rounds} {schedule} M={m}: {out['step_ms']:.1f} ms, "
                  f"bubble {100 * out['bubble']:.1f}%", flush=True)
        for schedule, m in configs:
            ratios.setdefault((schedule, m), []).append(
                this_round[(schedule, m)] / this_round[("1f1b", m)])

    def med(label, key):
        return statistics.median(x[key] for x in results[label])

    lines = [f"P = 2 (1 thread per rank), global batch {args.global_batch}, "
             f"{args.rounds} rounds:", "",
             "| schedule | M | step (ms) | throughput vs 1F1B (median of per-round ratios) | "
             "bubble measured | bubble ideal | measured bubble vs 1F1B's | activation peak MB "
             "stage 0 / stage 1 | vs 1F1B's (larger stage) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for schedule, m in configs:
        label, base = (schedule, m), ("1f1b", m)
        peak = max(med(label, "act_peak_mb_first"), med(label, "act_peak_mb_last"))
        base_peak = max(med(base, "act_peak_mb_first"), med(base, "act_peak_mb_last"))
        lines.append(
            f"| {schedule} | {m} | {med(label, 'step_ms'):.0f} | "
            f"{statistics.median(ratios[label]):.3f}x | {100 * med(label, 'bubble'):.1f}% | "
            f"{100 * med(label, 'bubble_formula'):.1f}% | "
            f"{med(label, 'bubble') / med(base, 'bubble'):.2f} | "
            f"{med(label, 'act_peak_mb_first'):.1f} / {med(label, 'act_peak_mb_last'):.1f} | "
            f"{peak / base_peak:.2f} |")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
