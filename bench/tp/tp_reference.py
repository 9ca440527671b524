"""One rank of the PyTorch 2.x peer of bench/tp/tp_bench.cpp: the same GPT blocks (token + position
embeddings, pre-LayerNorm blocks with attention written out as dtrain's is (packed qkv per head,
causal mask, softmax) and a 4x GELU MLP, a final LayerNorm and an output layer without bias),
sizes, batch and Adam, split over the T ranks of the world by DTensor's parallelize_module
with Megatron's layout: qkv and fc1 ColwiseParallel, proj and fc2 RowwiseParallel, the token
embedding RowwiseParallel (vocabulary-parallel), the output layer ColwiseParallel with its
logits left sharded for loss_parallel's vocabulary-parallel cross-entropy. Start it with
`dtrain launch` of the pip build; rank 0 prints one JSON line (step time: the slowest rank's).
Runs under .venv-torch/bin/python."""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from reference_models import leave, timed_steps
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)


class Block(nn.Module):
    def __init__(self, width, heads, layers):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        for linear in (self.qkv, self.fc1):
            nn.init.normal_(linear.weight, std=0.02)
        for linear in (self.proj, self.fc2):
            nn.init.normal_(linear.weight, std=0.02 / math.sqrt(2.0 * layers))

    def attention(self, x):
        packed = self.qkv(x)  # [b, t, local heads x 3 x d]: ColwiseParallel keeps whole heads
        b, t = packed.shape[0], packed.shape[1]
        d = self.proj.in_features // self.heads
        local_heads = packed.shape[-1] // (3 * d)
        q, k, v = (packed.view(b, t, local_heads, 3, d).select(3, i).transpose(1, 2)
                   for i in range(3))
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(d))
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, local_heads * d))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, width, heads, layers, context):
        super().__init__()
        self.token, self.position = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, layers) for _ in range(layers))
        self.ln, self.out = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = self.token(ids) + self.position(positions).unsqueeze(0)
        for block in self.blocks:
            h = block(h)
        return self.out(self.ln(h))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("DTRAIN_THREADS", "1")))
    dist.init_process_group("gloo")
    T = dist.get_world_size()
    mesh = init_device_mesh("cpu", (T,))
    torch.manual_seed(0)
    model = Gpt(args.vocab, args.width, args.heads, args.layers, args.context)
    plan = {"token": RowwiseParallel(input_layouts=Replicate()),
            "out": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(args.layers):
        plan.update({f"blocks.{i}.qkv": ColwiseParallel(), f"blocks.{i}.proj": RowwiseParallel(),
                     f"blocks.{i}.fc1": ColwiseParallel(), f"blocks.{i}.fc2": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(args.vocab, (args.batch, args.context), generator=generator)
    targets = torch.randint(args.vocab, (args.batch, args.context), generator=generator)
    def step():
        optimizer.zero_grad()
        logits = model(ids)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        optimizer.step()

    step_ms, rss = timed_steps(step, args.warmup, args.steps)
    if dist.get_rank() == 0:
        print(json.dumps({"mode": "pytorch", "T": T, "step_ms": round(step_ms, 1),
                          "tokens_per_s": round(args.batch * args.context / step_ms * 1e3, 1),
                          "step_peak_rss_mb": round(rss, 1)}))
    leave()


if __name__ == "__main__":
    main()
