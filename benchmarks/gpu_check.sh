#!/usr/bin/env bash
# The GPU checks of issues 25-27 in one run, on the GPU machine (the `device` tool): CUDA tests, then the
# GPU benchmark. Results land in $OUT (or ./gpu-out). Wheels the image lacks travel in .whl/ (crc32c,
# torchdata); the image's own torch is used. See docs/benchmarks.md "The GPU path".
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "python", sys.version.split()[0])';
  nproc; free -g | head -2; df -h /dev/shm /tmp | tail -2; } 2>&1 | tee "$OUT/machine.txt"
rc=0
timeout "${GPU_TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" --timeout 200 -v ${GPU_TESTS:-tests/gpu} 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
timeout "${GPU_BENCH_S:-240}" python3 benchmarks/bench_gpu.py ${GPU_BENCH_ARGS:---cases 2048x300,512x3000 --rounds 3} --out "$OUT/bench_gpu.json" 2>&1 | tail -60 | tee "$OUT/bench_gpu.log"
exit $rc
