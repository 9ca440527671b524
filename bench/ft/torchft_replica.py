"""One torchft replica group of one rank (the peer of bench/ft/run_replica_failure.py): the MLP
784-1792-1792-10 with Adam, 32 images a step, on synthetic Fashion-MNIST-shaped batches (what a
failure costs does not depend on the data), torchft's Manager, DistributedDataParallel and
Optimizer over its Gloo process group, as torchft's train_ddp.py. It hosts its group's store,
writes one JSON line per step (the step the Manager is at, the wall-clock time, the replicas
that took part, whether it committed) and, as --kill-replica at --kill-at, SIGKILLs itself right
after committing that step. A replica started again (bench/ft/run_repeated_failures.py kills
and restarts replicas) appends to its log and heals from the others (torchft's live recovery).

  torchft_replica.py --replica R --store-port P --lighthouse http://127.0.0.1:29510 \\
      --steps 100 --kill-replica 2 --kill-at 50 --log FILE
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
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--kill-replica", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--log", required=True)
    # "ddp": torchft's DistributedDataParallel (its comm hook asserts when a peer dies in the
    # middle of the gradients' allreduce, torchft 0.2); "manual": Manager.allreduce of every
    # gradient after backward (errors tracked by the Manager, the step not committed).
    parser.add_argument("--grad-sync", choices=("ddp", "manual"), default="ddp")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 1792), torch.nn.ReLU(),
                                torch.nn.Linear(1792, 1792), torch.nn.ReLU(),
                                torch.nn.Linear(1792, 10))
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    store = TCPStore("127.0.0.1", args.store_port, is_master=True, wait_for_workers=False)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"replica_{args.replica}", store_addr="127.0.0.1",
                      store_port=args.store_port, rank=0, world_size=1,
                      lighthouse_addr=args.lighthouse, timeout=timedelta(seconds=10))
    ddp = DistributedDataParallel(manager, model) if args.grad_sync == "ddp" else model
    optimizer = Optimizer(manager, inner)
    generator = torch.Generator().manual_seed(args.replica)
    with open(args.log, "a") as log:
        while manager.current_step() < args.steps:
            inputs = torch.randn(32, 1, 28, 28, generator=generator)
            targets = torch.randint(0, 10, (32,), generator=generator)
            optimizer.zero_grad()
            F.cross_entropy(ddp(inputs), targets).backward()
            if args.grad_sync == "manual":
                for work in [manager.allreduce(p.grad) for p in model.parameters()]:
                    work.wait()
            before = manager.current_step()
            optimizer.step()
            committed = manager.current_step() > before
            log.write(json.dumps({"step": manager.current_step(), "time": time.time(),
                                  "replicas": manager.num_participants(),
                                  "committed": committed}) + "\n")
            log.flush()
            if (args.replica == args.kill_replica and committed
                    and manager.current_step() == args.kill_at):
                os.kill(os.getpid(), signal.SIGKILL)
    del store


if __name__ == "__main__":
    main()
