"""The PyTorch side of the GPU checks' step-time comparison (tests/gpu/gpu_check.cpp): dtrain's
GPT twin (bench/tp/tp_reference.py's Gpt: the same blocks, initialization and sizes) trained with
AdamW on one device, a step = forward, cross-entropy, backward, optimizer step, synchronized at
its end as dtrain's side is. Prints one JSON line with the median step time. Runs under the
python3 whose PyTorch dtrain was built against (scripts/gpu-check)."""
import argparse
import os
import sys
import json
import statistics
import time

import torch
import torch.nn.functional as F
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
from tp.tp_reference import Gpt  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    for name, default in (("layers", 12), ("width", 768), ("heads", 12), ("context", 512),
                          ("vocab", 512), ("batch", 16), ("warmup", 5), ("steps", 30)):
        parser.add_argument("--" + name, type=int, default=default)
    args = parser.parse_args()
    torch.manual_seed(1)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as dtrain's side in the checks' CPU mode
    model = Gpt(args.vocab, args.width, args.heads, args.layers, args.context).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    generator = torch.Generator().manual_seed(13)
    tokens = torch.randint(args.vocab, (args.batch * 4, args.context + 1), generator=generator)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(args.warmup + args.steps):
        begin = (i * args.batch) % (tokens.shape[0] - args.batch + 1)
        batch = tokens[begin:begin + args.batch]
        ids = batch[:, :-1].pin_memory().to(device, non_blocking=True) if device.type == "cuda" \
            else batch[:, :-1]
        targets = batch[:, 1:].pin_memory().to(device, non_blocking=True) if device.type == "cuda" \
            else batch[:, 1:]
        synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        with torch.autocast(device.type, dtype=torch.bfloat16,
                            enabled=args.precision == "bf16-mixed"):
            logits = model(ids)
            loss = F.cross_entropy(logits.flatten(0, -2), targets.reshape(-1))
        loss.backward()
        loss.item()
        optimizer.step()
        synchronize()
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({"step_ms": statistics.median(times), "steps": args.steps,
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
