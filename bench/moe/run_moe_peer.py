#!/usr/bin/env python3
"""dtrain's expert parallelism against the same mixture of experts in plain PyTorch 2.x with
all_to_all_single over gloo (issue 81; its autograd form, torchtitan's
`_functional_collectives.all_to_all_single_autograd`), side by side on one
machine: 2 processes on each side, the experts split over both (EP 2 x DP 2, each rank's tokens
sent to their experts' rank and back).

The model is transformers' MixtralForCausalLM (attention, norms, embeddings), its MoE blocks'
forward replaced by an expert-parallel one written here in plain PyTorch: softmax router, top-2,
the chosen weights normalized, the assignments sorted by expert (stable), the counts exchanged by
all_to_all_single, the rows sent by the autograd all_to_all_single, each local expert's rows
gathered from every rank's block, SwiGLU, and the reverse. The dense parameters are DDP's
(bucketed all-reduce overlapped with backward; the experts ignored by it), the experts' gradients
divided by the data-parallel size (each expert's gradient already sums every rank's tokens).
dtrain: `dtrain train --nproc 2 --expert-parallel 2`. Same initial weights (the Mixtral saved by
save_pretrained, read by `dtrain train --init-from`), the same samples in the same order on the
same ranks (`data_bench samples`; rank r takes every other sample of a global batch, as dtrain's
DistributedSampler does), the same recipe (AdamW with decoupled weight decay, linear warmup then
cosine decay, clipping at 1.0 of the global norm, the experts' part summed over the ranks; no
auxiliary loss on either side), float32, one thread per process.

Reported: each step's loss on both sides (the largest absolute difference over the steps) and
the step time (rank 0's: forward, both exchanges, backward, the gradients' reduction, clipping,
AdamW; dtrain's step_ms against the loop's), medians of per-round ratios over alternated rounds.

The shape: 2 layers of hidden 256, 8 heads, 4 key/value heads, 8 experts of 512 hidden units,
top-2, vocabulary 8192 (a BPE dtrain trains on python3-doc), context 128, global batch 8.

  .venv-torch/bin/python bench/moe/run_moe_peer.py [--dtrain build-pip/dtrain]
      [--data-bench build-pip/bench/data_bench] [--steps 100] [--rounds 3] [--markdown FILE]

Raw records: bench/results/moe/peer.jsonl (stamped).
"""
import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from report import ROOT, Records, alternated_rounds, dtrain_steps, table  # noqa: E402
from lm.run_llama_peer import RECIPE, lr_at, prepare_data, recipe_flags  # noqa: E402  (the same recipe, data)

SHAPE = dict(hidden=256, heads=8, kv_heads=4, experts=8, top_k=2, expert_ffn=512, layers=2,
             vocab=8192, context=128)
RANKS = 2


def save_initial(folder):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=SHAPE["vocab"], hidden_size=SHAPE["hidden"],
                           intermediate_size=SHAPE["expert_ffn"],
                           num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"],
                           num_key_value_heads=SHAPE["kv_heads"],
                           num_local_experts=SHAPE["experts"],
                           num_experts_per_tok=SHAPE["top_k"],
                           max_position_embeddings=SHAPE["context"], rms_norm_eps=1e-5,
                           rope_theta=10000.0, tie_word_embeddings=False)
    MixtralForCausalLM(config).save_pretrained(folder)


def expert_parallel_moe(block, rank, ranks):
    """Replaces a MixtralSparseMoeBlock's experts by this rank's and its forward by the
    expert-parallel one. Returns the local expert parameters."""
    import torch
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    def all_to_all_single(output_split, rows, input_split):
        return all_to_all_single_autograd(rows, output_split, input_split, dist.group.WORLD)
    experts = block.experts
    total = experts.gate_up_proj.shape[0]
    local = total // ranks
    first = rank * local
    gate_up = torch.nn.Parameter(experts.gate_up_proj.detach()[first:first + local].clone())
    down = torch.nn.Parameter(experts.down_proj.detach()[first:first + local].clone())
    del experts.gate_up_proj, experts.down_proj
    experts.local_gate_up, experts.local_down = gate_up, down
    top_k = block.top_k

    def forward(hidden_states):
        batch, length, width = hidden_states.shape
        x = hidden_states.reshape(-1, width)
        probs = torch.nn.functional.linear(x, block.gate.weight).softmax(-1)
        weights, chosen = probs.topk(top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        token_of = order // top_k
        rows = x[token_of]
        counts = torch.bincount(flat, minlength=total)            # [E] this rank's
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts)           # [ranks x local] to me
        send = counts.view(ranks, local).sum(1).tolist()
        received_counts = received_counts.view(ranks, local)
        receive = received_counts.sum(1).tolist()
        received = all_to_all_single(receive, rows, send)
        # Each source rank's block holds its rows for my experts, expert by expert: regroup by
        # expert (expert j's rows from every rank, in rank order).
        pieces = received.split(received_counts.reshape(-1).tolist())
        by_expert = [torch.cat([pieces[r * local + j] for r in range(ranks)])
                     for j in range(local)]
        outputs = []
        for j, rows_j in enumerate(by_expert):
            gate, up = torch.nn.functional.linear(rows_j, gate_up[j]).chunk(2, dim=-1)
            outputs.append(torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                                      down[j]))
        # Back in the received order ([source rank][local expert]), then home.
        per_expert = [o.split(received_counts[:, j].tolist()) for j, o in enumerate(outputs)]
        back = torch.cat([per_expert[j][r] for r in range(ranks) for j in range(local)])
        results = all_to_all_single(send, back, receive)
        scaled = results * weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(x).index_add(0, token_of, scaled)
        return out.view(batch, length, width)

    block.forward = forward
    return [gate_up, down]


def peer_worker(rank, initial, samples, steps, port, queue):
    import numpy
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import MixtralForCausalLM
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=RANKS)
    model = MixtralForCausalLM.from_pretrained(initial, dtype=torch.float32)
    model.train()
    expert_parameters = []
    for layer in model.model.layers:
        expert_parameters += expert_parallel_moe(layer.mlp, rank, RANKS)
    expert_ids = {id(p) for p in expert_parameters}
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, [name for name, p in model.named_parameters() if id(p) in expert_ids])
    ddp = DistributedDataParallel(model)
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    optimizer = torch.optim.AdamW(model.parameters(), lr=RECIPE["lr"], betas=(0.9, 0.999),
                                  eps=1e-8, weight_decay=RECIPE["weight_decay"])
    rows = torch.from_numpy(numpy.load(samples))
    batch = RECIPE["batch"]
    losses, times = [], []
    for step in range(steps):
        tokens = rows[step * batch:(step + 1) * batch][rank::RANKS]
        dist.barrier()
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps)
        logits = ddp(tokens[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for p in expert_parameters:
            p.grad.div_(RANKS)
        # The global norm: the dense part is alike on every rank, the experts' part is summed.
        dense_sq = torch.stack([p.grad.pow(2).sum() for p in dense]).sum()
        expert_sq = torch.stack([p.grad.pow(2).sum() for p in expert_parameters]).sum()
        dist.all_reduce(expert_sq)
        norm = (dense_sq + expert_sq).sqrt()
        scale = (RECIPE["clip"] / (norm + 1e-6)).clamp(max=1.0)
        for p in model.parameters():
            p.grad.mul_(scale)
        optimizer.step()
        times.append((time.perf_counter() - start) * 1e3)
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        losses.append(reported.item() / RANKS)
    dist.barrier()
    if rank == 0:
        queue.put((losses, times))
        queue.close()
        queue.join_thread()
    # (no destroy_process_group: its gloo teardown hung once after a round's last step)
    os._exit(0)


def peer_round(initial, samples, steps):
    import torch.multiprocessing as mp
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=peer_worker, args=(r, initial, samples, steps, port, queue))
               for r in range(RANKS)]
    for w in workers:
        w.start()
    result = queue.get()
    for w in workers:
        w.join()
        if w.exitcode != 0:
            sys.exit(f"peer rank failed: exit {w.exitcode}")
    return result


def dtrain_round(dtrain, prefix, initial, steps, work):
    metrics = os.path.join(work, "metrics.jsonl")
    command = [dtrain, "train", "--model", "llama", "--dataset", "tokens:" + prefix,
               "--validation-fraction", "0.01", "--init-from", initial,
               "--layers", str(SHAPE["layers"]), "--width", str(SHAPE["hidden"]),
               "--heads", str(SHAPE["heads"]), "--kv-heads", str(SHAPE["kv_heads"]),
               "--moe-experts", str(SHAPE["experts"]), "--moe-top-k", str(SHAPE["top_k"]),
               "--moe-ffn-width", str(SHAPE["expert_ffn"]), "--moe-aux-loss", "0",
               "--context", str(SHAPE["context"]), "--norm-eps", "1e-5",
               "--nproc", str(RANKS), "--expert-parallel", str(RANKS), "--threads", "1",
               "--batch-size", str(RECIPE["batch"] // RANKS), "--no-run-dir"] + \
        recipe_flags(steps, metrics)
    records = dtrain_steps(command, metrics, steps)
    return [r["loss"] for r in records], [r["step_ms"] for r in records], command


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtrain", default=os.path.join(ROOT, "build-pip", "dtrain"))
    parser.add_argument("--data-bench",
                        default=os.path.join(ROOT, "build-pip", "bench", "data_bench"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="dtrain-moe-peer-")
    prefix, samples = prepare_data(args.dtrain, args.data_bench, work, SHAPE["vocab"],
                                   SHAPE["context"], args.steps)
    initial = os.path.join(work, "initial")
    save_initial(initial)

    def run_one(side):
        if side == "dtrain":
            losses, times, _ = dtrain_round(args.dtrain, prefix, initial, args.steps, work)
        else:
            losses, times = peer_round(initial, samples, args.steps)
        return {"bench": "moe_peer", "side": side, "shape": SHAPE, "recipe": RECIPE,
                "ranks": RANKS, "expert_parallel": RANKS, "steps": args.steps,
                "threads_per_rank": 1, "dtype": "float32", "losses": losses, "step_ms": times,
                "median_step_ms": statistics.median(times[1:])}

    def describe(result):
        return (f"losses {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}, "
                f"step {result['median_step_ms']:.1f} ms")

    with Records(os.path.join(ROOT, "bench", "results", "moe", "peer.jsonl"), "a",
                 args.dtrain) as records:
        rounds = alternated_rounds(("dtrain", "peer"), args.rounds, run_one, records, describe)
    worst = [max(abs(a - b) for a, b in zip(r["dtrain"]["losses"], r["peer"]["losses"]))
             for r in rounds]
    ours_ms = [r["dtrain"]["median_step_ms"] for r in rounds]
    theirs_ms = [r["peer"]["median_step_ms"] for r in rounds]
    ratios = [a / b for a, b in zip(ours_ms, theirs_ms)]
    print("rounds' largest loss differences " + ", ".join(f"{w:.2e}" for w in worst) +
          "; step time ratios " + ", ".join(f"{x:.3f}" for x in ratios))
    table(["| Mixtral-shaped, 2 x (256, 8 heads, 4 kv, 8 experts x 512, top-2), vocab 8192, "
           "context 128, global batch 8, float32, 2 ranks x 1 thread, EP 2 | dtrain | "
           "PyTorch 2.12 (all_to_all_single, gloo, DDP) | |",
           "|---|---|---|---|",
           f"| largest loss difference over {args.steps} steps (worst round) | "
           f"{max(worst):.2e} | | target <= 1e-5 |",
           f"| step time (median of steps; median of {args.rounds} rounds' ratios) | "
           f"{statistics.median(ours_ms):.1f} ms | {statistics.median(theirs_ms):.1f} ms | "
           f"{statistics.median(ratios):.3f}x (target <= 0.9x) |"], args.markdown)


if __name__ == "__main__":
    main()
