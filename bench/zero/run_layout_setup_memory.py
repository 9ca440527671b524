#!/usr/bin/env python3
"""Setup memory per rank for every layout (issue 80): ZeRO-3, tensor parallelism, a pipeline and
DP x PP x TP, each set up fresh, resumed from its own checkpoint (values and Adam's state) and
started from it as --init-from does (values alone). A Llama of llama-1b's shape (one block by
default, as run_setup_memory.py) is built whole on every rank, as before issue 80 (a
tensor-parallel rank its blocks of it), or as placeholders (nn/DeferredInit.h) of which each
rank draws what it keeps: ZeRO-3 its shards, a pipeline rank its stages; a tensor-parallel rank
builds only its blocks either way. Each rank is a process started by `dtrain launch`; its peak
resident memory during build, setup and the checkpoint's reading is counted from its resident
memory just before (VmHWM reset), and what it keeps afterwards (its parameters, and after a
resume Adam's two moments) from the same point. The target: the peak at most what the rank keeps
plus its largest parameter plus 10% (a ratio of at most 1.1). The checkpoint each layout reads
is written first by the same layout, built as placeholders, after one Adam step. Sides
alternate round by round; medians per rank, the table shows the worst rank's.

    bench/zero/run_layout_setup_memory.py --rounds 2 \\
        --records bench/results/zero/layout-setup-memory.jsonl --markdown /tmp/layouts.md
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import report  # noqa: E402
from zero.run_setup_memory import run_ranks  # noqa: E402

# name: (world size, bench flags)
LAYOUTS = {
    "zero3 N=2": (2, ["--strategy", "zero3"]),
    "TP=2": (2, ["--strategy", "ddp", "--tp", "2"]),
    "PP=2": (2, ["--strategy", "ddp", "--pp", "2"]),
    "DP=2 x PP=2 x TP=2 (zero1)": (8, ["--strategy", "zero1", "--pp", "2", "--tp", "2"]),
}


def run_once(build, layout, mode, phase, layers, checkpoint, extra=()):
    world, flags = LAYOUTS[layout]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank")
        threads = max(1, (os.cpu_count() or 1) // world)
        command = [os.path.join(build, "dtrain"), "launch", "--no-prefix", "--nproc-per-node",
                   str(world), "--threads", str(threads), "--",
                   os.path.join(build, "bench", "setup_memory_bench"), "--mode", mode,
                   "--layers", str(layers), "--threads", str(threads), "--out", out] + flags
        if phase == "fresh":
            command += ["--step-tokens", "0"]
        elif phase == "save":
            command += ["--step-tokens", "128", "--save", checkpoint]
        else:
            command += ["--step-tokens", "0", "--load", checkpoint, "--load-how",
                        "resume" if phase == "resume" else "init"]
        command += list(extra)
        ranks = run_ranks(command, out, world)
    for r in ranks:
        r["ratio"] = r["peak_mb"] / (r["kept_mb"] + r["largest_parameter_mb"])
    return {"layout": layout, "mode": mode, "phase": phase, "world": world, "layers": layers,
            "ranks": ranks, "peak_mb": max(r["peak_mb"] for r in ranks),
            "kept_mb": max(r["kept_mb"] for r in ranks),
            "ratio": max(r["ratio"] for r in ranks),
            "setup_s": max(r["setup_s"] for r in ranks), "model_mb": ranks[0]["model_mb"],
            "command": " ".join(command)}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=report.default_build())
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="flags passed to setup_memory_bench (a smaller shape for a trial)")
    parser.add_argument("--records", default=os.path.join(report.ROOT, "bench", "results", "zero",
                                                          "layout-setup-memory.jsonl"))
    parser.add_argument("--markdown")
    args = parser.parse_args()
    lines = ["| layout | ranks | setup | built whole: peak per rank | as placeholders: peak per "
             "rank | kept per rank | largest parameter per rank | placeholders' peak / (kept + "
             "largest), worst rank | target <= 1.1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    sides = ("whole", "placeholders")
    with report.Records(args.records, dtrain=os.path.join(args.build, "dtrain")) as records, \
            tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as scratch:
        for layout in args.layouts:
            checkpoint = os.path.join(scratch, layout.replace(" ", "_").replace("=", ""))
            saved = run_once(args.build, layout, "placeholders", "save", args.layers, checkpoint,
                             args.extra)
            records.write(saved)
            print(f"{layout}: checkpoint written after one step", flush=True)
            for phase in ("fresh", "resume", "init"):
                rounds = report.alternated_rounds(
                    sides, args.rounds,
                    lambda mode: run_once(args.build, layout, mode, phase, args.layers,
                                          checkpoint, args.extra),
                    records,
                    lambda r: f"{layout} {r['phase']}: peak {r['peak_mb']:.0f} MB, kept "
                              f"{r['kept_mb']:.0f} MB, ratio {r['ratio']:.3f}, "
                              f"{r['setup_s']:.1f} s")
                world = rounds[0]["placeholders"]["world"]

                def per_rank(side, key):  # the median over rounds of each rank's, the worst
                    return max(statistics.median(r[side]["ranks"][k][key] for r in rounds)
                               for k in range(world))

                ratio = per_rank("placeholders", "ratio")
                lines.append(
                    f"| {layout} | {world} | {phase} | "
                    f"{per_rank('whole', 'peak_mb') / 1024:.2f} GiB | "
                    f"{per_rank('placeholders', 'peak_mb') / 1024:.2f} GiB | "
                    f"{per_rank('placeholders', 'kept_mb') / 1024:.2f} GiB | "
                    f"{per_rank('placeholders', 'largest_parameter_mb'):.0f} MiB | "
                    f"{ratio:.3f} | {'met' if ratio <= 1.1 else 'MISSED'} |")
            shutil.rmtree(checkpoint, ignore_errors=True)
    report.table(lines, args.markdown)


if __name__ == "__main__":
    main()
