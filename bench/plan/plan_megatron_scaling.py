#!/usr/bin/python3
"""`dtrain plan` against Megatron-Core's published scaling (its README, "Training Speed and
Scalability", r0.8.0 on DGX H100): the weak-scaling table (images/model_table.png: nine GPT
models from 1.7B on 48 GPUs to 462B on 6144, each row's heads, width, layers, TP, PP, DP, GPUs,
batch, per-GPU TFLOP/s and MFU) and the strong-scaling endpoints (the 177B model at a batch of
1152 on 96 and 4608 GPUs: 47% and 42% MFU, the README's text). Every model has a vocabulary of
131072, sequences of 4096 and untied embeddings (the README's text; 1.7B and 7.1B count only
untied), attention as one FlashAttention kernel (`flash=1`: Megatron-Core runs Transformer
Engine's fused attention; dtrain's GPT runs scaled_dot_product_attention on LibTorch 2.x) and
Megatron's default dropout. Megatron's runs overlap what dtrain's planner models as
--overlap-param-gather and --tp-comm-overlap, with its distributed optimizer (zero1) and
sequence parallelism.

For each weak-scaling row two predictions:
- "its layout": the row's TP, PP and DP, zero1, micro-batches of one, sequence parallelism and
  both overlaps; what the README leaves out (the schedule and its chunks, the recomputation) the
  fastest that fits;
- "search": `dtrain plan --search` over every layout with the same flags.
For the strong-scaling points the search alone (the README gives no layout).

MFU two ways: the planner's (the model's matrix-product flops, 3x forward, over the profile's
989 TFLOP/s) and Megatron's own formula (training.py's num_floating_point_operations at the
commit that published the figures) over the same peak: the published MFU is the latter.

--precision bf16-master predicts the layouts with Megatron's precision layout (dtrain train's
--precision bf16-master: bf16 weights, gradients accumulated and reduced in fp32, fp32 master
weights in the sharded optimizer) instead of bf16-mixed (fp32 weights and gradients, each
micro-batch casting the weights).

  bench/plan/plan_megatron_scaling.py [--dtrain build/dtrain] [--precision P] [--markdown FILE]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import subprocess
import time

import report
from report import Records

VOCAB, SEQ, PEAK = 131072, 4096, 989e12
# images/model_table.png: (size, heads, hidden, layers, TP, PP, DP, GPUs, batch, TFLOP/s, MFU)
WEAK = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 0.41),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 0.47),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 0.49),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 0.46),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 0.42),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 0.43),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 0.44),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 0.48),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 0.47),
]
# The README's text: the 177B model, batch 1152, 96 -> 4608 GPUs, 47% -> 42% MFU.
STRONG = [(96, 0.47), (4608, 0.42)]
FLAGS = ["--cluster", "h100-dgx"]  # + --cluster, --precision (main)
# Megatron's own layouts: its distributed optimizer's overlapped gathers, and where tp > 1
# sequence parallelism and the TP communication overlap.
LAYOUT_FLAGS = ["--overlap-param-gather"]
TP_FLAGS = ["--sequence-parallel", "--tp-comm-overlap"]


def model(heads, hidden, layers):
    return (f"transformer:layers={layers},hidden={hidden},heads={heads},seq={SEQ},vocab={VOCAB},"
            "tied=0,flash=1")


def megatron_flops(batch, layers, hidden):
    """Megatron-LM's training.py (commit 937571c, the README's scaling figures):
    12 B s l h^2 ((1 + 1 + s/h) + 4 + V / (2 l h)) for a GPT without GQA, MoE or SwiGLU."""
    return 12 * batch * SEQ * layers * hidden ** 2 * ((2 + SEQ / hidden) + 4 + VOCAB / (2 * layers * hidden))


def plan(dtrain, *args):
    out = subprocess.run([dtrain, "plan", "--json", *map(str, args)], capture_output=True, text=True)
    if out.returncode not in (0, 2):
        sys.exit(f"dtrain plan {' '.join(map(str, args))} failed: {out.stderr}")
    if out.returncode == 2 or not out.stdout.strip():
        return None  # refused: does not fit, or an invalid layout
    result = json.loads(out.stdout)
    return result


def fits(p):
    return p is not None and p.get("fits", False)


def its_layout(dtrain, row):
    size, heads, hidden, layers, tp, pp, dp, gpus, batch, _, _ = row
    base = ["--model", model(heads, hidden, layers), *FLAGS, *LAYOUT_FLAGS,
            *(TP_FLAGS if tp > 1 else []),
            "--nodes", gpus // 8, "--strategy",
            "zero1", "--tp", tp, "--pp", pp, "--dp", dp, "--global-batch", batch,
            "--micro-batch-size", 1]
    schedules = [["--schedule", "1f1b"]] if pp > 1 else [[]]
    if pp > 1:
        schedules += [["--schedule", "interleaved", "--chunks", c] for c in range(2, layers // pp + 1)
                      if (layers // pp) % c == 0 and layers % pp == 0]
    best = None
    for schedule in schedules:
        for recompute in ([], ["--selective-recompute"], ["--checkpointing"]):
            p = plan(dtrain, *base, *schedule, *recompute)
            if fits(p) and (best is None or p["step_s"] < best["step_s"]):
                best = p
    return best


def search(dtrain, heads, hidden, layers, gpus, batch):
    """`dtrain plan --search` with no step option pinned: it decides sequence parallelism and
    both overlaps itself."""
    out = plan(dtrain, "--model", model(heads, hidden, layers), *FLAGS, "--nodes", gpus // 8,
               "--global-batch", batch, "--search", "--top", 1)
    layouts = out["best"] if out is not None else []
    return layouts[0] if layouts and fits(layouts[0]) else None


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=os.path.join(report.default_build(), "dtrain"))
    parser.add_argument("--out", default=os.path.join(report.ROOT, "bench", "results", "plan",
                                                      "megatron-scaling.jsonl"))
    parser.add_argument("--markdown")
    parser.add_argument("--rows", help="weak-scaling rows to run (sizes, comma-separated)")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--cluster", default="h100-dgx",
                        help="the profile (a name or a .toml file: a copy without its "
                             "[matmul_table] gives the single-efficiency predictions)")
    args = parser.parse_args()
    FLAGS[1] = args.cluster
    FLAGS.extend(["--precision", args.precision])

    rows = []
    for row in WEAK:
        size, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops, mfu = row
        if args.rows and size not in args.rows.split(","):
            continue
        for kind in ("its layout", "search"):
            started = time.time()
            p = its_layout(args.dtrain, row) if kind == "its layout" else \
                search(args.dtrain, heads, hidden, layers, gpus, batch)
            record = {"table": "weak", "model": size, "precision": args.precision,
                      "cluster": args.cluster, "gpus": gpus, "batch": batch, "kind": kind,
                      "published_mfu": mfu, "published_tflops_per_gpu": tflops,
                      "plan_s": time.time() - started}
            if p is not None:
                record.update({"layout": p["layout"], "step_s": p["step_s"], "planner_mfu": p["mfu"],
                               "megatron_mfu": megatron_flops(batch, layers, hidden) / p["step_s"] / gpus / PEAK,
                               "record": p})
            rows.append(record)
            print(json.dumps({k: v for k, v in record.items() if k != "record"}), flush=True)
    if not args.rows:
        for gpus, mfu in STRONG:
            started = time.time()
            p = search(args.dtrain, 96, 12288, 96, gpus, 1152)
            record = {"table": "strong", "model": "177B", "precision": args.precision,
                      "cluster": args.cluster, "gpus": gpus, "batch": 1152,
                      "kind": "search", "published_mfu": mfu, "plan_s": time.time() - started}
            if p is not None:
                record.update({"layout": p["layout"], "step_s": p["step_s"], "planner_mfu": p["mfu"],
                               "megatron_mfu": megatron_flops(1152, 96, 12288) / p["step_s"] / gpus / PEAK,
                               "record": p})
            rows.append(record)
            print(json.dumps({k: v for k, v in record.items() if k != "record"}), flush=True)

    with Records(args.out, "a") as f:
        for r in rows:
            f.write(r)
    lines = ["| table | model | GPUs | batch | prediction | layout | planner MFU | Megatron-formula MFU | "
             "Megatron-Core | predicted / published |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "layout" not in r:
            lines.append(f"| {r['table']} | {r['model']} | {r['gpus']} | {r['batch']} | {r['kind']} | "
                         f"nothing fits | | | {r['published_mfu']:.0%} | |")
            continue
        lines.append(f"| {r['table']} | {r['model']} | {r['gpus']} | {r['batch']} | {r['kind']} | "
                     f"{r['layout']} | {r['planner_mfu']:.1%} | {r['megatron_mfu']:.1%} | "
                     f"{r['published_mfu']:.0%} | **{r['megatron_mfu'] / r['published_mfu']:.2f}** |")
    report.table(lines, args.markdown)


if __name__ == "__main__":
    main()
