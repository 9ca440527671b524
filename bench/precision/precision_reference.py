"""PyTorch twin of bench/precision/precision_bench.cpp: the same models, batch, optimizer and threads, with
torch.autocast("cpu", torch.bfloat16) for bf16-mixed and torch.utils.checkpoint.checkpoint_sequential
for --segments. One configuration per process; prints one JSON line. Run with /usr/bin/python3."""
import os  # noqa: E402
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/'s helpers
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint_sequential

from reference_models import Cnn, Mlp, peak_rss_mb, reset_peak, rss_mb, status_mb


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads), -1)
        h = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return h + self.down(F.gelu(self.up(self.ln2(h))))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--segments", type=int, default=-1)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    classify = True
    if args.model in ("mlp", "cnn"):
        module = Mlp((1024, 1024)) if args.model == "mlp" else Cnn()
        forward = module
        inputs = torch.randn(args.batch, 1, 28, 28)
        targets = torch.randint(0, 10, (args.batch,))
    elif args.model == "transformer":
        module = Block(256, 8)
        forward = module
        inputs = torch.randn(args.batch, 128, 256)
        classify = False
    else:  # deep-mlp
        module = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(32)])
        segments = args.segments
        forward = (lambda x: module(x)) if segments < 0 else \
            (lambda x: checkpoint_sequential(module, segments, x))
        inputs = torch.randn(args.batch, 512).requires_grad_()
        classify = False
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    baseline = rss_mb()
    state_rss, peak_reset = 0.0, False
    times = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:  # after warm-up: parameters, gradients, optimizer state allocated
            state_rss = rss_mb()
            peak_reset = reset_peak()
        start = time.perf_counter()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed"):
            out = forward(inputs)
            loss = F.cross_entropy(out, targets) if classify else out.float().pow(2).mean()
        loss.backward()
        optimizer.step()
        loss.item()
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    peak = peak_rss_mb()
    print(json.dumps({"impl": "pytorch", "model": args.model, "precision": args.precision,
                      "segments": args.segments, "batch": args.batch,
                      "step_ms": round(times[len(times) // 2], 3), "peak_rss_mb": round(peak, 1),
                      "baseline_rss_mb": round(baseline, 1),
                      "activation_mb": round(status_mb("VmHWM:") - state_rss, 1)
                      if peak_reset else -1}))


if __name__ == "__main__":
    main()
