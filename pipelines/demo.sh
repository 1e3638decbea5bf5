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
#   --steps N     training steps (default 1200, configs/demo/train.toml's; or $DEMO_STEPS)
#   --taef2 DIR   encode with the TAEF2 autoencoder (DIR holds taef2_encoder.pth and
#                 taef2_decoder.pth; or set $DITKIT_TAEF2) at 64 px instead of raw pixels
#   --quick       a few steps and a few samples: checks the pipeline, not the pictures
#
# Each command reads its settings from pipelines/configs/demo/STAGE.toml (--config); the
# options above only add to them.
set -euo pipefail

OUT=${DEMO_OUT:-./demo-out}
TAEF2=${DITKIT_TAEF2:-}
train_args=() sample_args=()  # what --steps and --quick change in configs/demo/train.toml, sample.toml
[ -n "${DEMO_STEPS:-}" ] && train_args=(--max-steps "$DEMO_STEPS" --save-every "$DEMO_STEPS")
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --steps) train_args=(--max-steps "$2" --save-every "$2"); shift 2 ;;
    --taef2) TAEF2=$2; shift 2 ;;
    --quick) train_args=(--max-steps 4 --save-every 4); sample_args=(--n-per-class 2 --steps 4); shift ;;
    -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

# The tools of the active environment, else of the repository's .venv.
repo=$(cd "$(dirname "$0")/.." && pwd)
configs=$repo/pipelines/configs/demo
bin=""
command -v ditdata >/dev/null 2>&1 || bin="$repo/.venv/bin/"
PYTHON=${PYTHON:-${bin}python}
DITDATA=${DITDATA:-${bin}ditdata}
DITTRAIN=${DITTRAIN:-${bin}dittrain}
export HF_HUB_OFFLINE=1 NO_ALBUMENTATIONS_UPDATE=1

encode_args=()
RES=16                    # the image itself: 3 x 16 x 16 (the resolution of configs/demo/encode.toml)
if [ -n "$TAEF2" ]; then
  RES=64                  # 64 px digits -> 32 x 8 x 8 TAEF2 latents
  encode_args=(--vae "$TAEF2" --resolution "$RES")
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
stage fetch "$DITDATA" fetch "$OUT/digits" --config "$configs/fetch.toml" --out "$OUT/shards"
stage encode "$DITDATA" encode "$OUT/shards" --config "$configs/encode.toml" --out "$OUT/store" "${encode_args[@]}"
stage train "$DITTRAIN" run --config "$configs/train.toml" --latents "$OUT/store" --out "$OUT/run" "${train_args[@]}"
stage sample "$DITTRAIN" sample --config "$configs/sample.toml" --ckpt "$OUT/run" --out "$OUT/samples" "${sample_args[@]}"

echo >&2
printf '%s\n' "${timings[@]}" >&2
echo "grid (one row per digit 0-9): $OUT/samples/grid.png" >&2
echo "each sample:                  $OUT/samples/samples/<class>/NNNN.png" >&2
