#!/usr/bin/env bash
# Builds the binaries scripts/gpu-check.sh runs, into .gpu/ (ignored by git):
# the device tests (tensor and DTensor), bench_cuda and train, optimised, with the `cuda` feature. They
# load CUDA at run time, so any x86-64 Linux machine with glibc no newer than
# the GPU machine's builds them.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
cargo build --release --features cuda --example bench_cuda --example train
cp target/release/examples/bench_cuda target/release/examples/train .gpu/
test=$(cargo test --release --features cuda -p tessera-tensor --test cuda --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "cuda" and m.get("executable"): print(m["executable"])')
cp "$test" .gpu/cuda-tests
test=$(cargo test --release --features cuda --test cuda_dtensor --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "cuda_dtensor" and m.get("executable"): print(m["executable"])')
cp "$test" .gpu/cuda-dtensor-tests
strip .gpu/cuda-tests .gpu/cuda-dtensor-tests .gpu/bench_cuda .gpu/train
ls -la .gpu
