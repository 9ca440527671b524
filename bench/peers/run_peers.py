#!/usr/bin/env python3
"""dtrain against PyTorch 2.x's own distributed training, side by side (issue 32, item 5): both
sides built on the same LibTorch (the pip build, build-pip/, against .venv-torch's torch), on
the same CPU, same threads per rank, same allocator environment, started through the same
`dtrain launch` (the pip build's: its store speaks 2.x's c10d protocol). Pairs:

  ddp     dtrain ddp    vs DistributedDataParallel            (MLP 784-256-256-10, SGD; CNN;
          ddp-resnet50 when named: torchvision's ResNet-50, 8 images of 3x224x224 per rank)
  zero1   dtrain zero1  vs DDP + ZeroRedundancyOptimizer      (MLP 784-64x1256-10, Adam)
  zero3   dtrain zero3  vs FSDP2 fully_shard per layer (gloo)  (the same MLP, Adam)
  pipe-*  dtrain's pipeline schedules vs torch.distributed.pipelining's ScheduleGPipe,
          Schedule1F1B, ScheduleInterleaved1F1B (V = 2): 8 x Linear(2048, 2048) + ReLU, P = 2,
          M = 8 micro-batches of a global batch of 128, plain SGD
  tp      dtrain's tensor parallelism (T = 2) vs DTensor parallelize_module (ColwiseParallel /
          RowwiseParallel, vocabulary-parallel embedding and loss) on the same GPT blocks
          (width 1024, 16 heads, context 256, 2 blocks, vocabulary 128, 4 sequences, Adam)

Each round runs every pair once, the two sides alternated (A B, then B A); a pair's figure is
the median over rounds of the per-round ratio dtrain / PyTorch (step time, and peak RSS of the
measured steps). The global batch is FIXED (ranks x --batch) and the same on both sides. Every
run is appended as a JSON line to --records.

  bench/peers/run_peers.py --rounds 5 --records bench/results/peers/peers.jsonl [--markdown FILE]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os
import statistics
import subprocess
import time

from ddp.run_ddp_bench import ROOT, emit, run_json, run_once
from report import Records

ZERO_HIDDEN = ["1256"] * 64
PAIRS = {
    # name: (model, dtrain strategy, PyTorch strategy, optimizer, hidden, steps, batch/rank)
    "ddp-mlp": ("mlp", "ddp", "ddp", "sgd", ["256", "256"], 200, 64),
    "ddp-cnn": ("cnn", "ddp", "ddp", "sgd", None, 40, 64),
    # torchvision's ResNet-50 on ImageNet-shaped images (issue 51; not in the default pairs)
    "ddp-resnet50": ("resnet50", "ddp", "ddp", "sgd", None, 5, 8),
    "zero1": ("mlp", "zero1", "zero1", "adam", ZERO_HIDDEN, 5, 16),
    "zero3": ("mlp", "zero3", "fsdp2", "adam", ZERO_HIDDEN, 5, 16),
}
PIPELINES = {"pipe-gpipe": ("gpipe", 1), "pipe-1f1b": ("1f1b", 1),
             "pipe-interleaved": ("interleaved", 2),
             # issue 52 (not in the default pairs): dtrain's zb-v against PyTorch's two
             # zero-bubble schedules with two chunks per rank
             "pipe-zbv": ("zb-v", 2), "pipe-zb-interleaved": ("zb-v", 2)}
# The peer's schedule where it differs from dtrain's.
PEER_SCHEDULE = {"pipe-zb-interleaved": "zb-interleaved"}
PIPE_BATCH, PIPE_M = 128, 8
IMAGE_SIZE = 224
TP_BATCH = 4
PEER_NAMES = {"ddp": "DistributedDataParallel", "zero1": "DDP + ZeroRedundancyOptimizer",
              "fsdp2": "FSDP2 fully_shard", "gpipe": "pipelining ScheduleGPipe",
              "1f1b": "pipelining Schedule1F1B", "interleaved": "pipelining ScheduleInterleaved1F1B",
              "zb-v": "pipelining ScheduleZBVZeroBubble",
              "zb-interleaved": "pipelining ScheduleInterleavedZeroBubble (V = 2)",
              "tp": "DTensor parallelize_module"}


def run_tensor_parallel(build, python, impl, world):
    """One run of the tensor-parallel pair's side `impl` (T = world ranks, 1 thread each)."""
    args = ["--steps", "3", "--warmup", "1", "--batch", str(TP_BATCH)]
    program = ([os.path.join(build, "bench", "tp_bench")] if impl == "dtrain" else
               [python, os.path.join(ROOT, "bench", "tp/tp_reference.py")])
    return run_json([os.path.join(build, "dtrain"), "launch", "--no-prefix", "--nproc-per-node",
                     str(world), "--threads", "1", "--"] + program + args)


def run_pipeline(build, python, impl, world, schedule, chunks):
    """One run of the pipeline pair's side `impl` (P = world ranks, 1 thread each)."""
    args = ["--schedule", schedule, "--micro-batches", str(PIPE_M), "--virtual-stages",
            str(chunks), "--global-batch", str(PIPE_BATCH), "--steps", "6", "--warmup", "2",
            "--no-input-grad"]
    program = ([os.path.join(build, "bench", "pipeline_bench")] if impl == "dtrain" else
               [python, os.path.join(ROOT, "bench", "pipeline/pipeline_reference.py")])
    return run_json([os.path.join(build, "dtrain"), "launch", "--no-prefix", "--nproc-per-node",
                     str(world), "--threads", "1", "--"] + program + args)


def describe(pair, world):
    """(dtrain side, peer, global batch) for the table."""
    if pair == "tp":
        return f"tensor parallel T={world} (GPT)", PEER_NAMES["tp"], TP_BATCH
    if pair in PIPELINES:
        schedule, chunks = PIPELINES[pair]
        name = f"pipeline {schedule}" + (f" V={chunks}" if chunks > 1 else "") + f" M={PIPE_M}"
        return name, PEER_NAMES[PEER_SCHEDULE.get(pair, schedule)], PIPE_BATCH
    model, ours, theirs, _, _, _, batch = PAIRS[pair]
    return f"{ours} ({model})", PEER_NAMES[theirs], batch * world


def git_commit():
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build-pip"))
    parser.add_argument("--python", default=os.path.join(ROOT, ".venv-torch", "bin", "python"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--pairs", default=",".join(
        [p for p in PAIRS if p != "ddp-resnet50"] +
        [p for p in PIPELINES if p not in ("pipe-zbv", "pipe-zb-interleaved")] + ["tp"]))
    parser.add_argument("--records", default=os.path.join(ROOT, "bench", "results/peers/peers.jsonl"))
    parser.add_argument("--markdown")
    args = parser.parse_args()
    pairs = args.pairs.split(",")
    torch_version = subprocess.run([args.python, "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True).stdout.strip()
    commit = git_commit()
    ratios = {}  # pair -> {"step": [...], "mem": [...]}
    runs = {}  # (pair, side) -> [result]
    with Records(args.records, "a") as records:
        for round_index in range(args.rounds):
            for pair in pairs:
                sides = ["dtrain", "pytorch"]
                if round_index % 2:
                    sides.reverse()
                got = {}
                for impl in sides:
                    if pair == "tp":
                        r = run_tensor_parallel(args.build, args.python, impl, args.world)
                    elif pair in PIPELINES:
                        schedule, chunks = PIPELINES[pair]
                        if impl == "pytorch":
                            schedule = PEER_SCHEDULE.get(pair, schedule)
                        r = run_pipeline(args.build, args.python, impl, args.world, schedule,
                                         chunks)
                    else:
                        model, ours, theirs, optimizer, hidden, steps, batch = PAIRS[pair]
                        extra = ["--optimizer", optimizer, "--warmup", "2", "--no-comm-baseline",
                                 "--strategy", ours if impl == "dtrain" else theirs]
                        if hidden:
                            extra += ["--hidden"] + hidden
                        if model.startswith("resnet"):
                            extra += ["--image-size", str(IMAGE_SIZE)]
                        r = run_once(args.build, impl, model, args.world, batch, steps, 25, extra,
                                     python=args.python)
                    r.update(pair=pair, side=impl, round=round_index, commit=commit,
                             torch=torch_version, when=time.strftime("%Y-%m-%dT%H:%M:%S"))
                    records.write(r)
                    records.flush()
                    got[impl] = r
                    runs.setdefault((pair, impl), []).append(r)
                    print(f"round {round_index + 1}/{args.rounds} {pair:8s} {impl:7s} "
                          f"{r['step_ms']:8.2f} ms/step, steps' peak RSS "
                          f"{r['step_peak_rss_mb']:.0f} MB", flush=True)
                ratio = ratios.setdefault(pair, {"step": [], "mem": []})
                ratio["step"].append(got["dtrain"]["step_ms"] / got["pytorch"]["step_ms"])
                ratio["mem"].append(got["dtrain"]["step_peak_rss_mb"] /
                                    got["pytorch"]["step_peak_rss_mb"])

    lines = [f"PyTorch {torch_version}, dtrain {commit} on the same LibTorch, {args.world} ranks, "
             f"{args.rounds} rounds; ratios are medians of per-round ratios (target: step <= 0.9, "
             f"memory <= 1.0)", "",
             "| pair | global batch | dtrain step (ms) | PyTorch peer | peer step (ms) | "
             "step dtrain / peer | steps' peak RSS dtrain / peer (MB) | memory dtrain / peer |",
             "|---|---|---|---|---|---|---|---|"]
    for pair in pairs:
        ours, peer_name, global_batch = describe(pair, args.world)
        mine, peer = runs[(pair, "dtrain")], runs[(pair, "pytorch")]
        med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
        lines.append(
            f"| {ours} | {global_batch} | {med(mine, 'step_ms'):.2f} | "
            f"{peer_name} | {med(peer, 'step_ms'):.2f} | "
            f"{statistics.median(ratios[pair]['step']):.3f} | "
            f"{med(mine, 'step_peak_rss_mb'):.0f} / {med(peer, 'step_peak_rss_mb'):.0f} | "
            f"{statistics.median(ratios[pair]['mem']):.2f} |")
    emit("\n".join(lines), args.markdown)


if __name__ == "__main__":
    main()
