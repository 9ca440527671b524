#!/usr/bin/env python3
"""Memory-saver benchmark driver (issue: mixed precision and activation checkpointing).

Part A: bf16-mixed against fp32 on the MLP, the CNN and a transformer block, for dtrain and for
PyTorch's autocast on the same models. Part B: activation checkpointing of a 32-layer
Linear(512)+ReLU MLP at batch 4096 with no checkpointing and 1, 2, 4, 6 (sqrt), 8, 32 segments,
dtrain's checkpoint_sequential next to PyTorch's. Every configuration runs in a fresh process
(peak resident memory is per process); the two sides alternate (A B, then B A) over rounds;
tables give medians.

  bench/precision/run_precision_bench.py --rounds 3 [--markdown FILE]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import math
import os
import statistics
import subprocess
import sys

from ddp.run_ddp_bench import emit
import report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(build, impl, args):
    if impl == "dtrain":
        command = [os.path.join(build, "bench", "precision_bench")] + args
    else:
        command = ["/usr/bin/python3", os.path.join(ROOT, "bench", "precision/precision_reference.py")] + args
    # A fixed mmap threshold makes glibc return every large freed block to the OS at once, so
    # peak RSS follows live tensor memory (the default threshold grows after large frees and
    # keeps freed tensors in the heap). The same for both sides.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{out.stderr[-2000:]}")
    result = json.loads([l for l in out.stdout.splitlines() if l.startswith("{")][-1])
    report.record_run(command, result)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parts", default="A,B")
    parser.add_argument("--markdown")
    parser.add_argument("--records", default=os.path.join(ROOT, "bench", "results", "precision", "runs.jsonl"),
                        help="raw records: every run's command and result, stamped (appended)")
    args = parser.parse_args()
    report.record_runs(args.records, os.path.join(args.build, "dtrain"))
    threads = ["--threads", str(args.threads)]

    precision_configs = [("mlp", 256, 20), ("cnn", 256, 10), ("transformer", 16, 10)]
    segment_configs = [-1, 1, 2, 4, 6, 8, 32]
    results = {}

    def measure(key, extra, round_index):
        order = ["dtrain", "pytorch"] if round_index % 2 == 0 else ["pytorch", "dtrain"]
        for impl in order:
            r = run(args.build, impl, extra + threads)
            results.setdefault((impl,) + key, []).append(r)
            print(f"round {round_index + 1} {impl:7s} {key}: {r['step_ms']:.1f} ms, "
                  f"peak {r['peak_rss_mb']:.0f} MB", flush=True)

    for round_index in range(args.rounds):
        if "A" in args.parts:
            for model, batch, steps in precision_configs:
                for precision in ("fp32", "bf16-mixed"):
                    measure(("A", model, precision), ["--model", model, "--precision", precision,
                                                      "--batch", str(batch), "--steps", str(steps)],
                            round_index)
        if "B" in args.parts:
            for segments in segment_configs:
                measure(("B", segments), ["--model", "deep-mlp", "--segments", str(segments),
                                          "--batch", "4096", "--steps", "3", "--warmup", "1"],
                        round_index)

    def med(impl, key, field):
        return statistics.median(r[field] for r in results[(impl,) + key])

    def activation(impl, key):
        return statistics.median(r["activation_mb"] for r in results[(impl,) + key])

    out = []
    if "A" in args.parts:
        out += ["### bf16-mixed against fp32", "",
                "| model | dtrain fp32 (ms) | dtrain bf16-mixed (ms) | dtrain speed-up | "
                "PyTorch fp32 (ms) | PyTorch autocast (ms) | PyTorch speed-up | "
                "dtrain bf16-mixed / PyTorch autocast | peak RSS MB dtrain fp32 / bf16-mixed | "
                "peak RSS MB PyTorch fp32 / autocast |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for model, batch, _ in precision_configs:
            d32, d16 = med("dtrain", ("A", model, "fp32"), "step_ms"), \
                med("dtrain", ("A", model, "bf16-mixed"), "step_ms")
            p32, p16 = med("pytorch", ("A", model, "fp32"), "step_ms"), \
                med("pytorch", ("A", model, "bf16-mixed"), "step_ms")
            out.append(
                f"| {model} (batch {batch}) | {d32:.1f} | {d16:.1f} | {d32 / d16:.2f}x | "
                f"{p32:.1f} | {p16:.1f} | {p32 / p16:.2f}x | {d16 / p16:.2f} | "
                f"{med('dtrain', ('A', model, 'fp32'), 'peak_rss_mb'):.0f} / "
                f"{med('dtrain', ('A', model, 'bf16-mixed'), 'peak_rss_mb'):.0f} | "
                f"{med('pytorch', ('A', model, 'fp32'), 'peak_rss_mb'):.0f} / "
                f"{med('pytorch', ('A', model, 'bf16-mixed'), 'peak_rss_mb'):.0f} |")
        out.append("")
    if "B" in args.parts:
        base_act = activation("dtrain", ("B", -1))
        base_ms = med("dtrain", ("B", -1), "step_ms")
        per_layer = base_act / 32  # measured activation memory of one layer
        out += ["### Activation checkpointing, 32 x (Linear 512 + ReLU), batch 4096", "",
                "| segments K | dtrain step (ms) | extra time | dtrain activation MB | "
                "reduction | theory (K-1 + ceil(32/K)) x layer, MB | PyTorch step (ms) | "
                "PyTorch activation MB | dtrain / PyTorch memory |",
                "|---|---|---|---|---|---|---|---|---|"]
        for segments in segment_configs:
            key = ("B", segments)
            ms, act = med("dtrain", key, "step_ms"), activation("dtrain", key)
            p_ms, p_act = med("pytorch", key, "step_ms"), activation("pytorch", key)
            k = segments
            theory = 32 * per_layer if k <= 1 else (k - 1 + math.ceil(32 / k)) * per_layer
            label = "none" if k < 0 else f"{k}{' (sqrt)' if k == 6 else ''}"
            out.append(f"| {label} | {ms:.0f} | {ms / base_ms - 1:+.0%} | {act:.0f} | "
                       f"{base_act / act:.2f}x | {theory:.0f} | {p_ms:.0f} | {p_act:.0f} | "
                       f"{act / p_act:.2f} |")
    emit("\n".join(out), args.markdown)


if __name__ == "__main__":
    main()
