#!/usr/bin/env python3
"""Prints the C++ sources under the given folders that reach no heavy LibTorch header: neither
they nor any project header they include (followed through #include "...") includes a
<torch/...>, <ATen/...> or <caffe2/...> header other than the few small ones in CHEAP. CMake
compiles those without the precompiled header:
loading LibTorch's precompiled header costs a file 5-10 s before its first line (measured with
GCC 12 on an empty file: 7.7 s against Debian's LibTorch 1.13, 9.7 s against the 2.12 wheel),
several times what a file that needs no tensor takes to compile on its own.

  torch_free_sources.py ROOT FOLDER... -> one absolute path a line

Only speed depends on this list: a file compiles either way (a stale list after an edit is
corrected at the next configure).
"""
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
TORCH = ("torch/", "ATen/", "c10/", "caffe2/")
# LibTorch headers that stay small (under a thousand headers with all they include, against
# ~4,300 for ATen/ATen.h): the tensor's own class, one operator's header, c10's utilities, the
# TCP store.
CHEAP = ("c10/", "ATen/core/Tensor.h", "ATen/ops/", "ATen/Parallel.h",
         "torch/csrc/distributed/c10d/TCPStore.hpp")


def main():
    root = os.path.abspath(sys.argv[1])
    search = [os.path.join(root, "include"), os.path.join(root, "src"), root]
    memo = {}

    def reaches_torch(path, stack):
        if path in memo:
            return memo[path]
        if path in stack:  # an include cycle: decided by the files outside it
            return False
        stack.add(path)
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
        found = False
        for kind, name in INCLUDE.findall(text):
            if kind == "<":
                if name.startswith(TORCH) and not name.startswith(CHEAP):
                    found = True
                    break
                continue
            for base in [os.path.dirname(path)] + search:
                candidate = os.path.normpath(os.path.join(base, name))
                if os.path.isfile(candidate):
                    if reaches_torch(candidate, stack):
                        found = True
                    break
            if found:
                break
        stack.discard(path)
        memo[path] = found
        return found

    for folder in sys.argv[2:]:
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in sorted(files):
                if name.endswith(".cpp"):
                    path = os.path.join(dirpath, name)
                    if not reaches_torch(path, set()):
                        print(path)


if __name__ == "__main__":
    main()
