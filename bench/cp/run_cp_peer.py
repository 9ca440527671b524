#!/usr/bin/env python3
"""dtrain's context parallelism against PyTorch's (issue 82), side by side on one machine: one
Llama and one long sequence split over 2 ranks by ring attention, trained the same steps.

The peer. PyTorch's own, torch.distributed.tensor.experimental.context_parallel, does not run on
a CPU: inside it, F.scaled_dot_product_attention dispatches to
aten._scaled_dot_product_flash_attention_for_cpu, for which its DTensor dispatch has no sharding
rule ("NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default
does not have a sharding strategy registered", PyTorch 2.12; --probe-torch re-runs that check).
So the peer is transformers' LlamaForCausalLM in a plain PyTorch loop with its attention replaced
(transformers' AttentionInterface) by a ring written here as the field writes it (torch's
_templated_ring_attention, zhuzilin's zigzag_ring_flash_attn): each rank holds the zigzag's two
chunks of the sequence (chunks r and 2C - 1 - r), its keys and values go round the ring by
isend/irecv while the block in hand is computed, chunk pair by chunk pair (pairs whose keys all
come later skipped), each pair by PyTorch's fused CPU FlashAttention kernel, which returns the
log-sum-exp the partial results are merged by; backward recomputes each pair with the kernel's
backward from the global output and log-sum-exp, the key/value gradients travelling with their
block. Rotary positions are each rank's global ones (position_ids); the loss is each rank's
tokens' share of the whole sequence's mean; gradients are all-reduced (summed) over the 2 ranks.

dtrain: `dtrain train --context-parallel 2 --cp-method ring` (LibTorch 2.x: the same fused CPU
kernels per chunk pair), from the same initial weights (transformers' init, --init-from), on the
same samples (the token set's training windows in dtrain's order, dumped by data_bench), the same
recipe (AdamW, warmup and cosine decay, clipping at 1.0), float32, 1 thread per rank.

Reported: the step time (dtrain's step_ms against the peer's rank 0 step), medians over
alternated rounds of per-round ratios; the largest relative loss difference over the steps.

  .venv-torch/bin/python bench/cp/run_cp_peer.py [--dtrain build-pip/dtrain]
      [--data-bench build-pip/bench/data_bench] [--context 16384] [--steps 20] [--rounds 2]
      [--markdown FILE]
  .venv-torch/bin/python bench/cp/run_cp_peer.py --probe-torch     (torch's context_parallel)

Raw records: bench/results/cp/cp_peer.jsonl (stamped).
"""
import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lm"))
import run_llama_peer as llama_peer  # noqa: E402
from report import ROOT, Records, dtrain_steps, table  # noqa: E402

# A llama-tiny-like shape with 64-wide heads, long enough that attention is most of the step.
SHAPE = dict(hidden=256, heads=4, kv_heads=2, ffn=688, layers=2, vocab=1024)
RECIPE = dict(lr=3e-4, weight_decay=0.1, warmup=5, clip=1.0, batch=1, seed=1)
RANKS = 2


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---- the peer's ring -------------------------------------------------------------------------

def ring_function():
    """The ring as a torch.autograd.Function (built here: torch is imported by the workers)."""
    import torch
    import torch.distributed as dist
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def chunks(rank, world):  # the zigzag's chunk indices of a rank, in its token order
        return (rank, 2 * world - 1 - rank)

    def pass_on(x):
        rank, world = dist.get_rank(), dist.get_world_size()
        received = torch.empty_like(x)
        works = [dist.isend(x.contiguous(), (rank + 1) % world),
                 dist.irecv(received, (rank - 1) % world)]
        return received, works

    class Ring(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            rank, world = dist.get_rank(), dist.get_world_size()
            half = q.shape[2] // 2
            kv = torch.stack([k, v]).contiguous()
            outs, lses = [None, None], [None, None]
            for step in range(world):
                if step + 1 < world:
                    received, works = pass_on(kv)
                source = (rank - step) % world
                for i, qc in enumerate(chunks(rank, world)):
                    qt = q[:, :, i * half:(i + 1) * half].contiguous()
                    for j, kc in enumerate(chunks(source, world)):
                        if kc > qc:
                            continue
                        o, lse = flash(qt, kv[0, :, :, j * half:(j + 1) * half].contiguous(),
                                       kv[1, :, :, j * half:(j + 1) * half].contiguous(), 0.0,
                                       kc == qc)[:2]
                        if outs[i] is None:
                            outs[i], lses[i] = o, lse
                        else:
                            merged = torch.logaddexp(lses[i], lse)
                            outs[i] = (outs[i] * torch.exp(lses[i] - merged).unsqueeze(-1) +
                                       o * torch.exp(lse - merged).unsqueeze(-1))
                            lses[i] = merged
                if step + 1 < world:
                    for work in works:
                        work.wait()
                    kv = received
            out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, d_out):
            q, k, v, out, lse = ctx.saved_tensors
            rank, world = dist.get_rank(), dist.get_world_size()
            half = q.shape[2] // 2
            d_out = d_out.contiguous()
            d_q = torch.zeros_like(q)
            kv = torch.stack([k, v]).contiguous()
            d_kv = torch.zeros_like(kv)
            for step in range(world):
                if step + 1 < world:
                    received, works = pass_on(kv)
                source = (rank - step) % world
                for i, qc in enumerate(chunks(rank, world)):
                    rows = slice(i * half, (i + 1) * half)
                    for j, kc in enumerate(chunks(source, world)):
                        if kc > qc:
                            continue
                        cols = slice(j * half, (j + 1) * half)
                        dq, dk, dv = flash_backward(
                            d_out[:, :, rows].contiguous(), q[:, :, rows].contiguous(),
                            kv[0, :, :, cols].contiguous(), kv[1, :, :, cols].contiguous(),
                            out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), 0.0,
                            kc == qc)
                        d_q[:, :, rows] += dq
                        d_kv[0, :, :, cols] += dk
                        d_kv[1, :, :, cols] += dv
                gradients, gradient_works = pass_on(d_kv)
                if step + 1 < world:
                    for work in works:
                        work.wait()
                    kv = received
                for work in gradient_works:
                    work.wait()
                d_kv = gradients
            return d_q, d_kv[0], d_kv[1]

    return Ring


def zigzag_positions(tokens, rank, world):
    import torch
    chunk = tokens // (2 * world)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk)])


def peer_worker(rank, initial, samples, steps, threads, port, out_path, dtype_name):
    import numpy
    import torch
    import torch.distributed as dist
    from transformers import AttentionInterface, LlamaForCausalLM
    from transformers.masking_utils import AttentionMaskInterface
    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=RANKS)
    Ring = ring_function()

    def ring_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       **kwargs):
        groups = query.shape[1] // key.shape[1]  # each key/value head serves its group
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        out = Ring.apply(query.contiguous(), key.contiguous(), value.contiguous())
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("peer_ring", ring_attention)
    AttentionMaskInterface.register("peer_ring", lambda *args, **kwargs: None)  # no T x T mask
    model = LlamaForCausalLM.from_pretrained(initial, dtype=dtype, attn_implementation="peer_ring")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=RECIPE["lr"], betas=(0.9, 0.999),
                                  eps=1e-8, weight_decay=RECIPE["weight_decay"])
    rows = torch.from_numpy(numpy.load(samples))
    tokens = rows.shape[1] - 1
    mine = zigzag_positions(tokens, rank, RANKS)
    losses, times = [], []
    for step in range(steps):
        window = rows[step:step + 1]
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = llama_peer.lr_at(step, steps, RECIPE)
        inputs, targets = window[:, :-1][:, mine], window[:, 1:][:, mine]
        logits = model(input_ids=inputs, position_ids=mine.unsqueeze(0)).logits
        # This rank's tokens' share of the whole sequence's mean: the summed gradients are the
        # whole sequence's.
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1), reduction="sum") / tokens
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE["clip"])
        optimizer.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(whole.item())
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "step_ms": times}, f)
    dist.destroy_process_group()


def peer_round(initial, samples, steps, threads, work, dtype="float32"):
    import torch.multiprocessing as mp
    out_path = os.path.join(work, "peer.json")
    if os.path.exists(out_path):
        os.remove(out_path)
    mp.spawn(peer_worker, args=(initial, samples, steps, threads, free_port(), out_path, dtype),
             nprocs=RANKS, join=True)
    result = json.load(open(out_path))
    return result["losses"], result["step_ms"]


# ---- dtrain's side ---------------------------------------------------------------------------

def dtrain_round(dtrain, prefix, initial, context, steps, threads, work):
    metrics = os.path.join(work, "metrics.jsonl")
    command = [dtrain, "train", "--model", "llama", "--dataset", "tokens:" + prefix,
               "--validation-fraction", "0.01", "--init-from", initial,
               "--layers", str(SHAPE["layers"]), "--width", str(SHAPE["hidden"]),
               "--heads", str(SHAPE["heads"]), "--kv-heads", str(SHAPE["kv_heads"]),
               "--ffn-width", str(SHAPE["ffn"]), "--context", str(context), "--norm-eps", "1e-5",
               "--nproc", str(RANKS), "--context-parallel", str(RANKS), "--cp-method", "ring",
               "--threads", str(threads), "--batch-size", str(RECIPE["batch"]),
               "--max-steps", str(steps), "--optimizer", "adamw", "--lr", str(RECIPE["lr"]),
               "--weight-decay", str(RECIPE["weight_decay"]), "--lr-decay", "cosine",
               "--warmup-steps", str(RECIPE["warmup"]), "--max-grad-norm", str(RECIPE["clip"]),
               "--seed", str(RECIPE["seed"]), "--no-progress", "--no-run-dir", "--log-every", "1",
               "--metrics", metrics]
    steps_seen = dtrain_steps(command, metrics, steps)
    return [r["loss"] for r in steps_seen], [r["step_ms"] for r in steps_seen]


def probe_torch():
    """torch's own context_parallel on a CPU over gloo (2 processes): what it says."""
    import torch.multiprocessing as mp
    out = os.path.join(tempfile.mkdtemp(prefix="dtrain-cp-probe-"), "probe.json")
    mp.spawn(probe_worker, args=(free_port(), out), nprocs=RANKS, join=True)
    return json.load(open(out))


def probe_worker(rank, port, out):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=RANKS)
    mesh = init_device_mesh("cpu", (RANKS,))
    torch.manual_seed(0)
    q, k, v = [torch.randn(1, 4, 256, 64) for _ in range(3)]
    result = {"torch": torch.__version__}
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            qg, kg, vg = [x.requires_grad_() for x in (q, k, v)]
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).sum().backward()
        result["runs"] = True
    except Exception as error:  # noqa: BLE001: what it raises is the finding
        result.update(runs=False, error=f"{type(error).__name__}: {error}")
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtrain", default=os.path.join(ROOT, "build-pip", "dtrain"))
    parser.add_argument("--data-bench", default=os.path.join(ROOT, "build-pip", "bench",
                                                             "data_bench"))
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="per rank")
    parser.add_argument("--probe-torch", action="store_true")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    records_path = os.path.join(ROOT, "bench", "results", "cp", "cp_peer.jsonl")
    probe = probe_torch()
    print(f"torch {probe['torch']} context_parallel on CPU/gloo: "
          f"{'runs' if probe['runs'] else probe['error']}", flush=True)
    if args.probe_torch:
        with Records(records_path, "a", args.dtrain) as records:
            records.write({"bench": "cp_peer_probe", **probe})
        return
    work = tempfile.mkdtemp(prefix="dtrain-cp-peer-")
    prefix, samples = llama_peer.prepare_data(args.dtrain, args.data_bench, work, SHAPE["vocab"],
                                              args.context, args.steps, RECIPE["batch"])
    initial = os.path.join(work, "initial")
    llama_peer.save_initial(initial, {**SHAPE, "context": args.context})
    worst, ratios, ours_ms, theirs_ms = [], [], [], []
    with Records(records_path, "a", args.dtrain) as records:
        records.write({"bench": "cp_peer_probe", **probe})
        for r in range(args.rounds):
            sides = ["dtrain", "peer"] if r % 2 == 0 else ["peer", "dtrain"]
            result = {}
            for side in sides:
                if side == "dtrain":
                    result[side] = dtrain_round(args.dtrain, prefix, initial, args.context,
                                                args.steps, args.threads, work)
                else:
                    result[side] = peer_round(initial, samples, args.steps, args.threads, work)
            (l_ours, t_ours), (l_peer, t_peer) = result["dtrain"], result["peer"]
            compared = llama_peer.compare(result["dtrain"], result["peer"])
            for seen, value in zip((worst, ours_ms, theirs_ms, ratios), compared):
                seen.append(value)
            m_ours, m_peer = ours_ms[-1], theirs_ms[-1]
            records.write({"bench": "cp_peer", "round": r, "shape": SHAPE, "recipe": RECIPE,
                           "context": args.context, "ranks": RANKS, "method": "ring",
                           "steps": args.steps, "threads_per_rank": args.threads,
                           "dtype": "float32", "dtrain_losses": l_ours, "peer_losses": l_peer,
                           "dtrain_step_ms": t_ours, "peer_step_ms": t_peer,
                           "max_relative_loss_difference": worst[-1],
                           "step_time_ratio": ratios[-1]})
            print(f"round {r}: losses {l_ours[0]:.4f} -> {l_ours[-1]:.4f} (dtrain), "
                  f"{l_peer[0]:.4f} -> {l_peer[-1]:.4f} (peer), largest relative difference "
                  f"{worst[-1]:.2e}; step {m_ours:.0f} ms vs {m_peer:.0f} ms "
                  f"({ratios[-1]:.3f}x)", flush=True)
    table(["| context | ranks | dtrain step (ms) | peer step (ms) | ratio (median of rounds) | "
           "largest loss difference |",
           "|---|---|---|---|---|---|",
           f"| {args.context} | {RANKS} (ring, zigzag) | {statistics.median(ours_ms):.0f} | "
           f"{statistics.median(theirs_ms):.0f} | **{statistics.median(ratios):.3f}** | "
           f"{max(worst):.1e} |"], args.markdown)


if __name__ == "__main__":
    main()
