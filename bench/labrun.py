"""What the network-lab benchmark drivers share (bench/run_*_lab.py): the command that runs
`dtrain train` on 2 lab hosts x 1 rank, running it and reading its metrics file back, and the
commit and date every record carries."""
import json
import os
import subprocess

import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTRAIN = os.environ.get("DTRAIN_BIN", os.path.join(ROOT, "build", "dtrain"))  # a copy: builds go on

# configs/fortunes-gpt.toml's model and recipe as flags, with 1 rank per lab host instead of its
# 2 local ranks (the same global batch: 64 windows of 64 characters).
GPT = ["--model", "gpt", "--dataset", "text", "--layers", "4", "--heads", "4", "--width", "192",
       "--context", "64", "--dropout", "0", "--batch-size", "32", "--optimizer", "adamw",
       "--lr", "0.002", "--weight-decay", "0.1", "--lr-decay", "cosine", "--warmup-steps", "100",
       "--max-grad-norm", "1.0"]


def across_lab(profile, train, hosts=2, per_host=1):
    """`train` (a dtrain train command) on `hosts` lab hosts x `per_host` ranks under
    `profile`."""
    return [os.path.join(ROOT, "scripts", "netlab"), "run", "--hosts", str(hosts), "--profile",
            profile, "--", DTRAIN, "launch", "--nnodes", str(hosts), "--node-rank", "{host}",
            "--nproc-per-node", str(per_host), "--master-addr", "{addr0}", "--master-port",
            "29500", "--", *train]


def run_and_read(command, metrics):
    """Runs `command`; returns its wall seconds and the metrics file's summary, step and eval
    records."""
    start = time.time()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.time() - start
    records = [json.loads(line) for line in open(metrics)]
    summary = next(r for r in records if r.get("event") == "summary")
    steps = [r for r in records if r.get("event") == "step"]
    evals = [r for r in records if r.get("event") == "eval"]
    return round(wall, 2), summary, steps, evals
