#!/usr/bin/env python3
"""DDP benchmark driver: dtrain's DDP against PyTorch's DistributedDataParallel on the same model,
batch, optimizer and threads, at 1, 2 and 4 ranks, alternating the two sides (A B A B ...) over
several rounds, and reporting medians and ratios. Both sides start through `dtrain launch`, so they
get the same environment. Needs no torch itself; the reference runs under /usr/bin/python3.

  bench/ddp/run_ddp_bench.py --rounds 5 [--markdown BENCHMARKS-ddp.md]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def emit(table, markdown_path):
    """Prints a result table and, when asked, writes it to a Markdown file."""
    print(table)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(table + "\n")


def run_once(build, impl, model, world, batch, steps, bucket_cap_mb, extra=(), env=None,
             python="/usr/bin/python3"):
    args = ["--model", model, "--batch", str(batch), "--steps", str(steps),
            "--bucket-cap-mb", str(bucket_cap_mb)] + list(extra)
    if impl == "dtrain":
        program = [os.path.join(build, "bench", "ddp_bench")] + args
    else:
        program = [python, os.path.join(ROOT, "bench", "ddp/ddp_reference.py")] + args
    threads = max(1, (os.cpu_count() or 1) // world)
    command = [os.path.join(build, "dtrain"), "launch", "--no-prefix", "--nproc-per-node",
               str(world), "--threads", str(threads), "--"] + program
    return run_json(command, env)


def run_json(command, env=None):
    """Runs a benchmark command and returns the JSON line it prints (exits on failure)."""
    out = subprocess.run(command, capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, **(env or {})))
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {' '.join(command)}\n{out.stderr[-2000:]}")
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            report.record_run(command, result)
            return result
    sys.exit(f"no result from: {' '.join(command)}\n{out.stdout[-2000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--batch", type=int, default=64, help="examples per rank per step")
    parser.add_argument("--bucket-cap-mb", type=float, default=25)
    parser.add_argument("--markdown", help="write the result table to this file")
    parser.add_argument("--records", default=os.path.join(ROOT, "bench", "results", "ddp", "runs.jsonl"),
                        help="raw records: every run's command and result, stamped (appended)")
    args = parser.parse_args()
    report.record_runs(args.records, os.path.join(args.build, "dtrain"))

    steps = {"mlp": 200, "cnn": 40}
    results = {}  # (impl, model, world) -> list of runs
    configs = [(m, int(w)) for m in args.models.split(",") for w in args.worlds.split(",")]
    for round_index in range(args.rounds):
        for model, world in configs:
            order = ["dtrain", "pytorch"] if round_index % 2 == 0 else ["pytorch", "dtrain"]
            for impl in order:
                r = run_once(args.build, impl, model, world, args.batch, steps[model],
                             args.bucket_cap_mb)
                results.setdefault((impl, model, world), []).append(r)
                print(f"round {round_index + 1}/{args.rounds} {impl:7s} {model} x{world}: "
                      f"{r['step_ms']:.2f} ms/step", flush=True)

    lines = [
        "| model | ranks | threads/rank | dtrain step (ms) | PyTorch DDP step (ms) | "
        "dtrain / PyTorch | dtrain samples/s | PyTorch samples/s | exposed comm / allreduce | "
        "rank skew (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, world in configs:
        ours = results[("dtrain", model, world)]
        ref = results[("pytorch", model, world)]
        ours_ms = statistics.median(r["step_ms"] for r in ours)
        ref_ms = statistics.median(r["step_ms"] for r in ref)
        exposed = statistics.median(r["exposed_comm_ms"] for r in ours)
        allreduce = statistics.median(r["allreduce_ms"] for r in ours)
        skew = statistics.median(r["skew_ms"] for r in ours)
        overlap = f"{exposed:.2f} / {allreduce:.2f} ms = {exposed / allreduce:.0%}" \
            if world > 1 and allreduce > 0 else "n/a (1 rank)"
        lines.append(
            f"| {model} | {world} | {ours[0]['threads']} | {ours_ms:.2f} | {ref_ms:.2f} | "
            f"{ours_ms / ref_ms:.3f} | {statistics.median(r['samples_per_s'] for r in ours):.0f} | "
            f"{statistics.median(r['samples_per_s'] for r in ref):.0f} | {overlap} | "
            f"{skew:.2f} |")
    emit("\n".join(lines), args.markdown)


if __name__ == "__main__":
    main()
