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
# Model weights never come from the network at run time: CLIP tags and VAE presets are read
# from the local Hugging Face cache, or pass files (--clip-pretrained FILE, --vae DIR).
# Rerun the same command after a crash or a stop: fetch and score keep their finished shards,
# and training continues from its latest checkpoint (--resume).
set -euo pipefail
# shellcheck source=pipelines/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

USAGE="Usage: $(basename "$0") --parquet FILE [options]
Text-to-image DiT on CLIP-filtered LAION pairs: fetch -> score -> filter -> encode -> train -> sample."

# ---- parameters: VARIABLE --flag default "help"; a default may name an earlier parameter ----
param LAION_PARQUET --parquet "" "URL list: a LAION parquet (or .csv/.jsonl, or a folder of them); required to fetch"
param URL_COL --url-col URL "its URL column"
param CAPTION_COL --caption-col TEXT "its caption column"
param KEEP_COLS --keep-cols "" "more of its columns to keep with each image, comma-separated (e.g. similarity,punsafe)"
param OUT --out "laion-t2i-out" "where shards, selection, store and run go"
param SHARDS_DIR --shards '$OUT/shards' "image shards and their CLIP scores (fetch, score)"
param SELECTION --selection '$OUT/selection.parquet' "the kept keys (ditdata filter)"
param STORE_DIR --store '$OUT/store' "latent store (ditdata encode)"
run_params "fetch,score,filter,encode,train,sample"  # RUN_DIR SAMPLES_OUT STAGES DEVICE NPROC WORKERS
# fetch
param RESOLUTION --resolution 256 "training image size in pixels (encode: resize the short side, centre crop)"
param IMAGE_SIZE --image-size '$RESOLUTION' "fetch: resize to this (smaller side, centre square)"
param MIN_IMAGE_SIZE --min-image-size '$RESOLUTION' "fetch: skip images whose smaller side is below this (no upscaled blur)"
param MAX_ASPECT_RATIO --max-aspect-ratio 2 "fetch: skip images longer than this on one side"
param SAMPLES_PER_SHARD --samples-per-shard 10000 "images per shard"
param THREADS --threads 64 "download threads per fetch process"
param EXTRA_FETCH_ARGS --fetch-args "" "more options for ditdata fetch"
# score and filter
param CLIP_CONFIG --clip-config "" "an open_clip model-config JSON, for an architecture open_clip does not know"
clip_default() { if [[ -n $CLIP_CONFIG ]]; then basename "${CLIP_CONFIG%.json}"; else echo ViT-B-32; fi; }
param CLIP_MODEL --clip '$(clip_default)' "open_clip model that scores the pairs" "ViT-B-32, or the stem of CLIP_CONFIG"
param CLIP_PRETRAINED --clip-pretrained laion2b_s34b_b79k "its pretrained tag (from the local HF cache) or a weights file"
param MIN_CLIP_SCORE --min-clip-score 0.28 "keep pairs with at least this CLIP score (LAION-5B: 0.28 with ViT-B-32)"
param TOP_FRACTION --top-fraction "" "keep this top fraction of the scores instead (DataComp: 0.3 with ViT-L-14)"
param EXTRA_SCORE_ARGS --score-args "" "more options for ditdata score"
param EXTRA_FILTER_ARGS --filter-args "" "more options for ditdata filter (e.g. --min-caption-length 5)"
# encode
param VAE --vae sd-vae-ft-ema "autoencoder: a preset (sd-vae-ft-ema, sd-vae-ft-mse, sdxl-vae, flux-vae, taef2, pixels), a local folder or a cached hub id"
param TEXT_ENCODER --text-encoder '$CLIP_MODEL' "open_clip model that embeds the captions"
param TEXT_PRETRAINED --text-pretrained '$CLIP_PRETRAINED' "its pretrained tag or weights file"
param TEXT_CONFIG --text-config '$CLIP_CONFIG' "its model-config JSON, if custom"
switch TEXT_TOKENS --text-tokens 1 "store per-token embeddings too, for cross-attention (off: pooled only)"
switch FLIP --flip 0 "also store flipped latents (off: captions may say left or right)"
store_params  # BACKEND ENCODE_BATCH EXTRA_ENCODE_ARGS
# train
train_params  # MODEL BATCH ACCUM GRAD_CKPT STEPS LR ... SEED EXTRA_TRAIN_ARGS; then this recipe's own
default SAMPLE_EVERY 10000 "EMA sample grid (of the store's own captions) every N steps (0: never)"
param WARMUP --warmup 0 "linear warmup steps"
param CAPTION_DROPOUT --caption-dropout 0.1 "caption dropout (the empty caption), for classifier-free guidance"
switch QK_NORM --qk-norm 0 "normalise queries and keys (steadier attention logits)"
# sample
list PROMPTS --prompt "a photograph of a cat sitting on a sofa|a red sports car on a mountain road|a bowl of fruit on a wooden table|a lighthouse on a cliff at sunset" "prompts to sample, '|'-separated (the flag is repeatable)"
param SAMPLE_PER_PROMPT --sample-per-prompt 4 "samples per prompt (one grid row each)"
sample_params  # CFG SAMPLE_STEPS EXTRA_SAMPLE_ARGS
parse_params "$@"
check_stages fetch score filter encode train sample

setup_commands  # DITDATA, DITTRAIN, encode_cmd, train_cmd (torchrun when NPROC > 1)
extra_args fetch score filter encode train sample  # extra_fetch=(...) from EXTRA_FETCH_ARGS, ...
keep_col_args=()
IFS=',' read -r -a cols <<<"$KEEP_COLS"
for c in "${cols[@]}"; do keep_col_args+=(--keep-col "$c"); done
clip_config=()
[[ -n $CLIP_CONFIG ]] && clip_config=(--clip-config "$CLIP_CONFIG")
text_config=()
[[ -n $TEXT_CONFIG ]] && text_config=(--text-config "$TEXT_CONFIG")
if [[ -n $TOP_FRACTION ]]; then rule=(--top-fraction "$TOP_FRACTION"); else rule=(--min-clip-score "$MIN_CLIP_SCORE"); fi
prompt_args=()
IFS='|' read -r -a items <<<"$PROMPTS"
for p in "${items[@]}"; do prompt_args+=(--prompt "$p"); done

# ---- 1 fetch: URLs -> image shards (img2dataset; a rerun resumes, finished shards are kept) ----
fetch_stage "download $LAION_PARQUET -> image shards in $SHARDS_DIR" \
    LAION_PARQUET "--parquet FILE (or LAION_PARQUET) is required to fetch" \
    --kind urls --url-col "$URL_COL" --caption-col "$CAPTION_COL" "${keep_col_args[@]}" \
    --image-size "$IMAGE_SIZE" --resize-mode center_crop --min-image-size "$MIN_IMAGE_SIZE" \
    --max-aspect-ratio "$MAX_ASPECT_RATIO" --samples-per-shard "$SAMPLES_PER_SHARD" \
    --processes "$WORKERS" --threads "$THREADS" "${extra_fetch[@]}"

# ---- 2 score: CLIP similarity per pair, NNNNN.clip.parquet beside each shard (a rerun skips scored shards) ----
if want score; then
    stage score "CLIP $CLIP_MODEL ($CLIP_PRETRAINED) scores of $SHARDS_DIR"
    run "$DITDATA" score "$SHARDS_DIR" --clip "$CLIP_MODEL" --pretrained "$CLIP_PRETRAINED" "${clip_config[@]}" \
        --device "$DEVICE" --threads "$WORKERS" "${extra_score[@]}"
fi

# ---- 3 filter: the scores -> the keys to train on ----
if want filter; then
    stage filter "${rule[*]} -> $SELECTION"
    run "$DITDATA" filter "$SHARDS_DIR" "${rule[@]}" --out "$SELECTION" "${extra_filter[@]}"
fi

# ---- 4 encode: the selected images -> latents + caption embeddings (the filter goes in the manifest) ----
encode_stage "$VAE latents at $RESOLUTION px + $TEXT_ENCODER text embeddings -> latent store in $STORE_DIR" \
    --select "$SELECTION" --vae "$VAE" --resolution "$RESOLUTION" "$(on_off FLIP --flip)" \
    --text-encoder "$TEXT_ENCODER" --text-pretrained "$TEXT_PRETRAINED" "${text_config[@]}" \
    "$(on_off TEXT_TOKENS --text-tokens)"

# ---- 5 train: a text-conditioned DiT (text widths come from the store) ----
train_stage --objective "$OBJECTIVE" \
    --batch-size "$BATCH" --accumulation-steps "$ACCUM" --grad-checkpointing "$GRAD_CKPT" \
    --lr "$LR" --warmup-steps "$WARMUP" --weight-decay "$WEIGHT_DECAY" --grad-clip "$GRAD_CLIP" \
    --ema "$EMA" --caption-dropout "$CAPTION_DROPOUT" "$(on_off QK_NORM --qk-norm)"

# ---- 6 sample: one grid row per prompt, embedded with the store's text encoder ----
sample_stage "$SAMPLE_PER_PROMPT per prompt" "${prompt_args[@]}" --n-per-class "$SAMPLE_PER_PROMPT"
finish
