"""Writes tiny.safetensors, the fixture of mpi_tests/test_weights_file.cpp.

Run with the PyPI packages `safetensors` and `numpy` (any recent version):
    python3 -m venv /tmp/st && /tmp/st/bin/pip install safetensors numpy
    /tmp/st/bin/python data/weights/make_tiny.py data/weights/tiny.safetensors

Every element of tensor number k (the order of TENSORS) at row-major flat
index i is

    value(k, i) = ((7 * i + 13 * k) % 101 - 50) / 64

a multiple of 1/64 between -50/64 and 50/64, exact in float32 and float16,
so the test computes the same values independently and compares them with
exact equality.
"""
import sys

import numpy as np
from safetensors.numpy import save_file

# name, shape, dtype (k is the position in this list)
TENSORS = [
    ("fc1.weight", (37, 16), np.float32),  # 37 rows: uneven over 2 and 4 ranks
    ("fc1.bias", (37,), np.float32),
    ("fc2.weight", (8, 37), np.float32),
    ("fc2.bias", (8,), np.float32),
    ("half.weight", (5, 3), np.float16),  # a float16 tensor (dtype checks)
]


def value(k, shape, dtype):
    i = np.arange(int(np.prod(shape)), dtype=np.int64)
    return (((7 * i + 13 * k) % 101 - 50) / 64.0).astype(dtype).reshape(shape)


def main(path):
    tensors = {name: value(k, shape, dtype) for k, (name, shape, dtype) in enumerate(TENSORS)}
    save_file(tensors, path, metadata={"formula": "((7*i + 13*k) % 101 - 50) / 64"})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny.safetensors")
