#!/usr/bin/env python3
"""ZeRO benchmark driver: step time and memory per rank of dtrain's ddp, zero1, zero2 and zero3
against PyTorch's DistributedDataParallel and ZeroRedundancyOptimizer (ZeRO-1), with Adam, on the
same ~100M-parameter MLP (784 -> 64 x 1256 -> 10: 65 layers, so zero3 gathers ~1.6M parameters
at a time) at 1, 2 and 4 ranks; sides alternated over rounds, medians reported.

Memory per rank, three ways: the whole run's peak RSS (includes building the full model before
sharding it), the peak RSS of the measured steps (the kernel's VmHWM reset after warm-up), and
the model state each strategy holds (parameters + gradients + optimizer state, from
memory_report(); for zero3 plus the most gathered parameters and unsharded gradients held at once
during a step). dtrain's processes tune glibc malloc as `dtrain train` does
(launch::tune_allocator); the PyTorch side runs as users run it, with glibc's defaults. Uses bench/ddp_bench and bench/ddp/ddp_reference.py through run_ddp_bench.run_once.

  bench/zero/run_zero_bench.py --rounds 2 [--markdown FILE]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import os
import statistics

from ddp.run_ddp_bench import ROOT, emit, run_once
import report  # noqa: E402

HIDDEN = ["1256"] * 64
NAMES = {("dtrain", "ddp"): "dtrain ddp", ("dtrain", "zero1"): "dtrain zero1",
         ("dtrain", "zero2"): "dtrain zero2", ("dtrain", "zero3"): "dtrain zero3",
         ("pytorch", "ddp"): "PyTorch DDP + Adam",
         ("pytorch", "zero1"): "PyTorch DDP + ZeroRedundancyOptimizer"}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--markdown")
    parser.add_argument("--records", default=os.path.join(ROOT, "bench", "results", "zero", "runs.jsonl"),
                        help="raw records: every run's command and result, stamped (appended)")
    args = parser.parse_args()
    report.record_runs(args.records, os.path.join(args.build, "dtrain"))
    worlds = [int(w) for w in args.worlds.split(",")]
    results = {}
    dtrain_sides = [("dtrain", s) for s in ("ddp", "zero1", "zero2", "zero3")]
    pytorch_sides = [("pytorch", "ddp"), ("pytorch", "zero1")]
    for round_index in range(args.rounds):
        for world in worlds:
            # Interleave the two implementations: A B A B ...
            sides = [dtrain_sides[0], pytorch_sides[0], dtrain_sides[1], pytorch_sides[1],
                     dtrain_sides[2], dtrain_sides[3]] if world > 1 else dtrain_sides
            order = sides if round_index % 2 == 0 else list(reversed(sides))
            for impl, strategy in order:
                extra = ["--strategy", strategy, "--optimizer", "adam", "--warmup", "2",
                         "--no-comm-baseline", "--hidden"] + HIDDEN
                r = run_once(args.build, impl, "mlp", world, args.batch, args.steps, 25, extra)
                results.setdefault((impl, strategy, world), []).append(r)
                print(f"round {round_index + 1} {impl:7s} {strategy} x{world}: "
                      f"{r['step_ms']:.0f} ms, peak {r['peak_rss_mb']:.0f} MB, "
                      f"steps' peak {r['step_peak_rss_mb']:.0f} MB", flush=True)

    def med(key, field):
        return statistics.median(r[field] for r in results[key])

    lines = ["| ranks | side | step (ms) | vs dtrain ddp | peak RSS, whole run (MB) | "
             "peak RSS, steps (MB) | model state held (MB): params + grads + optimizer "
             "(+ zero3 transient) | model state vs ddp / N |",
             "|---|---|---|---|---|---|---|---|"]
    for world in worlds:
        base = med(("dtrain", "ddp", world), "step_ms")
        ddp_state = sum(med(("dtrain", "ddp", world), f)
                        for f in ("param_mb", "grad_mb", "optimizer_mb"))
        for impl, strategy in dtrain_sides + (pytorch_sides if world > 1 else []):
            key = (impl, strategy, world)
            state, ratio = "n/a", "n/a"
            if impl == "dtrain":
                p, g, o, t = (med(key, f) for f in ("param_mb", "grad_mb", "optimizer_mb",
                                                     "transient_mb"))
                total = p + g + o + t
                state = f"{p:.0f} + {g:.0f} + {o:.0f}" + (f" (+ {t:.0f})" if t > 0 else "") + \
                    f" = {total:.0f}"
                ratio = f"{total / (ddp_state / world):.2f}"
            lines.append(f"| {world} | {NAMES[(impl, strategy)]} | {med(key, 'step_ms'):.0f} | "
                         f"{med(key, 'step_ms') / base:.2f} | {med(key, 'peak_rss_mb'):.0f} | "
                         f"{med(key, 'step_peak_rss_mb'):.0f} | {state} | {ratio} |")
    emit("\n".join(lines), args.markdown)


if __name__ == "__main__":
    main()
