#!/usr/bin/python3
"""PipeDream's comparison (issue 52; Narayanan et al., SOSP'19: VGG16 2.99-5.12x faster to a
target accuracy than data parallelism): dtrain's VGG-style network (`--model vgg`: the
convolutions hold ~80% of the compute, the fully-connected layers 98% of the 4.3M parameters) on
Fashion-MNIST across the network lab, one rank per lab host, each layout at the same global
batch and recipe, rounds alternated:

  ddp        every rank a replica: the whole model's gradients all-reduced every step
  pp         a pipeline of one stage per host (1F1B, stages placed by measured time)
  pp-2bw     the same without a flush (PipeDream-2BW: gradients one step stale)
  pp-eager   the same without a flush, each stage updating where its schedule next needs the
             weights (--pipeline-sync eager: only its late micro-batches' gradients stale)
  replicated PipeDream's layout: the convolutions on hosts 0 and 1, the dense layers on host 2
             (--stage-replicas 2,1), 1F1B

Per run: training seconds (evaluation left out) to the first evaluation at or above --target
validation accuracy, seconds per step, the final accuracy; and dtrain plan's prediction of each
layout on a profile of the lab (this machine's calibrated rates; the lab's link), with the
layout the planner's --search picks. Records: bench/results/netlab/pipedream-lab.jsonl. Root
(scripts/netlab); a built dtrain (DTRAIN_BIN, default build/dtrain).

  bench/netlab/run_pipedream_lab.py --profile wan --rounds 1 --steps 300"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import re
import subprocess
import tempfile

from labrun import DTRAIN, ROOT, across_lab, run_and_read
from report import Records

PROFILES = {"lan": (1.0, 500.0), "wan": (0.1, 20000.0)}  # Gbit/s each way, round trip in us


def layout_flags(layout, hosts, global_batch, micro_batches):
    """dtrain train flags of a layout over `hosts` ranks at the global batch."""
    if layout == "ddp":
        return ["--strategy", "ddp", "--batch-size", str(global_batch // hosts)]
    micro = ["--batch-size", str(global_batch // micro_batches), "--micro-batches",
             str(micro_batches), "--schedule", "1f1b", "--pipeline-balance", "time"]
    if layout == "replicated":
        counts = [hosts - 1, 1]
        return ["--stage-replicas", ",".join(map(str, counts))] + micro
    flags = ["--pipeline-parallel", str(hosts)] + micro
    return flags + sync_flags(layout)


def sync_flags(layout):
    """--pipeline-sync of the flush-free layouts (pp-2bw, pp-eager)."""
    return ["--pipeline-sync", layout[3:]] if layout in ("pp-2bw", "pp-eager") else []


def lab_profile(profile, directory):
    """This machine's calibrated profile with one rank per node and the lab's link between."""
    gbit, rtt_us = PROFILES[profile]
    text = open(os.path.join(ROOT, "configs", "hardware", "this-machine.toml")).read()
    text = re.sub(r"(\[node\]\s*\ngpus = )\d+", r"\g<1>1", text)
    text = re.sub(r"cores = \d+", "cores = 1", text)
    text = re.sub(r"node_gbit_s = [0-9.]+", f"node_gbit_s = {gbit}", text)
    text = re.sub(r"(\[network\][^\[]*latency_us = )[0-9.]+", rf"\g<1>{rtt_us / 2}", text)
    path = os.path.join(directory, f"lab-{profile}.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def planned(profile, hosts, global_batch, micro_batches):
    """dtrain plan's step time for each layout on the lab's profile, and its --search pick."""
    with tempfile.TemporaryDirectory() as directory:
        cluster = lab_profile(profile, directory)
        common = [DTRAIN, "plan", "--model", "vgg-small", "--cluster", cluster, "--nodes",
                  str(hosts), "--precision", "fp32", "--optimizer", "momentum", "--json"]
        steps = {}
        for layout in ("ddp", "pp", "pp-2bw", "pp-eager", "replicated"):
            if layout == "ddp":
                flags = ["--micro-batch-size", str(global_batch // hosts)]
            else:
                flags = ["--micro-batch-size", str(global_batch // micro_batches),
                         "--micro-batches", str(micro_batches), "--schedule", "1f1b"]
                flags += (["--stage-replicas", f"{hosts - 1},1"] if layout == "replicated" else
                          ["--pp", str(hosts)])
                flags += sync_flags(layout)
            out = subprocess.run(common + flags, check=True, capture_output=True, text=True)
            steps[layout] = json.loads(out.stdout)["step_s"]
        search = subprocess.run(common + ["--search", "--replicated-stages", "--global-batch",
                                          str(global_batch), "--strategies", "ddp",
                                          "--pipeline-sync", "2bw", "--top", "1"],
                                check=True, capture_output=True, text=True)
        best = json.loads(search.stdout)["best"][0]
    return steps, best


def run(profile, layout, args, round_index):
    metrics = f"/tmp/pipedream-lab-{layout}.jsonl"
    if os.path.exists(metrics):
        os.remove(metrics)
    train = [DTRAIN, "train", "--model", "vgg", "--dataset", "fashion-mnist", "--max-steps",
             str(args.steps), "--threads", "1", "--no-progress", "--seed", str(round_index),
             "--eval-every", str(args.eval_every), "--metrics", metrics,
             *(["--lr", str(args.lr)] if args.lr else []),
             *layout_flags(layout, args.hosts, args.global_batch, args.micro_batches)]
    wall, summary, steps, evals = run_and_read(across_lab(profile, train, args.hosts), metrics)
    reached = next((e for e in evals if e["val_accuracy"] >= args.target), None)
    # Training time without the evaluations (the summary's seconds count them): the last
    # evaluation's, taken at the last step.
    train_seconds = (evals[-1]["train_seconds"] if evals and evals[-1]["step"] == summary["steps"]
                     else summary["seconds"])
    return {"profile": profile, "layout": layout, "round": round_index, "hosts": args.hosts,
            "model": "vgg", "steps": summary["steps"], "global_batch": summary["global_batch"],
            "micro_batches": None if layout == "ddp" else args.micro_batches,
            "train_seconds": train_seconds, "seconds_with_evaluation": summary["seconds"],
            "wall_seconds": wall, "seconds_per_step": train_seconds / max(1, summary["steps"]),
            "lr": args.lr,
            "target_accuracy": args.target,
            "seconds_to_target": reached["train_seconds"] if reached else None,
            "step_at_target": reached["step"] if reached else None,
            "final_val_accuracy": summary.get("val_accuracy"),
            "evals": [(e["step"], e["train_seconds"], e["val_accuracy"]) for e in evals]}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="wan", choices=sorted(PROFILES))
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=96)
    parser.add_argument("--micro-batches", type=int, default=6)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--layouts", default="ddp,pp,pp-2bw,pp-eager,replicated")
    parser.add_argument("--lr", type=float, default=0,
                        help="the recipe's learning rate unless given (vgg's: 0.05)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results/netlab/pipedream-lab.jsonl"))
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    steps, best = planned(args.profile, args.hosts, args.global_batch, args.micro_batches)
    with Records(args.out, "a", DTRAIN) as out:
        plan_record = {"event": "plan", "profile": args.profile, "hosts": args.hosts,
                       "predicted_step_s": steps, "search_best": best["layout"],
                       "search_best_step_s": best["step_s"]}
        print(json.dumps(plan_record))
        out.write(plan_record)
        for r in range(args.rounds):
            for layout in (layouts if r % 2 == 0 else layouts[::-1]):
                record = run(args.profile, layout, args, r)
                record["predicted_step_s"] = steps.get(layout)
                print(json.dumps({k: v for k, v in record.items() if k != "evals"}))
                out.write(record)


if __name__ == "__main__":
    sys.exit(main())
