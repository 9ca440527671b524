#!/usr/bin/env python3
"""What resuming costs the loader (issue 50: under 1 s however far into the run). A token set
is presampled (Megatron's indices, cached beside the data by the first run), so a resume opens
the cache, takes this rank's order and reads its first batch: measured at the start, the middle
and the end of runs of 1 M and 10 M samples (context 1024, global batch 512 over 8 ranks), over
python3-doc's text tokenized by a BPE dtrain trains on it. A shuffled set's resume (images)
draws its epoch's permutation: measured for ImageNet's 1,281,167 examples.

  python3 bench/data/run_resume_bench.py [--build build-unity] [--rounds 3] [--markdown FILE]
Raw records: bench/results/data/resume.jsonl (stamped).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from report import ROOT, Records, table  # noqa: E402

CORPUS = "/usr/share/doc/python3.11/html"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build-unity"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    dtrain = os.path.join(args.build, "dtrain")
    bench = os.path.join(args.build, "bench", "data_bench")
    work = tempfile.mkdtemp(prefix="dtrain-resume-bench-")
    tokenizer = os.path.join(work, "tokenizer.json")
    subprocess.run([dtrain, "data", "tokenizer", "train", CORPUS, "--vocab-size", "8192",
                    "--output", tokenizer], check=True, capture_output=True)
    prefix = os.path.join(work, "pydoc")
    subprocess.run([dtrain, "data", "prepare", CORPUS, "--tokenizer", tokenizer, "--output",
                    prefix], check=True, capture_output=True)
    rows = []
    with Records(os.path.join(ROOT, "bench", "results", "data", "resume.jsonl"), "a",
                 dtrain) as records:
        shuffled = []
        for samples in (1_000_000, 10_000_000):
            done = subprocess.run([bench, "resume", "--data", prefix, "--context", "1024",
                                   "--batch", "512", "--ranks", "8", "--samples", str(samples),
                                   "--rounds", str(args.rounds)], check=True,
                                  capture_output=True, text=True)
            results = [json.loads(line) for line in done.stdout.splitlines()]
            for r in results:
                records.write({**r, "corpus": CORPUS, "threads": 1})
            tokens = [r for r in results if r["set"] == "tokens"]
            shuffled += [r["seconds"] for r in results if r["set"] == "shuffled"]
            for fraction in (0.0, 0.5, 0.999):
                at = [r for r in tokens if r["fraction"] == fraction]
                rows.append(f"| tokens, {samples / 1e6:.0f} M samples, at {fraction:.0%} of the run "
                            f"(step {at[0]['step']}) | {statistics.median(r['seconds'] for r in at):.3f} s | "
                            f"{statistics.median(r['open_seconds'] for r in at):.3f} s | "
                            f"{at[0]['build_seconds']:.1f} s |")
        rows.append(f"| shuffled (images), 1,281,167 examples, any step | "
                    f"{statistics.median(shuffled):.3f} s | | |")
    table(["| resume at 8 ranks, one thread | loader time to the first batch (median) | of which "
           "opening the cached indices | the first run's index build |", "|---|---|---|---|"]
          + rows, args.markdown)


if __name__ == "__main__":
    main()
