#!/usr/bin/python3
"""ZeRO-1/2's communication across the network lab (issue 54 part 2): 2 lab hosts x 1 rank over
a shaped link, the same job (the fortunes GPT of bench/labrun.py at a smaller batch, so the
communication weighs, and small gradient buckets) run as

  before   the binary given by --before (a build of the commit before the bucket-by-bucket
           shard layout: each rank's shard a contiguous cut of all parameters, so a bucket
           inside one rank's shard went round the ring whole),
  layout   this build: every bucket split evenly over the ranks (Megatron's layout), the update's
           all-gathers waited at once,
  overlap  this build with --overlap-param-gather: the all-gathers left running, the next
           forward waiting for each bucket where its layers begin,
  before-overlap  the --before binary with --overlap-param-gather (where it has the flag),

sides alternated over rounds (--sides picks some). With --tensor-parallel T each host runs T ranks,
a tensor-parallel group with sequence parallelism (TP inside a host, data parallelism across the
link, as in a cluster); `before` is then the build of the commit before the reduce-scatter under
sequence parallelism (22151ba: zero1 allreduced every gradient there), `layout` this build
(reduce-scatter). Per run: median step time after warm-up, the gradient reduction's
exposed time (exposed_comm_ms: from the end of backward until every bucket is reduced), the
waits for parameter gathers (param_gather_wait_ms: the forward's with the overlap, else the
update's; none from a binary older than the metric), the loss at the end.
Records go to bench/results/zero/overlap-lab.jsonl (stamped). Root (scripts/netlab).

  bench/zero/run_overlap_lab.py --before /tmp/dtrain-old --strategy zero2 --rounds 3
  bench/zero/run_overlap_lab.py --before /tmp/dtrain-22151ba --strategy zero1 --tensor-parallel 2 \
      --sides before,layout --batch 32
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import statistics

import report  # noqa: E402
from labrun import DTRAIN, GPT, ROOT, across_lab, run_and_read
from report import Records


def job(binary, args, side, seed):
    metrics = f"/tmp/zero-overlap-lab-{args.strategy}-{side}.jsonl"
    if os.path.exists(metrics):
        os.remove(metrics)
    flags = list(GPT)
    flags[flags.index("--batch-size") + 1] = str(args.batch)
    train = [binary, "train", *flags, "--text-file", args.text, "--strategy", args.strategy,
             "--bucket-cap-mb", str(args.bucket_mb), "--max-steps", str(args.steps),
             "--eval-every", str(args.steps), "--threads", str(args.threads), "--no-progress",
             "--seed", str(seed), "--metrics", metrics, "--log-every", "1"]
    if side in ("overlap", "before-overlap"):
        train.append("--overlap-param-gather")
    if args.tensor_parallel > 1:
        train += ["--tensor-parallel", str(args.tensor_parallel), "--sequence-parallel"]
    command = across_lab(args.profile, train, args.hosts, args.tensor_parallel)
    # across_lab runs bench/labrun's DTRAIN: point it at this side's binary.
    command = [binary if c == DTRAIN else c for c in command]
    wall, summary, steps, _ = run_and_read(command, metrics)
    measured = steps[args.warmup:]
    tail = steps[-max(1, len(steps) // 10):]
    return {"side": side, "binary": binary, "profile": args.profile, "strategy": args.strategy,
            "hosts": args.hosts, "tensor_parallel": args.tensor_parallel,
            "batch_per_rank": args.batch, "bucket_cap_mb": args.bucket_mb,
            "threads": args.threads, "steps": summary["steps"], "wall_seconds": wall,
            "median_step_ms": statistics.median(r["step_ms"] for r in measured),
            "exposed_comm_ms": statistics.median(r.get("exposed_comm_ms", 0) for r in measured),
            # None: a binary from before the metric (9267685's did not gather bucket by bucket).
            "param_gather_wait_ms": (statistics.median(r["param_gather_wait_ms"] for r in measured)
                                     if "param_gather_wait_ms" in measured[0] else None),
            "wire_bytes_per_step": statistics.median(r["wire_bytes"] for r in measured),
            "final_loss": statistics.mean(r["loss"] for r in tail)}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="dtrain of the commit before the layout")
    parser.add_argument("--after", default=DTRAIN)
    parser.add_argument("--strategy", default="zero2", choices=["zero1", "zero2"])
    parser.add_argument("--profile", default="lan")
    parser.add_argument("--hosts", type=int, default=2, help="lab hosts")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="ranks per host, one TP group with sequence parallelism")
    parser.add_argument("--sides", default="before,layout,overlap")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="windows per rank per step")
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--text", default="/usr/share/games/fortunes/fortunes")
    parser.add_argument("--markdown")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "zero",
                                                      "overlap-lab.jsonl"))
    args = parser.parse_args()
    sides = tuple(args.sides.split(","))
    if "before" not in sides or not set(sides) <= {"before", "before-overlap", "layout", "overlap"}:
        parser.error("--sides: 'before' and any of 'before-overlap', 'layout', 'overlap'")
    binaries = {"before": args.before, "before-overlap": args.before, "layout": args.after,
                "overlap": args.after}
    with Records(args.out, "a", args.after) as out:
        rounds = report.alternated_rounds(
            sides, args.rounds, lambda side: job(binaries[side], args, side, 1), out,
            lambda r: (f"step {r['median_step_ms']:.1f} ms, reduction exposed "
                       f"{r['exposed_comm_ms']:.1f} ms, gather waits "
                       f"{r['param_gather_wait_ms'] or 0:.1f} ms, loss {r['final_loss']:.4f}"))
    lines = [f"| side | step (ms) | step / before | gradient reduction exposed (ms) | "
             f"parameter gathers waited (ms) | loss at the end |",
             "|---|---|---|---|---|---|"]
    def gathers(side):
        waits = [r[side]["param_gather_wait_ms"] for r in rounds]
        return "n/a" if None in waits else f"{statistics.median(waits):.1f}"

    for side in sides:
        ratio = statistics.median(r[side]["median_step_ms"] / r["before"]["median_step_ms"]
                                  for r in rounds)
        med = lambda key: statistics.median(r[side][key] for r in rounds)  # noqa: E731
        lines.append(f"| {side} | {med('median_step_ms'):.1f} | {ratio:.3f} | "
                     f"{med('exposed_comm_ms'):.1f} | "
                     f"{gathers(side)} | "
                     f"{med('final_loss'):.4f} |")
    report.table(lines, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
