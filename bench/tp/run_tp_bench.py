#!/usr/bin/env python3
"""Tensor-parallel benchmark driver: a stack of GPT blocks (width 1024, 16 heads, context 256,
2 blocks, batch 4 sequences, Adam) at T = 1 (one process, 2 threads: the two cores as one
compute) against T = 2 (two ranks of 1 thread each, started by dtrain launch), with and without
sequence parallelism, with and without --tp-comm-overlap (backward's input-gradient
collectives beside the weight gradients; the communication share then counts only the time
backward waited for them). Runs alternate within a round (reversed on odd rounds); medians over
rounds, ratios of medians. Per run (medians over its steps): step time of the slowest rank, the
share of it inside the tensor-parallel collectives (from the trace), per-rank parameter +
gradient + Adam bytes, and the activation peak (live tensor bytes after the forward).

  bench/tp/run_tp_bench.py --rounds 3 [--markdown FILE] [--layers 2 --batch 4]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import os
import statistics

from ddp.run_ddp_bench import run_json
import report  # noqa: E402
from report import table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--markdown")
    parser.add_argument("--records", default=os.path.join(ROOT, "bench", "results", "tp", "runs.jsonl"),
                        help="raw records: every run's command and result, stamped (appended)")
    args = parser.parse_args()
    report.record_runs(args.records, os.path.join(args.build, "dtrain"))
    program = os.path.join(args.build, "bench", "tp_bench")
    common = ["--steps", str(args.steps), "--warmup", "1", "--layers", str(args.layers),
              "--batch", str(args.batch)]
    launch = [os.path.join(args.build, "dtrain"), "launch", "--no-prefix", "--nproc-per-node",
              "2", "--threads", "1", "--"]
    configs = [
        ("T=1, 2 threads", [program, "--single", "--threads", "2"] + common),
        ("T=2", launch + [program] + common),
        ("T=2, sequence parallel", launch + [program, "--sequence-parallel"] + common),
        ("T=2, overlapped", launch + [program, "--tp-comm-overlap"] + common),
        ("T=2, sequence parallel, overlapped",
         launch + [program, "--sequence-parallel", "--tp-comm-overlap"] + common),
        ("T=1, 1 thread", [program, "--single", "--threads", "1"] + common),
    ]
    results = {}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else list(reversed(configs))
        for label, command in order:
            out = run_json(command)
            results.setdefault(label, []).append(out)
            print(f"round {r + 1}/{args.rounds} {label}: {out['step_ms']:.0f} ms", flush=True)

    def med(label, key):
        return statistics.median(x[key] for x in results[label])

    base = "T=1, 2 threads"
    lines = [
        f"GPT blocks: width 1024, 16 heads, context 256, {args.layers} blocks, vocabulary 128, "
        f"batch {args.batch} sequences, Adam; {args.rounds} rounds.",
        "",
        "| layout | step (ms) | tokens/s | vs T=1, 2 threads | communication share | "
        "params + grads + Adam per rank (MB) | vs T=1 | activation peak (MB) | vs T=2 |",
        "|---|---|---|---|---|---|---|---|---|"]
    for label, _ in configs:
        lines.append(
            f"| {label} | {med(label, 'step_ms'):.0f} | {med(label, 'tokens_per_s'):.0f} | "
            f"{med(label, 'tokens_per_s') / med(base, 'tokens_per_s'):.2f}x | "
            f"{100 * med(label, 'comm_share'):.1f}% | {med(label, 'model_state_mb'):.1f} | "
            f"{med(label, 'model_state_mb') / med(base, 'model_state_mb'):.3f} | "
            f"{med(label, 'activation_peak_mb'):.1f} | "
            f"{med(label, 'activation_peak_mb') / med('T=2', 'activation_peak_mb'):.2f} |")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
