#!/usr/bin/env python3
"""Pipeline benchmark driver: dtrain's pipeline (P = 2 ranks, 1 thread each, started by dtrain
launch) on an MLP of 8 equal Linear(2048, 2048) + ReLU layers, under GPipe, 1F1B and interleaved
1F1B (V = 2) for M = 1, 2, 4, 8, 16 micro-batches of 64 examples, against one process training
the same global batch with 2 threads and with 1 thread; at a fixed global batch of 128, the
cost of cutting it into small micro-batches; and the stages' shared-memory transport against
Gloo. Configurations are run in turn within a round, in
reverse order on odd rounds; medians over rounds. Figures per run are medians over its steps:
step time (slowest rank), the bubble measured from the trace (mean idle share of the ranks
between the step's first and last forward/backward on any rank) next to (P-1)/(VM+P-1), and each
stage's activation peak (bytes of live tensors after a forward, above the step's start).

  bench/pipeline/run_pipeline_bench.py --rounds 3 [--markdown FILE]
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
MICRO = 64


def run(build, args, pipeline=True):
    program = [os.path.join(build, "bench", "pipeline_bench")] + args
    command = ([os.path.join(build, "dtrain"), "launch", "--no-prefix", "--nproc-per-node", "2",
                "--threads", "1", "--"] + program) if pipeline else program
    return run_json(command)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--markdown")
    parser.add_argument("--records", default=os.path.join(ROOT, "bench", "results", "pipeline", "runs.jsonl"),
                        help="raw records: every run's command and result, stamped (appended)")
    args = parser.parse_args()
    report.record_runs(args.records, os.path.join(args.build, "dtrain"))
    steps = ["--steps", str(args.steps), "--warmup", "2"]
    configs = []  # (label, args, pipeline?)
    for schedule, ms in (("gpipe", (1, 2, 4, 8, 16)), ("1f1b", (2, 4, 8, 16)),
                         ("interleaved", (2, 4, 8, 16))):
        for m in ms:
            extra = ["--virtual-stages", "2"] if schedule == "interleaved" else []
            configs.append(((schedule, m, MICRO), ["--schedule", schedule, "--micro-batches",
                            str(m), "--global-batch", str(MICRO * m)] + extra + steps, True))
    for threads in (2, 1):
        configs.append((("single", threads, MICRO), ["--single", "--threads", str(threads),
                        "--micro-batches", "8", "--global-batch", str(8 * MICRO)] + steps, False))
    for schedule in ("gpipe", "1f1b"):
        for m in (2, 8):
            configs.append(((schedule, m, 128 // m, "fixed"), ["--schedule", schedule,
                            "--micro-batches", str(m), "--global-batch", "128"] + steps, True))
    configs.append((("gpipe", 1, 128, "fixed"), ["--schedule", "gpipe", "--micro-batches", "1",
                    "--global-batch", "128"] + steps, True))
    # The same as the main table's through Gloo instead of shared memory between the stages.
    for schedule in ("1f1b", "interleaved"):
        for m in (4, 8):
            extra = ["--virtual-stages", "2"] if schedule == "interleaved" else []
            configs.append(((schedule, m, MICRO, "comm", "transport"),
                            ["--schedule", schedule, "--micro-batches", str(m), "--global-batch",
                             str(MICRO * m), "--pipeline-transport", "comm"] + extra + steps, True))

    results = {}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else list(reversed(configs))
        for label, cargs, pipeline in order:
            out = run(args.build, cargs, pipeline)
            results.setdefault(label, []).append(out)
            print(f"round {r + 1}/{args.rounds} {label}: {out['step_ms']:.1f} ms", flush=True)

    def med(label, key):
        return statistics.median(x[key] for x in results[label])

    single2 = med(("single", 2, MICRO), "samples_per_s")
    single1 = med(("single", 1, MICRO), "samples_per_s")
    naive = med(("gpipe", 1, MICRO), "samples_per_s")
    lines = [
        f"Micro-batches of {MICRO} examples (global batch = {MICRO} x M); one process: "
        f"{single2:.0f} samples/s with 2 threads, {single1:.0f} with 1 thread.",
        "",
        "| schedule | M | step (ms) | samples/s | vs naive (M=1) | vs 1 process, 2 threads | "
        "vs 1 process, 1 thread | bubble measured | bubble formula | difference (points) | "
        "activation peak MB stage 0 / stage 1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, _, pipeline in configs:
        if not pipeline or len(label) != 3:
            continue
        schedule, m, _ = label
        tput = med(label, "samples_per_s")
        bubble, formula = med(label, "bubble"), med(label, "bubble_formula")
        lines.append(
            f"| {schedule}{' (V=2)' if schedule == 'interleaved' else ''} | {m} | "
            f"{med(label, 'step_ms'):.0f} | {tput:.0f} | {tput / naive:.2f}x | "
            f"{tput / single2:.2f}x | {tput / single1:.2f}x | {100 * bubble:.1f}% | "
            f"{100 * formula:.1f}% | {100 * (bubble - formula):+.1f} | "
            f"{med(label, 'act_peak_mb_first'):.1f} / {med(label, 'act_peak_mb_last'):.1f} |")
    lines += ["", "Fixed global batch of 128 (smaller micro-batches as M grows):", "",
              "| schedule | M | micro-batch | step (ms) | samples/s | bubble measured | bubble formula |",
              "|---|---|---|---|---|---|---|"]
    for label, _, pipeline in configs:
        if len(label) != 4:
            continue
        schedule, m, each, _ = label
        lines.append(f"| {schedule} | {m} | {each} | {med(label, 'step_ms'):.0f} | "
                     f"{med(label, 'samples_per_s'):.0f} | {100 * med(label, 'bubble'):.1f}% | "
                     f"{100 * med(label, 'bubble_formula'):.1f}% |")
    lines += ["", "Transport between the stages: shared memory (the default, `--pipeline-transport "
              "auto`) against the communicator (Gloo, `--pipeline-transport comm`):", "",
              "| schedule | M | step (ms) shared memory | step (ms) Gloo | Gloo / shared memory | "
              "bubble shared memory | bubble Gloo |", "|---|---|---|---|---|---|---|"]
    for label, _, pipeline in configs:
        if len(label) != 5:
            continue
        schedule, m, each, _, _ = label
        shm = (schedule, m, each)
        lines.append(f"| {schedule} | {m} | {med(shm, 'step_ms'):.0f} | {med(label, 'step_ms'):.0f} | "
                     f"{med(label, 'step_ms') / med(shm, 'step_ms'):.2f}x | "
                     f"{100 * med(shm, 'bubble'):.1f}% | {100 * med(label, 'bubble'):.1f}% |")
    g8, f8 = ("gpipe", 8, MICRO), ("1f1b", 8, MICRO)
    lines += ["", f"Targets: M=8 throughput / naive: 1F1B {med(f8, 'samples_per_s') / naive:.2f}x, "
              f"GPipe {med(g8, 'samples_per_s') / naive:.2f}x (>= 1.6x); 1F1B / GPipe stage-0 "
              f"activation peak at M=8: {med(f8, 'act_peak_mb_first') / med(g8, 'act_peak_mb_first'):.3f}"
              f" (P/M = 0.25); interleaved bubble at M=8 "
              f"{100 * med(('interleaved', 8, MICRO), 'bubble'):.1f}% against 1F1B "
              f"{100 * med(f8, 'bubble'):.1f}%."]
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
