#!/usr/bin/env python3
"""dtrain against Flower (flwr, its Ray simulation engine, the same MLP in PyTorch 2.x): time
per round of FedAvg at 100 and 1,000 clients (C = 0.1: 10 and 100 a round; E = 5, B = 10,
lr 0.05; each client holds its share of Fashion-MNIST, all of it for training), and time per
round of secure aggregation with SecAgg+ (Flower's SecAggPlusWorkflow + secaggplus_mod; dtrain's
--secagg-graph; the same number of shares per client, k + 1, and threshold: a majority, or with
--secure-dropout D 0.4 of the shares as in bench/fl/run_fl_secaggplus.py) at n clients all selected,
E = 1 full batch. With --secure-dropout D a fraction D of the clients (drawn per round from a
hash of client and round) leave after sharing keys, before sending their masked input: in
dtrain --dropout D, in Flower a client mod around secaggplus_mod that raises at that stage (the
workflow counts an error reply as a dropout). Secure cases also give each side's protocol time
alone: Flower's server time is its SecAggPlusWorkflow's round less the time it waits in
grid.send_and_receive, a client's the time inside secaggplus_mod less its local training;
dtrain's are the simulation's server_aggregation_s and client_aggregation_s. Both on the same
cores with the same
threads: dtrain --threads 2 (one LibTorch thread each), Flower two Ray workers of one CPU each
(torch.set_num_threads(1)). Runs alternate dtrain and Flower --repeats times; per run the median
round time (Flower: the time between consecutive aggregations, its first round dropped with
Ray's start-up; dtrain: round_s, evaluation off in both); the table gives medians of the
per-repeat ratios. Raw per-round records: bench/results/fl/flower-peer.jsonl.

Needs the Flower environment (git-ignored): /usr/bin/python3 -m venv .venv-flower &&
.venv-flower/bin/pip install "flwr[simulation]" torch==2.12.0 numpy

  .venv-flower/bin/python bench/fl/run_flower_peer.py [--repeats 2] [--markdown FILE]
"""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import gzip
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from report import Records, open_log

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = "/usr/share/datasets/fashion-mnist"


def load_fashion():
    import numpy as np
    with gzip.open(os.path.join(DATA, "train-images-idx3-ubyte.gz")) as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 784).astype(np.float32) / 255
    with gzip.open(os.path.join(DATA, "train-labels-idx1-ubyte.gz")) as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64)
    return x, y


def flower_run(args):
    """One Flower simulation (in its own process); writes per-round times to args.out."""
    import numpy as np
    import torch
    from flwr.app import ConfigRecord, Context
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import ndarrays_to_parameters
    from flwr.server import Grid, LegacyContext, ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.simulation import run_simulation

    torch.set_num_threads(1)
    x, y = load_fashion()
    n = args.clients
    per = len(x) // n
    order = np.random.default_rng(0).permutation(len(x))

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(784, args.hidden[0]), torch.nn.ReLU(),
                                   *[m for a, b in zip(args.hidden, args.hidden[1:])
                                     for m in (torch.nn.Linear(a, b), torch.nn.ReLU())],
                                   torch.nn.Linear(args.hidden[-1], 10))

    class Trainer(NumPyClient):
        def __init__(self, cid):
            self.idx = order[cid * per:(cid + 1) * per]
            self.net = model()

        def get_parameters(self, config):
            return [p.detach().numpy() for p in self.net.state_dict().values()]

        def fit(self, parameters, config):
            torch.set_num_threads(1)
            state = dict(zip(self.net.state_dict().keys(),
                             [torch.from_numpy(np.copy(p)) for p in parameters]))
            self.net.load_state_dict(state)
            xs, ys = torch.from_numpy(x[self.idx]), torch.from_numpy(y[self.idx])
            opt = torch.optim.SGD(self.net.parameters(), lr=args.lr)
            batch = args.batch if args.batch > 0 else len(self.idx)
            for _ in range(args.epochs):
                perm = torch.randperm(len(self.idx))
                for b in range(0, len(self.idx), batch):
                    i = perm[b:b + batch]
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(self.net(xs[i]), ys[i]).backward()
                    opt.step()
            return self.get_parameters({}), len(self.idx), {}

    def client_fn(context: Context):
        return Trainer(int(context.node_config["partition-id"])).to_client()

    marks = []

    class Timed(FedAvg):
        def aggregate_fit(self, server_round, results, failures):
            out = super().aggregate_fit(server_round, results, failures)
            marks.append(time.perf_counter())
            return out

    initial = ndarrays_to_parameters([p.detach().numpy() for p in model().state_dict().values()])
    strategy = Timed(fraction_fit=args.fraction, fraction_evaluate=0.0,
                     min_fit_clients=max(2, int(round(args.fraction * n))),
                     min_available_clients=n, initial_parameters=initial)
    server_s, workflow_s, aggregated = [], [], []
    client_log = args.out + ".clients"
    if args.secure:
        import random

        from flwr.common.secure_aggregation.secaggplus_constants import (RECORD_KEY_CONFIGS,
                                                                         Key, Stage)

        def measured_secaggplus(msg, ctxt, call_next):
            """secaggplus_mod, timed without the local training; a dropout raises after
            sharing keys."""
            configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
            stage = configs.get(Key.STAGE) if configs is not None else None
            counter = ctxt.state.config_records.setdefault("bench", ConfigRecord({"round": 0}))
            if stage == Stage.SETUP:
                counter["round"] = int(counter["round"]) + 1
            pid = int(ctxt.node_config["partition-id"])
            if stage == Stage.COLLECT_MASKED_VECTORS and args.dropout > 0 and \
                    random.Random(f"{pid}-{counter['round']}").random() < args.dropout:
                raise RuntimeError("a dropout (bench)")
            inner = [0.0]

            def timed_next(m, c):
                t = time.perf_counter()
                reply = call_next(m, c)
                inner[0] += time.perf_counter() - t
                return reply

            start = time.perf_counter()
            reply = secaggplus_mod(msg, ctxt, timed_next)
            if stage is not None:
                spent = time.perf_counter() - start - inner[0]
                with open(client_log, "a") as f:
                    f.write(json.dumps({"pid": pid, "round": int(counter["round"]),
                                        "stage": stage, "s": spent}) + "\n")
            return reply

        class TimedGrid:
            """The grid, counting the time the workflow waits for its clients."""

            def __init__(self, grid):
                self.grid, self.waited = grid, 0.0

            def __getattr__(self, name):
                return getattr(self.grid, name)

            def send_and_receive(self, *a, **k):
                t = time.perf_counter()
                try:
                    return self.grid.send_and_receive(*a, **k)
                finally:
                    self.waited += time.perf_counter() - t

        class TimedWorkflow(SecAggPlusWorkflow):
            """A round's time, its server's share, and whether it aggregated: a round whose
            unmasking fails ("Not enough shares to recover secret": some neighbourhood kept
            fewer survivors than the threshold) ends without an aggregate and is not a round's
            time (its interval between aggregations would also span the next round)."""

            def __call__(self, grid, context):
                timed = TimedGrid(grid)
                before = len(marks)
                start = time.perf_counter()
                super().__call__(timed, context)
                spent = time.perf_counter() - start
                workflow_s.append(spent)
                server_s.append(spent - timed.waited)
                aggregated.append(len(marks) > before)

        client_app = ClientApp(client_fn=client_fn, mods=[measured_secaggplus])
        app = ServerApp()

        @app.main()
        def main(grid: Grid, context: Context) -> None:
            legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=args.rounds),
                                   strategy=strategy)
            workflow = DefaultWorkflow(fit_workflow=TimedWorkflow(
                num_shares=args.shares, reconstruction_threshold=args.threshold,
                max_weight=float(len(x))))
            workflow(grid, legacy)
    else:
        client_app = ClientApp(client_fn=client_fn)
        app = ServerApp(server_fn=lambda context: ServerAppComponents(
            strategy=strategy, config=ServerConfig(num_rounds=args.rounds)))
    start = time.perf_counter()
    run_simulation(server_app=app, client_app=client_app, num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": args.threads}})
    rounds = [b - a for a, b in zip(marks, marks[1:])]
    failed, server_kept = [], server_s[1:]
    if args.secure:
        # Rounds 2.. that aggregated (round = index + 1); the first dropped (start-up).
        kept = [i for i in range(1, len(workflow_s)) if aggregated[i]]
        failed = [i + 1 for i in range(len(workflow_s)) if not aggregated[i]]
        rounds = [workflow_s[i] for i in kept]
        server_kept = [server_s[i] for i in kept]
    # A sending client's protocol time a round (its stages summed), the mean over clients; the
    # first round dropped as for the round times.
    per_client, sent = {}, set()
    if os.path.exists(client_log):
        for line in open(client_log):
            r = json.loads(line)
            key = (r["round"], r["pid"])
            per_client[key] = per_client.get(key, 0) + r["s"]
            if r["stage"] == "collect_masked_vectors":
                sent.add(key)
    client_s = []
    for rnd in sorted({k[0] for k in sent})[1:]:
        if rnd in failed:
            continue
        values = [v for k, v in per_client.items() if k[0] == rnd and k in sent]
        client_s.append(sum(values) / len(values))
    with open(args.out, "w") as f:
        json.dump({"round_s": rounds, "server_s": server_kept, "client_s": client_s,
                   "failed_rounds": failed, "total_s": time.perf_counter() - start}, f)


def secure_threshold(shares, dropout, fraction=0.4):
    """A majority of the shares; with dropouts `fraction` of them, rounded up (as dtrain's
    --secagg-threshold)."""
    return max(2, math.ceil(fraction * shares)) if dropout > 0 else shares // 2 + 1


def dtrain_run(args, clients, fraction, secure, shares, log):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        command = [args.dtrain, "fl", "simulate", "--no-progress", "--metrics-file", metrics,
                   "--clients", str(clients), "--fraction", str(fraction), "--partition", "iid",
                   "--local-test-fraction", "0", "--hidden", *map(str, args.hidden),
                   "--lr", str(args.lr), "--rounds", str(args.rounds), "--threads",
                   str(args.threads), "--eval-every", "100000"]
        if secure:
            command += ["--local-epochs", "1", "--local-batch", "0", "--secure-aggregation",
                        "--secagg-graph", str(shares - 1)]
            if args.secure_dropout > 0:
                command += ["--dropout", str(args.secure_dropout), "--secagg-threshold",
                            str(args.secure_threshold)]
        else:
            command += ["--local-epochs", str(args.epochs), "--local-batch", str(args.batch)]
        out = subprocess.run(command, capture_output=True, text=True)
        log.write(" ".join(command) + "\n" + out.stdout + out.stderr)
        if out.returncode != 0:
            raise SystemExit(f"dtrain failed: {out.stderr}")
        rows = [json.loads(line) for line in open(metrics) if '"round"' in line]
    # Applied rounds only: a SecAgg+ round that some neighbourhood could not unmask (too few
    # survivors at 30% dropouts) is aborted early and retried, and its short time is no round.
    aborted = sum(1 for r in rows if r.get("event") == "round" and not r.get("applied", True))
    rows = [r for r in rows if r.get("event") == "round" and r.get("applied", True)]
    return {"aborted_rounds": aborted, "round_s": [r["round_s"] for r in rows],
            "server_s": [r.get("server_aggregation_s", 0.0) for r in rows],
            "client_s": [r.get("client_aggregation_s", 0.0) for r in rows]}


def flower(args, clients, fraction, secure, shares, log):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "flower.json")
        command = [sys.executable, os.path.abspath(__file__), "--flower-run", "--out", out,
                   "--clients", str(clients), "--fraction", str(fraction), "--rounds",
                   str(args.rounds + 1), "--threads", str(args.threads), "--lr", str(args.lr),
                   "--hidden", *map(str, args.hidden)]
        if secure:
            command += ["--secure", "--shares", str(shares), "--dropout",
                        str(args.secure_dropout), "--threshold",
                        str(secure_threshold(shares, args.secure_dropout, args.secure_threshold)),
                        "--epochs", "1",
                        "--batch", "0"]
        else:
            command += ["--epochs", str(args.epochs), "--batch", str(args.batch)]
        env = dict(os.environ, RAY_DEDUP_LOGS="0")
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        log.write(" ".join(command) + "\n" + done.stdout[-4000:] + done.stderr[-4000:])
        if done.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"flower failed:\n{done.stderr[-3000:]}")
        return json.load(open(out))


def default_degree(n):
    import math
    k = 2 * math.ceil(math.log2(max(2, n)))
    k += k % 2
    return min(k, (n - 2) - (n - 2) % 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flower-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dropout", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--secure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shares", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--threshold", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--clients", type=int, default=100, help=argparse.SUPPRESS)
    parser.add_argument("--fraction", type=float, default=0.1, help=argparse.SUPPRESS)
    parser.add_argument("--dtrain", default=os.path.join(ROOT, "build", "dtrain"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, nargs="+", default=[200, 200])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--secure-sizes", default="100")
    parser.add_argument("--secure-dropout", type=float, default=0.0)
    parser.add_argument("--secure-threshold", type=float, default=0.4,
                        help="with --secure-dropout: the threshold as a fraction of the k + 1 "
                        "shares in both systems (a round aborts when some neighbourhood keeps "
                        "fewer survivors)")
    parser.add_argument("--skip-fedavg", action="store_true", help="only the secure cases")
    parser.add_argument("--records", default=os.path.join(ROOT, "bench",
                                                          "results/fl/flower-peer.jsonl"))
    parser.add_argument("--log", default=os.path.join(ROOT, "bench", "results/fl/flower-peer.log"))
    parser.add_argument("--markdown")
    args = parser.parse_args()
    if args.flower_run:
        flower_run(args)
        return

    cases = [] if args.skip_fedavg else [("fedavg", 100, 0.1, False, 0),
                                         ("fedavg", 1000, 0.1, False, 0)]
    for n in [int(s) for s in args.secure_sizes.split(",") if s]:
        cases.append(("secagg+", n, 1.0, True, default_degree(n) + 1))
    ratios = {}
    with open_log(args.log, "w") as log, Records(args.records, "w") as records:
        for repeat in range(args.repeats):
            for name, n, fraction, secure, shares in cases:
                times = {}
                for system in ("dtrain", "flower"):  # alternated
                    run = dtrain_run if system == "dtrain" else flower
                    got = run(args, n, fraction, secure, shares, log)
                    times[system] = {k: statistics.median(v) if v else float("nan")
                                     for k, v in got.items()
                                     if k in ("round_s", "server_s", "client_s")}
                    records.write({"case": name, "clients": n, "system": system,
                                              "dropout": args.secure_dropout if secure else 0,
                                              "repeat": repeat, **got})
                    records.flush()
                d, f = times["dtrain"], times["flower"]
                ratios.setdefault((name, n), []).append(
                    (d["round_s"], f["round_s"], f["round_s"] / d["round_s"],
                     d.get("server_s"), f.get("server_s"), d.get("client_s"), f.get("client_s")))
                print(f"repeat {repeat} {name} n={n}: dtrain {d['round_s']:.3f} s, "
                      f"flower {f['round_s']:.3f} s a round" +
                      (f"; server {d['server_s']:.3f} / {f['server_s']:.3f} s, client "
                       f"{d['client_s'] * 1e3:.1f} / {f['client_s'] * 1e3:.1f} ms"
                       if secure else ""), flush=True)
    lines = ["| case | clients | dropout | dtrain s / round | Flower s / round | Flower / dtrain "
             "(median of per-repeat ratios) | server s dtrain / Flower | client ms dtrain / "
             "Flower |", "|---|---|---|---|---|---|---|---|"]
    for (name, n), rows in ratios.items():
        secure = name != "fedavg"
        med = lambda i: statistics.median(r[i] for r in rows)  # noqa: E731
        sides = (f"{med(3):.3f} / {med(4):.3f} | {med(5) * 1e3:.1f} / {med(6) * 1e3:.1f}"
                 if secure else " | ")
        lines.append(f"| {name} | {n} | {args.secure_dropout if secure else 0:.0%} | "
                     f"{med(0):.3f} | {med(1):.3f} | {med(2):.2f}x | {sides} |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        open(args.markdown, "w").write(text + "\n")


if __name__ == "__main__":
    main()
