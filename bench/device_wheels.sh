#!/usr/bin/env bash
# Fetch, HERE (PyPI is reachable), the wheels bench/gpu_check.sh installs on the device machine
# (Python 3.12, x86-64, no internet): zarr and its needs, for the real loaders' rows of
# bench/gpu_train.py (resident-cuda, streaming). Everything else the GPU benchmarks use (torch,
# numpy, pyyaml, packaging, typing-extensions) is in the device image. Writes .whl/ (git-ignored);
# name it in the device call's carry.
#
#   bash bench/device_wheels.sh && du -sh .whl
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
mkdir -p .whl
for pkg in zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.8.0; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$pkg"
done
ls -l .whl
