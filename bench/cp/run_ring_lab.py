#!/usr/bin/python3
"""How much of the ring's transfer time the block computation hides (issue 82), on the network
lab: 2 lab hosts x 1 rank over a shaped link (--profile, lan by default: 1 Gbit/s each way, 0.5
ms round trip), one sequence split over them (`--context-parallel 2 --cp-method ring`), traced
(`--trace`). Every transfer's exposed part is a "ring wait" span in the trace (the time a rank
waited for keys and values, or for gradients, after its block was computed); the blocks are
"ring block" spans. The same job run with DTRAIN_CP_SERIAL_RING=1 waits for every transfer
before computing, so its "ring wait" spans are the transfers' whole time. The share hidden:
1 - (waits overlapped) / (waits serial), both summed over the ranks and the measured steps
(after --warmup), medians over alternated rounds.

  bench/cp/run_ring_lab.py [--profile lan] [--context 8192] [--rounds 3]     (root)

Records go to bench/results/cp/ring-lab.jsonl (stamped).
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import statistics

import report  # noqa: E402
from labrun import DTRAIN, across_lab, run_and_read
from report import Records


def spans(trace, warmup_end_us):
    """{name: total microseconds} of the ring's spans after `warmup_end_us`, over the ranks."""
    events = json.load(open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    total = {"ring wait": 0, "ring block": 0}
    for e in events:
        if e.get("ph") == "X" and e.get("name") in total and e["ts"] >= warmup_end_us:
            total[e["name"]] += e["dur"]
    return total


def job(args, side):
    metrics = f"/tmp/cp-ring-lab-{side}.jsonl"
    trace = f"/tmp/cp-ring-lab-{side}.trace.json"
    for f in (metrics, trace):
        if os.path.exists(f):
            os.remove(f)
    # (A small validation split: one window, evaluated once at the end.)
    train = [args.dtrain, "train", "--model", "llama", "--dataset", "text",
             "--validation-fraction", "0.004", "--context", str(args.context), "--layers", "2", "--width", str(args.width),
             "--heads", str(args.heads), "--kv-heads", str(args.heads), "--batch-size", "1",
             "--context-parallel", "2", "--cp-method", "ring", "--max-steps", str(args.steps),
             "--threads", str(args.threads), "--no-progress", "--no-run-dir", "--metrics",
             metrics, "--log-every", "1", "--trace", trace, "--comm-timeout", "600000"]
    command = across_lab(args.profile, train, 2, 1)
    at = command.index(DTRAIN)
    command[at:at + 1] = (["env", "DTRAIN_CP_SERIAL_RING=1", args.dtrain] if side == "serial"
                          else [args.dtrain])
    wall, summary, steps, _ = run_and_read(command, metrics)
    # The measured steps begin where the warm-up's last step ended (wall clock, microseconds).
    events = json.load(open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    step_spans = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "step"
                         and e.get("pid") == 0), key=lambda e: e["ts"])
    begin = step_spans[args.warmup - 1]["ts"] + step_spans[args.warmup - 1]["dur"] \
        if len(step_spans) >= args.warmup > 0 else 0
    total = spans(trace, begin)
    measured = steps[args.warmup:]
    return {"side": side, "profile": args.profile, "context": args.context,
            "width": args.width, "heads": args.heads, "threads": args.threads,
            "steps": args.steps, "warmup": args.warmup, "wall_seconds": wall,
            "median_step_ms": statistics.median(r["step_ms"] for r in measured),
            "ring_wait_ms": total["ring wait"] / 1e3, "ring_block_ms": total["ring block"] / 1e3,
            "measured_steps": len(measured), "loss": steps[-1]["loss"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=DTRAIN)
    parser.add_argument("--profile", default="lan")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown")
    parser.add_argument("--out", default=os.path.join(report.ROOT, "bench", "results", "cp",
                                                      "ring-lab.jsonl"))
    args = parser.parse_args()
    sides = ("overlapped", "serial")
    with Records(args.out, "a", args.dtrain) as out:
        rounds = report.alternated_rounds(
            sides, args.rounds, lambda side: job(args, side), out,
            lambda r: (f"step {r['median_step_ms']:.0f} ms, ring waits {r['ring_wait_ms']:.0f} "
                       f"ms, blocks {r['ring_block_ms']:.0f} ms (all ranks, "
                       f"{r['measured_steps']} steps)"))
        hidden = [1 - r["overlapped"]["ring_wait_ms"] / r["serial"]["ring_wait_ms"]
                  for r in rounds]
        out.write({"bench": "ring_lab_hidden_share", "profile": args.profile,
                   "context": args.context, "hidden_share_per_round": hidden,
                   "hidden_share": statistics.median(hidden)})
    med = lambda side, key: statistics.median(r[side][key] for r in rounds)  # noqa: E731
    lines = ["| side | step (ms) | ring waits (ms, all ranks) | ring blocks (ms, all ranks) |",
             "|---|---|---|---|"]
    for side in sides:
        lines.append(f"| {side} | {med(side, 'median_step_ms'):.0f} | "
                     f"{med(side, 'ring_wait_ms'):.0f} | {med(side, 'ring_block_ms'):.0f} |")
    lines += ["", f"Share of the ring's transfer time hidden behind the blocks on `{args.profile}`"
              f" at {args.context} tokens: **{statistics.median(hidden):.1%}** (median of "
              f"{len(hidden)} rounds: {', '.join(f'{h:.1%}' for h in hidden)})."]
    report.table(lines, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
