"""One rank of the PyTorch reference for the DDP benchmark: the same models, batch, optimizer
and thread count as bench/ddp/ddp_bench.cpp, trained with torch.nn.parallel.DistributedDataParallel
over gloo. Start it with `dtrain launch` (torchrun's variables); rank 0 prints one JSON line.
Runs under Debian's /usr/bin/python3 (PyTorch 1.13) or .venv-torch/bin/python (the pinned 2.x,
which also has --strategy fsdp2: FSDP2's fully_shard on every Linear layer and the root, the
peer of dtrain's zero3)."""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from reference_models import Cnn, Mlp, leave, peak_rss_mb, reset_peak, status_mb


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="cnn", choices=["mlp", "cnn", "resnet18", "resnet50"])
    parser.add_argument("--image-size", type=int, default=28,
                        help="square images (1 channel; 3 for torchvision's ResNets)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--bucket-cap-mb", type=float, default=25)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "zero1", "fsdp2"],
                        help="zero1: torch.distributed.optim.ZeroRedundancyOptimizer; "
                             "fsdp2: torch.distributed.fsdp.fully_shard (PyTorch 2.x)")
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    parser.add_argument("--no-comm-baseline", action="store_true", help="(dtrain's flag; ignored)")
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("DTRAIN_THREADS", "1")))
    dist.init_process_group("gloo")  # env:// from the launcher
    world = dist.get_world_size()
    torch.manual_seed(0)
    if args.model.startswith("resnet"):
        import torchvision
        model = getattr(torchvision.models, args.model)(num_classes=10)
    else:
        model = Mlp(args.hidden) if args.model == "mlp" else Cnn()
    channels = 3 if args.model.startswith("resnet") else 1
    if args.strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.modules():
            if isinstance(layer, (nn.Linear, nn.Conv2d)):
                fully_shard(layer, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    else:
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    if args.optimizer == "adam":
        kind, settings = torch.optim.Adam, {"lr": 1e-4}
    else:
        kind, settings = torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}
    if args.strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=kind, **settings)
    else:
        optimizer = kind(ddp.parameters(), **settings)
    size = args.image_size
    batches = [(torch.randn(args.batch, channels, size, size), torch.randint(0, 10, (args.batch,)))
               for _ in range(4)]
    step_ms = []
    peak_reset = False
    for i in range(args.warmup + args.steps):
        if i == args.warmup:  # state allocated: measure the steps' own peak from here
            peak_reset = reset_peak()
        dist.barrier()
        start = time.perf_counter()
        inputs, targets = batches[i % len(batches)]
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(inputs), targets)
        loss.backward()
        optimizer.step()
        loss.item()
        elapsed = (time.perf_counter() - start) * 1e3
        if i >= args.warmup:
            step_ms.append(elapsed)
    peak = torch.tensor([peak_rss_mb()], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # MB, the largest rank
    step_peak = torch.tensor([status_mb("VmHWM:") if peak_reset else -1.0], dtype=torch.float64)
    dist.all_reduce(step_peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        step = statistics.median(step_ms)
        print(json.dumps({"impl": "pytorch", "model": args.model, "world": world,
                          "batch": args.batch, "threads": torch.get_num_threads(),
                          "strategy": args.strategy, "step_ms": round(step, 3),
                          "samples_per_s": round(args.batch * world * 1000.0 / step, 1),
                          "peak_rss_mb": round(peak.item(), 1),
                          "step_peak_rss_mb": round(step_peak.item(), 1)}))
    leave()


if __name__ == "__main__":
    main()
