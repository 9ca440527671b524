#!/usr/bin/env python3
"""dtrain's parameter server against ps-lite's own benchmark (tests/test_kv_app_benchmark.cc of
https://github.com/dmlc/ps-lite: one worker pushes, then pulls, 10M float values with their
uint64 keys, over ZeroMQ, to one server; the server answers a push at once without applying
it and a pull with zeros). ps-lite is built beside the project, never committed: clone it to
../ps-lite (`git clone https://github.com/dmlc/ps-lite ../ps-lite`) and this script builds it
with Debian's ZeroMQ (libzmq3-dev) and protobuf into ../ps-lite/build.

dtrain's side: bench/ps_bench with the same 10M float32 values, one shard (`dtrain ps serve`,
its own process, as ps-lite's server), which also applies the pushed gradient (SGD) — work
ps-lite's benchmark server skips. Rounds alternate the two (A B, B A, ...); the figure is the
median of per-round ratios of pull + push time. Raw records: --records (JSON lines).

  bench/ps/run_pslite.py --rounds 5 [--pslite ../ps-lite] [--build build]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os
import re
import statistics
import subprocess
import time

from ddp.run_ddp_bench import ROOT, run_json
from report import Records

VALUES = 10_000_000


def build_pslite(source):
    build = os.path.join(source, "build")
    binary = os.path.join(build, "tests", "kv_app_benchmark_test")
    if not os.path.exists(binary):
        subprocess.run(["cmake", "-S", source, "-B", build, "-G", "Ninja",
                        "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_CXX_FLAGS=-O2"], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", build, "--target", "kv_app_benchmark_test"],
                       check=True, stdout=subprocess.DEVNULL)
    return binary


def run_pslite(binary, port):
    """Scheduler, one server and one worker, as ps-lite's tests/local.sh starts them."""
    env = dict(os.environ, DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="1",
               DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port))
    procs = [subprocess.Popen([binary], env=dict(env, DMLC_ROLE=role), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for role in ("scheduler", "server", "worker")]
    out = "".join(p.communicate(timeout=300)[0] for p in procs)
    push = re.search(r"Push average time cost: ([\d.]+)ms", out)
    pull = re.search(r"Pull average time cost: ([\d.]+)ms", out)
    if not push or not pull:
        raise SystemExit(f"ps-lite printed no times:\n{out[-2000:]}")
    return {"push_ms": float(push.group(1)), "pull_ms": float(pull.group(1))}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--pslite", default=os.path.join(os.path.dirname(ROOT), "ps-lite"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--records", default=os.path.join(ROOT, "bench",
                                                          "results/ps/pslite.jsonl"))
    args = parser.parse_args()
    if not os.path.exists(os.path.join(args.pslite, "tests", "test_kv_app_benchmark.cc")):
        raise SystemExit(f"no ps-lite in {args.pslite}: git clone "
                         f"https://github.com/dmlc/ps-lite {args.pslite}")
    binary = build_pslite(args.pslite)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    ratios, runs = [], {"dtrain": [], "ps-lite": []}
    with Records(args.records, "a") as records:
        for r in range(args.rounds):
            got = {}
            for side in (["dtrain", "ps-lite"] if r % 2 == 0 else ["ps-lite", "dtrain"]):
                if side == "ps-lite":
                    x = run_pslite(binary, 18000 + r)
                else:
                    out = run_json([os.path.join(args.build, "bench", "ps_bench"), "--params",
                                    str(VALUES), "--shards", "1", "--rounds", "1", "--dtrain",
                                    os.path.join(args.build, "dtrain")])
                    # The first line is round 0's pull + push (it runs before the loopback).
                    x = {"push_ms": VALUES * 4 / out["push_gb_s"] / 1e6,
                         "pull_ms": VALUES * 4 / out["pull_gb_s"] / 1e6}
                x.update(side=side, round=r, values=VALUES, commit=commit,
                         when=time.strftime("%Y-%m-%dT%H:%M:%S"))
                x["pull_push_ms"] = x["push_ms"] + x["pull_ms"]
                records.write(x)
                got[side] = x
                runs[side].append(x)
                print(f"round {r + 1}/{args.rounds} {side:7s} pull {x['pull_ms']:.1f} ms, push "
                      f"{x['push_ms']:.1f} ms", flush=True)
            ratios.append(got["dtrain"]["pull_push_ms"] / got["ps-lite"]["pull_push_ms"])
    med = lambda side, k: statistics.median(x[k] for x in runs[side])  # noqa: E731
    mb = VALUES * 4 / 1e6
    print(f"\n| side | pull (ms) | push (ms) | pull + push (ms) | values MB/s each way |\n"
          f"|---|---|---|---|---|")
    for side in ("dtrain", "ps-lite"):
        print(f"| {side} | {med(side, 'pull_ms'):.1f} | {med(side, 'push_ms'):.1f} | "
              f"{med(side, 'pull_push_ms'):.1f} | {2 * mb / med(side, 'pull_push_ms') * 1e3:.0f} |")
    print(f"\ndtrain / ps-lite, pull + push time: {statistics.median(ratios):.3f} "
          f"(median of {len(ratios)} per-round ratios; target <= 0.9)")


if __name__ == "__main__":
    main()
