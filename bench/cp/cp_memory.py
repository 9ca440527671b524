#!/usr/bin/python3
"""Context parallelism's memory (issue 82): each rank's peak of live tensor bytes while causal
attention runs forward and backward over a sequence split over C = 2 and 4 ranks (ring,
all-gather, Ulysses; the zigzag split), against one rank over the whole sequence. Target: at most
1/C of C = 1's plus 10%. Ranks are threads of one process; an allocator charges each tensor to
the rank whose thread made it (bench/cp/cp_memory_bench.cpp).

  bench/cp/cp_memory.py [--tokens 8192] [--out bench/results/cp/memory.jsonl]
"""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import subprocess
from report import ROOT, Records


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench", default=os.path.join(ROOT, "build", "bench", "cp_memory_bench"))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "cp", "memory.jsonl"))
    args = parser.parse_args()
    command = [args.bench, "--tokens", str(args.tokens), "--heads", str(args.heads)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    whole = next(r["peak_bytes_per_rank"] for r in rows if r["ranks"] == 1)
    print(f"{'method':10} {'C':>2} {'peak MiB/rank':>14} {'of C=1':>8} {'target':>8}  seconds")
    with Records(args.out, "w") as records:
        for r in rows:
            share = r["peak_bytes_per_rank"] / whole
            target = 1 / r["ranks"] * 1.1
            r.update({"command": " ".join(command), "share_of_one_rank": share,
                      "target_share": target, "met": share <= target})
            records.write(r)
            print(f"{r['method']:10} {r['ranks']:2d} {r['peak_bytes_per_rank'] / 2**20:14.1f} "
                  f"{share:8.3f} {target if r['ranks'] > 1 else 1:8.3f}  {r['seconds']:.2f}")


if __name__ == "__main__":
    main()
