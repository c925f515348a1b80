#!/usr/bin/env bash
# The GPU checks of the CUDA backend, in one run on a machine with an NVIDIA
# GPU and CUDA's libraries in its Python environment (no Rust toolchain
# needed there): the device tests against the host kernels, the kernels'
# rates beside PyTorch's on the same shapes, and a summary table last.
#
#   scripts/gpu-check.sh [DIR]    # DIR holds the prebuilt binaries (default .gpu)
#   SKIP_BENCH=1 scripts/gpu-check.sh   # the checks without the timings
#   NCU=1 scripts/gpu-check.sh          # and the GPU time of each kernel in one step (Nsight Compute)
#
# Build the binaries on any x86-64 machine first:
#   scripts/gpu-build.sh          # -> .gpu/cuda-tests, .gpu/bench_cuda
set -u
DIR=${1:-.gpu}
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
PY=${PY:-python3}

# CUDA's libraries: the driver's libcuda from the system, NVRTC, cuBLAS and
# NCCL from the Python environment's nvidia-* wheels (cudarc also looks for
# the unversioned libnccl.so, which the wheel does not ship: link it).
SITE=$($PY -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)
LIBS=$(find "$SITE/nvidia" -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)
mkdir -p /tmp/tessera-cudalibs
for lib in nccl nvrtc cublas cublasLt; do
    f=$(find "$SITE/nvidia" -name "lib$lib.so.*" 2>/dev/null | grep -v alt | sort | head -1)
    [ -n "$f" ] && ln -sf "$f" /tmp/tessera-cudalibs/lib$lib.so
done
export LD_LIBRARY_PATH=/tmp/tessera-cudalibs:$LIBS:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

status=0
if [ -z "${SKIP_TESTS:-}" ]; then
echo "== device tests (against the host kernels)"
timeout 150 "$DIR/cuda-tests" --ignored --test-threads=1 --nocapture 2>&1 | tee "$OUT/tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== DTensor on one GPU (against the host)"
timeout 150 "$DIR/cuda-dtensor-tests" --ignored --test-threads=1 --nocapture 2>&1 | tee "$OUT/dtensor.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

fi
if [ -z "${SKIP_PARITY:-}" ]; then
echo "== train --device cuda against PyTorch's losses (tests/data/tiny_reference.json, llama_reference.json)"
D=tests/data
train() {
    name=$1
    init=$2
    shift 2
    timeout 120 "$DIR/train" --device cuda --steps 20 --init "$D/$init" \
        --tokens $D/tiny_tokens_G16.safetensors --losses-out "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1 ||
        { echo "$name failed:"; tail -3 "$OUT/$name.log"; status=1; }
}
train single_G8 tiny_init.safetensors --world-size 1 --batch 8
train fsdp_W2_G8 tiny_init.safetensors --world-size 2 --batch 4
train fsdp_tp_2x2_G8 tiny_init.safetensors --world-size 4 --tp 2 --batch 4
train fsdp_W2_G8_bf16 tiny_init.safetensors --world-size 2 --batch 4 --mixed-precision bf16
LLAMA="llama_tiny_init.safetensors --model llama --n-kv-heads 2 --ffn-hidden 192"
train llama_single_G8 $LLAMA --world-size 1 --batch 8
train llama_fsdp_tp_2x2_G8 $LLAMA --world-size 4 --tp 2 --batch 4
train llama_fsdp_W2_G8_bf16 $LLAMA --world-size 2 --batch 4 --mixed-precision bf16
$PY - "$OUT" <<'PYEOF' || status=1
import json, os, sys
out = sys.argv[1]
refs = {"": json.load(open("tests/data/tiny_reference.json"))["runs"],
        "llama_": json.load(open("tests/data/llama_reference.json"))["runs"]}
bad = 0
for run, tol in [("single_G8", 1e-5), ("fsdp_W2_G8", 1e-5), ("fsdp_tp_2x2_G8", 1e-5), ("fsdp_W2_G8_bf16", 1e-3),
                 ("llama_single_G8", 1e-5), ("llama_fsdp_tp_2x2_G8", 1e-5), ("llama_fsdp_W2_G8_bf16", 1e-3)]:
    p = os.path.join(out, run + ".json")
    if not os.path.exists(p):
        print(f"parity {run:<18} no result"); bad += 1; continue
    got = json.load(open(p))["loss"]
    prefix = "llama_" if run.startswith("llama_") else ""
    want = refs[prefix][run[len(prefix):]]["loss"]
    worst = max(abs(a - b) for a, b in zip(got, want))
    ok = len(got) == len(want) and worst <= tol
    bad += not ok
    print(f"parity {run:<18} max |dloss| {worst:.2e} over {len(got)} steps (tolerance {tol:g}) {'ok' if ok else 'FAILED'}")
sys.exit(1 if bad else 0)
PYEOF

fi
if [ -z "${SKIP_BENCH:-}" ]; then
echo "== bench_cuda"
timeout 100 "$DIR/bench_cuda" --reps 10 2>&1 | tee "$OUT/bench.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== PyTorch on the same shapes (TF32 off)"
timeout 100 $PY - <<'PYEOF' 2>&1 | tee "$OUT/torch.txt"
import torch, statistics, time
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = "cuda"
def bench(f, reps=20):
    for _ in range(3): f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)
shapes = [("bench qkv", 128, 128, 384), ("bench mlp", 128, 128, 512), ("bench head", 128, 128, 512),
          ("large qkv", 4096, 1024, 3072), ("large mlp up", 4096, 1024, 4096), ("large mlp down", 4096, 4096, 1024),
          ("large head", 4096, 1024, 32000), ("square 8192", 8192, 8192, 8192)]
print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
for dt, name in [(torch.float32, "f32"), (torch.bfloat16, "bf16")]:
    for label, m, k, n in shapes:
        a = torch.randn(m, k, device=dev).to(dt); b = torch.randn(k, n, device=dev).to(dt)
        s = bench(lambda: a @ b, 10 if m * k * n > 1 << 36 else 20)
        print(f"matmul {label} {m}x{k}x{n}".ljust(40), name.ljust(5), f"{s*1e3:10.3f} ms {2*m*k*n/s/1e12:10.1f} TFLOP/s")
n = 64 << 20
for dt, name in [(torch.float32, "f32"), (torch.bfloat16, "bf16")]:
    x = torch.randn(n // 4096, 4096, device=dev).to(dt); y = torch.randn_like(x); w = torch.randn(4096, device=dev).to(dt)
    by = n * x.element_size()
    for label, passes, f in [("add", 3, lambda: x + y), ("gelu", 2, lambda: torch.nn.functional.gelu(x)),
                             ("softmax rows", 2, lambda: torch.softmax(x, 1)),
                             ("layer_norm rows", 2, lambda: torch.nn.functional.layer_norm(x, (4096,), w, w)),
                             ("transpose copy", 2, lambda: x.t().contiguous())]:
        s = bench(f)
        print(f"{label} 64M".ljust(40), name.ljust(5), f"{s*1e3:10.3f} ms {passes*by/s/1e9:10.1f} GB/s")
PYEOF

echo "== summary: Tessera against PyTorch (rate ratio; >= 1 is as fast or faster)"
$PY - "$OUT/bench.txt" "$OUT/torch.txt" <<'PYEOF'
import re, sys
def rows(p):
    out = {}
    for line in open(p):
        m = re.match(r"(.{40}) (\w+)\s+([\d.]+) ms\s+([\d.]+) (\S+)", line)
        if m: out[(m.group(1).strip(), m.group(2))] = (float(m.group(3)), float(m.group(4)), m.group(5))
    return out
ours, theirs = rows(sys.argv[1]), rows(sys.argv[2])
for k, (ms, rate, unit) in ours.items():
    t = theirs.get(k)
    ratio = f"{rate / t[1]:.2f}" if t and t[1] > 0 else "-"
    print(f"{k[0]:<40} {k[1]:<5} ours {rate:9.1f} torch {t[1] if t else float('nan'):9.1f} {unit:<8} ratio {ratio}")
PYEOF
fi
if [ -z "${SKIP_SPEED:-}" ]; then
echo "== train step time against PyTorch (one GPU, eager, TF32 off)"
BENCH_CFG="--dim 256 --n-layers 4 --n-heads 8 --vocab 4096 --seq 128"
LARGE_CFG="--dim 1024 --n-layers 8 --n-heads 16 --vocab 32000 --seq 512"
speed() {
    name=$1 cfg=$2 batch=$3 steps=$4 bf16=$5
    ours=""
    theirs=""
    if [ "$bf16" = 1 ]; then ours="--mixed-precision bf16"; theirs="--bf16"; fi
    # shellcheck disable=SC2086
    timeout 240 "$DIR/train" --device cuda --world-size 1 $cfg --batch "$batch" --steps "$steps" $ours \
        --losses-out "$OUT/speed_$name.json" >"$OUT/speed_$name.log" 2>&1 ||
        { echo "$name (Tessera) failed:"; tail -3 "$OUT/speed_$name.log"; status=1; }
    grep -E "^device:" "$OUT/speed_$name.log"
    # shellcheck disable=SC2086
    timeout 240 $PY scripts/torch_gpu_train.py $cfg --batch "$batch" --steps "$steps" $theirs \
        >"$OUT/torch_$name.json" 2>"$OUT/torch_$name.err" ||
        { echo "$name (PyTorch) failed:"; tail -3 "$OUT/torch_$name.err"; status=1; }
}
speed bench_f32 "$BENCH_CFG" 8 200 0
speed bench_bf16 "$BENCH_CFG" 8 20 1
speed large_f32 "$LARGE_CFG" 8 8 0
speed large_bf16 "$LARGE_CFG" 8 8 1
$PY - "$OUT" <<'PYEOF'
import json, os, statistics, sys
out = sys.argv[1]
cfgs = {"bench": (256, 4, 4096, 128), "large": (1024, 8, 32000, 512)}
PEAK = 989.4e12  # dense bf16 of an H100/H200 SXM, by the datasheet
for name in ["bench_f32", "bench_bf16", "large_f32", "large_bf16"]:
    try:
        ours = json.load(open(os.path.join(out, f"speed_{name}.json")))
        theirs = json.load(open(os.path.join(out, f"torch_{name}.json")))
    except Exception as e:
        print(f"speed {name:<11} no result ({e})"); continue
    o = statistics.median(ours["step_time_s"][2:])
    t = theirs["median_step_s"]
    d, L, V, S = cfgs[name.split("_")[0]]
    tokens = 8 * S
    flops = 6 * theirs["params"] * tokens + 12 * L * d * S * tokens
    r = ours.get("device_reserved_bytes_per_step", [])
    growth = (r[-1] - r[min(2, len(r) - 1)]) if len(r) > 1 else 0
    print(f"speed {name:<11} Tessera {o*1e3:8.2f} ms  PyTorch {t*1e3:8.2f} ms  ratio {o/t:5.2f}  "
          f"MFU {flops/o/PEAK*100:5.1f}% (PyTorch {flops/t/PEAK*100:5.1f}%)  device peak: tracker "
          f"{max(ours['device_peak_bytes_per_rank'])/2**20:.0f} MiB, allocator in use "
          f"{ours.get('device_allocator_peak_allocated_bytes', 0)/2**20:.0f} MiB, reserved "
          f"{ours.get('device_allocator_peak_reserved_bytes', 0)/2**20:.0f} MiB, PyTorch "
          f"{theirs['peak_allocated_bytes']/2**20:.0f} MiB; reserved growth from step 3 to {len(r)}: {growth} B")
PYEOF
fi
if [ -z "${SKIP_PROFILE:-}" ]; then
echo "== where the large config's step goes (train --profile: every op waits for its kernels)"
for mp in none bf16; do
    timeout 120 "$DIR/train" --device cuda --world-size 1 --dim 1024 --n-layers 8 --n-heads 16 --vocab 32000 \
        --seq 512 --batch 8 --steps 8 --mixed-precision $mp --losses-out "$OUT/plain_$mp.json" >/dev/null 2>&1 &&
        $PY -c 'import json,statistics,sys; t=json.load(open(sys.argv[1]))["step_time_s"][2:]; print(f"-- unprofiled: {statistics.median(t)*1e3:.2f} ms per step (median of {len(t)})")' "$OUT/plain_$mp.json"
    timeout 120 "$DIR/train" --device cuda --world-size 1 --dim 1024 --n-layers 8 --n-heads 16 --vocab 32000 \
        --seq 512 --batch 8 --steps 6 --mixed-precision $mp --profile >"$OUT/profile_$mp.log" 2>&1 ||
        { echo "profile $mp failed:"; tail -3 "$OUT/profile_$mp.log"; status=1; }
    echo "-- mixed precision $mp"
    sed -n '/^profile of/,/^init:/p' "$OUT/profile_$mp.log" | grep -v '^init:'
done
fi
if [ -n "${NCU:-}" ]; then
echo "== GPU time per kernel over one step of the large config, ours and PyTorch's (Nsight Compute)"
NCU_BIN=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
LARGE="--dim 1024 --n-layers 8 --n-heads 16 --vocab 32000 --seq 512 --batch 8"
ncu_run() {
    timeout 120 "$NCU_BIN" --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
        --launch-count 6000 "$@" >"$OUT/ncu.csv" 2>/dev/null
}
for mp in none bf16; do
    echo "-- mixed precision $mp"
    # shellcheck disable=SC2086
    ncu_run "$DIR/train" --device cuda --world-size 1 $LARGE --steps 4 --mixed-precision $mp &&
        $PY scripts/ncu_step.py "$OUT/ncu.csv" cross_entropy_rows 25 | tee "$OUT/ncu_ours_$mp.txt"
    theirs=""
    [ "$mp" = bf16 ] && theirs="--bf16"
    # shellcheck disable=SC2086
    ncu_run $PY scripts/torch_gpu_train.py $LARGE --steps 4 $theirs &&
        $PY scripts/ncu_step.py "$OUT/ncu.csv" cunn_SoftMaxForward 25 | tee "$OUT/ncu_torch_$mp.txt"
done
rm -f "$OUT/ncu.csv"
fi
grep -E "^test result|FAILED|panicked" "$OUT/tests.log" "$OUT/dtensor.log" 2>/dev/null | tail -8
echo "gpu-check exit $status"
exit $status
