#!/usr/bin/env python3
"""Checks a safetensors file written by `fsdp-checkpoint export` against the
baseline of dcp-make-checkpoint (manifest.json + raw/*.bin, exact bytes).
Standard library only (json, struct).

  check-safetensors.py <file.safetensors> <baseline dir> <step> [--rank-local]

Checks: 8-byte little-endian header length N, a multiple of 8, the header
JSON padded with spaces; __metadata__ {step, source} as strings; every
tensor's dtype name and shape; data_offsets contiguous from 0, in header
order, ending at the end of the file; the names exactly the baseline's
(rank-local ones only with --rank-local); and every tensor's bytes equal to
the baseline's.
"""
import json
import os
import struct
import sys

ST = {"float32": ("F32", 4), "float64": ("F64", 8), "float16": ("F16", 2),
      "bfloat16": ("BF16", 2), "int64": ("I64", 8), "int32": ("I32", 4),
      "int16": ("I16", 2), "int8": ("I8", 1), "uint8": ("U8", 1), "bool": ("BOOL", 1)}


def main():
    path, base, step = sys.argv[1], sys.argv[2], sys.argv[3]
    rank_local = "--rank-local" in sys.argv[4:]
    errors = []
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    if n % 8 != 0:
        errors.append(f"header length {n} is not a multiple of 8")
    text = data[8:8 + n].decode("utf-8")
    if len(text) - len(text.rstrip(" ")) > 7:
        errors.append("header padding is more than 7 spaces")
    header = json.loads(text)
    meta = header.pop("__metadata__", None)
    if meta is None:
        errors.append("no __metadata__")
    else:
        if meta.get("step") != step:
            errors.append(f"__metadata__.step {meta.get('step')!r}, expected {step!r}")
        if not isinstance(meta.get("source"), str) or not meta["source"].startswith("/"):
            errors.append(f"__metadata__.source {meta.get('source')!r} is not an absolute path")
    buf = data[8 + n:]
    with open(os.path.join(base, "manifest.json")) as f:
        manifest = json.load(f)
    want = {k: v for k, v in manifest.items() if rank_local or not v["rank_local"]}
    if set(header) != set(want):
        errors.append(f"names {sorted(header)} != baseline {sorted(want)}")
    offset = 0
    for name, h in header.items():  # in header (file) order
        b, e = h["data_offsets"]
        if b != offset:
            errors.append(f"{name}: data begins at {b}, expected {offset}")
        offset = e
        if name not in want:
            continue
        w = want[name]
        code, size = ST[w["dtype"]]
        if h["dtype"] != code:
            errors.append(f"{name}: dtype {h['dtype']}, expected {code}")
        if h["shape"] != w["shape"]:
            errors.append(f"{name}: shape {h['shape']}, expected {w['shape']}")
        count = 1
        for s in w["shape"]:
            count *= s
        if e - b != count * size:
            errors.append(f"{name}: {e - b} bytes, expected {count * size}")
        with open(os.path.join(base, w["file"]), "rb") as f:
            expect = f.read()
        if buf[b:e] != expect:
            errors.append(f"{name}: bytes differ from the baseline")
    if offset != len(buf):
        errors.append(f"data ends at {offset}, the file's buffer has {len(buf)} bytes")
    for e in errors:
        print("FAIL:", e)
    if errors:
        return 1
    print(f"safetensors OK: {path}: header {n} bytes, {len(header)} tensors, {len(buf)} data "
          f"bytes, all bitwise equal to the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
