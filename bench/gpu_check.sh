#!/usr/bin/env bash
# The one prepared script for a GPU device session (issue 7): DiT training and sampling speed on the GPU.
#
#   bash bench/gpu_check.sh                # on the device machine, from the repository root
#
# Needs python3 with torch (numpy) only: bench/gpu_train.py feeds the real training step from
# a synthetic store held in GPU memory, so neither zarr nor webdataset is needed, and the
# store module is not imported. (bench/loader.py --device cuda needs zarr: not run here.)
# Writes $OUT/gpu_train.json (rewritten after every configuration, so a cut-short run keeps
# what it measured), $OUT/gpu_train.md (the printed table), $OUT/sample_throughput.{json,md}
# and $OUT/nvidia-smi.txt.
# Expected: about 3-5 minutes on an H200 (18 training configurations, eager; --compile adds minutes;
# then 8 sampling configurations).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"

# DiT-S/2, B/2, XL/2 at 256 px; no checkpointing and every block; batch 64/128/256; bf16 autocast
timeout 300 python3 bench/gpu_train.py --json "$OUT/gpu_train.json" 2>&1 | tee "$OUT/gpu_train.md"
rc=${PIPESTATUS[0]}
echo "gpu_train.py exit status: $rc"

# Evaluation sampling (issue 14): DiT-S/2 and XL/2, 250 ddpm steps and 50 Euler steps with CFG 1.5;
# about 30-60 s. Gives the FID-50K sampling time on this GPU.
timeout 150 python3 bench/sample_throughput.py --json "$OUT/sample_throughput.json" 2>&1 | tee "$OUT/sample_throughput.md"
rc2=${PIPESTATUS[0]}
echo "sample_throughput.py exit status: $rc2"
[ "$rc" -eq 0 ] && rc=$rc2
exit "$rc"
