#!/usr/bin/env python3
"""ZeRO benchmark driver: step time and peak resident memory per rank of dtrain's ddp, zero1 and
zero2 against PyTorch's DistributedDataParallel and ZeroRedundancyOptimizer (ZeRO-1), with Adam, on the
same ~93M-parameter MLP (784 -> 8 x 3584 -> 10) at 2 and 4 ranks; sides alternated over rounds,
medians reported. Uses bench/ddp_bench and bench/ddp_reference.py through run_ddp_bench.run_once.

  bench/run_zero_bench.py --rounds 2 [--markdown FILE]
"""
import argparse
import os
import statistics

from run_ddp_bench import ROOT, emit, run_once

HIDDEN = ["3584"] * 8


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    results = {}
    sides = [("dtrain", "ddp"), ("pytorch", "ddp"), ("dtrain", "zero1"), ("pytorch", "zero1"),
             ("dtrain", "zero2")]
    for round_index in range(args.rounds):
        for world in (int(w) for w in args.worlds.split(",")):
            order = sides if round_index % 2 == 0 else list(reversed(sides))
            for impl, strategy in order:
                extra = ["--strategy", strategy, "--optimizer", "adam", "--warmup", "2",
                         "--no-comm-baseline", "--hidden"] + HIDDEN
                r = run_once(args.build, impl, "mlp", world, args.batch, args.steps, 25, extra)
                results.setdefault((impl, strategy, world), []).append(r)
                print(f"round {round_index + 1} {impl:7s} {strategy} x{world}: "
                      f"{r['step_ms']:.0f} ms, peak {r['peak_rss_mb']:.0f} MB", flush=True)

    def med(key, field):
        return statistics.median(r[field] for r in results[key])

    lines = ["| ranks | side | step (ms) | vs dtrain ddp | peak RSS per rank (MB) | "
             "model state per rank (MB): params + grads + optimizer |",
             "|---|---|---|---|---|---|"]
    for world in (int(w) for w in args.worlds.split(",")):
        base = med(("dtrain", "ddp", world), "step_ms")
        for impl, strategy in sides:
            key = (impl, strategy, world)
            name = {("dtrain", "ddp"): "dtrain ddp", ("dtrain", "zero1"): "dtrain zero1",
                    ("dtrain", "zero2"): "dtrain zero2",
                    ("pytorch", "ddp"): "PyTorch DDP + Adam",
                    ("pytorch", "zero1"): "PyTorch DDP + ZeroRedundancyOptimizer"}[(impl, strategy)]
            state = "n/a"
            if impl == "dtrain":
                p, g, o = (med(key, f) for f in ("param_mb", "grad_mb", "optimizer_mb"))
                state = f"{p:.0f} + {g:.0f} + {o:.0f} = {p + g + o:.0f}"
            lines.append(f"| {world} | {name} | {med(key, 'step_ms'):.0f} | "
                         f"{med(key, 'step_ms') / base:.2f} | {med(key, 'peak_rss_mb'):.0f} | "
                         f"{state} |")
    emit("\n".join(lines), args.markdown)


if __name__ == "__main__":
    main()
