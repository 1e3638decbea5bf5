#!/usr/bin/env bash
# shellcheck disable=SC2016  # defaults in single quotes ('$OUT/store') are expanded after the flags are read
# Text-to-image on a CLIP-filtered LAION subset.
#
#   a LAION parquet (URL + caption columns, e.g. laion2B-en part-00000.parquet)
#     1 fetch   ditdata fetch     img2dataset downloads, resizes, packs -> WebDataset image shards
#     2 score   ditdata score     CLIP similarity of every image-caption pair (open_clip ViT-B-32)
#     3 filter  ditdata filter    keep the pairs scoring >= 0.28 (LAION-5B's rule) -> a selection of keys
#     4 encode  ditdata encode    autoencoder latents of the selection + CLIP text embeddings
#                                 (pooled and per token) -> latent store
#     5 train   dittrain run      a DiT conditioned on the pooled embedding (adaLN) and the tokens
#                                 (cross-attention), caption dropout 0.1 for classifier-free guidance
#     6 sample  dittrain sample   one grid row per prompt
#
# Examples:
#   pipelines/laion_t2i.sh --parquet part-00000.parquet --dry-run          # see the commands first
#   pipelines/laion_t2i.sh --parquet part-00000.parquet --prompt "a red fox in snow" --prompt "a lighthouse"
#   # DataComp's rule instead: the top 30% by ViT-L-14 score
#   pipelines/laion_t2i.sh --parquet part-00000.parquet --clip ViT-L-14 --clip-pretrained datacomp_xl_s13b_b90k \
#       --top-fraction 0.3
#
# The settings are in pipelines/configs/laion_t2i/STAGE.toml, one file per stage, read by each
# command's --config; the flags below win over them, and --STAGE-config FILE reads your own file
# instead (start from a copy). `--help` shows each setting's value there. The filter's rule is
# the one setting kept here (--min-clip-score or --top-fraction: filter takes exactly one, and
# a flag could not take back a file's).
#
# Model weights never come from the network at run time: CLIP tags and VAE presets are read
# from the local Hugging Face cache, or pass files (--clip-pretrained FILE, --vae DIR).
# Rerun the same command after a crash or a stop (a signal stops training with a checkpoint
# and exit status 75): fetch and score keep their finished shards, and training continues
# from its latest checkpoint (--resume).
set -euo pipefail
# shellcheck source=pipelines/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

USAGE="Usage: $(basename "$0") --parquet FILE [options]
Text-to-image DiT on CLIP-filtered LAION pairs: fetch -> score -> filter -> encode -> train -> sample."

# ---- parameters: VARIABLE --flag default "help"; a default may name an earlier parameter; ----
# ---- a setting's default is in its stage's file: `setting VARIABLE --flag STAGE --its-flag` ----
param LAION_PARQUET --parquet "" "URL list: a LAION parquet (or .csv/.jsonl, or a folder of them); required to fetch"
param OUT --out "laion-t2i-out" "where shards, selection, store and run go"
param SHARDS_DIR --shards '$OUT/shards' "image shards and their CLIP scores (fetch, score)"
param SELECTION --selection '$OUT/selection.parquet' "the kept keys (ditdata filter)"
run_params "fetch,score,filter,encode,train,sample"  # STORE_DIR RUN_DIR SAMPLES_OUT STAGES DEVICE NPROC WORKERS
# fetch
config fetch ditdata fetch  # FETCH_CONFIG
setting URL_COL --url-col fetch --url-col "the URL list's URL column"
setting CAPTION_COL --caption-col fetch --caption-col "its caption column"
param KEEP_COLS --keep-cols "" "more of its columns to keep with each image, comma-separated (e.g. similarity,punsafe)"
setting RESOLUTION --resolution encode --resolution "training image size in pixels (encode: resize the short side, centre crop; also fetch's sizes when set)"
setting IMAGE_SIZE --image-size fetch --image-size "fetch: resize to this (smaller side, centre square); RESOLUTION when that is set"
setting MIN_IMAGE_SIZE --min-image-size fetch --min-image-size "fetch: skip images whose smaller side is below this (no upscaled blur); RESOLUTION when that is set"
setting MAX_ASPECT_RATIO --max-aspect-ratio fetch --max-aspect-ratio "fetch: skip images longer than this on one side"
setting SAMPLES_PER_SHARD --samples-per-shard fetch --samples-per-shard "images per shard"
setting THREADS --threads fetch --threads "download threads per fetch process"
param EXTRA_FETCH_ARGS --fetch-args "" "more options for ditdata fetch"
# score and filter
config score ditdata score  # SCORE_CONFIG
setting CLIP_CONFIG --clip-config score --clip-config "an open_clip model-config JSON, for an architecture open_clip does not know"
setting CLIP_MODEL --clip score --clip "open_clip model that scores the pairs (the stem of CLIP_CONFIG when that is set)"
setting CLIP_PRETRAINED --clip-pretrained score --pretrained "its pretrained tag (from the local HF cache) or a weights file"
param MIN_CLIP_SCORE --min-clip-score 0.28 "keep pairs with at least this CLIP score (LAION-5B: 0.28 with ViT-B-32)"
param TOP_FRACTION --top-fraction "" "keep this top fraction of the scores instead (DataComp: 0.3 with ViT-L-14)"
param EXTRA_SCORE_ARGS --score-args "" "more options for ditdata score"
param EXTRA_FILTER_ARGS --filter-args "" "more options for ditdata filter (e.g. --min-caption-length 5)"
# encode
config encode ditdata encode  # ENCODE_CONFIG
setting VAE --vae encode --vae "autoencoder: a preset (sd-vae-ft-ema, sd-vae-ft-mse, sdxl-vae, flux-vae, taef2, pixels), a local folder or a cached hub id"
setting TEXT_ENCODER --text-encoder encode --text-encoder "open_clip model that embeds the captions (CLIP_MODEL when that is set)"
setting TEXT_PRETRAINED --text-pretrained encode --text-pretrained "its pretrained tag or weights file (CLIP_PRETRAINED when that is set)"
setting TEXT_CONFIG --text-config encode --text-config "its model-config JSON, if custom (CLIP_CONFIG when that is set)"
setting switch TEXT_TOKENS --text-tokens encode --text-tokens "store per-token embeddings too, for cross-attention (off: pooled only)"
setting switch FLIP --flip encode --flip "also store flipped latents (off: captions may say left or right)"
store_params  # BACKEND ENCODE_BATCH EXTRA_ENCODE_ARGS
# train
config train dittrain run  # TRAIN_CONFIG
train_params  # MODEL BATCH ACCUM GRAD_CKPT STEPS LR ... SEED EXTRA_TRAIN_ARGS; then this recipe's own
setting WARMUP --warmup train --warmup-steps "linear warmup steps"
setting CAPTION_DROPOUT --caption-dropout train --caption-dropout "caption dropout (the empty caption), for classifier-free guidance"
setting switch QK_NORM --qk-norm train --qk-norm "normalise queries and keys (steadier attention logits)"
# sample
config sample dittrain sample  # SAMPLE_CONFIG
setting list PROMPTS --prompt sample --prompt "prompts to sample, '|'-separated (the flag is repeatable)"
setting SAMPLE_PER_PROMPT --sample-per-prompt sample --n-per-class "samples per prompt (one grid row each)"
sample_params  # CFG SAMPLE_STEPS EXTRA_SAMPLE_ARGS
parse_params "$@"
check_stages fetch score filter encode train sample
# one choice for two stages: what the user sets for one applies to the other unless set apart
inherit IMAGE_SIZE RESOLUTION
inherit MIN_IMAGE_SIZE RESOLUTION
inherit CLIP_MODEL CLIP_CONFIG "$(basename "${CLIP_CONFIG%.json}")"  # a custom model is named after its file
inherit TEXT_ENCODER CLIP_MODEL
inherit TEXT_PRETRAINED CLIP_PRETRAINED
inherit TEXT_CONFIG CLIP_CONFIG

setup_commands  # DITDATA, DITTRAIN, encode_cmd, train_cmd (torchrun when NPROC > 1), device
check_configs   # each wanted stage's settings file, read by its command before anything runs
extra_args fetch score filter encode train sample  # extra_fetch=(...) from EXTRA_FETCH_ARGS, ...
keep_col_args=()
IFS=',' read -r -a cols <<<"$KEEP_COLS"
for c in "${cols[@]}"; do keep_col_args+=(--keep-col "$c"); done
if [[ -n $TOP_FRACTION ]]; then rule=(--top-fraction "$TOP_FRACTION"); else rule=(--min-clip-score "$MIN_CLIP_SCORE"); fi

# ---- 1 fetch: URLs -> image shards (img2dataset; a rerun resumes, finished shards are kept) ----
fetch_stage "download $LAION_PARQUET -> image shards in $SHARDS_DIR" \
    LAION_PARQUET "--parquet FILE (or LAION_PARQUET) is required to fetch" "${keep_col_args[@]}"

# ---- 2 score: CLIP similarity per pair, NNNNN.clip.parquet beside each shard (a rerun skips scored shards) ----
if want score; then
    stage score "CLIP $CLIP_MODEL ($CLIP_PRETRAINED) scores of $SHARDS_DIR"
    settings score
    run "$DITDATA" score "$SHARDS_DIR" --config "$SCORE_CONFIG" "${device[@]}" --threads "$WORKERS" "${given[@]}" \
        "${extra_score[@]}"
fi

# ---- 3 filter: the scores -> the keys to train on ----
if want filter; then
    stage filter "${rule[*]} -> $SELECTION"
    run "$DITDATA" filter "$SHARDS_DIR" "${rule[@]}" --out "$SELECTION" "${extra_filter[@]}"
fi

# ---- 4 encode: the selected images -> latents + caption embeddings (the filter goes in the manifest) ----
encode_stage "$VAE latents at $RESOLUTION px + $TEXT_ENCODER text embeddings -> latent store in $STORE_DIR" \
    --select "$SELECTION"

# ---- 5 train: a text-conditioned DiT (text widths come from the store) ----
train_stage

# ---- 6 sample: one grid row per prompt, embedded with the store's text encoder ----
sample_stage "$SAMPLE_PER_PROMPT per prompt"
finish
