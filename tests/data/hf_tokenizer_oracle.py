#!/usr/bin/env python3
"""Hugging Face `tokenizers` as the oracle for dtrain's byte-level BPE (tests/tokenizer_test.cpp):

  hf_tokenizer_oracle.py train CORPUS VOCAB OUT_DIR   GPT-2-style and Llama-3-style tokenizer.json
  hf_tokenizer_oracle.py encode TOKENIZER TEXT OUT    ids of TEXT's file (add_special_tokens=False)
                                                      as int64 .npy, and OUT.decoded (decode(ids))
"""
import sys

import numpy
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def train(corpus, vocab, out_dir):
    special = ["<|endoftext|>"]
    gpt2 = Tokenizer(models.BPE())
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gpt2.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    gpt2.train([corpus], trainer)
    gpt2.save(out_dir + "/gpt2-style.json")

    llama = Tokenizer(models.BPE(ignore_merges=True))
    llama.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    llama.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special + ["<|eot_id|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    llama.train([corpus], trainer)
    llama.save(out_dir + "/llama3-style.json")


def encode(tokenizer_path, text_path, out):
    tokenizer = Tokenizer.from_file(tokenizer_path)
    text = open(text_path, encoding="utf-8", newline="").read()
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    numpy.save(out, numpy.array(ids, dtype=numpy.int64))
    with open(out + ".decoded", "w", encoding="utf-8", newline="") as f:
        f.write(tokenizer.decode(ids, skip_special_tokens=False))


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "encode":
        encode(sys.argv[2], sys.argv[3], sys.argv[4])
