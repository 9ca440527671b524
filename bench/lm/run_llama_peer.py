#!/usr/bin/env python3
"""dtrain's Llama against transformers' LlamaForCausalLM in a plain PyTorch 2.x loop (issue 51),
side by side on one machine: the same initial weights (transformers' random init, saved with
save_pretrained and read by `dtrain train --init-from`), the same samples in the same order (the
token set's training samples as dtrain reads them, dumped by `data_bench samples`), the same
recipe (AdamW with decoupled weight decay, linear warmup then cosine decay, gradient clipping at
1.0), float32, one process, the same threads. Reported: each step's loss on both sides (the
largest relative difference over the steps) and the step time (forward, backward, clipping,
AdamW: dtrain's step_ms against the loop's), medians over alternated rounds.

The shape: Llama ~125M's layer (hidden 768, 12 heads, 4 key/value heads, intermediate 2048)
at 2 layers for time, vocabulary 8192 (a BPE dtrain trains on python3-doc), context 128, batch 8.

  .venv-torch/bin/python bench/lm/run_llama_peer.py [--dtrain build-pip/dtrain]
      [--data-bench build-unity/bench/data_bench] [--steps 100] [--rounds 2] [--threads 2]
      [--markdown FILE]
--precision bf16-master: dtrain's bf16 model with fp32 gradients and fp32 master weights against
PyTorch's FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over the same
model (fp32 sharded parameters the optimizer updates, bf16 copies for the forward and backward,
gradients reduced in fp32; one process, gloo), both computing the loss in fp32 from bf16 logits.
The two do not round alike (bf16 kernels), so the loss difference is a closeness, not an oracle.

Raw records: bench/results/lm/llama_peer.jsonl (stamped).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from report import ROOT, Records, dtrain_steps, table  # noqa: E402

CORPUS = "/usr/share/doc/python3.11/html"
SHAPE = dict(hidden=768, heads=12, kv_heads=4, ffn=2048, layers=2, vocab=8192, context=128)
RECIPE = dict(lr=3e-4, weight_decay=0.1, warmup=10, clip=1.0, batch=8, seed=1)


def save_initial(folder, shape=SHAPE):
    """transformers' random initialisation of a Llama of `shape` (SHAPE's keys), saved."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"],
                         max_position_embeddings=shape["context"], rms_norm_eps=1e-5,
                         rope_theta=10000.0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)


def prepare_data(dtrain, data_bench, work, vocab, context, steps, batch=RECIPE["batch"]):
    """A BPE of `vocab` tokens trained on CORPUS, CORPUS as its token shards (WORK/pydoc) and the
    training samples a run of `steps` steps of `batch` reads, in its order (WORK/samples.npy,
    data_bench's): (prefix, samples)."""
    tokenizer = os.path.join(work, "tokenizer.json")
    subprocess.run([dtrain, "data", "tokenizer", "train", CORPUS, "--vocab-size", str(vocab),
                    "--output", tokenizer], check=True, capture_output=True)
    prefix = os.path.join(work, "pydoc")
    subprocess.run([dtrain, "data", "prepare", CORPUS, "--tokenizer", tokenizer, "--output",
                    prefix], check=True, capture_output=True)
    samples = os.path.join(work, "samples.npy")
    subprocess.run([data_bench, "samples", "--data", prefix, "--context", str(context),
                    "--samples", str(steps * batch), "--seed", str(RECIPE["seed"]),
                    "--validation-fraction", "0.01", "--out", samples], check=True)
    return prefix, samples


def recipe_flags(steps, metrics):
    """RECIPE as `dtrain train` flags, logging every step to `metrics`."""
    return ["--max-steps", str(steps), "--optimizer", "adamw", "--lr", str(RECIPE["lr"]),
            "--weight-decay", str(RECIPE["weight_decay"]), "--lr-decay", "cosine",
            "--warmup-steps", str(RECIPE["warmup"]), "--max-grad-norm", str(RECIPE["clip"]),
            "--seed", str(RECIPE["seed"]), "--no-progress", "--log-every", "1",
            "--metrics", metrics]


def lr_at(step, steps, recipe=RECIPE):
    import math
    if step < recipe["warmup"]:
        return recipe["lr"] * (step + 1) / recipe["warmup"]
    progress = min(1.0, (step - recipe["warmup"]) / max(steps - recipe["warmup"], 1))
    return recipe["lr"] * 0.5 * (1.0 + math.cos(math.pi * progress))


def peer_round(initial, samples, steps, threads, precision="fp32"):
    """transformers' model (its default attention, sdpa) in a plain loop: losses, step times."""
    import numpy
    import torch
    from transformers import LlamaForCausalLM
    torch.set_num_threads(threads)
    model = LlamaForCausalLM.from_pretrained(initial, dtype=torch.float32)
    model.train()
    if precision == "bf16-master":
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        if not dist.is_initialized():
            # A free port of its own, not MASTER_PORT in the environment (dtrain's runs inherit
            # it and would host their store there).
            import socket
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                    world_size=1)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=RECIPE["lr"], betas=(0.9, 0.999),
                                  eps=1e-8, weight_decay=RECIPE["weight_decay"])
    rows = torch.from_numpy(numpy.load(samples))
    batch = RECIPE["batch"]
    losses, times = [], []
    for step in range(steps):
        tokens = rows[step * batch:(step + 1) * batch]
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps)
        logits = model(tokens[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE["clip"])
        optimizer.step()
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
    return losses, times


def compare(ours, peer):
    """One round's (losses, step ms) of dtrain and of the peer: the largest relative loss
    difference over the steps, each side's median step after the first, and their ratio."""
    (l_ours, t_ours), (l_peer, t_peer) = ours, peer
    if len(l_ours) != len(l_peer):
        sys.exit(f"dtrain logged {len(l_ours)} steps, the peer {len(l_peer)}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(l_ours, l_peer))
    m_ours, m_peer = statistics.median(t_ours[1:]), statistics.median(t_peer[1:])
    return worst, m_ours, m_peer, m_ours / m_peer


def dtrain_round(dtrain, prefix, initial, steps, threads, work, precision="fp32"):
    metrics = os.path.join(work, "metrics.jsonl")
    command = [dtrain, "train", "--model", "llama", "--dataset", "tokens:" + prefix,
               "--validation-fraction", "0.01", "--init-from", initial,
               "--layers", str(SHAPE["layers"]), "--width", str(SHAPE["hidden"]),
               "--heads", str(SHAPE["heads"]), "--kv-heads", str(SHAPE["kv_heads"]),
               "--ffn-width", str(SHAPE["ffn"]), "--context", str(SHAPE["context"]),
               "--norm-eps", "1e-5", "--nproc", "1", "--threads", str(threads),
               "--batch-size", str(RECIPE["batch"]), "--precision", precision] + \
        recipe_flags(steps, metrics)
    # The round ends when the last step is logged: the evaluation over the validation split
    # that follows training (minutes here) is not compared, and would set the rounds far apart
    # on a machine whose speed drifts.
    steps_seen = dtrain_steps(command, metrics, steps)
    return [r["loss"] for r in steps_seen], [r["step_ms"] for r in steps_seen], command


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtrain", default=os.path.join(ROOT, "build-pip", "dtrain"))
    parser.add_argument("--data-bench",
                        default=os.path.join(ROOT, "build-unity", "bench", "data_bench"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16-master"])
    parser.add_argument("--markdown")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="dtrain-llama-peer-")
    prefix, samples = prepare_data(args.dtrain, args.data_bench, work, SHAPE["vocab"],
                                   SHAPE["context"], args.steps)
    initial = os.path.join(work, "initial")
    save_initial(initial)
    worst, ratios, ours_ms, theirs_ms = [], [], [], []
    with Records(os.path.join(ROOT, "bench", "results", "lm", "llama_peer.jsonl"), "a",
                 args.dtrain) as records:
        for r in range(args.rounds):
            sides = ["dtrain", "peer"] if r % 2 == 0 else ["peer", "dtrain"]
            result = {}
            for side in sides:
                if side == "dtrain":
                    result[side] = dtrain_round(args.dtrain, prefix, initial, args.steps,
                                                args.threads, work, args.precision)[:2]
                else:
                    result[side] = peer_round(initial, samples, args.steps, args.threads,
                                              args.precision)
            (l_ours, t_ours), (l_peer, t_peer) = result["dtrain"], result["peer"]
            compared = compare(result["dtrain"], result["peer"])
            for seen, value in zip((worst, ours_ms, theirs_ms, ratios), compared):
                seen.append(value)
            m_ours, m_peer = ours_ms[-1], theirs_ms[-1]
            records.write({"bench": "llama_peer", "round": r, "shape": SHAPE, "recipe": RECIPE,
                           "steps": args.steps, "threads": args.threads,
                           "dtype": "float32" if args.precision == "fp32" else args.precision,
                           "dtrain_losses": l_ours, "peer_losses": l_peer,
                           "dtrain_step_ms": t_ours, "peer_step_ms": t_peer,
                           "max_relative_loss_difference": worst[-1],
                           "step_time_ratio": ratios[-1]})
            print(f"round {r}: losses {l_ours[0]:.4f} -> {l_ours[-1]:.4f} (dtrain), "
                  f"{l_peer[0]:.4f} -> {l_peer[-1]:.4f} (transformers), largest relative "
                  f"difference {worst[-1]:.2e}; step {m_ours:.0f} ms vs {m_peer:.0f} ms "
                  f"({ratios[-1]:.3f}x)", flush=True)
    table(["| Llama, 2 x (768, 12 heads, 4 kv, 2048), vocab 8192, context 128, batch 8, "
           f"{args.precision}, {args.threads} threads | dtrain | transformers + PyTorch"
           f"{' FSDP2' if args.precision != 'fp32' else ''} | |",
           "|---|---|---|---|",
           f"| largest relative loss difference over {args.steps} steps (worst round) | "
           f"{max(worst):.2e} | | {'target <= 1e-3' if args.precision == 'fp32' else 'bf16 kernels: no target'} |",
           f"| step time (median of steps; median of {args.rounds} rounds) | "
           f"{statistics.median(ours_ms):.0f} ms | {statistics.median(theirs_ms):.0f} ms | "
           f"{statistics.median(ratios):.3f}x (target <= 1.0x) |"], args.markdown)


if __name__ == "__main__":
    main()
