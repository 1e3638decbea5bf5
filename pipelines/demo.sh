#!/usr/bin/env bash
# The offline CPU demo, end to end, on real data that ships with scikit-learn:
#
#   1,797 handwritten digits (load_digits, 10 classes) -> a class-folder tree of PNGs
#   -> ditdata fetch   (WebDataset image shards)
#   -> ditdata encode  (latent store; --vae pixels, or TAEF2 when its weights are given)
#   -> dittrain run    (a tiny class-conditional DiT, rectified flow)
#   -> dittrain sample (a grid with one row per digit, and every sample as its own PNG)
#
# Usage: bash pipelines/demo.sh [--out DIR] [--steps N] [--taef2 DIR] [--quick]
#   --out DIR     where everything goes (default ./demo-out, or $DEMO_OUT)
#   --steps N     training steps (default 1200, or $DEMO_STEPS)
#   --taef2 DIR   encode with the TAEF2 autoencoder (DIR holds taef2_encoder.pth and
#                 taef2_decoder.pth; or set $DITKIT_TAEF2) at 64 px instead of raw pixels
#   --quick       a few steps and a few samples: checks the pipeline, not the pictures
set -euo pipefail

OUT=${DEMO_OUT:-./demo-out}
STEPS=${DEMO_STEPS:-1200}
TAEF2=${DITKIT_TAEF2:-}
PER_CLASS=8
SAMPLE_STEPS=40
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --taef2) TAEF2=$2; shift 2 ;;
    --quick) STEPS=4; PER_CLASS=2; SAMPLE_STEPS=4; shift ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "demo.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

# The tools of the active environment, else of the repository's .venv.
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=""
command -v ditdata >/dev/null 2>&1 || bin="$repo/.venv/bin/"
PYTHON=${PYTHON:-${bin}python}
DITDATA=${DITDATA:-${bin}ditdata}
DITTRAIN=${DITTRAIN:-${bin}dittrain}
export HF_HUB_OFFLINE=1 NO_ALBUMENTATIONS_UPDATE=1

if [ -n "$TAEF2" ]; then
  VAE=$TAEF2; RES=64      # 64 px digits -> 32 x 8 x 8 TAEF2 latents
else
  VAE=pixels; RES=16      # the image itself: 3 x 16 x 16
fi

mkdir -p "$OUT"
# A demo run starts clean (only what this script writes is removed).
rm -rf "$OUT/digits" "$OUT/shards" "$OUT/store" "$OUT/run" "$OUT/samples"

timings=()
stage() {  # stage NAME COMMAND...: run, time and remember it
  local name=$1; shift
  echo "== $name: $*" >&2
  local t0=$EPOCHREALTIME
  "$@"
  timings+=("$(awk -v n="$name" -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%-8s %6.1f s", n, b - a }')")
}

digits_tree() {  # real scanned digits (8x8, 0-16) as upscaled greyscale PNGs, one folder per class
  "$PYTHON" "$repo/pipelines/digits.py" "$OUT/digits" "$RES"
}

stage digits digits_tree
stage fetch "$DITDATA" fetch "$OUT/digits" --out "$OUT/shards" --kind classes --samples-per-shard 512 -q
# No --flip: a mirrored digit is not a digit.
stage encode "$DITDATA" encode "$OUT/shards" --vae "$VAE" --resolution "$RES" --out "$OUT/store" \
  --device cpu --workers 1 --batch-size 64
stage train "$DITTRAIN" run --latents "$OUT/store" --out "$OUT/run" --model DiT-T/4 --objective flow \
  --batch-size 32 --lr 1e-3 --ema 0.99 --max-steps "$STEPS" --save-every "$STEPS" --log-every 50 \
  --sample-every 0 --device cpu
stage sample "$DITTRAIN" sample --ckpt "$OUT/run" --classes all --n-per-class "$PER_CLASS" \
  --cfg 3.0 --steps "$SAMPLE_STEPS" --seed 0 --device cpu --grid-scale 4 --out "$OUT/samples"

echo >&2
printf '%s\n' "${timings[@]}" >&2
echo "grid (one row per digit 0-9): $OUT/samples/grid.png" >&2
echo "each sample:                  $OUT/samples/samples/<class>/NNNN.png" >&2
