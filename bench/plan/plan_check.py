#!/usr/bin/python3
"""`dtrain plan` against measured runs on this machine: each layout trained for a few steps
with `dtrain train` (the fortunes GPT, 1 thread per rank) and predicted with `dtrain plan`
(the same GPT described as layers, the calibrated profile of this machine); prints predicted
against measured step time (median step after warm-up) and rank 0's model-state memory
(parameters + gradients + optimizer, as the strategy reports it), and their ratios; writes the
raw records as JSON lines. Rounds alternate over the layouts; the table gives each layout's
median over rounds.

  bench/plan/plan_check.py [--profile configs/hardware/this-machine.toml] [--rounds 2] [--steps 16]
                      [--only NAME,...] [--out bench/results/plan/check.jsonl]

Layouts NAME@PROFILE run on two network-lab hosts (root; scripts/netlab).
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import labrun  # noqa: E402
from report import Records

# The GPT: dtrain's (untied output, no dropout, attention's softmax written out), fp32, AdamW.
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
    # Attention's core recomputed in backward (issue 54).
    "selective-1": (1, ["--checkpointing", "selective"], ["--selective-recompute"]),
    "3d-8": (8, ["--tensor-parallel", "2", "--pipeline-parallel", "2", "--micro-batches", "2"],
             ["--tp", "2", "--pp", "2", "--micro-batches", "2"]),
    # Asynchronous workers and one parameter-server shard (a process of its own here).
    "downpour-2": (2, ["--strategy", "downpour", "--ps-shards", "1"],
                   ["--strategy", "downpour", "--ps-shards", "1"]),
    # Two lab hosts x 1 rank over a shaped link (scripts/netlab, root): the planner's profile is
    # this machine's with the network the lab measures (TCP goodput, half the round trip).
    "ddp-2@lan": (2, [], []),
    "ddp-2@wan": (2, [], []),
    "zero2-2@lan": (2, ["--strategy", "zero2"], ["--strategy", "zero2"]),
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
    train = [dtrain, "train", "--model", "gpt", "--dataset", "text", "--layers", str(LAYERS),
             "--heads", str(HEADS), "--width", str(WIDTH), "--context", str(CONTEXT),
             "--batch-size", str(BATCH), "--optimizer", "adamw", "--precision", "fp32",
             "--threads", "1", "--max-steps", str(steps), "--log-every", "1",
             "--eval-every", "0", "--no-progress", "--metrics", metrics, *flags]
    if "@" in name:
        run(labrun.across_lab(name.split("@")[1], [os.path.abspath(train[0]), *train[1:]]))
    else:
        run(train + ["--nproc", str(ranks)])
    records = [json.loads(line) for line in open(metrics)]
    step_ms = [r["step_ms"] for r in records if r.get("event") == "step"]
    summary = next(r for r in records if r.get("event") == "summary")
    warm = step_ms[len(step_ms) // 3:] or step_ms  # the first third warms up
    return {"step_s": statistics.median(warm) / 1e3, "step_ms_all": step_ms,
            "model_state_bytes": summary["parameter_bytes"] + summary["gradient_bytes"] +
            summary["optimizer_bytes"], "summary": summary}


def lab_profile(profile, lab, workdir):
    """This machine's profile with the lab's measured network: 2 nodes of 1 rank."""
    check = subprocess.run([os.path.join(labrun.ROOT, "scripts", "netlab"), "check", "--profile",
                            lab], capture_output=True, text=True)
    record = json.loads(check.stdout.strip().splitlines()[-1])
    text = open(profile).read()
    head, _, _ = text.partition("[network]")
    path = os.path.join(workdir, f"this-machine-{lab}.toml")
    with open(path, "w") as f:
        f.write(head + "[network]\n# scripts/netlab check --profile " + lab + ": " +
                json.dumps(record) + "\n" +
                f"node_gbit_s = {record['goodput_measured_mbit'] / 1e3}\n"
                f"latency_us = {record['rtt_measured_ms'] * 1e3 / 2}\n")
    return path


def predict(dtrain, profile, vocab, ranks, flags, nodes=1):
    out = subprocess.run(
        [dtrain, "plan", "--json", "--model",
         f"transformer:layers={LAYERS},hidden={WIDTH},heads={HEADS},seq={CONTEXT},vocab={vocab},"
         "tied=0,dropout=0,fused=0", "--cluster", profile, "--nodes", str(nodes), "--gpus-per-node",
         str(ranks // nodes), "--precision", "fp32", "--optimizer", "adam", *flags],
        capture_output=True, text=True)
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
    parser.add_argument("--out", default="bench/results/plan/check.jsonl")
    parser.add_argument("--predict-again", metavar="RECORDS",
                        help="keep the measurements of RECORDS (a previous --out) and predict "
                             "them again with this build (writes --out)")
    args = parser.parse_args()
    if args.predict_again:
        return predict_again(args)
    names = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    records = []
    lab_profiles = {}
    with tempfile.TemporaryDirectory() as workdir:
        vocab = args.vocab
        if not vocab:
            # The text's vocabulary from one rank's parameter count: dtrain's GPT has
            # V w (embedding) + V w (untied output) + context w + blocks + 2 w (final norm).
            w = WIDTH
            block = 4 * w + 3 * w * w + 3 * w + w * w + w + 4 * w * w + 4 * w + 4 * w * w + w
            params = measure(args.dtrain, "vocabulary", 1, [], 1, workdir)["summary"]["parameter_bytes"] / 4
            vocab = round((params - CONTEXT * w - LAYERS * block - 2 * w) / (2 * w))
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else list(reversed(names))
            for name in order:
                ranks, train_flags, _ = LAYOUTS[name]
                measured = measure(args.dtrain, name, ranks, train_flags, args.steps, workdir)
                record = {"layout": name, "ranks": ranks, "round": round_, "commit": commit,
                          "measured_step_s": measured["step_s"],
                          "measured_model_state_bytes": measured["model_state_bytes"],
                          "step_ms_all": measured["step_ms_all"], "vocab": vocab}
                add_prediction(args, record, lab_profiles, workdir)
                records.append(record)
                with Records(args.out + ".partial", "a") as partial:
                    partial.write(record)
                print(f"round {round_} {name:14} measured {record['measured_step_s'] * 1e3:8.1f} ms "
                      f"predicted {record['predicted_step_s'] * 1e3:8.1f} ms", flush=True)
    write_and_print(records, names, args.out)


def plan_flags_of(name):
    """`dtrain plan`'s flags for a layout: dtrain's --batch-size is one micro-batch's windows
    (a replica's step is --micro-batches of them); DP is what PP x TP leave."""
    ranks, _, plan_flags = LAYOUTS[name]
    def value(flag):
        return int(plan_flags[plan_flags.index(flag) + 1]) if flag in plan_flags else 1
    dp = ranks // (value("--pp") * value("--tp"))
    return [*plan_flags, "--micro-batch-size", str(BATCH), "--dp", str(dp)]


def predict_again(args):
    records = [json.loads(line) for line in open(args.predict_again)]
    names = [n for n in LAYOUTS if any(r["layout"] == n for r in records)]
    lab_profiles = {}
    with tempfile.TemporaryDirectory() as workdir:
        for record in records:
            add_prediction(args, record, lab_profiles, workdir)
    write_and_print(records, names, args.out)


def add_prediction(args, record, lab_profiles, workdir):
    """`dtrain plan`'s prediction of a record's layout, into the record."""
    name, ranks = record["layout"], record["ranks"]
    flags = plan_flags_of(name)
    if "@" in name:
        lab = name.split("@")[1]
        if lab not in lab_profiles:
            lab_profiles[lab] = lab_profile(args.profile, lab, workdir)
        p = predict(args.dtrain, lab_profiles[lab], record["vocab"], ranks, flags, nodes=2)
    else:
        p = predict(args.dtrain, args.profile, record["vocab"], ranks, flags)
    stage0 = p["memory_bytes_per_stage"][0]
    record["prediction"] = p
    record["predicted_step_s"] = p["step_s"]
    record["predicted_model_state_bytes"] = (stage0["parameters"] + stage0["gradients"] +
                                             stage0["optimizer"])


def write_and_print(records, names, out):
    with Records(out, "w") as f:
        for record in records:
            f.write(record)
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
