#!/usr/bin/env python3
"""The largest Llama that trains with ZeRO-3 on 2 ranks on this machine (issue 80): dtrain's
against PyTorch FSDP2's (meta-device construction + fully_shard over gloo, setup_memory_fsdp2.py),
found by the same search, then dtrain with the Adam state in files (--offload optimizer:DIR) at
least twice that size, trained 20 steps, beside the disk's own read and write rates.

The family: Llama 3.2's shapes (width 2048: 32 heads, 8 KV heads, FFN 8192; width 3072: 24
heads, 8 KV heads, FFN 8192; vocabulary 128256, embeddings untied as zero3 needs), the depth
searched. "Trains" = built (each rank only its shards), then --steps Adam steps on 128 tokens
per rank, in a memory cgroup of --memory-gib for the whole job (both ranks), the same for both
sides, so that running out of memory ends the job and not this machine's other processes.
Each probe is one job; the search doubles the depth until a probe fails, then bisects.

    bench/zero/run_largest_model.py --widths 2048 --memory-gib 22 \\
        --records bench/results/zero/largest-model.jsonl --markdown /tmp/largest.md
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import report  # noqa: E402

VENV_PYTHON = os.path.join(report.ROOT, ".venv-torch", "bin", "python")
CGROUP = "/sys/fs/cgroup/memory/dtrain-largest-model"
SHAPES = {2048: {"heads": 32, "kv_heads": 8, "ffn_width": 8192},
          3072: {"heads": 24, "kv_heads": 8, "ffn_width": 8192}}
VOCAB = 128256


def parameters(width, layers):
    shape = SHAPES[width]
    head_dim = width // shape["heads"]
    kv = shape["kv_heads"] * head_dim
    block = 2 * width * width + 2 * width * kv + 3 * width * shape["ffn_width"] + 2 * width
    return 2 * VOCAB * width + layers * block + width


def make_cgroup(limit_bytes):
    os.makedirs(CGROUP, exist_ok=True)
    with open(os.path.join(CGROUP, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit_bytes))


OFFLOAD_BUCKET_MB = 64
OFFLOAD_PRECISION = "fp32"


def probe(build, side, width, layers, steps, swap_dir, threads=1):
    """One job; its ranks' records, or None when it did not train (the reason printed)."""
    shape = SHAPES[width]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank")
        sizes = ["--layers", str(layers), "--width", str(width), "--heads", str(shape["heads"]),
                 "--kv-heads", str(shape["kv_heads"]), "--ffn-width", str(shape["ffn_width"]),
                 "--vocab", str(VOCAB), "--threads", str(threads), "--steps", str(steps),
                 "--out", out]
        if side == "fsdp2":
            command = [VENV_PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       "--master-port", "29731",
                       os.path.join(report.ROOT, "bench", "zero", "setup_memory_fsdp2.py")] + sizes
        else:
            command = [os.path.join(build, "dtrain"), "launch", "--no-prefix", "--nproc-per-node",
                       "2", "--threads", str(threads), "--",
                       os.path.join(build, "bench", "setup_memory_bench"), "--mode",
                       "whole" if side == "dtrain-whole" else "placeholders"] + sizes
            if side == "dtrain-offload":
                command += ["--offload", "optimizer:" + swap_dir,
                            "--offload-bucket-mb", str(OFFLOAD_BUCKET_MB),
                            "--precision", OFFLOAD_PRECISION]
        # The job in the memory cgroup: the shell moves itself in, then runs it.
        wrapped = ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "sh"] + command
        started = time.time()
        done = subprocess.run(wrapped, capture_output=True, text=True, timeout=7200)
        seconds = time.time() - started
        records = []
        for rank in range(2):
            try:
                with open(f"{out}.{rank}") as f:
                    records.append(json.loads(f.readline()))
            except (OSError, ValueError):
                pass
        trained = done.returncode == 0 and len(records) == 2
        if not trained:
            tail = (done.stderr or done.stdout)[-400:].replace("\n", " | ")
            print(f"  {side} width {width} layers {layers}: did not train "
                  f"(exit {done.returncode}, {seconds:.0f} s): {tail}", flush=True)
            return None, {"command": " ".join(command), "exit": done.returncode,
                          "seconds": seconds, "tail": tail}
        print(f"  {side} width {width} layers {layers}: trained "
              f"({parameters(width, layers) / 1e9:.2f} B parameters, {seconds:.0f} s, "
              f"steps {records[0].get('step_s')})", flush=True)
        return records, {"command": " ".join(command), "exit": 0, "seconds": seconds}


def search(build, side, width, steps, swap_dir, records, start):
    """The deepest model of `width` that trains: doubling from `start`, then bisecting."""
    def attempt(layers):
        ranks, info = probe(build, side, width, layers, steps, swap_dir)
        records.write({"kind": "probe", "side": side, "width": width, "layers": layers,
                       "parameters": parameters(width, layers), "trained": ranks is not None,
                       "ranks": ranks or [], **info})
        return ranks is not None

    good, bad = 0, None
    layers = start
    while bad is None:
        if attempt(layers):
            good = layers
            layers *= 2
        else:
            bad = layers
    while bad - good > 1:
        middle = (good + bad) // 2
        if attempt(middle):
            good = middle
        else:
            bad = middle
    return good


def disk_rates(folder):
    """The folder's device, written and read with O_DIRECT (dd), GB/s."""
    path = os.path.join(folder, "dd-probe")
    rates = {}
    for name, args in (("write", ["if=/dev/zero", f"of={path}", "oflag=direct"]),
                       ("read", [f"if={path}", "of=/dev/null", "iflag=direct"])):
        done = subprocess.run(["dd", "bs=64M", "count=64"] + args, capture_output=True, text=True)
        line = done.stderr.strip().splitlines()[-1]  # "... copied, 4.0 s, 1.1 GB/s"
        seconds = float(line.split(",")[-2].split()[0])
        rates[name] = 64 * 64 * 2**20 / seconds / 1e9
    os.remove(path)
    return rates


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=report.default_build())
    parser.add_argument("--widths", type=int, nargs="+", default=[2048])
    parser.add_argument("--sides", nargs="+", default=["dtrain", "fsdp2"])
    parser.add_argument("--memory-gib", type=float, default=22.0)
    parser.add_argument("--steps", type=int, default=2, help="Adam steps of each probe")
    parser.add_argument("--start", type=int, default=4, help="first depth tried")
    parser.add_argument("--offload-steps", type=int, default=20)
    parser.add_argument("--offload-layers", type=int, default=0,
                        help="depth of the offload run (0: the least with at least twice the "
                             "parameters of dtrain's largest)")
    parser.add_argument("--offload-bucket-mb", type=int, default=16)
    parser.add_argument("--offload-precision", default="fp32",
                        help="--precision of the offloaded run: fp32 (Adam's state in the file) "
                        "or bf16-master (a bf16 model; its fp32 master weights in the file too)")
    parser.add_argument("--compare-whole", type=int, default=0, metavar="LAYERS",
                        help="also train LAYERS blocks --steps steps built whole (every rank the "
                        "whole model, then its shards) and as placeholders: the losses must be "
                        "equal to the bit (float32, same seed)")
    parser.add_argument("--known-largest", type=int, default=0,
                        help="dtrain's largest depth from an earlier search (its records): no "
                             "search, only the offload run")
    parser.add_argument("--swap", default=os.path.join(report.ROOT, "build", "offload-swap"))
    parser.add_argument("--records", default=os.path.join(report.ROOT, "bench", "results", "zero",
                                                          "largest-model.jsonl"))
    parser.add_argument("--markdown")
    args = parser.parse_args()
    global OFFLOAD_BUCKET_MB, OFFLOAD_PRECISION
    OFFLOAD_BUCKET_MB = args.offload_bucket_mb
    OFFLOAD_PRECISION = args.offload_precision
    make_cgroup(int(args.memory_gib * 2**30))
    os.makedirs(args.swap, exist_ok=True)
    lines = ["| width | side | deepest that trains | parameters | dtrain / FSDP2 |",
             "|---|---|---|---|---|"]
    with report.Records(args.records, dtrain=os.path.join(args.build, "dtrain")) as records:
        disk = disk_rates(args.swap)
        print(f"disk under {args.swap}: write {disk['write']:.2f} GB/s, read {disk['read']:.2f} "
              "GB/s (dd, O_DIRECT)", flush=True)
        records.write({"kind": "setup", "memory_limit_gib": args.memory_gib, "disk": disk})
        for width in args.widths:
            found = {"dtrain": args.known_largest} if args.known_largest else {}
            for side in ([] if args.known_largest else args.sides):
                if side == "fsdp2" and not os.access(VENV_PYTHON, os.X_OK):
                    print("no .venv-torch: FSDP2 skipped (scripts/setup --torch pip)")
                    continue
                found[side] = search(args.build, side, width, args.steps, args.swap, records,
                                     args.start)
                records.write({"kind": "largest", "side": side, "width": width,
                               "layers": found[side],
                               "parameters": parameters(width, found[side])})
            for side, layers in found.items():
                ratio = "-"
                if side == "dtrain" and "fsdp2" in found:
                    ratio = f"{parameters(width, layers) / parameters(width, found['fsdp2']):.3f}"
                lines.append(f"| {width} | {side} | {layers} layers | "
                             f"{parameters(width, layers) / 1e9:.2f} B | {ratio} |")
            if args.compare_whole:
                losses = {}
                for side in ("dtrain-whole", "dtrain"):
                    ranks, info = probe(args.build, side, width, args.compare_whole, args.steps,
                                        args.swap)
                    losses[side] = [r["losses"] for r in ranks] if ranks else None
                    records.write({"kind": "construction", "side": side, "width": width,
                                   "layers": args.compare_whole,
                                   "parameters": parameters(width, args.compare_whole),
                                   "trained": ranks is not None, "ranks": ranks or [], **info})
                equal = None not in losses.values() and losses["dtrain-whole"] == losses["dtrain"]
                records.write({"kind": "construction-losses", "width": width,
                               "layers": args.compare_whole, "whole": losses["dtrain-whole"],
                               "placeholders": losses["dtrain"], "equal": equal})
                print(f"  losses built whole {losses['dtrain-whole']}, as placeholders "
                      f"{losses['dtrain']}: {'equal' if equal else 'NOT equal'}", flush=True)
                lines.append(f"| {width} | dtrain built whole vs as placeholders | "
                             f"{args.compare_whole} layers, {args.steps} steps | "
                             f"{parameters(width, args.compare_whole) / 1e9:.2f} B | losses "
                             f"{'equal' if equal else 'differ'} |")
            if "dtrain" not in found or args.offload_steps == 0:
                continue
            target = 2 * parameters(width, found["dtrain"])
            layers = args.offload_layers or next(
                n for n in range(1, 1000) if parameters(width, n) >= target)
            ranks, info = probe(args.build, "dtrain-offload", width, layers, args.offload_steps,
                                args.swap)
            records.write({"kind": "offload", "width": width, "layers": layers,
                           "precision": args.offload_precision,
                           "parameters": parameters(width, layers),
                           "times_dtrain_largest": parameters(width, layers) /
                           parameters(width, found["dtrain"]),
                           "trained": ranks is not None, "ranks": ranks or [], **info})
            if ranks:
                step_s = sorted(ranks[0]["step_s"][1:])
                median = step_s[len(step_s) // 2]
                lines.append(f"| {width} | dtrain, --offload optimizer:DIR, --precision "
                             f"{args.offload_precision} | {layers} layers, "
                             f"{args.offload_steps} steps, median step {median:.1f} s | "
                             f"{parameters(width, layers) / 1e9:.2f} B | "
                             f"{parameters(width, layers) / parameters(width, found['dtrain']):.2f}"
                             f"x dtrain's largest |")
    shutil.rmtree(args.swap, ignore_errors=True)
    report.table(lines, args.markdown)


if __name__ == "__main__":
    main()
