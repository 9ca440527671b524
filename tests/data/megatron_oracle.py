#!/usr/bin/env python3
"""The oracle for dtrain's token shards: Megatron-LM's formats and GPTDataset / BlendedDataset
indices re-implemented in NumPy from Megatron's own code (megatron/core/datasets/
indexed_dataset.py, gpt_dataset.py, helpers.cpp; llm.c's dev/data/data_common.py), without
Megatron or torch. tests/tokens_test.cpp drives it:

  megatron_oracle.py write DIR          corpora written the way Megatron and llm.c write them
  megatron_oracle.py check DIR CASE     dtrain's samples (DIR/CASE-*.npy) against the oracle's
"""
import json
import os
import struct
import sys

import numpy

INDEX_HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES = {numpy.uint8: 1, numpy.int8: 2, numpy.int16: 3, numpy.int32: 4, numpy.int64: 5,
               numpy.float64: 6, numpy.float32: 7, numpy.uint16: 8}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def write_megatron(prefix, documents, dtype):
    """indexed_dataset.py's IndexedDatasetBuilder + _IndexWriter, one sequence per document."""
    lengths = [len(d) for d in documents]
    with open(prefix + ".bin", "wb") as out:
        for d in documents:
            out.write(numpy.array(d, dtype=dtype).tobytes(order="C"))
    itemsize = numpy.dtype(dtype).itemsize
    pointers, pointer = [], 0
    for length in lengths:
        pointers.append(pointer)
        pointer += length * itemsize
    document_indices = list(range(len(documents) + 1))
    with open(prefix + ".idx", "wb") as out:
        out.write(INDEX_HEADER)
        out.write(struct.pack("<Q", 1))
        out.write(struct.pack("<B", DTYPE_CODES[dtype]))
        out.write(struct.pack("<Q", len(lengths)))
        out.write(struct.pack("<Q", len(document_indices)))
        out.write(numpy.array(lengths, dtype=numpy.int32).tobytes(order="C"))
        out.write(numpy.array(pointers, dtype=numpy.int64).tobytes(order="C"))
        out.write(numpy.array(document_indices, dtype=numpy.int64).tobytes(order="C"))


def read_megatron(prefix):
    """_IndexReader: the lengths and the documents' tokens."""
    with open(prefix + ".idx", "rb") as stream:
        assert stream.read(9) == INDEX_HEADER
        assert struct.unpack("<Q", stream.read(8))[0] == 1
        dtype = CODE_DTYPES[struct.unpack("<B", stream.read(1))[0]]
        sequences = struct.unpack("<Q", stream.read(8))[0]
        struct.unpack("<Q", stream.read(8))
        offset = stream.tell()
    index = numpy.memmap(prefix + ".idx", mode="r")
    lengths = numpy.frombuffer(index, dtype=numpy.int32, count=sequences, offset=offset)
    pointers = numpy.frombuffer(index, dtype=numpy.int64, count=sequences,
                                offset=offset + lengths.nbytes)
    tokens = numpy.memmap(prefix + ".bin", mode="r", dtype=dtype)
    itemsize = numpy.dtype(dtype).itemsize
    documents = [numpy.array(tokens[p // itemsize:p // itemsize + n], dtype=numpy.int64)
                 for p, n in zip(pointers, lengths)]
    return lengths.copy(), documents


def write_llmc(path, tokens, wide):
    """llm.c's write_datafile."""
    header = numpy.zeros(256, dtype=numpy.int32)
    header[0] = 20240801 if wide else 20240520
    header[1] = 7 if wide else 1
    header[2] = len(tokens)
    with open(path, "wb") as out:
        out.write(header.tobytes())
        out.write(numpy.array(tokens, dtype=numpy.uint32 if wide else numpy.uint16).tobytes())


def build_document_index(documents, num_epochs, random_state, separate_final_epoch):
    if not separate_final_epoch or num_epochs == 1:
        document_index = numpy.mgrid[0:num_epochs, 0:len(documents)][1]
        document_index[:] = documents
        document_index = document_index.reshape(-1).astype(numpy.int32)
        random_state.shuffle(document_index)
        return document_index
    first = build_document_index(documents, num_epochs - 1, random_state, False)
    last = build_document_index(documents, 1, random_state, False)
    return numpy.concatenate((first, last))


def build_sample_index(sizes, document_index, seq_length, num_epochs, tokens_per_epoch):
    """helpers.cpp's build_sample_idx with drop_last_partial_sequence and one extra token."""
    extra = 1
    num_samples = (num_epochs * tokens_per_epoch - extra) // seq_length
    sample_index = numpy.zeros((num_samples + 1, 2), dtype=numpy.int64)
    position, offset = 0, 0
    for s in range(1, num_samples + 1):
        remaining = seq_length + extra
        while remaining != 0:
            length = sizes[document_index[position]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - extra
                remaining = 0
            else:
                if position == len(document_index) - 1:
                    assert s == num_samples
                    offset = sizes[document_index[position]] - extra
                    break
                position += 1
                offset = 0
        sample_index[s] = (position, offset)
    return sample_index


def build_shuffle_index(num_samples, total_size, random_state):
    first = numpy.arange(0, num_samples, 1, dtype=numpy.uint32)
    random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, 1, dtype=numpy.uint32)
    random_state.shuffle(last)
    return numpy.concatenate((first, last))


def gpt_indices(sizes, documents, seq_length, num_samples, seed):
    """GPTDataset._build_document_sample_shuffle_indices."""
    tokens_per_epoch = int(numpy.sum(sizes[documents]))
    num_epochs = 1
    if num_samples:
        tokens = tokens_per_epoch
        while tokens < num_samples * seq_length + 1:
            num_epochs += 1
            tokens += tokens_per_epoch
    separate = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        from_final = num_samples - sans_final
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = from_final < int(0.80 * per_epoch)
    random_state = numpy.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, random_state, separate)
    sample_index = build_sample_index(sizes, document_index, seq_length, num_epochs,
                                      tokens_per_epoch)
    if separate:
        shuffle_index = build_shuffle_index(sans_final, sample_index.shape[0] - 1, random_state)
    else:
        shuffle_index = build_shuffle_index(sample_index.shape[0] - 1,
                                            sample_index.shape[0] - 1, random_state)
    return document_index, sample_index, shuffle_index


def sample_tokens(documents_tokens, indices, idx, seq_length):
    """GPTDataset._query_document_sample_shuffle_indices."""
    document_index, sample_index, shuffle_index = indices
    idx = shuffle_index[idx]
    doc_f, off_f = sample_index[idx]
    doc_l, off_l = sample_index[idx + 1]
    if doc_f == doc_l:
        return documents_tokens[document_index[doc_f]][off_f:off_l + 1]
    parts = [documents_tokens[document_index[doc_f]][off_f:]]
    for i in range(doc_f + 1, doc_l):
        parts.append(documents_tokens[document_index[i]])
    parts.append(documents_tokens[document_index[doc_l]][:off_l + 1])
    return numpy.concatenate(parts)


def blending_indices(weights, size):
    """helpers.cpp's build_blending_indices."""
    weights = numpy.array(weights, dtype=numpy.float64) / sum(weights)
    current = numpy.zeros(len(weights), dtype=numpy.int64)
    which = numpy.zeros(size, dtype=numpy.int16)
    local = numpy.zeros(size, dtype=numpy.int64)
    for s in range(size):
        at = max(float(s), 1.0)
        errors = weights * at - current
        best = int(numpy.argmax(errors))  # the first of equal errors, as helpers.cpp
        which[s], local[s] = best, current[best]
        current[best] += 1
    return which, local


def write(folder):
    rng = numpy.random.RandomState(7)
    documents = [list(rng.randint(0, 1000, size=rng.randint(1, 60))) for _ in range(50)]
    write_megatron(os.path.join(folder, "a_text_document"), documents, numpy.uint16)
    others = [list(rng.randint(0, 70000, size=rng.randint(5, 90))) for _ in range(30)]
    write_megatron(os.path.join(folder, "b_text_document"), others, numpy.int32)
    shards = os.path.join(folder, "shards")
    os.makedirs(shards, exist_ok=True)
    for i, name in enumerate(["c_train_000001.bin", "c_train_000002.bin", "c_val_000000.bin"]):
        write_llmc(os.path.join(shards, name), list(rng.randint(0, 50257, size=300 + 40 * i)),
                   False)
    write_llmc(os.path.join(folder, "wide.bin"), [0, 1, 100000, 2 ** 31 - 1], True)


def split(n, fraction):
    end = int(round((1.0 - fraction) * n))
    return numpy.arange(0, end, dtype=numpy.int32), numpy.arange(end, n, dtype=numpy.int32)


def check(folder, case):
    """Compares DIR/CASE-train.npy and -valid.npy (dtrain's samples, [n, context + 1]) with the
    oracle's for the case's settings in DIR/CASE.json."""
    settings = json.load(open(os.path.join(folder, case + ".json")))
    seq, seed, fraction = settings["context"], settings["seed"], settings["fraction"]
    corpora = []
    for prefix in settings["prefixes"]:
        lengths, tokens = read_megatron(os.path.join(folder, prefix))
        train_docs, valid_docs = split(len(lengths), fraction)
        corpora.append((lengths, tokens, train_docs, valid_docs))
    weights = settings.get("weights")
    wanted = settings["samples"]
    sizes = [wanted]
    if weights:
        total = sum(weights)
        sizes = [int(numpy.ceil(numpy.ceil(wanted * w / total) * 1.005)) for w in weights]
    expected_train, expected_valid = [], []
    per_corpus = []
    for (lengths, tokens, train_docs, valid_docs), size in zip(corpora, sizes):
        train = gpt_indices(lengths, train_docs, seq, size, seed)
        valid = gpt_indices(lengths, valid_docs, seq, 0, seed)
        per_corpus.append((tokens, train))
        expected_valid += [sample_tokens(tokens, valid, i, seq)
                           for i in range(len(valid[2]))]
    if weights:
        which, local = blending_indices(weights, wanted)
        expected_train = [sample_tokens(per_corpus[c][0], per_corpus[c][1], s, seq)
                          for c, s in zip(which, local)]
    else:
        tokens, train = per_corpus[0]
        expected_train = [sample_tokens(tokens, train, i, seq) for i in range(len(train[2]))]
    problems = []
    for split_name, expected in (("train", expected_train), ("valid", expected_valid)):
        got = numpy.load(os.path.join(folder, case + "-" + split_name + ".npy"))
        expected = numpy.array(expected, dtype=numpy.int64)
        if got.shape != expected.shape:
            problems.append(f"{split_name}: dtrain has {got.shape}, Megatron {expected.shape}")
        elif not (got == expected).all():
            bad = numpy.nonzero((got != expected).any(axis=1))[0]
            problems.append(f"{split_name}: {len(bad)} samples differ, the first is {bad[0]}")
    if not weights:
        # The cached indices themselves, against Megatron's.
        cache = os.path.join(folder, case + "-cache")
        lengths, tokens, train_docs, _ = corpora[0]
        document_index, sample_index, shuffle_index = gpt_indices(lengths, train_docs, seq,
                                                                  wanted, seed)
        found = False
        for name in os.listdir(cache):
            if name.endswith("document_index.npy"):
                base = os.path.join(cache, name[:-len("document_index.npy")])
                if not open(base + "description.txt").read().endswith("index version 1"):
                    continue
                if "split train" not in open(base + "description.txt").read():
                    continue
                found = True
                for label, mine, theirs in (
                        ("document index", numpy.load(base + "document_index.npy"),
                         document_index),
                        ("sample index", numpy.load(base + "sample_index.npy"), sample_index),
                        ("shuffle index", numpy.load(base + "shuffle_index.npy"),
                         shuffle_index)):
                    if mine.shape != theirs.shape or not (mine == theirs.astype(mine.dtype)).all():
                        problems.append(f"cached {label} differs from Megatron's")
        if not found:
            problems.append("no cached training index in " + cache)
    for problem in problems:
        print(f"{case}: {problem}")
    print(f"{case}: {len(expected_train)} training and {len(expected_valid)} held-out samples "
          + ("differ" if problems else "equal to Megatron's"))
    return 1 if problems else 0


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2])
    elif sys.argv[1] == "check":
        sys.exit(check(sys.argv[2], sys.argv[3]))
