#!/usr/bin/env bash
# The one prepared script for a GPU device session (issues 7, 14, 17, 25, 26): DiT training step speed
# (the trainer's own step: dittrain.train.step.TrainStep, eager against torch.compile, CUDA graphs,
# checkpointing, host syncs, the SDPA kernel, the loaders' data wait) and sampling speed.
#
#   bash bench/device_wheels.sh     # HERE, once: zarr wheels into .whl/ (for the real loaders' rows)
#   bash bench/gpu_check.sh         # on the device machine, from the repository root; carry .whl
#
# Needs python3 with torch and numpy; with .whl/ present, zarr is installed from it into
# /tmp/site first (the rows with the real resident and streaming loaders need it; without it
# they are recorded as skipped). Writes $OUT/gpu_train.json (rewritten after every
# configuration, so a cut-short run keeps what it measured), $OUT/gpu_train.md (the printed
# table), $OUT/sample_throughput.{json,md} and $OUT/nvidia-smi.txt.
# Expected: about 9-10 minutes on an H200 (21 training configurations, most compiled: each
# compile 20-60 s; gpu_train.py stops at 330 s, keeping the rows measured, so that the whole script
# fits a 10-minute command; the 4 recipe rows, at most 150 s; then 8 sampling configurations, about 1 minute).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

nvidia-smi | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"

# bench/gpu_train.py's default list: XL/2, S/2, B/2 at batch 256, eager / compiled (blocks,
# model) / CUDA graphs, checkpointing every block / selective, the real loaders, XL/2 with --repa
# on synthetic targets and with --route 0.5:2:24 (eager and compiled: against the rows without),
# LightningDiT-XL/1 on VA-VAE's 32x16x16 latents (in order of importance: a cut-short run keeps
# the first rows)
timeout 330 python3 bench/gpu_train.py --json "$OUT/gpu_train.json" 2>&1 | tee "$OUT/gpu_train.md"
rc=${PIPESTATUS[0]}
echo "gpu_train.py exit status: $rc"

# One row per published recipe (pipelines/configs/recipes/*.toml, issue 35): its [run] settings at its
# global batch and precision (micro-batches of at most 256, selective checkpointing where needed):
# step time and peak memory; about 1-2 minutes, not measured yet.
timeout 150 python3 bench/gpu_train.py --steps 5 --json "$OUT/gpu_recipes.json" \
    --configs "recipe:dit_xl2;recipe:dit_xl2_tread;recipe:sit_xl2_repa;recipe:lightningdit_xl1_vavae" \
    2>&1 | tee "$OUT/gpu_recipes.md"
echo "gpu_train.py (recipes) exit status: ${PIPESTATUS[0]}"

# Evaluation sampling (issue 14): DiT-S/2 and XL/2, 250 ddpm steps and 50 Euler steps with CFG 1.5;
# about 30-60 s. Gives the FID-50K sampling time on this GPU.
timeout 120 python3 bench/sample_throughput.py --json "$OUT/sample_throughput.json" 2>&1 | tee "$OUT/sample_throughput.md"
rc2=${PIPESTATUS[0]}
echo "sample_throughput.py exit status: $rc2"
timeout 120 python3 bench/activation_memory.py --device cuda --check "DiT-XL/2:64:none;DiT-XL/2:64:every;DiT-XL/2:64:selective;DiT-B/2:64:mlp" 2>&1 | tee "$OUT/activation_check.md"  # issue 27: dittrain plan's CPU-measured bf16 rows against CUDA
[ "$rc" -eq 0 ] && rc=$rc2
exit "$rc"
