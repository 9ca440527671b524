#!/usr/bin/env python3
"""Setup memory of ZeRO-3 per rank (issue 80): a Llama of llama-1b's shape (fewer layers by
default, so that N whole models fit in this machine's memory) built whole on every rank, as
before, or as placeholders each rank draws only its shards of (nn/DeferredInit.h), then cut into
ZeRO-3 shards. Each rank is a process started by `dtrain launch`; its peak resident memory during
build and setup is counted from its resident memory just before (VmHWM reset). Sides alternate
round by round; the table shows per-rank medians and the ratio of the placeholders' peak to
what they keep afterwards (their parameter shard; the gradient shard gets its memory at the
first step, as FSDP's) plus the largest parameter, the target being at most 1.1. With
.venv-torch (scripts/setup --torch pip), PyTorch FSDP2 runs beside them
(setup_memory_fsdp2.py: meta-device construction, fully_shard, to_empty, init on the shards):
the target is a ratio of at most 1.0. Then each side runs one Adam step on 128 tokens and
reports its peak from the same starting point (the whole-model side too).

    bench/zero/run_setup_memory.py --worlds 2 4 --layers 2 --rounds 2 \\
        --records bench/results/zero/setup-memory.jsonl --markdown /tmp/setup.md
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import report  # noqa: E402


VENV_PYTHON = os.path.join(report.ROOT, ".venv-torch", "bin", "python")


def run_ranks(command, out, world):
    """Runs `command` (every rank writes its JSON line to OUT.RANK); exits naming it if it
    fails. Returns the ranks' records."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-3000:]}")
    ranks = []
    for rank in range(world):
        with open(f"{out}.{rank}") as f:
            ranks.append(json.loads(f.readline()))
    return ranks


def run_once(build, mode, world, layers, steps):
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank")
        threads = max(1, (os.cpu_count() or 1) // world)
        if mode == "fsdp2":
            command = [VENV_PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                       "--master-port", str(29500 + world),
                       os.path.join(report.ROOT, "bench", "zero", "setup_memory_fsdp2.py"),
                       "--layers", str(layers), "--threads", str(threads), "--steps", str(steps),
                       "--out", out]
        else:
            command = [os.path.join(build, "dtrain"), "launch", "--no-prefix", "--nproc-per-node",
                       str(world), "--threads", str(threads), "--",
                       os.path.join(build, "bench", "setup_memory_bench"), "--mode", mode,
                       "--layers", str(layers), "--threads", str(threads), "--steps", str(steps),
                       "--out", out]
        ranks = run_ranks(command, out, world)
    return {"mode": mode, "world": world, "layers": layers, "steps": steps, "ranks": ranks,
            "peak_mb": max(r["peak_mb"] for r in ranks),
            "kept_mb": max(r["kept_mb"] for r in ranks),
            "setup_s": max(r["setup_s"] for r in ranks),
            "step_peak_mb": max(r.get("step_peak_mb", 0.0) for r in ranks),
            "model_mb": ranks[0]["model_mb"],
            "largest_parameter_mb": ranks[0]["largest_parameter_mb"],
            "shard_mb": ranks[0]["shard_mb"], "command": " ".join(command)}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=report.default_build())
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1,
                        help="Adam steps after the setup (the step peak covers them all)")
    parser.add_argument("--sides", nargs="+", default=["whole", "placeholders", "fsdp2"],
                        help="whole, placeholders, fsdp2 (placeholders is needed)")
    parser.add_argument("--records", default=os.path.join(report.ROOT, "bench", "results", "zero",
                                                          "setup-memory.jsonl"))
    parser.add_argument("--markdown")
    args = parser.parse_args()
    sides = tuple(side for side in args.sides
                  if side != "fsdp2" or os.access(VENV_PYTHON, os.X_OK))
    lines = ["| ranks | model | largest parameter | built whole: peak per rank | as placeholders: "
             "peak per rank | kept (the parameter shard) | placeholders' peak / (kept + largest) "
             "| FSDP2: peak per rank | placeholders' peak / FSDP2's | one Adam step's peak: "
             "dtrain / FSDP2 (ratio) | setup time whole / placeholders / FSDP2 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    with report.Records(args.records, dtrain=os.path.join(args.build, "dtrain")) as records:
        for world in args.worlds:
            rounds = report.alternated_rounds(
                sides, args.rounds,
                lambda mode: run_once(args.build, mode, world, args.layers, args.steps), records,
                lambda r: f"peak {r['peak_mb']:.0f} MB, kept {r['kept_mb']:.0f} MB, "
                          f"{r['setup_s']:.1f} s, step peak {r.get('step_peak_mb', 0):.0f} MB")
            whole = (statistics.median(r["whole"]["peak_mb"] for r in rounds)
                     if "whole" in sides else float("nan"))
            placeholders = statistics.median(r["placeholders"]["peak_mb"] for r in rounds)
            kept = statistics.median(r["placeholders"]["kept_mb"] for r in rounds)
            ratio = statistics.median(
                r["placeholders"]["peak_mb"] /
                (r["placeholders"]["kept_mb"] + r["placeholders"]["largest_parameter_mb"])
                for r in rounds)
            first = rounds[0]["placeholders"]
            times = " / ".join(f"{statistics.median(r[side]['setup_s'] for r in rounds):.1f} s"
                               for side in sides)
            fsdp2, versus = "-", "-"
            ours_step = statistics.median(r["placeholders"]["step_peak_mb"] for r in rounds)
            step = f"{ours_step / 1024:.2f} GiB / -"
            if "fsdp2" in sides:
                fsdp2 = f"{statistics.median(r['fsdp2']['peak_mb'] for r in rounds) / 1024:.2f} GiB"
                versus = f"{statistics.median(r['placeholders']['peak_mb'] / r['fsdp2']['peak_mb'] for r in rounds):.3f}"
                theirs = statistics.median(r["fsdp2"]["step_peak_mb"] for r in rounds)
                ratio_step = statistics.median(r["placeholders"]["step_peak_mb"] /
                                               r["fsdp2"]["step_peak_mb"] for r in rounds)
                step = f"{ours_step / 1024:.2f} / {theirs / 1024:.2f} GiB ({ratio_step:.3f})"
            lines.append(
                f"| {world} | {first['model_mb'] / 1024:.2f} GiB | "
                f"{first['largest_parameter_mb']:.0f} MiB | {whole / 1024:.2f} GiB | "
                f"{placeholders / 1024:.2f} GiB | {kept / 1024:.2f} GiB | {ratio:.3f} | "
                f"{fsdp2} | {versus} | {step} | {times} |")
    report.table(lines, args.markdown)


if __name__ == "__main__":
    main()
