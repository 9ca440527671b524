#!/usr/bin/python3
"""`dtrain plan` against published results at 8-3072 GPUs: each paper's model and hardware
(configs/hardware/), the layout the paper gives, and the knobs it leaves out (micro-batch size,
schedule) chosen by the planner (the fastest that fits). Prints one row per published figure:
the paper's value, the prediction, the ratio; writes the raw records as JSON lines.

  bench/plan/plan_published.py [--dtrain build/dtrain] [--out bench/results/plan/published.jsonl]

No factor in here is fitted to a paper: the profiles' efficiencies are the same everywhere
(docs/PLAN.md, "Efficiency"); the FLOP counts are each paper's own formula.
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import subprocess
import sys
from report import Records


def plan(dtrain, *args):
    out = subprocess.run([dtrain, "plan", "--json", *map(str, args)], capture_output=True, text=True)
    if out.returncode not in (0, 2):
        sys.exit(f"dtrain plan failed: {out.stderr}")
    if out.returncode == 2 and not out.stdout:
        return None  # refused (does not fit, or an invalid layout)
    return json.loads(out.stdout)


def best(dtrain, base, choices):
    """The prediction with the highest throughput that fits over the combinations in `choices`
    (at a fixed global batch: the shortest step)."""
    results = []
    for extra in choices:
        p = plan(dtrain, *base, *extra)
        if p is not None and p["fits"]:
            results.append((-p["samples_per_s"], p, extra))
    if not results:
        return None, None
    results.sort(key=lambda r: r[0])
    return results[0][1], results[0][2]


def megatron_flops(batch, seq, layers, hidden, vocab, recompute=True):
    """Narayanan et al. 2021, Section 5.1: 96 B s l h^2 (1 + s/6h + V/16lh) with activation
    recomputation (72 without)."""
    factor = 96 if recompute else 72
    return factor * batch * seq * layers * hidden ** 2 * (
        1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


# Narayanan et al. 2021, Table 1: (model, GPUs, TP, PP, global batch, TFLOP/s per GPU).
NARAYANAN = [
    ("gpt-1.7b", 24, 2304, 32, 1, 1, 512, 137),
    ("gpt-3.6b", 30, 3072, 64, 2, 1, 512, 138),
    ("gpt-7.5b", 36, 4096, 128, 4, 1, 512, 142),
    ("gpt-18b", 40, 6144, 256, 8, 1, 1024, 135),
    ("gpt-39b", 48, 8192, 512, 8, 2, 1536, 138),
    ("gpt-76b", 60, 10240, 1024, 8, 4, 1792, 140),
    ("gpt-146b", 80, 12288, 1536, 8, 8, 2304, 148),
    ("gpt-310b", 96, 16384, 1920, 8, 16, 2160, 155),
    ("gpt-530b", 105, 20480, 2520, 8, 35, 2520, 163),
    ("gpt-1t", 128, 25600, 3072, 8, 64, 3072, 163),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtrain", default="build/dtrain")
    parser.add_argument("--out", default="bench/results/plan/published.jsonl")
    args = parser.parse_args()
    rows = []

    # Narayanan et al. 2021 (Megatron-LM on Selene): per-GPU TFLOP/s, their formula.
    for name, layers, hidden, gpus, tp, pp, batch, published in NARAYANAN:
        base = ["--model", name, "--cluster", "a100-selene", "--nodes", gpus // 8, "--tp", tp,
                "--pp", pp, "--global-batch", batch, "--precision", "fp16-master",
                "--checkpointing"]
        choices = []
        for mbs in (1, 2, 4, 8):
            if pp == 1:
                choices.append(["--micro-batch-size", mbs])
            else:
                choices.append(["--micro-batch-size", mbs, "--schedule", "1f1b"])
                if layers % (2 * pp) == 0:
                    choices.append(["--micro-batch-size", mbs, "--schedule", "interleaved", "--chunks", 2])
        p, extra = best(args.dtrain, base, choices)
        predicted = megatron_flops(batch, 2048, layers, hidden, 51200) / p["step_s"] / gpus / 1e12
        rows.append({"paper": "Narayanan et al. 2021, Table 1", "row": f"{name} on {gpus} A100",
                     "quantity": "TFLOP/s per GPU", "published": published,
                     "predicted": predicted, "layout": p["layout"], "record": p})

    # Shoeybi et al. 2019 (Megatron-LM on DGX-2H): 1.2B on one GPU at 39 TFLOP/s; 8.3B with
    # 8-way model and 64-way data parallelism (512 GPUs) at 15.1 PFLOP/s, 76% scaling
    # efficiency. Batch 8 per replica (their Section 5.1), activation checkpointing.
    one = plan(args.dtrain, "--model", "megatron-1.2b", "--cluster", "v100-dgx2h", "--nodes", 1,
               "--gpus-per-node", 1, "--micro-batch-size", 8, "--precision", "fp16-master",
               "--checkpointing")
    one_tflops = megatron_flops(8, 1024, 40, 1536, 51200) / one["step_s"] / 1e12
    rows.append({"paper": "Shoeybi et al. 2019, Section 5.1", "row": "1.2B on 1 V100",
                 "quantity": "TFLOP/s", "published": 39, "predicted": one_tflops,
                 "layout": one["layout"], "record": one})
    big = plan(args.dtrain, "--model", "megatron-8.3b", "--cluster", "v100-dgx2h", "--nodes", 32,
               "--tp", 8, "--micro-batch-size", 8, "--precision", "fp16-master", "--checkpointing")
    big_pflops = megatron_flops(512, 1024, 72, 3072, 51200) / big["step_s"] / 1e15
    rows.append({"paper": "Shoeybi et al. 2019, Section 5.1", "row": "8.3B on 512 V100 (8-way MP x 64-way DP)",
                 "quantity": "PFLOP/s", "published": 15.1, "predicted": big_pflops,
                 "layout": big["layout"], "record": big})
    rows.append({"paper": "Shoeybi et al. 2019, Section 5.1", "row": "8.3B on 512 V100 against 1.2B on 1",
                 "quantity": "scaling efficiency", "published": 0.76,
                 "predicted": big_pflops * 1e3 / 512 / one_tflops, "layout": big["layout"]})

    # Goyal et al. 2017 (ResNet-50, Caffe2, 32 images per GPU): ~90% scaling efficiency from 8 to
    # 256 P100s (abstract, Section 5.5). fp32, SGD with momentum, buckets overlapped with backward.
    def resnet(nodes):
        return plan(args.dtrain, "--model", "resnet50", "--cluster", "p100-bigbasin", "--nodes", nodes,
                    "--micro-batch-size", 32, "--precision", "fp32", "--optimizer", "momentum")
    small, large = resnet(1), resnet(32)
    rows.append({"paper": "Goyal et al. 2017, Section 5.5", "row": "ResNet-50, 8 -> 256 P100",
                 "quantity": "scaling efficiency", "published": 0.90,
                 "predicted": (large["samples_per_s"] / 256) / (small["samples_per_s"] / 8),
                 "layout": large["layout"], "record": large})

    # Rajbhandari et al. 2020 (ZeRO), Figure 1 / Section 5: model-state memory per GPU of a
    # 7.5B-parameter model over 64-way data parallelism with mixed-precision Adam (K = 12):
    # baseline 120 GB, Pos 31.4 GB, Pos+g 16.6 GB, Pos+g+p 1.88 GB.
    for strategy, published in (("ddp", 120), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.88)):
        p = plan(args.dtrain, "--model", "gpt-7.5b", "--cluster", "v100-dgx2", "--nodes", 4,
                 "--strategy", strategy, "--micro-batch-size", 1, "--precision", "fp16-master")
        m = p["memory_bytes"]
        states = (m["parameters"] + m["gradients"] + m["optimizer"]) / 1e9
        rows.append({"paper": "Rajbhandari et al. 2020, Figure 1", "row": f"7.5B, DP 64, {strategy}",
                     "quantity": "model-state GB per GPU", "published": published,
                     "predicted": states, "layout": p["layout"], "record": p})

    # Rajbhandari et al. 2020 (ZeRO-100B, Section 10.2): 100B parameters on 400 V100 (25 DGX-2),
    # 16-way Megatron model parallelism inside a node x 25-way ZeRO-2 (Pos+g) data parallelism,
    # about 15 PFLOP/s (38 TFLOP/s per GPU). The model shape is the paper's appendix's (125
    # layers, hidden 8192); heads, sequence (1024) and vocabulary are GPT-2's; the batch per GPU
    # is not in the text: the planner picks the fastest micro-batch size that fits.
    zero_model = "transformer:layers=125,hidden=8192,heads=64,seq=1024,vocab=51200"
    p, extra = best(args.dtrain, ["--model", zero_model, "--cluster", "v100-dgx2", "--nodes", 25,
                                  "--tp", 16, "--strategy", "zero2", "--precision", "fp16-master",
                                  "--checkpointing"],
                    [["--micro-batch-size", mbs] for mbs in (1, 2, 4, 8, 16, 32)])
    if p is not None:
        batch = p["global_batch"]
        pflops = megatron_flops(batch, 1024, 125, 8192, 51200) / p["step_s"] / 1e15
        rows.append({"paper": "Rajbhandari et al. 2020, Section 10.2", "row": "100B on 400 V100 (MP 16 x ZeRO-2 DP 25)",
                     "quantity": "PFLOP/s", "published": 15, "predicted": pflops,
                     "layout": p["layout"], "record": p})

    # Huang et al. 2019 (GPipe), Table 2, the Transformer columns: throughput normalized to
    # K = 2 partitions and M = 1 micro-batch, on TPU v3 cores, "batch size adjusted to fit memory
    # if necessary". The model's shape is not in the table: a 24-layer transformer (model 2048,
    # feed-forward 8192, 32 heads, 1024 tokens, 32k vocabulary), equal layers per partition,
    # re-materialization on; the batch is the largest of 128 / 2^k (a multiple of M) that fits.
    gpipe_model = "transformer:layers=24,hidden=2048,ffn=8192,heads=32,seq=1024,vocab=32000"
    gpipe_table = {(2, 1): 1.0, (4, 1): 1.07, (8, 1): 1.3, (2, 4): 1.7, (4, 4): 3.2,
                   (8, 4): 4.8, (2, 32): 1.8, (4, 32): 3.4, (8, 32): 6.3}
    throughput = {}
    for (k, m) in gpipe_table:
        for batch in (128, 64, 32, 16, 8, 4, 2, 1):
            if batch % m:
                continue
            p = plan(args.dtrain, "--model", gpipe_model, "--cluster", "tpu-v3", "--gpus-per-node", k,
                     "--pp", k, "--schedule", "gpipe", "--micro-batches", m, "--micro-batch-size",
                     batch // m, "--precision", "bf16-master", "--checkpointing")
            if p is not None and p["fits"]:
                throughput[(k, m)] = p
                break
    base = throughput[(2, 1)]["samples_per_s"]
    for (k, m), published in gpipe_table.items():
        p = throughput[(k, m)]
        rows.append({"paper": "Huang et al. 2019, Table 2", "row": f"Transformer, K={k}, M={m}",
                     "quantity": "normalized throughput", "published": published,
                     "predicted": p["samples_per_s"] / base, "layout": p["layout"], "record": p})

    # Megatron-Core's MoE (megatron/core/transformer/moe/README.md, MCore v0.9: "468 TFLOPS for
    # Mixtral 8X7B bf16 training"; its reference mapping: 64 H100, TP 1, EP 8, PP 4, VP 8, MBS 1,
    # GBS 256, sequence 4096, all-to-all dispatcher, dropless). Their flops formula
    # (num_floating_point_operations: the routed experts' top-k, SwiGLU's 3/2). Megatron ran bf16
    # with fp32 master weights in the distributed optimizer: bf16-master over zero1, which dtrain
    # train takes with --expert-parallel in pipelines since 41ff3df's successor.
    mixtral = ["--model", "llama", "--layers", 32, "--width", 4096, "--heads", 32, "--kv-heads", 8,
               "--ffn-width", 14336, "--context", 4096, "--rope-theta", 1000000, "--moe-experts", 8,
               "--moe-top-k", 2, "--vocab", 32000, "--flash-attention", "--cluster", "h100-dgx",
               "--nodes", 8, "--strategy", "zero1", "--pp", 4, "--ep", 8, "--schedule", "interleaved",
               "--chunks", 8, "--micro-batch-size", 1, "--global-batch", 256,
               "--precision", "bf16-master"]
    p = plan(args.dtrain, *mixtral)
    seq, layers, hidden = 4096, 32, 4096
    mixtral_flops = 12 * 256 * seq * layers * hidden ** 2 * (
        (1 + 8 / 32 + seq / hidden) + 14336 / hidden * 2 * 1.5 + 32000 / (2 * layers * hidden))
    rows.append({"paper": "Megatron-Core MoE README (v0.9)", "row": "Mixtral 8x7B on 64 H100 (EP 8, PP 4)",
                 "quantity": "TFLOP/s per GPU", "published": 468,
                 "predicted": mixtral_flops / p["step_s"] / 64 / 1e12, "layout": p["layout"],
                 "record": p})

    # Llama 3 405B (Dubey et al. 2024, Table 4; Balaji, SC'24): 16,384 H100 (Meta's RoCE
    # cluster: 8 per node), TP 8, PP 16, 16M tokens a step; 8192 tokens at CP 1 (DP 128): 400
    # TFLOP/s per GPU; 131072 tokens at CP 16 (DP 8): 380. BF16 with fp32 master weights in the
    # sharded optimizer (bf16-master, zero1), micro-batch 1, interleaved 1F1B (its virtual stages
    # unpublished: the planner's fastest of 2, 4 and 8). FLOPs counted as a causal kernel
    # computes them (the score products below the diagonal: 6 x parameters + 6 s h l per token);
    # the records keep the full count's figure too. The planner finds both layouts short of
    # memory by its activation count (Llama 3 moved layers off the first and last stages for
    # it): the step is predicted all the same (memory_headroom in the records).
    llama3 = ["--model", "llama", "--layers", 126, "--width", 16384, "--heads", 128, "--kv-heads", 8,
              "--ffn-width", 53248, "--vocab", 128256, "--rope-theta", 500000, "--flash-attention",
              "--cluster", "h100-dgx", "--nodes", 2048, "--strategy", "zero1", "--tp", 8, "--pp", 16,
              "--schedule", "interleaved", "--micro-batch-size", 1, "--precision", "bf16-master",
              "--sequence-parallel"]
    linear = 126 * (16384 * 16384 * 1.125 + 16384 * 16384 + 3 * 16384 * 53248) + 16384 * 128256
    for seq, cp, batch, published in [(8192, 1, 2048, 400), (131072, 16, 128, 380)]:
        runs = [plan(args.dtrain, *llama3, "--context", seq, "--cp", cp, "--global-batch", batch,
                     "--chunks", v) for v in (2, 4, 8)]
        p = min((r for r in runs if r is not None), key=lambda r: r["step_s"])
        tokens = seq * batch
        causal = tokens * (6 * linear + 6 * seq * 16384 * 126)
        p["full_attention_tflops"] = tokens * (6 * linear + 12 * seq * 16384 * 126) / p["step_s"] / 16384 / 1e12
        rows.append({"paper": "Llama 3 (Dubey et al. 2024, Table 4)",
                     "row": f"405B on 16384 H100, {seq} tokens, CP {cp}",
                     "quantity": "TFLOP/s per GPU", "published": published,
                     "predicted": causal / p["step_s"] / 16384 / 1e12, "layout": p["layout"],
                     "record": p})

    with Records(args.out, "w") as f:
        for row in rows:
            f.write(row)
    print(f"{'paper':36} {'row':44} {'quantity':20} {'published':>10} {'predicted':>10} {'ratio':>7}  layout")
    for row in rows:
        ratio = row["predicted"] / row["published"]
        print(f"{row['paper']:36} {row['row']:44} {row['quantity']:20} {row['published']:10.3g} "
              f"{row['predicted']:10.3g} {ratio:7.3f}  {row['layout']}")
    within = sum(abs(r["predicted"] / r["published"] - 1) <= 0.2 for r in rows)
    print(f"within 20%: {within} of {len(rows)}")


if __name__ == "__main__":
    main()
