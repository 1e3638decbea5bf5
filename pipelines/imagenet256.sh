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
#   # your own training settings: a copy of pipelines/configs/imagenet256/train.toml, edited
#   pipelines/imagenet256.sh --imagenet /data/imagenet/train --train-config my-train.toml
#   # FID-50K of the finished run (250 ddpm steps, CFG 1.5; see docs/measuring.md)
#   pipelines/imagenet256.sh --stages fid --fid-ref VIRTUAL_imagenet256_labeled.npz
#
# The settings (the paper's) are in pipelines/configs/imagenet256/STAGE.toml, one file per
# stage, read by each command's --config; the flags below win over them, and --STAGE-config FILE
# reads your own file instead (start from a copy). `--help` shows each setting's value there.
#
# Rerun the same command after a crash or a stop (a signal stops training with a checkpoint
# and exit status 75): fetch and encode keep their finished shards, and training continues
# from its latest checkpoint (--resume).
set -euo pipefail
# shellcheck source=pipelines/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

USAGE="Usage: $(basename "$0") --imagenet DIR [options]
ImageNet-256 class-conditional DiT (the DiT paper's settings): fetch -> encode -> train -> sample."

# ---- parameters: VARIABLE --flag default "help"; a default may name an earlier parameter; ----
# ---- a setting's default is in its stage's file: `setting VARIABLE --flag STAGE --its-flag` ----
param IMAGENET_DIR --imagenet "" "ILSVRC2012 train folder, one folder per class (required to fetch)"
param OUT --out "imagenet256-out" "where shards, store and run go"
param SHARDS_DIR --shards '$OUT/shards' "image shards (ditdata fetch)"
run_params "fetch,encode,train,sample"  # STORE_DIR RUN_DIR SAMPLES_OUT STAGES DEVICE NPROC WORKERS
# fetch
config fetch ditdata fetch  # FETCH_CONFIG
setting FETCH_SIZE --fetch-size fetch --image-size "resize while packing (e.g. 288: smaller side, centre square) to save disk; not set: the originals"
setting SAMPLES_PER_SHARD --samples-per-shard fetch --samples-per-shard "images per shard"
param EXTRA_FETCH_ARGS --fetch-args "" "more options for ditdata fetch"
# encode
config encode ditdata encode  # ENCODE_CONFIG
setting VAE --vae encode --vae "autoencoder: a preset (sd-vae-ft-ema, sd-vae-ft-mse, sdxl-vae, flux-vae, taef2, pixels), a local folder or a cached hub id"
setting RESOLUTION --resolution encode --resolution "image size in pixels (resize the short side, centre crop)"
setting switch FLIP --flip encode --flip "also store the latent of the flipped image (the paper's only augmentation)"
store_params  # BACKEND ENCODE_BATCH EXTRA_ENCODE_ARGS
# train
config train dittrain run  # TRAIN_CONFIG
train_params  # MODEL BATCH ACCUM GRAD_CKPT STEPS LR ... SEED EXTRA_TRAIN_ARGS; then this recipe's own
setting CLASS_DROPOUT --class-dropout train --class-dropout "label dropout, for classifier-free guidance"
# sample
config sample dittrain sample  # SAMPLE_CONFIG
setting SAMPLE_CLASSES --sample-classes sample --classes=class "classes to sample: indices, names or all (the file's: the paper's figure classes)"
setting SAMPLE_PER_CLASS --sample-per-class sample --n-per-class "samples per class (one grid row each)"
sample_params  # CFG SAMPLE_STEPS EXTRA_SAMPLE_ARGS
# fid (the DiT paper's FID-50K protocol)
config fid dittrain sample  # FID_CONFIG
param FID_REF --fid-ref "" "FID reference: ADM's VIRTUAL_imagenet256_labeled.npz (required for the fid stage)"
setting FID_N --fid-n fid --num-samples=n "samples for FID"
setting FID_CFG --fid-cfg fid --cfg "guidance scale for FID (the paper: 1.5)"
setting FID_STEPS --fid-steps fid --steps "ddpm steps for FID (the paper: 250)"
param FID_DIR --fid-dir '$RUN_DIR/fid' "where samples.npz and fid.json go"
param INCEPTION --inception "" "the FID Inception weights file (default: \$DITKIT_INCEPTION or the torch hub cache)"
parse_params "$@"
check_stages fetch encode train sample fid

setup_commands  # DITDATA, DITTRAIN, encode_cmd, train_cmd (torchrun when NPROC > 1), device
check_configs   # each wanted stage's settings file, read by its command before anything runs
extra_args fetch encode train sample  # extra_fetch=(...) from EXTRA_FETCH_ARGS, ...

# ---- 1 fetch: class folders -> image shards (an interrupted fetch resumes: finished shards are kept) ----
fetch_stage "ImageNet class folders -> image shards in $SHARDS_DIR" \
    IMAGENET_DIR "--imagenet DIR (or IMAGENET_DIR) is required to fetch"

# ---- 2 encode: image shards -> latent store (an interrupted encode resumes: finished shards are kept) ----
encode_stage "$VAE latents at $RESOLUTION px -> latent store in $STORE_DIR"

# ---- 3 train: DiT on the latents (in_channels, size, classes come from the store) ----
train_stage

# ---- 4 sample: the EMA weights, one grid row per class ----
sample_stage "$SAMPLE_PER_CLASS per class of $SAMPLE_CLASSES"

# ---- 5 fid: FID-50K samples (resumable chunks; torchrun when NPROC > 1), then the metrics ----
if want fid; then
    stage fid "FID-$FID_N of $RUN_DIR against ${FID_REF:-<FID_REF>} -> $FID_DIR/fid.json"
    need FID_REF "--fid-ref REF (or FID_REF) is required for the fid stage"
    [[ $DRY_RUN == 1 ]] || mkdir -p "$FID_DIR"
    settings fid
    run "${sample_cmd[@]}" --config "$FID_CONFIG" --ckpt "$RUN_DIR" --npz "$FID_DIR/samples.npz" "${device[@]}" \
        "${given[@]}"
    run "$DITTRAIN" eval --samples "$FID_DIR/samples.npz" --ref "$FID_REF" ${INCEPTION:+--inception "$INCEPTION"} \
        "${device[@]}" --json "$FID_DIR/fid.json"
fi
finish
