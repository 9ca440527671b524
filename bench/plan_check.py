#!/usr/bin/python3
"""`dtrain plan` against measured runs on this machine: each layout trained for a few steps
with `dtrain train` (the fortunes GPT, 1 thread per rank) and predicted with `dtrain plan`
(the same GPT described as layers, the calibrated profile of this machine); prints predicted
against measured step time (median step after warm-up) and rank 0's model-state memory
(parameters + gradients + optimizer, as the strategy reports it), and their ratios; writes the
raw records as JSON lines. Rounds alternate over the layouts; the table gives each layout's
median over rounds.

  bench/plan_check.py [--profile configs/hardware/this-machine.toml] [--rounds 2] [--steps 16]
                      [--only NAME,...] [--out bench/results-plan-check.jsonl]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# The GPT: dtrain's (untied output, no dropout), fp32, AdamW.
LAYERS, HEADS, WIDTH, CONTEXT = 4, 4, 256, 128
BATCH = 16  # windows per data-parallel replica per step

# name: (ranks, dtrain train flags, dtrain plan flags)
LAYOUTS = {
    "ddp-1": (1, [], []),
    "ddp-2": (2, [], []),
    "ddp-4": (4, [], []),
    "ddp-8": (8, [], []),
    "zero1-2": (2, ["--strategy", "zero1"], ["--strategy", "zero1"]),
    "zero2-2": (2, ["--strategy", "zero2"], ["--strategy", "zero2"]),
    "zero3-2": (2, ["--strategy", "zero3"], ["--strategy", "zero3"]),
    "gpipe-2": (2, ["--pipeline-parallel", "2", "--micro-batches", "4", "--schedule", "gpipe"],
                ["--pp", "2", "--micro-batches", "4", "--schedule", "gpipe"]),
    "1f1b-2": (2, ["--pipeline-parallel", "2", "--micro-batches", "4", "--schedule", "1f1b"],
               ["--pp", "2", "--micro-batches", "4", "--schedule", "1f1b"]),
    "interleaved-2": (2, ["--pipeline-parallel", "2", "--micro-batches", "4", "--schedule",
                          "interleaved", "--virtual-stages", "2"],
                      ["--pp", "2", "--micro-batches", "4", "--schedule", "interleaved",
                       "--chunks", "2"]),
    "tp-2": (2, ["--tensor-parallel", "2"], ["--tp", "2"]),
    "3d-8": (8, ["--tensor-parallel", "2", "--pipeline-parallel", "2", "--micro-batches", "2"],
             ["--tp", "2", "--pp", "2", "--micro-batches", "2"]),
}


def run(cmd, **kw):
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return out


def measure(dtrain, name, ranks, flags, steps, workdir):
    metrics = os.path.join(workdir, f"{name}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    run([dtrain, "train", "--model", "gpt", "--dataset", "text", "--layers", str(LAYERS),
         "--heads", str(HEADS), "--width", str(WIDTH), "--context", str(CONTEXT),
         "--batch-size", str(BATCH), "--optimizer", "adamw", "--precision", "fp32",
         "--nproc", str(ranks), "--threads", "1", "--max-steps", str(steps), "--log-every", "1",
         "--eval-every", "0", "--no-progress", "--metrics", metrics, *flags])
    records = [json.loads(line) for line in open(metrics)]
    step_ms = [r["step_ms"] for r in records if r.get("event") == "step"]
    summary = next(r for r in records if r.get("event") == "summary")
    warm = step_ms[len(step_ms) // 3:]  # the first third warms up
    return {"step_s": statistics.median(warm) / 1e3, "step_ms_all": step_ms,
            "model_state_bytes": summary["parameter_bytes"] + summary["gradient_bytes"] +
            summary["optimizer_bytes"], "summary": summary}


def predict(dtrain, profile, vocab, ranks, flags):
    dp_flags = flags
    out = subprocess.run(
        [dtrain, "plan", "--json", "--model",
         f"transformer:layers={LAYERS},hidden={WIDTH},heads={HEADS},seq={CONTEXT},vocab={vocab},"
         "tied=0,dropout=0", "--cluster", profile, "--nodes", "1", "--gpus-per-node", str(ranks),
         "--precision", "fp32", "--optimizer", "adam", *dp_flags], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"dtrain plan failed: {out.stderr}")
    return json.loads(out.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtrain", default="build/dtrain")
    parser.add_argument("--profile", default="configs/hardware/this-machine.toml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--only", default="")
    parser.add_argument("--vocab", type=int, default=0, help="the text's vocabulary (default: read from a run)")
    parser.add_argument("--out", default="bench/results-plan-check.jsonl")
    args = parser.parse_args()
    names = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    records = []
    with tempfile.TemporaryDirectory() as workdir:
        vocab = args.vocab
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else list(reversed(names))
            for name in order:
                ranks, train_flags, plan_flags = LAYOUTS[name]
                measured = measure(args.dtrain, name, ranks, train_flags, args.steps, workdir)
                if not vocab:
                    # dtrain's GPT: parameters = V (w + w) + context w + blocks + 2w (untied)
                    w = WIDTH
                    block = 4 * w + 3 * w * w + 3 * w + w * w + w + 4 * w * w + 4 * w + 4 * w * w + w
                    params = measured["summary"]["parameter_bytes"] / 4
                    if name == "ddp-1":
                        vocab = round((params - CONTEXT * w - LAYERS * block - 2 * w) / (2 * w))
                if not vocab:
                    continue
                global_batch = BATCH * measured["summary"]["world_size"] // ranks * 0 + BATCH
                dp = measured["summary"]["global_batch"] // BATCH
                mbs_flags = []
                if "--micro-batches" in plan_flags:
                    m = int(plan_flags[plan_flags.index("--micro-batches") + 1])
                    mbs_flags = ["--micro-batch-size", str(BATCH // m)]
                else:
                    mbs_flags = ["--micro-batch-size", str(BATCH)]
                p = predict(args.dtrain, args.profile, vocab, ranks,
                            [*plan_flags, *mbs_flags, "--dp", str(dp)])
                stage0 = p["memory_bytes_per_stage"][0]
                record = {"layout": name, "ranks": ranks, "round": round_, "commit": commit,
                          "measured_step_s": measured["step_s"],
                          "predicted_step_s": p["step_s"],
                          "measured_model_state_bytes": measured["model_state_bytes"],
                          "predicted_model_state_bytes": stage0["parameters"] + stage0["gradients"] + stage0["optimizer"],
                          "step_ms_all": measured["step_ms_all"], "prediction": p, "vocab": vocab}
                records.append(record)
                print(f"round {round_} {name:14} measured {record['measured_step_s'] * 1e3:8.1f} ms "
                      f"predicted {record['predicted_step_s'] * 1e3:8.1f} ms", flush=True)
    with open(args.out, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    print(f"\n{'layout':14} {'ranks':>5} {'measured':>10} {'predicted':>10} {'ratio':>7} "
          f"{'state MB':>9} {'pred MB':>9} {'ratio':>7}")
    time_ratios, memory_ratios = [], []
    for name in names:
        rows = [r for r in records if r["layout"] == name]
        if not rows:
            continue
        measured = statistics.median(r["measured_step_s"] for r in rows)
        predicted = statistics.median(r["predicted_step_s"] for r in rows)
        mem = rows[0]["measured_model_state_bytes"] / 1e6
        pmem = rows[0]["predicted_model_state_bytes"] / 1e6
        time_ratios.append(predicted / measured)
        memory_ratios.append(pmem / mem)
        print(f"{name:14} {rows[0]['ranks']:5} {measured * 1e3:8.1f}ms {predicted * 1e3:8.1f}ms "
              f"{predicted / measured:7.3f} {mem:9.2f} {pmem:9.2f} {pmem / mem:7.3f}")
    errors = sorted(abs(r - 1) for r in time_ratios)
    print(f"\nstep time: median |predicted/measured - 1| = {statistics.median(errors):.3f}; "
          f"memory: median |ratio - 1| = {statistics.median(sorted(abs(r - 1) for r in memory_ratios)):.3f}")


if __name__ == "__main__":
    main()
