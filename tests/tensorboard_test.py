"""`dtrain train --tensorboard DIR` read back with TensorBoard's own reader.

A run with evaluations and checkpoints, then the same run resumed for more steps (a second
events file in the folder): TensorBoard's EventAccumulator (the one its server uses) must hold
every number of metrics.jsonl, exactly (float64), at its step and under its tag
("<event>/<key>", the per-step records' "train/..."), and the run's configuration as text; the
command prints the `tensorboard --logdir` line. A folder that cannot be made is one line, exit 2,
before any rank starts. Exit 77 where the tensorboard package is not installed.

Usage: python tensorboard_test.py PATH/TO/dtrain
"""
import json
import math
import os
import subprocess
import sys
import tempfile

try:
    from tensorboard.backend.event_processing import event_accumulator as tb_sizes
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
except ImportError:
    print("SKIPPED: the tensorboard package is not installed (scripts/setup --torch pip)")
    sys.exit(77)

DTRAIN = os.path.abspath(sys.argv[1])


def fail(message):
    print("FAILED: " + message)
    sys.exit(1)


def run(args, code=0):
    done = subprocess.run([DTRAIN] + args, capture_output=True, text=True, timeout=300)
    if done.returncode != code:
        fail(f"dtrain {' '.join(args)} exited {done.returncode}, expected {code}:\n"
             f"{done.stdout}\n{done.stderr}")
    return done


def tag_of(event, key):
    """metrics.jsonl's field -> TensorBoard tag (dtrain::train::tensorboard_tag)."""
    if key in ("event", "step", "time"):
        return None
    return ("train" if event == "step" else event) + "/" + key


def expected_scalars(metrics_file):
    """{tag: [(step, value), ...]} in the order written; a record without a step takes the last
    step written."""
    out = {}
    last_step = 0
    for line in open(metrics_file):
        record = json.loads(line)
        if isinstance(record.get("step"), (int, float)):
            last_step = int(record["step"])
        for key, value in record.items():
            tag = tag_of(record.get("event", "metrics"), key)
            if tag is None or isinstance(value, str):
                continue
            out.setdefault(tag, []).append((last_step, math.nan if value is None else float(value)))
    return out


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == b


def main():
    work = tempfile.mkdtemp()
    board = os.path.join(work, "tb")
    job = ["train", "--dataset", "synthetic", "--model", "mlp", "--hidden", "32",
           "--synthetic-examples", "512", "--batch-size", "32", "--log-every", "2",
           "--eval-every", "4", "--checkpoint-every", "4", "--warmup-steps", "2",
           "--no-progress", "--threads", "1", "--run-dir", os.path.join(work, "run"),
           "--tensorboard", board]
    first = run(job + ["--max-steps", "8"])
    if f"tensorboard --logdir {board}" not in first.stdout:
        fail("no `tensorboard --logdir` line:\n" + first.stdout)
    resumed = run(job + ["--max-steps", "12"])
    if "resumed from step 8" not in resumed.stdout + resumed.stderr:
        fail("the second run did not resume:\n" + resumed.stdout + resumed.stderr)
    files = [f for f in os.listdir(board) if f.startswith("events.out.tfevents.")]
    if len(files) != 2:
        fail(f"expected an events file per run, found {files}")

    reader = EventAccumulator(board, size_guidance={tb_sizes.TENSORS: 0})
    reader.Reload()
    expected = expected_scalars(os.path.join(work, "run", "metrics.jsonl"))
    if not any(tag == "train/loss" for tag in expected) or "eval/val_loss" not in expected:
        fail(f"the metrics file lacks the records this test needs: {sorted(expected)}")
    tags = set(reader.Tags()["tensors"])
    count = 0
    for tag, points in expected.items():
        if tag not in tags:
            fail(f"TensorBoard has no {tag}")
        got = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in reader.Tensors(tag)]
        if len(got) != len(points) or not all(
                s == t and same(a, b) for (s, a), (t, b) in zip(got, points)):
            fail(f"{tag}: TensorBoard read {got}, metrics.jsonl has {points}")
        if reader.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
            fail(f"{tag} is not for the scalars plugin")
        count += len(points)
    config = reader.Tensors("config")
    text = tensor_util.make_ndarray(config[0].tensor_proto).item().decode()
    if reader.SummaryMetadata("config").plugin_data.plugin_name != "text" or "mlp" not in text:
        fail("the configuration is not TensorBoard text naming the model: " + text)
    print(f"ok: TensorBoard's reader got all {count} numbers of metrics.jsonl exactly, "
          f"under {len(expected)} tags, over 2 events files, and the configuration")

    # A folder that cannot be made: one line, exit 2, nothing trained.
    bad = os.path.join(work, "run", "metrics.jsonl", "tb")
    refused = run(job[:-2] + ["--tensorboard", bad, "--max-steps", "2"], code=2)
    lines = refused.stderr.strip().splitlines()
    if len(lines) != 1 or f"--tensorboard {bad}: cannot create it" not in lines[0]:
        fail("not one line naming the folder:\n" + refused.stderr)
    print("ok: a TensorBoard folder that cannot be made is refused in one line, exit 2")


main()
