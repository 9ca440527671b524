#!/usr/bin/env python3
"""A replica killed mid-run (issue 53, part 1): `--fault-tolerance replicas` against today's
restart-from-checkpoint path, on the same job. Fashion-MNIST MLP 784-1792-1792-10 with Adam (a
56 MB checkpoint), 3 ranks of 1 thread, 100 steps; rank 2 kills itself (SIGKILL,
DTRAIN_SIMULATE_FAILURE) right after step --kill-at. Sides, alternated over rounds:

- none: the job without a failure (plain ddp);
- tolerant: --fault-tolerance replicas without a failure (what it costs a step: one flat sum
  after backward instead of buckets overlapped with it, and the store's decision);
- replicas: --fault-tolerance replicas: the other two go on at once;
- stopped: the same with the rank SIGSTOPped instead (a hung machine): counted as dead after
  2 s without a heartbeat, then killed by its launcher;
- restart: --max-restarts 1 with a checkpoint every --every steps: every rank restarts and
  resumes from the newest checkpoint (the launcher's elastic path);
- torchft: the peer, torchft 0.2 from PyPI on PyTorch 2.x (.venv-torch), the same model,
  batch and failure (bench/ft/torchft_replica.py), its lighthouse's heartbeat timeout 2 s.

From rank 0's metrics (each step record's wall-clock "time"): the time from the kill (the
killed step's record) to the next step committed after it, the steps trained again (the killed
step less the step resumed from), and the job's wall time against the run without a failure.
After the kill the replicas side trains 2 ranks on the 2 cores the 3 shared: its later steps are
faster (and on 2/3 of the data); the first two figures are the failure's own cost.

  bench/ft/run_replica_failure.py --rounds 2 [--markdown FILE]

The torchft side needs torchft in the PyTorch 2.x venv (scripts/setup --torch pip makes it;
torchft is a benchmark peer only): .venv-torch/bin/pip install torchft==0.2.0

--job zero2-hybrid: zero2 with --replica-shards 2 (hybrid sharding), the MLP job on 4 ranks: 2
replicas of 2 ranks sharding Adam's state and the gradients; world rank 3 fails, its launcher
ends rank 2 with it. Sides as for gpt-tp2.

--job zero1-buddy: zero1 with --shard-across-replicas, the MLP job on 3 ranks: Adam's state
sharded over the 3 replicas, each shard also kept by the next; world rank 1 fails, its buddy
(rank 2) gives its shard out until the replacement takes it. The job without a failure is plain
zero1 over the 3 ranks; one more side, whole: --fault-tolerance replicas without
--shard-across-replicas (each replica keeps the whole state). Sides as for gpt-tp2 otherwise.

--job diloco-islands: DiLoCo (--strategy diloco --island-size 2 --outer-steps 10, inner ddp),
the MLP job on 4 ranks: 2 islands of 2 ranks; world rank 3 is killed after step --kill-at (55:
mid-round), its launcher ends rank 2 with it. The other island does not wait for it until the
next outer step; reported also: the time from the kill to that outer step's commit, and that
step's time against the outer steps without a failure. Sides as for gpt-tp2.

--job diloco: the same with islands of 1 rank, 3 ranks (world rank 2 killed), and the peer:
torchft's DiLoCo (bench/ft/torchft_diloco.py), 3 replica groups of one rank, the same model,
inner and outer optimizers and H.

--job pipeline: replicas that are pipelines: the MLP job with --pipeline-parallel 2
--micro-batches 2 (1F1B) on 6 ranks, 3 replicas of 2 stages (laid out replica by replica);
world rank 5 (replica 2's last stage) is killed or stopped and its launcher ends rank 4 with it.
Sides as for gpt-tp2.

--job gpt-tp2: replicas of two tensor-parallel ranks instead (a failure inside a replica's
model-parallel group): a GPT of 4 blocks, width 256, context 64 on the fortunes text, tensor
parallel 2 with sequence parallelism, 3 replicas (6 ranks of 1 thread); world rank 5 (replica
2's second rank) is killed or stopped, and its launcher ends rank 4 with it. Sides none,
tolerant, replicas, stopped, restart (torchft's replica groups of several ranks are not run).
"""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time

import report

SIDES = ("none", "tolerant", "replicas", "stopped", "restart", "torchft")
VENV_PYTHON = os.path.join(report.ROOT, ".venv-torch", "bin", "python")
LIGHTHOUSE = os.path.join(report.ROOT, ".venv-torch", "bin", "torchft_lighthouse")


def start_lighthouse(port):
    """torchft's lighthouse on `port`, its heartbeat timeout set to dtrain's 2 s (its default is
    5 s)."""
    lighthouse = subprocess.Popen([LIGHTHOUSE, "--min_replicas", "1", "--bind", f"[::]:{port}",
                                   "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "2000"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return lighthouse


def run_torchft(args, workdir):
    """torchft 0.2 (PyPI, PyTorch 2.x in .venv-torch) on the same model and failure: a
    lighthouse and 3 replica groups of one rank (bench/ft/torchft_replica.py)."""
    port = 29610
    lighthouse = start_lighthouse(port)
    diloco = args.job == "diloco"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "torchft_diloco.py" if diloco else "torchft_replica.py")
    logs = [os.path.join(workdir, f"torchft-{r}.jsonl") for r in range(3)]
    for log in logs:
        if os.path.exists(log):
            os.remove(log)
    started = time.time()
    replicas = [subprocess.Popen([VENV_PYTHON, script, "--replica", str(r), "--store-port",
                                  str(port + 10 + r), "--lighthouse", f"http://127.0.0.1:{port}",
                                  "--steps", str(args.steps), "--kill-replica", "2", "--kill-at",
                                  str(args.kill_at), "--log", logs[r]]
                                 + (["--sync-every", "10"] if diloco else []),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for r in range(3)]
    codes = [p.wait(timeout=300) for p in replicas]
    wall = time.time() - started
    lighthouse.terminate()
    lighthouse.wait()
    if codes[0] != 0 or codes[1] != 0:
        raise SystemExit(f"torchft replicas exited {codes}")
    steps = [json.loads(line) for line in open(logs[0])]
    if diloco:  # every inner step is its own; the islands meet at the outer steps
        killed = [r for r in steps if r["step"] == args.kill_at][0]
        after = [r for r in steps if r["time"] > killed["time"]][0]
        outer = [r for r in steps if r["time"] > killed["time"] and r["outer_step"]]
        gaps = {b["step"]: b["time"] - a["time"] for a, b in zip(steps, steps[1:])}
        return {"side": "torchft", "command": " ".join(replicas[0].args), "wall_s": wall,
                "median_step_ms": 1e3 * statistics.median(gaps.values()),
                "kill_to_commit_s": after["time"] - killed["time"], "steps_again": 0,
                "first_step_after": after["step"], "replicas_after": outer[0]["replicas"],
                "kill_to_outer_s": outer[0]["time"] - killed["time"],
                "outer_step_after_ms": 1e3 * gaps[outer[0]["step"]],
                "median_outer_step_ms": 1e3 * statistics.median(
                    gaps[r["step"]] for r in steps if r["outer_step"] and r["step"] in gaps)}
    committed = [r for r in steps if r["committed"]]
    killed = [r for r in committed if r["step"] == args.kill_at][0]
    after = [r for r in committed if r["time"] > killed["time"]][0]
    return {"side": "torchft", "command": " ".join(replicas[0].args), "wall_s": wall,
            "median_step_ms": 1e3 * statistics.median(
                b["time"] - a["time"] for a, b in zip(committed, committed[1:])),
            "kill_to_commit_s": after["time"] - killed["time"],
            "steps_again": args.kill_at - (after["step"] - 1),
            "first_step_after": after["step"], "replicas_after": after["replicas"],
            "discarded_steps": len(steps) - len(committed)}


# The job's flags, the rank that fails, and what --fault-tolerance replicas adds.
JOBS = {
    "mlp": (["--model", "mlp", "--hidden", "1792", "1792", "--optimizer", "adam",
             "--batch-size", "32", "--nproc", "3"], 2, []),
    "gpt-tp2": (["--model", "gpt", "--dataset", "text", "--layers", "4", "--width", "256",
                 "--heads", "4", "--context", "64", "--tensor-parallel", "2",
                 "--sequence-parallel", "--batch-size", "8", "--nproc", "6"], 5, []),
    "zero2-hybrid": (["--model", "mlp", "--hidden", "1792", "1792", "--optimizer", "adam",
                      "--batch-size", "32", "--nproc", "4", "--strategy", "zero2"], 3,
                     ["--replica-shards", "2"]),
    "zero1-buddy": (["--model", "mlp", "--hidden", "1792", "1792", "--optimizer", "adam",
                     "--batch-size", "32", "--nproc", "3", "--strategy", "zero1"], 1,
                    ["--shard-across-replicas"]),
    "pipeline": (["--model", "mlp", "--hidden", "1792", "1792", "--optimizer", "adam",
                  "--batch-size", "32", "--nproc", "6", "--pipeline-parallel", "2",
                  "--micro-batches", "2"], 5, []),
    "diloco": (["--model", "mlp", "--hidden", "1792", "1792", "--optimizer", "adam",
                "--batch-size", "32", "--nproc", "3", "--strategy", "diloco", "--island-size", "1",
                "--outer-steps", "10"], 2, []),
    "diloco-islands": (["--model", "mlp", "--hidden", "1792", "1792", "--optimizer", "adam",
                        "--batch-size", "32", "--nproc", "4", "--strategy", "diloco",
                        "--island-size", "2", "--outer-steps", "10"], 3, []),
}


def run_side(dtrain, side, args, workdir):
    if side == "torchft":
        return run_torchft(args, workdir)
    metrics = os.path.join(workdir, f"{side}.jsonl")
    checkpoints = os.path.join(workdir, f"ck-{side}")
    shutil.rmtree(checkpoints, ignore_errors=True)
    if os.path.exists(metrics):
        os.remove(metrics)
    job, victim, tolerant = JOBS[args.job]
    command = [dtrain, "train"] + job + [
        "--max-steps", str(args.steps), "--threads", "1", "--log-every", "1", "--metrics",
        metrics, "--no-progress"]
    env = dict(os.environ)
    if side == "tolerant":  # what fault tolerance costs when nothing fails
        command += ["--fault-tolerance", "replicas"] + tolerant
    elif side == "whole":  # zero1-buddy: replicas that each keep the whole state instead
        command += ["--fault-tolerance", "replicas"]
    elif side == "replicas":
        command += ["--fault-tolerance", "replicas"] + tolerant
        env["DTRAIN_SIMULATE_FAILURE"] = f"{victim}:{args.kill_at}"
    elif side == "stopped":  # SIGSTOP: counted as dead after 2 s of heartbeat silence, fenced
        command += ["--fault-tolerance", "replicas"] + tolerant
        env["DTRAIN_SIMULATE_FAILURE"] = f"{victim}:{args.kill_at}:stop"
    elif side == "restart":
        command += ["--max-restarts", "1", "--checkpoint-dir", checkpoints, "--checkpoint-every",
                    str(args.every)]
        env["DTRAIN_SIMULATE_FAILURE"] = f"{victim}:{args.kill_at}:1"
    started = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in open(metrics)]
    steps = [r for r in records if r["event"] == "step"]
    result = {"side": side, "command": " ".join(command), "wall_s": wall,
              "median_step_ms": statistics.median(r["step_ms"] for r in steps)}
    summary = [r for r in records if r["event"] == "summary"]
    if summary:  # the leading rank's model state as its strategy keeps it
        result["optimizer_bytes"] = summary[-1].get("optimizer_bytes")
    if side not in ("none", "tolerant", "whole"):
        killed = [r for r in steps if r["step"] == args.kill_at][0]
        after = [r for r in steps if r["time"] > killed["time"]][0]
        if side == "restart":
            # The first step of the restarted run (the step count goes back): DiLoCo's other
            # island records steps of its own until the launcher ends it.
            later = [r for r in steps if r["time"] > killed["time"]]
            restarted = [b for a, b in zip(later, later[1:]) if b["step"] <= a["step"]]
            if restarted:
                after = restarted[0]
        result["kill_to_commit_s"] = after["time"] - killed["time"]
        result["steps_again"] = args.kill_at - (after["step"] - 1)
        result["first_step_after"] = after["step"]
        result["replicas_after"] = after.get("replicas")
        outer = [r for r in steps if r["time"] > killed["time"] and r.get("outer_step", 0) >= 1]
        if outer:  # DiLoCo: the first outer step after the kill, where the islands meet
            result["kill_to_outer_s"] = outer[0]["time"] - killed["time"]
            result["outer_step_after_ms"] = outer[0]["step_ms"]
    if any(r.get("outer_step", 0) >= 1 for r in steps):
        result["median_outer_step_ms"] = statistics.median(
            r["step_ms"] for r in steps if r.get("outer_step", 0) >= 1)
    shutil.rmtree(checkpoints, ignore_errors=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=report.default_build())
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--kill-at", type=int, default=50)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--job", choices=sorted(JOBS), default="mlp")
    parser.add_argument("--markdown")
    parser.add_argument("--records", default=os.path.join(report.ROOT, "bench", "results", "ft",
                                                          "replica-failure.jsonl"))
    args = parser.parse_args()
    dtrain = os.path.join(args.build, "dtrain")
    sides = SIDES if args.job in ("mlp", "diloco") else tuple(s for s in SIDES if s != "torchft")
    if args.job == "zero1-buddy":
        sides = ("none", "tolerant", "whole") + sides[2:]
    with report.Records(args.records, "a", dtrain) as records, \
            tempfile.TemporaryDirectory(prefix="dtrain-ft-") as workdir:
        rounds = report.alternated_rounds(
            sides, args.rounds, lambda side: run_side(dtrain, side, args, workdir), records,
            lambda r: f"wall {r['wall_s']:.1f} s, step {r['median_step_ms']:.0f} ms, kill to "
                      f"commit {r.get('kill_to_commit_s', 0):.3f} s, steps again "
                      f"{r.get('steps_again', 0)}")

    def med(side, field):
        return statistics.median(r[side][field] for r in rounds)

    job, victim, _ = JOBS[args.job]
    shape = {"mlp": "3 ranks x 1 thread",
             "diloco": "DiLoCo, 3 islands of 1 rank (H = 10; 3 ranks x 1 thread)",
             "gpt-tp2": "3 replicas x tensor-parallel 2 (6 ranks x 1 thread), GPT 4 x 256",
             "pipeline": "3 replicas x a 2-stage pipeline (1F1B, 2 micro-batches of 32; 6 ranks "
                         "x 1 thread)",
             "zero2-hybrid": "zero2, 2 replicas x 2 shards (4 ranks x 1 thread)",
             "zero1-buddy": "zero1 sharded across 3 replicas, each shard also at its buddy "
                            "(3 ranks x 1 thread)",
             "diloco-islands": "DiLoCo, 2 islands x 2 ranks (inner ddp, H = 10; 4 ranks x 1 "
                               "thread)"}[args.job]
    lines = [f"{shape}, {args.steps} steps, rank {victim} killed after step {args.kill_at}; "
             f"medians of {args.rounds} rounds:",
             "",
             "| side | kill to the next committed step (s) | steps trained again | job wall time (s) | "
             "wall time - no failure (s) |",
             "|---|---|---|---|---|",
             f"| no failure | - | - | {med('none', 'wall_s'):.1f} | - |"]
    step_ratio = statistics.median(r["tolerant"]["median_step_ms"] / r["none"]["median_step_ms"]
                                   for r in rounds)
    for side, label in (("replicas", "--fault-tolerance replicas"),
                        ("stopped", "--fault-tolerance replicas, the rank SIGSTOPped"),
                        ("restart", f"restart from a checkpoint every {args.every} steps"),
                        ("torchft", "torchft 0.2 (PyTorch 2.12), heartbeat timeout 2 s")):
        if side not in sides:
            continue
        extra = statistics.median(r[side]["wall_s"] - r["none"]["wall_s"] for r in rounds)
        lines.append(f"| {label} | {med(side, 'kill_to_commit_s'):.3f} | "
                     f"{med(side, 'steps_again'):.0f} | {med(side, 'wall_s'):.1f} | "
                     f"{extra:+.1f} |")
    lines += ["", f"Without a failure, --fault-tolerance replicas' median step / the same job's "
                  f"without it: "
                  f"{step_ratio:.3f} ({med('tolerant', 'median_step_ms'):.1f} ms against "
                  f"{med('none', 'median_step_ms'):.1f} ms)."]
    if args.job == "zero1-buddy":
        whole_ratio = statistics.median(r["tolerant"]["median_step_ms"] /
                                        r["whole"]["median_step_ms"] for r in rounds)
        lines.append(f"Against replicas that each keep the whole state (--fault-tolerance replicas "
                     f"without --shard-across-replicas): {whole_ratio:.3f} "
                     f"({med('whole', 'median_step_ms'):.1f} ms).")
        lines.append(f"Optimizer state per rank: {med('tolerant', 'optimizer_bytes') / 1e6:.1f} MB "
                     f"(its shard and its buddy's copy) against "
                     f"{med('whole', 'optimizer_bytes') / 1e6:.1f} MB (the whole state) and "
                     f"{med('none', 'optimizer_bytes') / 1e6:.1f} MB (plain zero1's shard).")
    if args.job.startswith("diloco"):
        for side in ("replicas", "stopped") + (("torchft",) if "torchft" in sides else ()):
            lines.append(
                f"{side}: from the kill to the next outer step committed "
                f"{med(side, 'kill_to_outer_s'):.3f} s; that outer step "
                f"{med(side, 'outer_step_after_ms'):.0f} ms against "
                f"{med('tolerant' if side != 'torchft' else side, 'median_outer_step_ms'):.0f}"
                f" ms for its outer steps without a failure.")
    report.table(lines, args.markdown)


if __name__ == "__main__":
    main()
