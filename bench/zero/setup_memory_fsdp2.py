"""PyTorch FSDP2's side of bench/zero/run_setup_memory.py (one rank; start with
`python -m torch.distributed.run`): the same Llama (llama-1b's shape unless told: RMSNorm,
grouped-query attention, SwiGLU, untied head) built on the meta device, each block and then the
root sharded with fully_shard over gloo, materialized with to_empty and initialised on each
rank's shards (torchtitan's init_weights), as FSDP2's documentation recommends. Writes this
rank's peak resident memory during build and setup (from its resident memory just before), what
it keeps afterwards, the peak of one Adam step after it (from the same point) and its shard's
size, as one JSON line to --out.RANK, as setup_memory_bench.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def status_mb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return float(line.split()[1]) / 1024
    return 0.0


def rotary(x, theta=10000.0):
    """Hugging Face Llama's rotary embeddings on [b, heads, t, d] (each head's halves)."""
    t, d = x.shape[2], x.shape[3]
    inverse = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(t, dtype=torch.float64), inverse).repeat(1, 2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    turned = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + turned * sin


class Block(nn.Module):
    def __init__(self, width, heads, kv_heads, ffn):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        head = width // heads
        self.ln1 = nn.RMSNorm(width)
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, kv_heads * head, bias=False)
        self.v = nn.Linear(width, kv_heads * head, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.ln2 = nn.RMSNorm(width)
        self.gate = nn.Linear(width, ffn, bias=False)
        self.up = nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def forward(self, x):
        b, t, w = x.shape
        d = w // self.heads
        y = self.ln1(x)
        q = rotary(self.q(y).view(b, t, self.heads, d).transpose(1, 2))
        k = rotary(self.k(y).view(b, t, self.kv_heads, d).transpose(1, 2))
        v = self.v(y).view(b, t, self.kv_heads, d).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        a = nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, w))
        y = self.ln2(x)
        return x + self.down(nn.functional.silu(self.gate(y)) * self.up(y))


class Llama(nn.Module):
    def __init__(self, vocab, width, layers, heads, kv_heads, ffn):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, kv_heads, ffn) for _ in range(layers))
        self.ln = nn.RMSNorm(width)
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        h = self.embedding(ids)
        for block in self.blocks:
            h = block(h)
        return self.out(self.ln(h))

    def init_weights(self):
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("ln1.weight") or name.endswith("ln2.weight") or name == "ln.weight":
                    p.fill_(1.0)
                else:
                    nn.init.normal_(p, 0.0, 0.02)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn-width", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--step-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_mb("VmRSS:")
    started = time.perf_counter()
    torch.manual_seed(1)
    with torch.device("meta"):
        model = Llama(args.vocab, args.width, args.layers, args.heads, args.kv_heads,
                      args.ffn_width)
    largest = max(p.numel() for p in model.parameters())
    parameters = sum(p.numel() for p in model.parameters())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    seconds = time.perf_counter() - started
    peak = status_mb("VmHWM:") - before
    kept = status_mb("VmRSS:") - before
    step_peak = 0.0
    losses, step_seconds = [], []
    if args.step_tokens > 0:  # Adam steps, their peak from the same starting point
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        generator = torch.Generator().manual_seed(rank + 1)
        for _ in range(args.steps):
            ids = torch.randint(args.vocab, (1, args.step_tokens + 1), generator=generator)
            begun = time.perf_counter()
            logits = model(ids[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab),
                                               ids[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            step_seconds.append(round(time.perf_counter() - begun, 3))
        step_peak = status_mb("VmHWM:") - before
    shard = sum(p.to_local().numel() for p in model.parameters())
    line = {"rank": rank, "world": world, "mode": "fsdp2", "layers": args.layers,
            "setup_s": round(seconds, 2),
            "peak_mb": round(peak, 1), "kept_mb": round(kept, 1),
            "step_peak_mb": round(step_peak, 1),
            "model_mb": round(parameters * 4 / 2**20, 1),
            "largest_parameter_mb": round(largest * 4 / 2**20, 1),
            "shard_mb": round(shard * 4 / 2**20, 1), "gradient_shard_mb": 0.0,
            "width": args.width, "parameters": parameters,
            "losses": losses, "step_s": step_seconds, "torch": torch.__version__}
    with open(f"{args.out}.{rank}", "w") as f:
        f.write(json.dumps(line) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
