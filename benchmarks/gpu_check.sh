#!/usr/bin/env bash
# The GPU checks of issues 25-27 in one run, on the GPU machine (the `device` tool): the CUDA tests, the
# Lightning FSDP/ModelParallel script and the real torchtitan Trainer run side by side, then the GPU
# benchmark and the fingerprint benchmark (GPU_FP_BENCH=0 skips it). Results land in $OUT (or ./gpu-out).
# Wheels the image lacks travel in .whl/ (crc32c, torchdata, torchtitan and its pure-Python needs); the
# image's own torch (and the triton it comes with) is used. benchmarks/gpu_wheels.sh fetches the wheels (here, before the run). docs/benchmarks.md "The GPU path" has the results.
# The 9,000-tensor blocking time alone with gathered staging (issue 27; docs/benchmarks.md "Gathered staging
# of small device tensors"), ~3 minutes:
#   GPU_TESTS=tests/gpu/test_cuda.py GPU_SKIP_FRAMEWORKS=1 GPU_FP_BENCH=0 GPU_BENCH_ARGS="--cases 512x3000,2048x300
#   --rounds 5 --variants pinned-foreach,pinned-bulk,sp-async-process,sp-async-thread" bash benchmarks/gpu_check.sh
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
# The fused fingerprint kernel needs Triton and a C compiler (Triton builds its launcher with one); without
# either, GPU fingerprints fall back to the torch ops and the Triton checks below fail, saying why.
{ command -v cc gcc || echo "no C compiler"; python3 -c 'import triton; print("triton", triton.__version__)'; } >> "$OUT/machine.txt" 2>&1
declare -A job
timeout "${GPU_TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" --timeout 200 -v \
    ${GPU_TESTS:-tests/gpu tests/store/test_fingerprint_cuda.py} > "$OUT/gpu_tests.log" 2>&1 & job[tests]=$!
# CPU benchmarks on an idle node with cores to spare (issue 27: async_writer="auto"'s threshold, the small
# state's sync save): GPU_SIDE_CMD (a shell command, e.g. "python3 benchmarks/bench_auto_writer.py; python3
# benchmarks/bench_small_state.py --steps 0 --rounds 0") runs on the last four cores, beside the GPU jobs.
if [ -n "${GPU_SIDE_CMD:-}" ]; then
    last=$(( $(nproc) - 1 ))
    timeout "${GPU_SIDE_S:-230}" taskset -c $((last - 3))-$last bash -c "$GPU_SIDE_CMD" > "$OUT/side.log" 2>&1 &
    job[side]=$!
fi
if [ -z "${GPU_SKIP_FRAMEWORKS:-}" ]; then
    timeout "${GPU_FW_S:-260}" python3 tests/integrations/gpu_lightning_fsdp.py > "$OUT/lightning.log" 2>&1 & job[lightning]=$!
    timeout "${GPU_FW_S:-260}" python3 tests/integrations/gpu_torchtitan_run.py --device cuda --attention sdpa --timeout 110 --workdir /tmp/sptt > "$OUT/torchtitan.log" 2>&1 & job[torchtitan]=$!
fi
rc=0
: > "$OUT/summary.txt"
for name in "${!job[@]}"; do  # not piped: wait must run in this shell, the jobs' parent
    if wait "${job[$name]}"; then echo "PASS $name" >> "$OUT/summary.txt"; else echo "FAIL $name (rc $?)" >> "$OUT/summary.txt"; rc=1; fi
done
cat "$OUT/summary.txt"
tail -5 "$OUT/gpu_tests.log"
[ -f "$OUT/side.log" ] && grep -v "creating a new checkpoint root" "$OUT/side.log"
if [ "${GPU_BENCH_ARGS:-}" != "none" ]; then
    timeout "${GPU_BENCH_S:-240}" python3 benchmarks/bench_gpu.py ${GPU_BENCH_ARGS:---cases 2048x300,512x3000 --rounds 3} --out "$OUT/bench_gpu.json" > "$OUT/bench_gpu.log" 2>&1
    # Each case's summary: medians, ratios, and the parts of the async saves (cpu_s, gc_s, copy_s).
    grep -A60 '"median_blocked_s"' "$OUT/bench_gpu.log" | grep -v '^ *[{}]' | head -150
fi
if [ "${GPU_FP_BENCH:-1}" != "0" ]; then  # the fingerprint kernels against the pinned copy (~20-30 s)
    timeout "${GPU_FP_BENCH_S:-120}" python3 benchmarks/bench_fingerprint.py ${GPU_FP_BENCH_ARGS:-} --out "$OUT/bench_fingerprint.json" > "$OUT/bench_fingerprint.log" 2>&1
    echo "bench_fingerprint rc $?" >> "$OUT/summary.txt"
    tail -30 "$OUT/bench_fingerprint.log"
fi
exit $rc
