"""The safetensors crate's own reader and writer as dtrain's oracle (tests/safetensors_test.cpp):
  python safetensors_oracle.py write PATH   writes the reference tensors with safetensors.torch
  python safetensors_oracle.py check PATH   reads dtrain's file of them and checks every value
The reference tensors: arange-based values of several dtypes and shapes, the same formula as the
test's C++."""
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def reference():
    return {
        "f64": (torch.arange(12, dtype=torch.float64) / 7).reshape(3, 4),
        "f32": (torch.arange(24, dtype=torch.float32) / 3 - 2).reshape(2, 3, 4),
        "bf16": (torch.arange(8, dtype=torch.float32) / 4).to(torch.bfloat16),
        "f16": (torch.arange(6, dtype=torch.float32) / 8).to(torch.float16).reshape(2, 3),
        "i64": torch.arange(5, dtype=torch.int64) * 1000003,
        "u8": torch.arange(7, dtype=torch.uint8) * 30,
        "bool": torch.arange(4) % 2 == 0,
        "scalar": torch.tensor(2.5, dtype=torch.float32),
        "empty": torch.zeros(0, 3, dtype=torch.float32),
    }


def main():
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "write":
        save_file(reference(), path, metadata={"format": "pt"})
        return 0
    want = reference()
    with safe_open(path, framework="pt") as f:
        names = set(f.keys())
        if names != set(want):
            print(f"names differ: {sorted(names)} vs {sorted(want)}")
            return 1
        for name, expected in want.items():
            got = f.get_tensor(name)
            if got.dtype != expected.dtype or got.shape != expected.shape or \
                    not torch.equal(got, expected):
                print(f"{name}: {got} vs {expected}")
                return 1
        if f.metadata() != {"format": "pt", "written_by": "dtrain"}:
            print(f"metadata {f.metadata()}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
