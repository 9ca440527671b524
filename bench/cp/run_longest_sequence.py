#!/usr/bin/env python3
"""The longest sequence this machine trains (issue 82): llama-tiny's shape (configs/llama-tiny.toml)
with `--checkpointing selective`, batch 1, at C = 1 (one process, 2 threads) and C = 2 (2 ranks,
`--context-parallel 2 --cp-method ring`, 1 thread each), everything in one memory budget: the
runs go into a memory cgroup (v1) limited to --limit-gib, whose peak (memory.max_usage_in_bytes:
both ranks together, page cache included) is what "fits" measures; a run past the limit is
ended by the cgroup's OOM killer and does not fit.

The search, per C: the peak at 3 sequence lengths (--probes-1, --probes-2; 2 steps each: the peak
is the first step's backward, and the optimizer's state is made in it) fitted by a + b T + c T^2; the predicted
longest T under the limit (less a margin) rounded down to a multiple of 256; 20 steps there under
the limit (if it fails, 6% shorter, again); then 2 steps 8% longer, which must not fit (if it
does, that is the new start). Reported: the longest T, its peak, its step time, and the ratio of
the two Ts (the target: C = 2 at least 1.8x C = 1).

  bench/cp/run_longest_sequence.py [--dtrain build/dtrain] [--limit-gib 22] [--steps 20]
      [--probes-1 T,T,T] [--probes-2 T,T,T] [--markdown FILE]      (root: the memory cgroup)

A step at C = 1 near its longest takes about a minute on 2 cores (the written-out T x T attention
of LibTorch 1.13), at C = 2 several: --steps 2 finds the lengths in about half an hour.

Raw records: bench/results/cp/longest_sequence.jsonl (stamped).
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from report import ROOT, Records, table  # noqa: E402

CORPUS = "/usr/share/doc/python3.11/html"
VOCAB = 1024
CGROUP = "/sys/fs/cgroup/memory"


def prepare_data(dtrain, work):
    tokenizer = os.path.join(work, "tokenizer.json")
    subprocess.run([dtrain, "data", "tokenizer", "train", CORPUS, "--vocab-size", str(VOCAB),
                    "--output", tokenizer], check=True, capture_output=True)
    prefix = os.path.join(work, "pydoc")
    subprocess.run([dtrain, "data", "prepare", CORPUS, "--tokenizer", tokenizer, "--output",
                    prefix], check=True, capture_output=True)
    return prefix


def run(dtrain, prefix, tokens, ranks, steps, limit, work):
    """`steps` steps at `tokens` tokens on `ranks` context-parallel ranks inside a fresh memory
    cgroup limited to `limit` bytes: {fits, peak_bytes, step_ms, losses}."""
    group = os.path.join(CGROUP, f"dtrain-longest-{os.getpid()}")
    if os.path.isdir(group):
        os.rmdir(group)
    os.mkdir(group)
    try:
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        metrics = os.path.join(work, f"metrics-{ranks}-{tokens}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        command = [dtrain, "train", "--config", os.path.join(ROOT, "configs", "llama-tiny.toml"),
                   "--dataset", "tokens:" + prefix, "--validation-fraction", "0.01",
                   "--context", str(tokens), "--checkpointing", "selective", "--batch-size", "1",
                   "--max-steps", str(steps), "--no-progress",
                   "--no-run-dir", "--log-every", "1", "--metrics", metrics,
                   "--threads", str(2 // ranks), "--nproc", str(ranks)]
        if ranks > 1:
            command += ["--context-parallel", str(ranks), "--cp-method", "ring"]
        enter = f"echo $$ > {group}/cgroup.procs && exec \"$@\""
        start = time.time()
        # Stopped (the whole process group) once the last step is logged: the evaluation that
        # follows is not what is measured, and takes minutes at these lengths.
        process = subprocess.Popen(["sh", "-c", enter, "sh", *command], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        logged = []
        while process.poll() is None and len(logged) < steps:
            time.sleep(0.5)
            if os.path.exists(metrics):
                logged = [json.loads(line) for line in open(metrics) if line.endswith("\n")]
                logged = [r for r in logged if r.get("event") == "step"]
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        output = process.communicate()[0]
        wall = time.time() - start
        peak = int(open(os.path.join(group, "memory.max_usage_in_bytes")).read())
        failures = int(open(os.path.join(group, "memory.failcnt")).read())
        records = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
        logged = [r for r in records if r.get("event") == "step"]
        fits = len(logged) == steps
        result = {"tokens": tokens, "ranks": ranks, "steps": steps, "fits": fits,
                  "peak_bytes": peak, "limit_bytes": limit, "limit_hits": failures,
                  "wall_s": round(wall, 1), "returncode": process.returncode,
                  "step_ms": [r["step_ms"] for r in logged],
                  "losses": [r["loss"] for r in logged]}
        if not fits:
            result["output_tail"] = output[-1500:]
        return result
    finally:
        for _ in range(50):  # the processes have exited; the cgroup empties
            try:
                os.rmdir(group)
                break
            except OSError:
                time.sleep(0.1)


def fit_longest(points, budget):
    """The largest T with a + b T + c T^2 <= budget, from (T, peak) points (least squares)."""
    import numpy
    t = numpy.array([p[0] for p in points], dtype=float)
    y = numpy.array([p[1] for p in points], dtype=float)
    a, b, c = numpy.linalg.lstsq(numpy.stack([numpy.ones_like(t), t, t * t], 1), y,
                                 rcond=None)[0]
    if c <= 0:
        return int((budget - a) / b)
    return int((-b + (b * b - 4 * c * (a - budget)) ** 0.5) / (2 * c))


def longest(dtrain, prefix, ranks, probes, steps, limit, margin, work, records):
    def round_down(tokens):
        return max(256, tokens // 256 * 256)

    points = []
    for tokens in probes:
        r = run(dtrain, prefix, tokens, ranks, 2, limit, work)
        records.write({"bench": "longest_sequence_probe", **r})
        print(f"C={ranks} T={tokens}: peak {r['peak_bytes'] / 2**30:.2f} GiB "
              f"({'fits' if r['fits'] else 'does not fit'})", flush=True)
        if r["fits"]:
            points.append((tokens, r["peak_bytes"]))
    tokens = round_down(fit_longest(points, limit * (1 - margin)))
    print(f"C={ranks}: predicted longest {tokens}", flush=True)
    while True:
        r = run(dtrain, prefix, tokens, ranks, steps, limit, work)
        records.write({"bench": "longest_sequence", **r})
        print(f"C={ranks} T={tokens} x {steps} steps: "
              f"{'fits' if r['fits'] else 'does not fit'}, peak {r['peak_bytes'] / 2**30:.2f} "
              f"GiB", flush=True)
        if not r["fits"]:
            tokens = round_down(int(tokens * 0.94))
            continue
        longer = round_down(int(tokens * 1.08))
        above = run(dtrain, prefix, longer, ranks, 2, limit, work)
        records.write({"bench": "longest_sequence_above", **above})
        print(f"C={ranks} T={longer}: {'fits' if above['fits'] else 'does not fit'}", flush=True)
        if above["fits"]:
            tokens = longer
            continue
        return r, above


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtrain", default=os.path.join(ROOT, "build", "dtrain"))
    parser.add_argument("--limit-gib", type=float, default=22.0)
    parser.add_argument("--margin", type=float, default=0.04,
                        help="the prediction aims this share under the limit")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--probes-1", default="8192,12288,16384",
                        help="sequence lengths whose peaks (2 steps) predict C = 1's longest")
    parser.add_argument("--probes-2", default="16384,24576,32768", help="the same for C = 2")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    if not os.access(CGROUP, os.W_OK):
        sys.exit(f"{CGROUP}: a writable memory cgroup (v1) is needed (run as root)")
    work = tempfile.mkdtemp(prefix="dtrain-longest-")
    prefix = prepare_data(args.dtrain, work)
    limit = int(args.limit_gib * 2**30)
    found = {}
    with Records(os.path.join(ROOT, "bench", "results", "cp", "longest_sequence.jsonl"), "a",
                 args.dtrain) as records:
        for ranks, probes in ((1, args.probes_1), (2, args.probes_2)):
            found[ranks] = longest(args.dtrain, prefix, ranks,
                                   [int(t) for t in probes.split(",")], args.steps, limit,
                                   args.margin, work, records)
    lines = ["| C | longest sequence (tokens) | peak, all ranks (GiB) | step (s, median) | "
             "next size up |", "|---|---|---|---|---|"]
    for ranks, (r, above) in found.items():
        lines.append(f"| {ranks} | {r['tokens']} | {r['peak_bytes'] / 2**30:.2f} | "
                     f"{statistics.median(r['step_ms'][1:]) / 1e3:.1f} | {above['tokens']}: "
                     f"does not fit |")
    ratio = found[2][0]["tokens"] / found[1][0]["tokens"]
    lines.append("")
    lines.append(f"C = 2 trains **{ratio:.2f}x** the tokens of C = 1 (target 1.8x), "
                 f"{args.steps} steps each, in {args.limit_gib:g} GiB.")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
