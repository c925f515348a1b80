#!/usr/bin/env bash
# Checkpoints across frameworks, checked with PyTorch (PYTHON names a Python
# with PyTorch 2.15, safetensors and transformers; CI runs this when
# TESSERA_INTEROP=1):
#
#   PYTHON=~/peers-venv/bin/python scripts/interop-pytorch.sh
#
# - Tessera -> PyTorch: `train` saves a sharded checkpoint on 2 ranks (FSDP)
#   and on 4 (FSDP over TP 2 x 2) and the consolidated weights; PyTorch's
#   distributed checkpoint reads every weight of each onto 2 and 3 gloo ranks
#   (HuggingFaceStorageReader) bit for bit.
# - The LLaMA model for Hugging Face (`train --save-hf`): transformers'
#   LlamaForCausalLM loads every weight bit for bit and gives Tessera's loss.
# - Round trips PyTorch -> Tessera -> PyTorch and Tessera -> PyTorch ->
#   Tessera, resharding onto 3 ranks on Tessera's side (reshard_checkpoint).
# - PyTorch -> Tessera: the checkpoint PyTorch wrote on 2 ranks
#   (scripts/sharded_safetensors_fixture.py) is written again now and loaded
#   by the checkpoint tests' fixture check.
# Exits non-zero on any mismatch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:?set PYTHON to a Python with PyTorch 2.15}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cargo build --release --example train
for run in "fsdp2:--world-size 2" "fsdp_tp_2x2:--world-size 4 --tp 2"; do
    name=${run%%:*}
    # shellcheck disable=SC2086
    target/release/examples/train ${run#*:} --steps 2 --checkpoint-dir "$work/$name" --checkpoint-every 2 \
        --save-full "$work/$name.safetensors" >/dev/null
    for world in 2 3; do
        "$PY" scripts/interop_pytorch.py "$work/$name/step_000002" "$work/$name.safetensors" "$world"
    done
done
# The LLaMA export: Hugging Face's LlamaForCausalLM (transformers) loads
# `train --save-hf` and gives Tessera's loss on the same rows.
target/release/examples/train --model llama --n-kv-heads 2 --ffn-hidden 192 \
    --init tests/data/llama_tiny_init.safetensors --tokens tests/data/tiny_tokens_G16.safetensors \
    --world-size 2 --batch 8 --steps 1 --lr 0 --save-full "$work/llama.safetensors" --save-hf "$work/llama_hf" \
    --losses-out "$work/llama_losses.json" >/dev/null
"$PY" scripts/interop_hf.py "$work/llama_hf" "$work/llama.safetensors" tests/data/tiny_tokens_G16.safetensors \
    "$work/llama_losses.json"
# Round trips, tensors bit for bit at every stop. PyTorch -> Tessera ->
# PyTorch: PyTorch's checkpoint (the fixture) resharded by Tessera onto 3 ranks
# and saved, read back by PyTorch on 2. Tessera -> PyTorch -> Tessera:
# Tessera's FSDP checkpoint read by PyTorch on 2 ranks and saved as sharded
# safetensors, resharded by Tessera onto 3 and saved, read by PyTorch again.
cargo build --release --example reshard_checkpoint
reshard=target/release/examples/reshard_checkpoint
fixture=tests/data/sharded_safetensors
"$reshard" "$fixture/shards" "$work/rt_tessera" --world-size 3
"$PY" scripts/interop_pytorch.py "$work/rt_tessera" "$fixture/full/full.safetensors" 2
"$PY" scripts/interop_pytorch.py "$work/fsdp2/step_000002" "$work/fsdp2.safetensors" 2 "$work/rt_pytorch"
"$reshard" "$work/rt_pytorch" "$work/rt_back" --world-size 3
"$PY" scripts/interop_pytorch.py "$work/rt_back" "$work/fsdp2.safetensors" 2
"$PY" scripts/sharded_safetensors_fixture.py "$work/fixture"
for f in "$work"/fixture/shards/*.safetensors; do
    cmp <("$PY" -c 'import sys; from safetensors.torch import load_file; t=load_file(sys.argv[1]); print(sorted((k, v.dtype, tuple(v.shape), v.float().sum().item()) for k, v in t.items()))' "$f") \
        <("$PY" -c 'import sys; from safetensors.torch import load_file; t=load_file(sys.argv[1]); print(sorted((k, v.dtype, tuple(v.shape), v.float().sum().item()) for k, v in t.items()))' "tests/data/sharded_safetensors/shards/$(basename "$f")")
done
echo "interop with PyTorch: ok"
