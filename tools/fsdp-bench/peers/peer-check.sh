#!/usr/bin/env bash
# fsdp_bench_peer_parity_np2: the PyTorch benchmark peer (tools/fsdp-bench/peers)
# trains the same model as fsdp-bench train. compare.py runs both at np 2 for two
# steps; the losses after them must agree -- libfsdp's single with the peer's
# single (the same model, init and data on the same LibTorch), libfsdp's fsdp and
# ddp with torch-fsdp2 and torch-ddp -- and the table must carry every row and
# target line.
#
#   tools/fsdp-bench/peers/peer-check.sh <fsdp-bench> <python with torch>
set -euo pipefail
bench="$1" python="$2"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$python" "$root/tools/fsdp-bench/peers/compare.py" --fsdp-bench "$bench" --np 2 \
  --dtypes float32 --rounds 1 --steps 2 --warmup 0 --mpiexec-args "--bind-to none" \
  --libfsdp-configs single,ddp,fsdp --peer-configs single,torch-ddp,torch-fsdp2 \
  --json "$out/compare.json" | tee "$out/table.txt"
grep -q '^# target plan np 2 float32: fsdp step vs torch-fsdp2: ' "$out/table.txt"
"$python" - "$out/compare.json" <<'PY'
import json, sys
points = {p["config"]: p for p in json.load(open(sys.argv[1]))["points"]}
want = ["single", "ddp", "fsdp", "torch-single", "torch-ddp", "torch-fsdp2"]
missing = [c for c in want if c not in points]
if missing:
    sys.exit(f"peer-check: rows missing: {missing}")
bad = []
# fp32 sums in another order (sharded, bucketed) differ in the last bits.
for ours, theirs, tol in (("single", "torch-single", 1e-6), ("fsdp", "torch-fsdp2", 1e-5),
                          ("ddp", "torch-ddp", 1e-5)):
    a, b = points[ours]["final_loss"], points[theirs]["final_loss"]
    print(f"peer-check: {ours} {a:.9f} vs {theirs} {b:.9f}: |diff| {abs(a - b):.2e} (tol {tol})")
    if not abs(a - b) <= tol:
        bad.append(ours)
for c in want:
    if not points[c]["step_ms"] > 0:
        bad.append(f"{c} step time")
if bad:
    sys.exit(f"peer-check: mismatch: {bad}")
PY
echo "peer-check: libfsdp and the PyTorch peer train the same model"
