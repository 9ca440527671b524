#!/usr/bin/env python3
"""SecAgg+ (a sparse random graph of degree about 2 log2 n) against full secure aggregation
(every pair) at n = 100, 500 and 1000 clients a round, with 0% and 30% dropouts (a client
leaving after sharing keys, before its masked input): the server's and a client's time per
round beside each one's floor, the mask expansions that side had to do x the masked input's
bytes / the ChaCha20 keystream rate measured here (libsodium's crypto_stream_chacha20_ietf, the
PRG the protocol uses, on a buffer of the same size, median of --floor-repeats). The times are
the simulation's clocks around the protocol work only ("server_aggregation_s",
"client_aggregation_s"); the counts are the protocol's own ("server_masks", "client_masks").
Model: MLP 784-128-10 (101,770 parameters; inputs of 101,772 words). Thresholds: a majority
with no dropouts; at 30% full takes t = 0.6 n and SecAgg+ t = 0.4 of a neighbourhood
(degree + 1: a lower share, so that a neighbourhood keeps t survivors at this dropout rate).

  bench/fl/run_fl_secaggplus.py [--sizes 100,500,1000] [--graphs full,log] [--markdown FILE]

A/B of two builds (`--ab OTHER_DTRAIN --repeats R`): each case runs R times on each build,
alternated (A B, B A, ...); the records carry "variant" (a or b) and "repeat", and the table
gives each build's median server and client times and the median of the per-repeat ratios b / a.
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import ctypes
import ctypes.util
import json
import os
import statistics
import time

from fl_bench import DTRAIN, ROOT, simulate
from report import table, Records, open_log

PARAMETERS = 101770


def chacha20_rate(words, repeats):
    """Bytes per second of libsodium's ChaCha20 keystream into a buffer of `words` int32."""
    sodium = ctypes.CDLL(ctypes.util.find_library("sodium"))
    assert sodium.sodium_init() >= 0
    size = 4 * words
    out = ctypes.create_string_buffer(size)
    nonce = ctypes.create_string_buffer(12)
    key = ctypes.create_string_buffer(os.urandom(32), 32)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(50):
            sodium.crypto_stream_chacha20_ietf(out, ctypes.c_ulonglong(size), nonce, key)
        rates.append(50 * size / (time.perf_counter() - start))
    return statistics.median(rates)


def run(dtrain, n, dropout, graph, args, log):
    flags = ["--clients", str(n), "--fraction", "1", "--hidden", "128", "--local-epochs", "1",
             "--local-batch", "0", "--rounds", str(args.rounds if n < 1000 else 1),
             "--dropout", str(dropout), "--threads", str(args.threads),
             "--eval-every", "1000", "--secure-aggregation", "--secagg-graph", graph]
    if dropout > 0:
        flags += ["--secagg-threshold", "0.6" if graph == "full" else "0.4"]
    return simulate(dtrain, flags, log)[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=DTRAIN)
    parser.add_argument("--sizes", default="100,500,1000")
    parser.add_argument("--graphs", default="full,log",
                        help="which protocols to run (full, log or both, alternated)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--floor-repeats", type=int, default=7)
    parser.add_argument("--records", default=os.path.join(ROOT, "bench",
                                                          "results/fl/secaggplus.jsonl"))
    parser.add_argument("--log", default=os.path.join(ROOT, "bench", "results/fl/secaggplus.log"))
    parser.add_argument("--markdown", help="also write the table here")
    parser.add_argument("--ab", metavar="OTHER_DTRAIN",
                        help="A/B: --dtrain (a) against this build (b), alternated")
    parser.add_argument("--repeats", type=int, default=3, help="A/B runs of each build per case")
    args = parser.parse_args()
    if args.ab:
        return ab(args)

    words = PARAMETERS + 2
    figures = {}
    with open_log(args.log, "w") as log, Records(args.records, "w") as records:
        for n in [int(s) for s in args.sizes.split(",")]:
            for dropout in (0.0, 0.3):
                for graph in args.graphs.split(","):  # alternated
                    rate = chacha20_rate(words, args.floor_repeats)  # beside each run
                    rounds = run(args.dtrain, n, dropout, graph, args, log)
                    for r in rounds:
                        records.write({"n": n, "dropout": dropout, "graph": graph,
                                                  "chacha20_bytes_per_s": rate, **r})
                        figures.setdefault((n, dropout, graph), []).append((r, rate))
                    print(f"n {n} dropout {dropout} {graph}: "
                          f"{[(round(r['server_aggregation_s'], 3), round(r['client_aggregation_s'], 4)) for r in rounds]}",
                          flush=True)

    lines = ["| n | dropout | graph | survivors | server s | server floor s | server x floor | "
             "client ms | client floor ms | client x floor | server masks | client masks | "
             "full / SecAgg+ (server) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (n, dropout, graph), rows in figures.items():
        med = lambda f: statistics.median(f(r, rate) for r, rate in rows)
        server = med(lambda r, rate: r["server_aggregation_s"])
        client = med(lambda r, rate: r["client_aggregation_s"])
        server_floor = med(lambda r, rate: r["server_masks"] * 4 * words / rate)
        client_floor = med(lambda r, rate: r["client_masks"] * 4 * words / rate)
        full = figures.get((n, dropout, "full"))
        speedup = ""
        if graph == "log" and full:
            speedup = f"{statistics.median(r['server_aggregation_s'] for r, _ in full) / server:.1f}x"
        lines.append(f"| {n} | {int(dropout * 100)}% | {graph} | {med(lambda r, _: r['finished']):g} | "
                     f"{server:.3f} | {server_floor:.3f} | {server / server_floor:.2f} | "
                     f"{1e3 * client:.1f} | {1e3 * client_floor:.1f} | {client / client_floor:.2f} | "
                     f"{med(lambda r, _: r['server_masks']):g} | {med(lambda r, _: r['client_masks']):g} | "
                     f"{speedup} |")
    table(lines, args.markdown)


def ab(args):
    """Each case on both builds, alternated; medians and the median of per-repeat ratios."""
    words = PARAMETERS + 2
    builds = {"a": args.dtrain, "b": args.ab}
    lines = ["| n | dropout | graph | server s a | server s b | server b / a | client ms a | "
             "client ms b | client b / a | server x floor a | server x floor b |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    with open_log(args.log, "w") as log, Records(args.records, "w") as records:
        for n in [int(s) for s in args.sizes.split(",")]:
            for dropout in (0.0, 0.3):
                for graph in args.graphs.split(","):
                    per = {"a": [], "b": []}
                    for repeat in range(args.repeats):
                        for variant in ("ab" if repeat % 2 == 0 else "ba"):
                            rate = chacha20_rate(words, args.floor_repeats)
                            rounds = run(builds[variant], n, dropout, graph, args, log)
                            for r in rounds:
                                records.write({
                                    "n": n, "dropout": dropout, "graph": graph, "variant": variant,
                                    "repeat": repeat, "chacha20_bytes_per_s": rate, **r})
                            med = lambda key: statistics.median(r[key] for r in rounds)
                            per[variant].append((med("server_aggregation_s"),
                                                 med("client_aggregation_s"),
                                                 med("server_masks") * 4 * words / rate))
                    print(f"n {n} dropout {dropout} {graph}: {per}", flush=True)
                    m = lambda v, i: statistics.median(x[i] for x in per[v])
                    ratio = lambda i: statistics.median(
                        b[i] / a[i] for a, b in zip(per["a"], per["b"]))
                    floor = lambda v: statistics.median(x[0] / x[2] for x in per[v])
                    lines.append(f"| {n} | {int(dropout * 100)}% | {graph} | {m('a', 0):.3f} | "
                                 f"{m('b', 0):.3f} | {ratio(0):.3f} | {1e3 * m('a', 1):.1f} | "
                                 f"{1e3 * m('b', 1):.1f} | {ratio(1):.3f} | {floor('a'):.2f} | "
                                 f"{floor('b'):.2f} |")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
