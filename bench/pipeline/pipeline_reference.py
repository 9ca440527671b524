"""One rank of the PyTorch 2.x peer of bench/pipeline/pipeline_bench.cpp: the same model (`--layers`
equal Linear(width, width) + ReLU layers, cross-entropy over `width` classes), global batch,
micro-batches and plain SGD, trained with torch.distributed.pipelining (PipelineStage +
ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B with V chunks per rank; the zero-bubble
ScheduleInterleavedZeroBubble, "zb-interleaved", V = 2 chunks placed looping, and
ScheduleZBVZeroBubble, "zb-v", 2 chunks per rank in a V) over gloo on CPU. Start it with `dtrain launch` of the pip build (torchrun's variables; 2.x's store);
rank 0 prints one JSON line (step time: the slowest rank's). Runs under .venv-torch/bin/python."""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from reference_models import leave, timed_steps
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--schedule", default="1f1b",
                        choices=["gpipe", "1f1b", "interleaved", "zb-interleaved", "zb-v"])
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--virtual-stages", type=int, default=1)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-input-grad", action="store_true", help="(dtrain's flag; implied)")
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("DTRAIN_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    V = (args.virtual_stages if args.schedule == "interleaved" else
         2 if args.schedule in ("zb-interleaved", "zb-v") else 1)
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU())
              for _ in range(args.layers)]
    chunks = P * V
    per_chunk = args.layers // chunks
    # Stage s holds layers [s * per_chunk, (s + 1) * per_chunk); rank r holds stages r, r + P, ...
    # (zb-v: r and 2P - 1 - r)
    stage_ids = ([rank, 2 * P - 1 - rank] if args.schedule == "zb-v" else
                 [rank + P * v for v in range(V)])
    stages = [PipelineStage(nn.Sequential(*layers[s * per_chunk:(s + 1) * per_chunk]), s, chunks,
                            torch.device("cpu")) for s in stage_ids]
    M = args.micro_batches

    def loss_fn(output, target):  # the micro-batch's share of the global batch's mean loss
        return F.cross_entropy(output, target) / M

    if V > 1:
        kind = {"interleaved": ScheduleInterleaved1F1B,
                "zb-interleaved": ScheduleInterleavedZeroBubble,
                "zb-v": ScheduleZBVZeroBubble}[args.schedule]
        schedule = kind(stages, n_microbatches=M, loss_fn=loss_fn)
    else:
        kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
        schedule = kind(stages[0], n_microbatches=M, loss_fn=loss_fn)
    parameters = [p for s in stages for p in s.submod.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=1e-4)
    inputs = torch.randn(args.global_batch, args.width)
    targets = torch.randint(args.width, (args.global_batch,))
    last_stage_here = any(s == chunks - 1 for s in stage_ids)
    def step():
        optimizer.zero_grad()
        kwargs = {"target": targets} if last_stage_here else {}
        if 0 in stage_ids:
            schedule.step(inputs, **kwargs)
        else:
            schedule.step(**kwargs)
        optimizer.step()

    step_ms, rss = timed_steps(step, args.warmup, args.steps)
    if rank == 0:
        print(json.dumps({"mode": "pytorch", "schedule": args.schedule, "P": P, "M": M, "V": V,
                          "step_ms": round(step_ms, 3),
                          "samples_per_s": round(args.global_batch / step_ms * 1e3, 1),
                          "step_peak_rss_mb": round(rss, 1)}))
    leave()


if __name__ == "__main__":
    main()
