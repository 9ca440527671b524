#!/usr/bin/python3
"""DualPipe-V against 1F1B with the same stages (issue 81): how much of a mixture of experts'
all-to-all is left exposed, from the trace, across the network lab (2 hosts x 1 rank, the
experts split over the hosts: --expert-parallel 2). Each host's rank holds the whole model as
one pipeline rank (--pipeline-parallel 1):

  1f1b       one chunk: every micro-batch's forward, then its backward (all-to-alls exposed)
  zb-v       the same model in two chunks (the V's two arms on the one rank), no pairs
  dualpipev  the same two chunks, the steady state's pairs of one chunk's forward and the other
             chunk's backward run on two threads (the backward's all-to-alls on the expert
             group's second lane)

Per run, from the rank's trace (steps after the first two): the all-to-all time per step (the
union of the spans in category comm named all_to_all*, on either thread), the part of it during
which no thread of the rank computes (inside a forward, backward or W span and not inside one of
its comm, recv or send spans): the exposed all-to-all, and the step time. Target: DualPipe-V's
exposed all-to-all at most half of 1F1B's. Rounds alternate the sides; the table gives medians
and the median of per-round ratios. Records: bench/results/moe/dualpipev-lab.jsonl. Root
(scripts/netlab); a built dtrain (DTRAIN_BIN, default build/dtrain).

  bench/moe/run_dualpipev_lab.py --profile lan --rounds 3 --steps 12"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import statistics
import tempfile

from labrun import DTRAIN, ROOT, across_lab, run_and_read
from report import Records, alternated_rounds, table

COMPUTE = ("forward", "backward", "weight")
INSIDE = ("comm", "recv", "send")


def union(intervals):
    """Sorted disjoint intervals covering `intervals` ((start, end) pairs)."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def minus(intervals, holes):
    """The parts of disjoint sorted `intervals` outside disjoint sorted `holes`."""
    out = []
    for start, end in intervals:
        cursor = start
        for h_start, h_end in holes:
            if h_end <= cursor or h_start >= end:
                continue
            if h_start > cursor:
                out.append((cursor, h_start))
            cursor = max(cursor, h_end)
            if cursor >= end:
                break
        if cursor < end:
            out.append((cursor, end))
    return out


def length(intervals):
    return sum(end - start for start, end in intervals)


def exposure(events, pid, skip_steps=2):
    """One rank's all-to-all time, exposed all-to-all time and step time per step (ms), over the
    steps after the first `skip_steps`."""
    mine = [e for e in events if e.get("ph") == "X" and e.get("pid") == pid]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if e["cat"] == "step")
    steps = steps[skip_steps:-1]  # (the last step span holds the final evaluation)
    if not steps:
        raise SystemExit(f"rank {pid}'s trace has no step after the first {skip_steps}")
    window = (steps[0][0], steps[-1][1])

    def spans(keep):
        return [(max(e["ts"], window[0]), min(e["ts"] + e["dur"], window[1])) for e in mine
                if keep(e) and e["ts"] < window[1] and e["ts"] + e["dur"] > window[0]]

    all_to_all = union(spans(lambda e: e["cat"] == "comm" and e["name"].startswith("all_to_all")))
    computing = []
    for tid in sorted({e.get("tid", 0) for e in mine}):
        work = union(spans(lambda e: e.get("tid", 0) == tid and e["cat"] in COMPUTE))
        waits = union(spans(lambda e: e.get("tid", 0) == tid and e["cat"] in INSIDE))
        computing += minus(work, waits)
    exposed = minus(all_to_all, union(computing))
    n = len(steps)
    return {"all_to_all_ms": length(all_to_all) / 1e3 / n, "exposed_ms": length(exposed) / 1e3 / n,
            "step_ms": length(steps) / 1e3 / n, "steps_measured": n}


def train_flags(args, schedule, directory):
    return [DTRAIN, "train", "--config", os.path.join(ROOT, "configs", "moe-tiny.toml"), "--dataset",
            "text", "--width", str(args.width), "--heads", "4", "--kv-heads", "2",
            "--moe-ffn-width", str(args.ffn), "--context", str(args.context), "--layers",
            str(args.layers), "--strategy", "pipeline", "--pipeline-parallel", "1",
            "--schedule", schedule, "--expert-parallel", "2", "--micro-batches",
            str(args.micro_batches), "--batch-size", str(args.batch_size), "--max-steps",
            str(args.steps), "--eval-every", "0", "--threads", "1", "--warmup-steps", "1",
            "--trace", os.path.join(directory, "trace.json"), "--metrics",
            os.path.join(directory, "metrics.jsonl")]


def run_side(args, schedule):
    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o777)
        flags = train_flags(args, schedule, directory)
        wall, summary, steps, _ = run_and_read(across_lab(args.profile, flags),
                                                os.path.join(directory, "metrics.jsonl"))
        events = json.load(open(os.path.join(directory, "trace.json")))["traceEvents"]
    ranks = [exposure(events, pid) for pid in (0, 1)]
    result = {"schedule": schedule, "profile": args.profile, "wall_s": wall,
              "final_loss": steps[-1]["loss"], "ranks": ranks,
              "flags": flags[:flags.index("--trace")]}
    for key in ("all_to_all_ms", "exposed_ms", "step_ms"):
        result[key] = round(statistics.mean(r[key] for r in ranks), 2)
    result["hidden_share"] = round(1 - result["exposed_ms"] / result["all_to_all_ms"], 3)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="lan")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--sides", default="1f1b,zb-v,dualpipev")
    parser.add_argument("--markdown")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "moe",
                                                      "dualpipev-lab.jsonl"))
    args = parser.parse_args()
    sides = tuple(args.sides.split(","))
    with Records(args.out, "a") as records:
        rounds = alternated_rounds(
            sides, args.rounds, lambda side: run_side(args, side), records,
            lambda r: (f"step {r['step_ms']:.1f} ms, all-to-all {r['all_to_all_ms']:.1f} ms, "
                       f"exposed {r['exposed_ms']:.1f} ms ({100 * r['hidden_share']:.0f}% "
                       f"hidden), loss {r['final_loss']:.4f}"))
    lines = ["| schedule | step (ms) | all-to-all (ms/step) | exposed (ms/step) | hidden | "
             "exposed / 1F1B's (median of rounds) | step / 1F1B's |",
             "|---|---|---|---|---|---|---|"]
    for side in sides:
        def median(key):
            return statistics.median(r[side][key] for r in rounds)
        ratio = statistics.median(r[side]["exposed_ms"] / r["1f1b"]["exposed_ms"] for r in rounds)
        step = statistics.median(r[side]["step_ms"] / r["1f1b"]["step_ms"] for r in rounds)
        lines.append(f"| {side} | {median('step_ms'):.1f} | {median('all_to_all_ms'):.1f} | "
                     f"{median('exposed_ms'):.1f} | {100 * median('hidden_share'):.0f}% | "
                     f"{ratio:.3f} | {step:.3f} |")
    table(lines, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
