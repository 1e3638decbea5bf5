#!/usr/bin/env bash
# shellcheck disable=SC2016  # defaults in single quotes ('$OUT/store') are expanded after the flags are read
# ImageNet 256x256, class-conditional: the DiT paper's recipe (Peebles & Xie, "Scalable
# Diffusion Models with Transformers", 2023) on one GPU.
#
#   ILSVRC2012 train/ (n01440764/*.JPEG, ... 1000 class folders)
#     1 fetch   ditdata fetch     class folders -> WebDataset image shards (labels = sorted folder names)
#     2 encode  ditdata encode    sd-vae-ft-ema at 256 px, + the horizontally flipped latent -> latent store
#     3 train   dittrain run      DiT-XL/2: AdamW lr 1e-4, no weight decay, global batch 256, EMA 0.9999,
#                                 class dropout 0.1 (for CFG), DDPM with learned sigma, 400k steps, bf16
#     4 sample  dittrain sample   a grid with one row per class, classifier-free guidance 4.0
#     5 fid     dittrain sample --npz + dittrain eval: FID-50K against ADM's reference batch
#               (not run by default: --stages fid --fid-ref VIRTUAL_imagenet256_labeled.npz)
#
# Examples:
#   pipelines/imagenet256.sh --imagenet /data/imagenet/train --dry-run     # see the commands first
#   pipelines/imagenet256.sh --imagenet /data/imagenet/train               # the paper's settings
#   # a 24 GB card: recompute activations and split the global batch of 256 into 4 micro-batches of 64
#   GRAD_CKPT=every ACCUM=4 pipelines/imagenet256.sh --imagenet /data/imagenet/train
#   # 8 GPUs on one machine: torchrun for encode and train (the global batch stays 256)
#   NPROC=8 pipelines/imagenet256.sh --imagenet /data/imagenet/train
#   # FID-50K of the finished run (250 ddpm steps, CFG 1.5; see README "Measuring a run")
#   pipelines/imagenet256.sh --stages fid --fid-ref VIRTUAL_imagenet256_labeled.npz
#
# Rerun the same command after a crash or a stop: fetch and encode keep their finished
# shards, and training continues from its latest checkpoint (--resume).
set -euo pipefail
# shellcheck source=pipelines/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

USAGE="Usage: $(basename "$0") --imagenet DIR [options]
ImageNet-256 class-conditional DiT (the DiT paper's settings): fetch -> encode -> train -> sample."

# ---- parameters: VARIABLE --flag default "help"; a default may name an earlier parameter ----
param IMAGENET_DIR --imagenet "" "ILSVRC2012 train folder, one folder per class (required to fetch)"
param OUT --out "imagenet256-out" "where shards, store and run go"
param SHARDS_DIR --shards '$OUT/shards' "image shards (ditdata fetch)"
param STORE_DIR --store '$OUT/store' "latent store (ditdata encode)"
run_params "fetch,encode,train,sample"  # RUN_DIR SAMPLES_OUT STAGES DEVICE NPROC WORKERS
# fetch
param FETCH_SIZE --fetch-size "" "resize while packing (e.g. 288: smaller side, centre square) to save disk; none keeps the originals"
param SAMPLES_PER_SHARD --samples-per-shard 10000 "images per shard"
param EXTRA_FETCH_ARGS --fetch-args "" "more options for ditdata fetch"
# encode
param VAE --vae sd-vae-ft-ema "autoencoder: a preset (sd-vae-ft-ema, sd-vae-ft-mse, sdxl-vae, flux-vae, taef2, pixels), a local folder or a cached hub id"
param RESOLUTION --resolution 256 "image size in pixels (resize the short side, centre crop)"
switch FLIP --flip 1 "also store the latent of the flipped image (the paper's only augmentation)"
store_params  # BACKEND ENCODE_BATCH EXTRA_ENCODE_ARGS
# train
train_params  # MODEL BATCH ACCUM GRAD_CKPT STEPS LR ... SEED EXTRA_TRAIN_ARGS; then this recipe's own
default MODEL DiT-XL/2
default LR 1e-4 "AdamW learning rate (constant)"
default GRAD_CLIP 0 "max gradient norm (0: none, as in the paper)"
default OBJECTIVE ddpm "ddpm (epsilon + learned sigma, as in the paper) or flow"
param CLASS_DROPOUT --class-dropout 0.1 "label dropout, for classifier-free guidance"
# sample
param SAMPLE_CLASSES --sample-classes "207,360,387,974,88,979,417,279" "classes to sample: indices, names or all (the default: the paper's figure classes)"
param SAMPLE_PER_CLASS --sample-per-class 4 "samples per class (one grid row each)"
sample_params  # CFG SAMPLE_STEPS EXTRA_SAMPLE_ARGS
default CFG 4.0 "classifier-free guidance scale (the paper: 4.0 for pictures, 1.5 for FID)"
default SAMPLE_STEPS 250 "sampling steps (the paper: 250 DDPM steps)"
# fid (the DiT paper's FID-50K protocol)
param FID_REF --fid-ref "" "FID reference: ADM's VIRTUAL_imagenet256_labeled.npz (required for the fid stage)"
param FID_N --fid-n 50000 "samples for FID"
param FID_CFG --fid-cfg 1.5 "guidance scale for FID (the paper: 1.5)"
param FID_STEPS --fid-steps 250 "ddpm steps for FID (the paper: 250)"
param FID_DIR --fid-dir '$RUN_DIR/fid' "where samples.npz and fid.json go"
param INCEPTION --inception "" "the FID Inception weights file (default: \$DITKIT_INCEPTION or the torch hub cache)"
parse_params "$@"
check_stages fetch encode train sample fid

setup_commands  # DITDATA, DITTRAIN, encode_cmd, train_cmd (torchrun when NPROC > 1)
extra_args fetch encode train sample  # extra_fetch=(...) from EXTRA_FETCH_ARGS, ...
sigma=()
[[ $OBJECTIVE == ddpm ]] && sigma=(--learn-sigma)  # DiT's learned variance (on for ddpm anyway)

# ---- 1 fetch: class folders -> image shards (an interrupted fetch resumes: finished shards are kept) ----
fetch_stage "ImageNet class folders -> image shards in $SHARDS_DIR" \
    IMAGENET_DIR "--imagenet DIR (or IMAGENET_DIR) is required to fetch" \
    --kind classes ${FETCH_SIZE:+--image-size "$FETCH_SIZE"} \
    --samples-per-shard "$SAMPLES_PER_SHARD" --processes "$WORKERS" "${extra_fetch[@]}"

# ---- 2 encode: image shards -> latent store (an interrupted encode resumes: finished shards are kept) ----
encode_stage "$VAE latents at $RESOLUTION px -> latent store in $STORE_DIR" \
    --vae "$VAE" --resolution "$RESOLUTION" "$(on_off FLIP --flip)"

# ---- 3 train: DiT on the latents (in_channels, size, classes come from the store) ----
train_stage --objective "$OBJECTIVE" "${sigma[@]}" \
    --batch-size "$BATCH" --accumulation-steps "$ACCUM" --grad-checkpointing "$GRAD_CKPT" \
    --lr "$LR" --weight-decay "$WEIGHT_DECAY" --lr-schedule constant --warmup-steps 0 \
    --grad-clip "$GRAD_CLIP" --ema "$EMA" --class-dropout "$CLASS_DROPOUT"

# ---- 4 sample: the EMA weights, one grid row per class ----
sample_stage "$SAMPLE_PER_CLASS per class of $SAMPLE_CLASSES" \
    --classes "$SAMPLE_CLASSES" --n-per-class "$SAMPLE_PER_CLASS"

# ---- 5 fid: FID-50K samples (resumable chunks; torchrun when NPROC > 1), then the metrics ----
if want fid; then
    stage fid "FID-$FID_N of $RUN_DIR against ${FID_REF:-<FID_REF>} -> $FID_DIR/fid.json"
    need FID_REF "--fid-ref REF (or FID_REF) is required for the fid stage"
    [[ $DRY_RUN == 1 ]] || mkdir -p "$FID_DIR"
    run "${sample_cmd[@]}" --ckpt "$RUN_DIR" --num-samples "$FID_N" --npz "$FID_DIR/samples.npz" \
        --cfg "$FID_CFG" --steps "$FID_STEPS" --seed "$SEED" --device "$DEVICE"
    run "$DITTRAIN" eval --samples "$FID_DIR/samples.npz" --ref "$FID_REF" ${INCEPTION:+--inception "$INCEPTION"} \
        --device "$DEVICE" --json "$FID_DIR/fid.json"
fi
finish
