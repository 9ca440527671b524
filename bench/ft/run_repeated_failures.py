#!/usr/bin/env python3
"""Replicas failing again and again (issue 53, parts 1-2): a replica SIGKILLed, or SIGSTOPped,
every --period seconds while the job trains, against the same job without failures and against
today's restart-from-checkpoint path under the same schedule. The job is
bench/ft/run_replica_failure.py's: Fashion-MNIST MLP 784-1792-1792-10 with Adam (56 MB of
weights and optimizer state), 3 ranks of 1 thread, 32 images per rank and step, --steps steps.
The victims alternate between ranks 1 and 2 (rank 0, which evaluates and checkpoints, must live;
its death stops the job as before).

Sides:
- none: no failure;
- kill: --fault-tolerance replicas, a replica SIGKILLed every period: the others go on at
  once, its launcher starts it again and the replacement joins at a step's end with the state
  of rank 0 (live recovery);
- stop: the same with SIGSTOP: counted as dead after --heartbeat-timeout ms of heartbeat silence
  (dtrain's --replica-heartbeat-timeout, default 2 s), killed by its launcher (fencing), then replaced;
- restart: --max-restarts with a checkpoint every --every steps: a kill restarts every rank
  from the newest checkpoint.
- torchft-none, torchft-kill: the peer, torchft 0.2 from PyPI on PyTorch 2.x (.venv-torch),
  the same model and batch on synthetic batches (bench/ft/torchft_replica.py: its Manager and
  Optimizer, Manager.allreduce of each gradient after backward (its DDP wrapper asserts when a
  peer dies mid-allreduce), one rank per replica group, the lighthouse's heartbeat timeout 2 s), without
  failures and with a replica SIGKILLed every period and started again at once (as dtrain's
  launcher does): it heals from the others. Its throughput is compared with its own run without
  failures (its loss is on other data).

Figures, from rank 0's metrics (each step record's wall-clock "time" and "replicas"):
throughput = the samples of the steps trained (32 x the replicas present, each step once) per
second between the first step's record and the last; the test loss of the final evaluation; for
kill/stop, the time from each failure to the first step with all three replicas again (the
replacement taking part) and the steps trained with fewer.

  bench/ft/run_repeated_failures.py --steps 6900 --period 30 --every 200 [--sides ...]
"""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import argparse
import json
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time

import report
from run_replica_failure import VENV_PYTHON, start_lighthouse


def rank_pids(launcher_pid):
    """{rank: pid} of the launcher's children (their RANK in /proc/PID/environ)."""
    pids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent != launcher_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            pids[int(env[b"RANK"])] = int(entry)
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return pids


def back_to_three(ordered, failures):
    """Seconds from each failure to the first step with three replicas again, and the steps
    trained with fewer. `ordered`: the committed steps' records ("time", "replicas")."""
    back = []
    for f in failures:
        later = [r for r in ordered if r["time"] > f["time"]]
        fewer = [r for r in later if r.get("replicas", 3) < 3]
        if not fewer:
            continue
        again = [r for r in later if r["time"] > fewer[0]["time"] and r.get("replicas") == 3]
        if again:
            back.append(again[0]["time"] - f["time"])
    return back, sum(1 for r in ordered if r.get("replicas", 3) < 3)


def run_torchft(side, args, workdir):
    port = 29710
    lighthouse = start_lighthouse(port)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchft_replica.py")
    logs = [os.path.join(workdir, f"{side}-{r}.jsonl") for r in range(3)]
    for log in logs:
        for path in (log, log + ".err"):
            if os.path.exists(path):
                os.remove(path)

    def start(r):
        with open(logs[r] + ".err", "a") as err:
            return subprocess.Popen([VENV_PYTHON, script, "--replica", str(r), "--store-port",
                                     str(port + 10 + r), "--lighthouse",
                                     f"http://127.0.0.1:{port}", "--steps", str(args.steps),
                                     "--log", logs[r], "--grad-sync", "manual"],
                                    stdout=subprocess.DEVNULL, stderr=err)

    started = time.time()
    replicas = [start(r) for r in range(3)]
    failures = []
    victim = 1
    next_failure = started + args.period
    while replicas[0].poll() is None:
        time.sleep(0.05)
        if side != "torchft-kill" or time.time() < next_failure:
            continue
        if replicas[victim].poll() is None:
            replicas[victim].kill()
            replicas[victim].wait()
            failures.append({"time": time.time(), "rank": victim})
            replicas[victim] = start(victim)
        victim = 3 - victim
        next_failure += args.period
    wall = time.time() - started
    for p in replicas[1:]:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
    lighthouse.terminate()
    lighthouse.wait()
    if replicas[0].returncode != 0:
        raise SystemExit(f"torchft replica 0 exited {replicas[0].returncode}:\n"
                         f"{open(logs[0] + '.err').read()[-3000:]}")
    committed = [json.loads(line) for line in open(logs[0])]
    committed = [r for r in committed if r["committed"]]
    steps = {}
    for r in committed:
        steps[r["step"]] = r
    ordered = [steps[k] for k in sorted(steps)]
    first, last = ordered[0]["time"], ordered[-1]["time"]
    result = {"side": side, "command": " ".join(replicas[0].args), "wall_s": wall,
              "steps": len(ordered), "failures": len(failures),
              "samples_per_s": sum(32 * r["replicas"] for r in ordered[1:]) / (last - first),
              "test_loss": None}
    result["failure_to_three_s"], result["steps_with_fewer"] = back_to_three(ordered, failures)
    return result


def run_side(dtrain, side, args, workdir):
    if side.startswith("torchft"):
        return run_torchft(side, args, workdir)
    metrics = os.path.join(workdir, f"{side}.jsonl")
    checkpoints = os.path.join(workdir, f"ck-{side}")
    shutil.rmtree(checkpoints, ignore_errors=True)
    if os.path.exists(metrics):
        os.remove(metrics)
    command = [dtrain, "train", "--model", "mlp", "--hidden", "1792", "1792", "--optimizer",
               "adam", "--batch-size", "32", "--epochs", "100", "--max-steps", str(args.steps),
               "--nproc", "3", "--threads", "1", "--log-every", "1", "--metrics", metrics,
               "--no-progress", "--seed", str(args.seed), "--lr", str(args.lr),
               "--weight-decay", str(args.weight_decay)]
    if side in ("kill", "stop"):
        command += ["--fault-tolerance", "replicas", "--max-replacements", "1000"]
        if side == "stop":  # a kill is an exit: the heartbeat timeout only times stops
            command += ["--replica-heartbeat-timeout", str(args.heartbeat_timeout / 1000)]
    elif side == "restart":
        command += ["--max-restarts", "1000", "--checkpoint-dir", checkpoints,
                    "--checkpoint-every", str(args.every)]
    started = time.time()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    reader = threading.Thread(target=lambda: output.extend(job.stdout), daemon=True)
    reader.start()
    failures = []
    if side != "none":
        victim = 1
        next_failure = started + args.period
        while job.poll() is None:
            time.sleep(0.05)
            if time.time() < next_failure:
                continue
            # The launcher that owns the ranks: `dtrain train --nproc` runs them itself.
            pids = rank_pids(job.pid)
            if victim in pids:
                os.kill(pids[victim], signal.SIGSTOP if side == "stop" else signal.SIGKILL)
                failures.append({"time": time.time(), "rank": victim})
            victim = 3 - victim
            next_failure += args.period
    code = job.wait()
    reader.join()
    wall = time.time() - started
    if code != 0:
        raise SystemExit(f"{' '.join(command)} failed ({code}):\n{''.join(output)[-3000:]}")
    records = [json.loads(line) for line in open(metrics)]
    steps = {}
    for r in records:
        if r["event"] == "step":
            steps[r["step"]] = r  # a step trained again (restart) counts once, its last time
    evals = [r for r in records if r["event"] == "eval"]
    ordered = [steps[s] for s in sorted(steps)]
    first, last = ordered[0]["time"], ordered[-1]["time"]
    samples = sum(32 * r.get("replicas", 3) for r in ordered[1:])
    result = {"side": side, "command": " ".join(command), "wall_s": wall,
              "steps": len(ordered), "failures": len(failures),
              "samples_per_s": samples / (last - first),
              "test_loss": evals[-1]["val_loss"] if evals else None,
              "test_accuracy": evals[-1]["val_accuracy"] if evals else None,
              "final_train_loss_mean50": statistics.mean(r["loss"] for r in ordered[-50:])}
    if side in ("kill", "stop"):
        result["heartbeat_timeout_ms"] = args.heartbeat_timeout if side == "stop" else 2000
        result["failure_to_three_s"], result["steps_with_fewer"] = back_to_three(ordered,
                                                                                 failures)
        result["replaced"] = sum(1 for line in output if "started rank" in line and "again" in line)
        result["joined"] = sum(1 for line in output if "joined after step" in line
                               and "[rank 0]" in line)
    if side == "restart":
        result["restarts"] = sum(1 for line in output if "restart " in line and "lost)" in line)
    shutil.rmtree(checkpoints, ignore_errors=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=report.default_build())
    parser.add_argument("--steps", type=int, default=6900)
    parser.add_argument("--period", type=float, default=30)
    parser.add_argument("--every", type=int, default=200, help="restart: checkpoint interval")
    parser.add_argument("--sides", default="none,kill,stop,restart")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.05,
                        help="the job's learning rate; 0.05 (the image models' recipe, what the "
                             "recorded runs used) is high for Adam: at --seed 1 the job diverged "
                             "to chance, and the final loss moves by several percent between "
                             "runs; 0.001 is Adam's usual rate")
    parser.add_argument("--weight-decay", type=float, default=5e-4,
                        help="the job's weight decay: 0.0005, the image recipe's, which the "
                             "recorded runs trained with (since --optimizer adam no longer takes "
                             "the SGD recipe's rates, it would be Adam's own 0)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the job's seed (its model and data order): a run at another seed "
                             "shows how far the final loss moves without a failure")
    parser.add_argument("--heartbeat-timeout", type=int, default=2000,
                        help="stop: dtrain's --replica-heartbeat-timeout, in ms (kill runs "
                             "at its default, 2 s: a kill is seen as an exit)")
    parser.add_argument("--markdown")
    parser.add_argument("--records", default=os.path.join(report.ROOT, "bench", "results", "ft",
                                                          "repeated-failures.jsonl"))
    args = parser.parse_args()
    dtrain = os.path.join(args.build, "dtrain")
    sides = tuple(args.sides.split(","))
    with report.Records(args.records, "a", dtrain) as records, \
            tempfile.TemporaryDirectory(prefix="dtrain-ft-") as workdir:
        rounds = report.alternated_rounds(
            sides, args.rounds, lambda side: run_side(dtrain, side, args, workdir), records,
            lambda r: f"wall {r['wall_s']:.0f} s, {r['failures']} failures, "
                      f"{r['samples_per_s']:.0f} samples/s, test loss {r['test_loss'] or 0:.4f}"
                      + (f", back to 3 replicas in median "
                         f"{statistics.median(r['failure_to_three_s']):.2f} s"
                         if r.get("failure_to_three_s") else ""))

    def med(side, field):
        return statistics.median(r[side][field] for r in rounds)

    def base_of(side):
        if side.startswith("torchft"):
            return "torchft-none" if "torchft-none" in sides else None
        return "none" if "none" in sides else None

    lines = [f"3 ranks x 1 thread, {args.steps} steps, a replica failing every {args.period:.0f} s; "
             f"medians of {args.rounds} round(s):", "",
             "| side | failures | job wall time (s) | samples/s | / no failure | test loss | "
             "/ no failure | training loss, last 50 steps | / no failure | "
             "failure to 3 replicas again (s, median) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    labels = {"none": "no failure", "kill": "`--fault-tolerance replicas`, SIGKILL",
              "stop": "`--fault-tolerance replicas`, SIGSTOP, heartbeat timeout "
                      f"{args.heartbeat_timeout} ms",
              "restart": f"restart from a checkpoint every {args.every} steps",
              "torchft-none": "torchft 0.2 (PyTorch 2.x), no failure",
              "torchft-kill": "torchft 0.2 (PyTorch 2.x), SIGKILL, started again"}
    for side in sides:
        base = base_of(side)
        ratio = statistics.median(r[side]["samples_per_s"] / r[base]["samples_per_s"]
                                  for r in rounds) if base else float("nan")
        loss = statistics.median(r[side]["test_loss"] / r[base]["test_loss"]
                                 for r in rounds) if base and rounds[0][side]["test_loss"] \
            else float("nan")
        train = med(side, "final_train_loss_mean50")
        train_ratio = statistics.median(
            r[side]["final_train_loss_mean50"] / r[base]["final_train_loss_mean50"]
            for r in rounds) if base and not side.startswith("torchft") else float("nan")
        test_loss = med(side, "test_loss") if rounds[0][side]["test_loss"] else float("nan")
        back = [t for r in rounds for t in r[side].get("failure_to_three_s", [])]
        lines.append(f"| {labels[side]} | {med(side, 'failures'):.0f} | {med(side, 'wall_s'):.0f} | "
                     f"{med(side, 'samples_per_s'):.0f} | {ratio:.3f} | "
                     f"{test_loss:.4f} | {loss:.3f} | {train:.4f} | {train_ratio:.3f} | "
                     f"{format(statistics.median(back), '.2f') if back else '-'} |")
    report.table(lines, args.markdown)


if __name__ == "__main__":
    main()
