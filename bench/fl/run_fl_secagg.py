#!/usr/bin/env python3
"""Secure aggregation's cost: server and client time per round against plaintext aggregation,
100 clients all selected each round, a 101,770-parameter model (MLP 784-128-10 on
Fashion-MNIST), 0% and 30% dropout (a client leaving after the keys were shared, before its
masked input). The figures are the simulation's own clocks around the aggregation work only
(metrics "server_aggregation_s", and "client_aggregation_s" = a client's mean): for plaintext,
the client's encoding into upload messages and the server's reading, checking and averaging;
with secure aggregation, every step of the protocol on each side (keys, Shamir shares and their
encryption, the masks, the reveals, the server's routing, unmasking and averaging). Local
training (E = 1, full batch) is not counted. One training thread, so no client's clock runs
while another trains. Runs alternate plaintext and secure (A B A B) --repeats times, each
--rounds rounds; medians over all rounds and the ratios of the medians.

  bench/fl/run_fl_secagg.py [--repeats 3 --rounds 3 --markdown FILE]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import os
import statistics

from fl_bench import DTRAIN, ROOT, simulate
from report import table, open_log


def run(dtrain, secure, dropout, args, log):
    flags = ["--clients", str(args.clients), "--fraction", "1", "--hidden", "128",
             "--local-epochs", "1", "--local-batch", "0", "--rounds", str(args.rounds),
             "--dropout", str(dropout), "--threads", "1", "--eval-every", str(args.rounds)]
    if secure:
        flags += ["--secure-aggregation", "--secagg-threshold", "0.6"]
    return simulate(dtrain, flags, log)[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtrain", default=DTRAIN)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log", default=os.path.join(ROOT, "bench", "results/fl/secagg.log"))
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args()

    figures = {}
    with open_log(args.log, "w") as log:
        for repeat in range(args.repeats):
            for dropout in (0.0, 0.3):
                for secure in (False, True):
                    rounds = run(args.dtrain, secure, dropout, args, log)
                    key = (dropout, secure)
                    for r in rounds:
                        figures.setdefault(key, []).append(
                            (r["server_aggregation_s"], r["client_aggregation_s"],
                             r["uplink_bytes"] / max(1, r["finished"]), r["finished"]))
                    print(f"repeat {repeat} dropout {dropout} "
                          f"{'secure' if secure else 'plaintext'}: "
                          f"{[(round(s, 5), round(c, 6)) for s, c, _, _ in figures[key][-len(rounds):]]}",
                          flush=True)

    lines = ["| dropout | aggregation | server ms / round | client ms / round | uplink bytes / "
             "client | survivors | server x | client x |", "|---|---|---|---|---|---|---|---|"]
    for dropout in (0.0, 0.3):
        base = None
        for secure in (False, True):
            rows = figures[(dropout, secure)]
            server = statistics.median(r[0] for r in rows)
            client = statistics.median(r[1] for r in rows)
            uplink = statistics.median(r[2] for r in rows)
            survivors = statistics.median(r[3] for r in rows)
            if base is None:
                base = (server, client)
            lines.append(f"| {int(dropout * 100)}% | {'secure' if secure else 'plaintext'} | "
                         f"{1e3 * server:.2f} | {1e3 * client:.3f} | {uplink:,.0f} | {survivors:g} | "
                         f"{server / base[0]:.1f} | {client / base[1]:.1f} |")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
