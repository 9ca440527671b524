"""What the federated-learning benchmark scripts share: running a command with its output kept
in the log (stopping with it on failure), running `dtrain fl simulate` and reading its round
records (report.py prints the tables)."""
import json
import os
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTRAIN = os.path.join(ROOT, "build", "dtrain")


def run_logged(command, log, allow_failure=False):
    """Runs `command`, appends it and its output to `log`; its stdout, or exits on failure
    (None instead with `allow_failure`)."""
    out = subprocess.run(command, capture_output=True, text=True)
    log.write(" ".join(command) + "\n" + out.stdout + out.stderr)
    log.flush()
    if out.returncode != 0:
        if allow_failure:
            log.write(f"# failed with exit {out.returncode}\n")
            return None
        raise SystemExit(f"failed: {' '.join(command)}\n{out.stdout}{out.stderr}")
    return out.stdout


def simulate(dtrain, flags, log, allow_failure=False):
    """`dtrain fl simulate FLAGS` with a metrics file: (its applied round records, stdout); with
    `allow_failure`, a run that fails (e.g. diverged) gives the rounds it recorded."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        stdout = run_logged([dtrain, "fl", "simulate", "--no-progress", "--metrics-file", metrics]
                            + flags, log, allow_failure)
        records = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    return [r for r in records if r.get("event") == "round" and r.get("applied")], stdout

