"""One torchft DiLoCo island of one rank (the peer of bench/ft/run_replica_failure.py --job
diloco): the MLP 784-1792-1792-10, Adam (lr 1e-3) inside the island, an outer Nesterov SGD (lr
0.7, momentum 0.9) every --sync-every steps over the islands present, torchft's Manager
(synchronous quorum, as its DiLoCo requires) and torchft.local_sgd.DiLoCo over its Gloo process
group, as torchft's train_diloco.py; synthetic Fashion-MNIST-shaped batches (what a failure
costs does not depend on the data). It hosts its group's store, writes one JSON line per inner
step (the step, the wall-clock time, the replicas of the last quorum, whether the step was an
outer one) and, as --kill-replica at --kill-at, SIGKILLs itself right after that step.

  torchft_diloco.py --replica R --store-port P --lighthouse http://127.0.0.1:29510 \\
      --steps 100 --sync-every 10 --kill-replica 2 --kill-at 55 --log FILE
"""
import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo
from torchft.local_sgd import DiLoCo


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--kill-replica", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 1792), torch.nn.ReLU(),
                                torch.nn.Linear(1792, 1792), torch.nn.ReLU(),
                                torch.nn.Linear(1792, 10))
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    store = TCPStore("127.0.0.1", args.store_port, is_master=True, wait_for_workers=False)

    def state_dict():
        return {"model": model.state_dict(), "inner": inner.state_dict(),
                "outer": outer.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        outer.load_state_dict(state["outer"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"replica_{args.replica}", store_addr="127.0.0.1",
                      store_port=args.store_port, rank=0, world_size=1,
                      lighthouse_addr=args.lighthouse, timeout=timedelta(seconds=10),
                      use_async_quorum=False)
    generator = torch.Generator().manual_seed(args.replica)
    with open(args.log, "a") as log, \
            DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every,
                   pin_memory=False):
        for step in range(1, args.steps + 1):
            inputs = torch.randn(32, 1, 28, 28, generator=generator)
            targets = torch.randint(0, 10, (32,), generator=generator)
            inner.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            inner.step()  # DiLoCo's hook makes the outer step every --sync-every steps
            log.write(json.dumps({"step": step, "time": time.time(),
                                  "replicas": manager.num_participants(),
                                  "outer_step": int(step % args.sync_every == 0),
                                  "outer_steps": manager.current_step()}) + "\n")
            log.flush()
            if args.replica == args.kill_replica and step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    del store


if __name__ == "__main__":
    main()
