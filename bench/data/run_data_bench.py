#!/usr/bin/env python3
"""The data path against its peers and limits, side by side in one run (issue 50):

1. Tokenizing: dtrain's byte-level BPE (bench/data/data_bench tokenize, one thread) against
   Hugging Face `tokenizers` (Rust, one thread: RAYON_NUM_THREADS=1, encode() per document) on
   the same tokenizer.json (trained by `tokenizers` on the corpus, GPT-2's pre-tokenization) and
   the same documents: the ids must be equal, and the throughput per core is compared in
   alternated rounds (both with a cold cache each round), median of per-round ratios.
2. Batch assembly: random global batches of --context + 1 tokens from memory-mapped Megatron
   shards (`dtrain data prepare`'s), against memcpy of the same bytes from the same mapping.

The corpus is Debian's python3-doc (its HTML and reST sources, ~60 MB of text offline).

  .venv-torch/bin/python bench/data/run_data_bench.py [--build build-unity] [--rounds 5]
      [--markdown FILE]
Raw records: bench/results/data/data.jsonl (stamped: commit, machine, versions, date).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from report import ROOT, Records, table  # noqa: E402

CORPUS = "/usr/share/doc/python3.11/html"
TEXT_EXTENSIONS = {".txt", ".md", ".rst", ".html", ".htm", ".text", ".jsonl", ".ndjson"}


def documents(folder):
    """The files dtrain's for_each_document reads from a folder, in its order."""
    found = []
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            ext = os.path.splitext(name)[1]
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            if (ext == "" and not name.startswith(".")) or ext in TEXT_EXTENSIONS:
                found.append(path)
    found.sort(key=lambda p: p.encode())
    return [open(p, encoding="utf-8", newline="").read() for p in found]


def hf_round(tokenizer_path, texts):
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(tokenizer_path)  # a cold cache each round, as dtrain's
    start = time.perf_counter()
    ids = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    return time.perf_counter() - start, ids


def run_json(command):
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    import json
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build-unity"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    bench = os.path.join(args.build, "bench", "data_bench")
    dtrain = os.path.join(args.build, "dtrain")
    records = Records(os.path.join(ROOT, "bench", "results", "data", "data.jsonl"), "a", dtrain)
    work = tempfile.mkdtemp(prefix="dtrain-data-bench-")
    texts = documents(CORPUS)
    size = sum(len(t.encode()) for t in texts)
    print(f"corpus: {CORPUS}, {len(texts)} documents, {size / 1e6:.1f} MB")

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=args.vocab, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer_path = os.path.join(work, "tokenizer.json")
    tokenizer.save(tokenizer_path)

    ratios, ours_mb, theirs_mb = [], [], []
    equal = None
    for r in range(args.rounds):
        ids_out = os.path.join(work, "ids.npy") if r == 0 else None
        command = [bench, "tokenize", "--tokenizer", tokenizer_path, CORPUS, "--rounds", "1"]
        if ids_out:
            command += ["--ids-out", ids_out]
        ours = run_json(command)[0]
        seconds, hf_ids = hf_round(tokenizer_path, texts)
        if r == 0:
            import numpy
            flat = numpy.fromiter((i for doc in hf_ids for i in doc), dtype=numpy.int64)
            mine = numpy.load(ids_out)
            equal = bool(mine.shape == flat.shape and (mine == flat).all())
            if not equal:
                first = int(numpy.argmax(mine[:len(flat)] != flat[:len(mine)]))
                print(f"ids differ: {mine.shape} vs {flat.shape}, first at {first}")
        ours_mb.append(ours["bytes"] / ours["seconds"] / 1e6)
        theirs_mb.append(size / seconds / 1e6)
        ratios.append(ours_mb[-1] / theirs_mb[-1])
        records.write({"bench": "tokenize", "round": r, "corpus_bytes": size,
                       "documents": len(texts), "vocab": args.vocab,
                       "dtrain_mb_per_s": ours_mb[-1], "tokenizers_mb_per_s": theirs_mb[-1],
                       "ratio": ratios[-1], "tokens": ours["tokens"], "ids_equal": equal,
                       "threads": 1})
        print(f"round {r}: dtrain {ours_mb[-1]:.2f} MB/s, tokenizers {theirs_mb[-1]:.2f} MB/s, "
              f"ratio {ratios[-1]:.2f}")

    subprocess.run([dtrain, "data", "prepare", CORPUS, "--tokenizer", tokenizer_path,
                    "--output", os.path.join(work, "shards", "pydoc")], check=True,
                   capture_output=True)
    batch = run_json([bench, "batch", "--data", os.path.join(work, "shards", "pydoc"),
                      "--context", "1024", "--batch", "16", "--rounds", str(args.rounds),
                      "--steps", "200"])
    for b in batch:
        records.write({**b, "corpus": CORPUS})
    ours_tps = statistics.median(b["tokens_per_s"] for b in batch)
    copy_tps = statistics.median(b["memcpy_tokens_per_s"] for b in batch)
    batch_ratio = statistics.median(b["tokens_per_s"] / b["memcpy_tokens_per_s"] for b in batch)
    records.close()
    lines = [
        "| measure (one thread) | dtrain | peer / limit | ratio (median of rounds) |",
        "|---|---|---|---|",
        f"| BPE encoding, {size / 1e6:.0f} MB of python3-doc, vocab {args.vocab} "
        f"(ids equal: {'yes' if equal else 'NO'}) | {statistics.median(ours_mb):.2f} MB/s | "
        f"tokenizers {statistics.median(theirs_mb):.2f} MB/s | "
        f"{statistics.median(ratios):.2f}x |",
        f"| batch assembly, context 1024, batch 16 | {ours_tps / 1e6:.0f} M tokens/s | "
        f"memcpy {copy_tps / 1e6:.0f} M tokens/s | {batch_ratio:.2f}x |",
    ]
    table(lines, args.markdown)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
