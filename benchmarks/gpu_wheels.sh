#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.sh needs on the GPU machine (the `device` tool) that its image lacks, fetched
# HERE into .whl/ (ignored: `echo /.whl/ >> .git/info/exclude`), for its Python 3.12 on x86_64; each `run`
# then names ".whl" in carry, and gpu_check.sh installs them. Versions are the dev lock's. The image has torch,
# triton, fsspec, rich, xxhash, numpy, lightning and pytest (device tool, KINDS.md); it lacks crc32c (every
# check), and torchdata, torchtitan and its own needs (the torchtitan Trainer run, skipped with
# GPU_SKIP_FRAMEWORKS=1), and torchao (the CUDA NF4 checks). One version of each: two stop the install there.
set -eu
cd "$(dirname "$0")/.."
version() { grep -hiE "^$1==" requirements-dev.lock requirements-torchtitan.lock | head -1; }
want=("$(version crc32c)" "$(version torchao)")  # torchao: tests/gpu/test_cuda_wrappers.py (NF4)
if [ -z "${GPU_SKIP_FRAMEWORKS:-}" ]; then
    for name in torchdata torchtitan spmd-types tyro docstring-parser typeguard; do want+=("$(version "$name")"); done
fi
mkdir -p .whl
for spec in "${want[@]}"; do
    [ -n "$spec" ] || { echo "gpu_wheels: a package is missing from the locks" >&2; exit 1; }
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec" 2>&1 | grep -v "^WARNING: Location" || true
done
ls .whl
du -sh .whl
