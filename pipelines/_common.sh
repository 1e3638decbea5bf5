# shellcheck shell=bash
# pipelines/_common.sh: the few shell helpers the recipes share. Sourced, never run.
#
#   param VAR --flag DEFAULT "help" [shown default]   a value: --flag X, --flag=X or VAR=X in the environment
#   switch VAR --flag 0|1 "help"                      on/off: --flag / --no-flag, or VAR=1 / VAR=0
#   list VAR --flag "a|b" "help"                      '|'-separated; each --flag X adds one item
#   default VAR VALUE ["help" [shown]]                another default (and help) for a declared one
#   run_params STAGES / store_params / train_params / sample_params
#                           the parameters both recipes declare, in groups (each further down)
#   parse_params "$@"       flags win over the environment, which wins over the default; defaults are
#                           evaluated in declaration order, so one may name an earlier one ('$OUT/store')
#   need VAR "message"      VAR must be set: die with the message, or in a dry run show <VAR> instead
#   extra_args STAGE ...    the array extra_STAGE of $EXTRA_STAGE_ARGS (split on spaces), for each
#   on_off VAR --flag       --flag when $VAR is 1, else --no-flag
#   check_stages A B ...    refuse a stage name in $STAGES that is not one of these
#   want STAGE              is STAGE listed in $STAGES?
#   stage NAME "what"       start a stage: prints "# [NAME] what"
#   run CMD ARGS...         print the command, then (unless --dry-run) run it and time it
#   skip "why"              the stage has nothing to do
#   skip_if_done FILE "why" skip the stage (true) when FILE, the mark of its finished output, exists
#   fetch_stage / encode_stage / train_stage / sample_stage
#                           the stages both recipes run, with the recipe's own arguments (further down)
#   resume_flag RUN_DIR     sets resume=(--resume) when RUN_DIR holds checkpoints, else resume=()
#   finish                  the time each stage took
#
# Commands are printed shell-quoted, stage headers as '#' comments, so the output of --dry-run
# is itself a script you can read, edit and run.

_PARAMS=()
declare -A _FLAG=() _DEFAULT=() _SHOWN=() _HELP=() _KIND=() _SET=() _FROM_FLAG=()
_TIMES=()
DRY_RUN=${DRY_RUN:-0}
_STAGE=""

param() {
    _PARAMS+=("$1"); _FLAG[$1]=$2; _DEFAULT[$1]=$3; _HELP[$1]=$4; _SHOWN[$1]=${5-$3}; _KIND[$1]=value
}

switch() {
    param "$@"; _KIND[$1]=switch
}

list() {
    param "$@"; _KIND[$1]=list
}

default() {
    _DEFAULT[$1]=$2; _SHOWN[$1]=${4-$2}
    if (($# > 2)); then _HELP[$1]=$3; fi
}

die() { echo "$(basename "$0"): $*" >&2; exit 2; }

usage() {
    # $USAGE (set by the recipe) first, then one line per parameter.
    printf '%s\n\nOptions (each flag'"'"'s value name is also its environment variable; flags win):\n' "$USAGE"
    printf '  %-38s %s\n' "--dry-run" "print the commands without running them (DRY_RUN=1)"
    printf '  %-38s %s\n' "-h, --help" "this help"
    local v left shown
    for v in "${_PARAMS[@]}"; do
        if [[ ${_KIND[$v]} == switch ]]; then
            left="${_FLAG[$v]}, --no-${_FLAG[$v]#--}"
            shown=$([[ ${_DEFAULT[$v]} == 1 ]] && echo on || echo off)
            printf '  %-38s %s [%s: %s]\n' "$left" "${_HELP[$v]}" "$v" "$shown"
        else
            left="${_FLAG[$v]} $v"
            [[ ${_KIND[$v]} == list ]] && left+=" ..."
            shown=${_SHOWN[$v]}
            printf '  %-38s %s [default: %s]\n' "$left" "${_HELP[$v]}" "${shown:-none}"
        fi
    done
}

parse_params() {
    local -A by_flag=()
    local v arg val has_val
    for v in "${_PARAMS[@]}"; do
        by_flag[${_FLAG[$v]}]=$v
        # the environment counts when set and not empty
        [[ -n ${!v:-} ]] && _SET[$v]=1
    done
    while (($#)); do
        arg=$1; shift
        case $arg in
            -h|--help) usage; exit 0 ;;
            --dry-run) DRY_RUN=1; continue ;;
        esac
        if [[ $arg == --no-* && -n ${by_flag[--${arg#--no-}]:-} && ${_KIND[${by_flag[--${arg#--no-}]}]} == switch ]]; then
            v=${by_flag[--${arg#--no-}]}; printf -v "$v" 0; _SET[$v]=1; continue
        fi
        val="" has_val=0
        if [[ $arg == --*=* ]]; then val=${arg#*=}; arg=${arg%%=*}; has_val=1; fi
        v=${by_flag[$arg]:-}
        [[ -n $v ]] || die "unknown option '$arg' (see --help)"
        if [[ ${_KIND[$v]} == switch ]]; then
            printf -v "$v" 1
        else
            if ((!has_val)); then
                (($#)) || die "$arg needs a value"
                val=$1; shift
            fi
            if [[ ${_KIND[$v]} == list && -n ${_SET[$v]:-} && -n ${_FROM_FLAG[$v]:-} ]]; then
                printf -v "$v" '%s|%s' "${!v}" "$val"  # a repeated list flag adds an item
            else
                printf -v "$v" '%s' "$val"
            fi
            _FROM_FLAG[$v]=1
        fi
        _SET[$v]=1
    done
    for v in "${_PARAMS[@]}"; do
        if [[ -z ${_SET[$v]:-} ]]; then
            eval "printf -v \"\$v\" '%s' \"${_DEFAULT[$v]}\""
        fi
    done
    [[ $DRY_RUN == 1 ]] && echo "# dry run: the commands are printed, nothing is run"
    return 0
}

# find_cli VAR NAME: $VAR if set, else NAME on PATH, else in the active venv, else in this
# checkout's .venv (a fresh clone's `python -m venv .venv && .venv/bin/pip install -e '.[all]'`).
find_cli() {
    local var=$1 name=$2 here
    [[ -n ${!var:-} ]] && return 0
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    if command -v "$name" >/dev/null 2>&1; then
        printf -v "$var" '%s' "$name"
    elif [[ -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/$name ]]; then
        printf -v "$var" '%s' "$VIRTUAL_ENV/bin/$name"
    elif [[ -x $here/.venv/bin/$name ]]; then
        printf -v "$var" '%s' "$here/.venv/bin/$name"
    elif [[ $DRY_RUN == 1 ]]; then
        printf -v "$var" '%s' "$name"
    else
        die "'$name' not found: activate the project's venv (pip install -e '.[all]'), or set ${var}=/path/to/$name"
    fi
}

# ---- the parameter groups the recipes share (in each recipe's --help where it calls them) ----

# run_params STAGES: the run and its samples (after OUT and the data folders), the stages
# (STAGES: the default list) and where and how wide they run
run_params() {
    param RUN_DIR --run '$OUT/run' "training run: checkpoints, metrics, EMA weights, sample grids"
    param SAMPLES_OUT --samples-out '$RUN_DIR/final' "final samples: grid.png and samples/"
    param STAGES --stages "$1" "which stages to run"
    param DEVICE --device auto "auto, cpu, cuda, cuda:1 (the stages that run a model)"
    param NPROC --nproc 1 "processes (GPUs) for encode and train; above 1 they run under torchrun"
    param WORKERS --workers '$(( $(nproc) < 8 ? $(nproc) : 8 ))' "fetch processes and image decoding workers" "CPU cores, at most 8"
}

# store_params: how encode writes the latent store
store_params() {
    param BACKEND --backend zarr "store backend: zarr (random access) or wds (tar streaming)"
    param ENCODE_BATCH --encode-batch 32 "images per autoencoder forward"
    param EXTRA_ENCODE_ARGS --encode-args "" "more options for ditdata encode"
}

# train_params: dittrain run's settings (a recipe's own defaults: `default VAR VALUE`)
train_params() {
    param MODEL --model DiT-B/2 "DiT size and patch (dittrain models)"
    param BATCH --batch 256 "GLOBAL batch per optimizer step"
    param ACCUM --accum 1 "gradient accumulation steps (the batch is split into ACCUM micro-batches)"
    param GRAD_CKPT --grad-ckpt none "gradient checkpointing: none, every (block) or k (every k-th block)"
    param STEPS --steps 400000 "optimizer steps"
    param LR --lr 1e-4 "AdamW learning rate"
    param WEIGHT_DECAY --weight-decay 0 "AdamW weight decay"
    param GRAD_CLIP --grad-clip 1.0 "max gradient norm (0: none)"
    param EMA --ema 0.9999 "EMA decay"
    param OBJECTIVE --objective ddpm "ddpm (epsilon + learned sigma) or flow (rectified flow)"
    param AMP --amp bf16 "autocast: bf16, fp16 (with a grad scaler), fp32 or auto"
    switch COMPILE --compile 0 "torch.compile the model"
    param LOADER --loader auto "auto (keep the store in RAM when it fits), resident or streaming"
    param SAVE_EVERY --save-every 5000 "checkpoint every N steps"
    param SAMPLE_EVERY --sample-every 10000 "EMA sample grid every N steps (0: never)"
    param LOG_EVERY --log-every 100 "metrics line every N steps"
    param SEED --seed 0 "training and sampling seed"
    param EXTRA_TRAIN_ARGS --train-args "" "more options for dittrain run"
}

# sample_params: dittrain sample's settings for the final grid (after the recipe's own: what to sample)
sample_params() {
    param CFG --cfg 4.0 "classifier-free guidance scale"
    param SAMPLE_STEPS --sample-steps 250 "sampling steps"
    param EXTRA_SAMPLE_ARGS --sample-args "" "more options for dittrain sample"
}

# ---- the stages the recipes share: each runs when `want`ed ----

# fetch_stage "what" VAR "message" ARGS...: `ditdata fetch $VAR` into SHARDS_DIR with ARGS,
# skipped when SHARDS_DIR holds a finished fetch; VAR (the input) must be set (need)
fetch_stage() {
    want fetch || return 0
    local what=$1 var=$2 message=$3
    shift 3
    stage fetch "$what"
    skip_if_done "$SHARDS_DIR/dataset.json" "a finished fetch" && return 0
    need "$var" "$message"
    run "$DITDATA" fetch "${!var}" --out "$SHARDS_DIR" "$@"
}

# encode_stage "what" ARGS...: SHARDS_DIR -> the latent store in STORE_DIR (ARGS: the autoencoder
# and the conditioning), skipped when the store is finished (an interrupted encode resumes)
encode_stage() {
    want encode || return 0
    stage encode "$1"
    shift
    # a finished store: skip loading the autoencoder just to find every shard done
    skip_if_done "$STORE_DIR/manifest.json" "a finished store; for other settings choose another --store" \
        && return 0
    run "${encode_cmd[@]}" "$SHARDS_DIR" --out "$STORE_DIR" "$@" --backend "$BACKEND" --device "$DEVICE" \
        --batch-size "$ENCODE_BATCH" --workers "$WORKERS" "${extra_encode[@]}"
}

# train_stage ARGS...: MODEL on the store into RUN_DIR (ARGS: the objective, batch, optimizer and
# conditioning settings), continued from its latest checkpoint when it has one
train_stage() {
    want train || return 0
    stage train "$MODEL on $STORE_DIR -> $RUN_DIR"
    resume_flag "$RUN_DIR"
    run "${train_cmd[@]}" --latents "$STORE_DIR" --out "$RUN_DIR" --model "$MODEL" "$@" \
        --max-steps "$STEPS" --amp "$AMP" "$(on_off COMPILE --compile)" --loader "$LOADER" \
        --save-every "$SAVE_EVERY" --sample-every "$SAMPLE_EVERY" --log-every "$LOG_EVERY" --seed "$SEED" \
        --device "$DEVICE" "${resume[@]}" "${extra_train[@]}"
}

# sample_stage "what" ARGS...: the final grid of RUN_DIR's EMA weights in SAMPLES_OUT (ARGS: what
# to sample and how many of each)
sample_stage() {
    want sample || return 0
    stage sample "$1, cfg $CFG -> $SAMPLES_OUT"
    shift
    run "$DITTRAIN" sample --ckpt "$RUN_DIR" --out "$SAMPLES_OUT" "$@" --cfg "$CFG" --steps "$SAMPLE_STEPS" \
        --seed "$SEED" --device "$DEVICE" "${extra_sample[@]}"
    [[ $DRY_RUN == 1 ]] || echo "# grid: $SAMPLES_OUT/grid.png"
}

# ---- small helpers ----

need() {
    [[ -n ${!1} ]] && return 0
    [[ $DRY_RUN == 1 ]] || die "$2"
    printf -v "$1" '<%s>' "$1"
}

extra_args() {
    local stage var
    for stage in "$@"; do
        var=EXTRA_${stage^^}_ARGS
        read -r -a "extra_$stage" <<<"${!var}"
    done
}

on_off() {
    if [[ ${!1} == 1 ]]; then echo "$2"; else echo "--no-${2#--}"; fi
}

want() { [[ ",${STAGES// /,}," == *",$1,"* ]]; }

# check_stages ALL...: every stage named in $STAGES must be one of ALL
check_stages() {
    local s
    for s in ${STAGES//,/ }; do
        [[ " $* " == *" $s "* ]] || die "unknown stage '$s' in --stages (choose from: $*)"
    done
}

# A word as the shell would need it typed: bare when safe, else in single quotes.
_quote() {
    if [[ $1 =~ ^[A-Za-z0-9_./:=,+@%^-]+$ ]]; then
        printf '%s' "$1"
    else
        printf "'%s'" "${1//\'/\'\\\'\'}"
    fi
}

stage() {
    _STAGE=$1
    echo
    echo "# [$1] $2"
}

skip() {
    echo "# [$_STAGE] skipped: $*"
    _TIMES+=("$_STAGE skipped")
}

skip_if_done() {
    [[ -f $1 ]] || return 1
    skip "$1 exists ($2)"
}

resume_flag() {
    resume=()
    if compgen -G "$1/checkpoints/step_*.pt" >/dev/null; then
        resume=(--resume)
        echo "# $1 holds checkpoints: continuing from the latest"
    fi
}

_human() {  # microseconds -> 4.2s, 3m07s, 2h05m
    local us=$1 s
    s=$((us / 1000000))
    if ((s < 60)); then
        printf '%d.%ds' "$s" $(((us / 100000) % 10))
    elif ((s < 3600)); then
        printf '%dm%02ds' $((s / 60)) $((s % 60))
    else
        printf '%dh%02dm' $((s / 3600)) $((s % 3600 / 60))
    fi
}

run() {
    local line="" word start rc
    for word in "$@"; do line+="${line:+ }$(_quote "$word")"; done
    echo "$line"
    [[ $DRY_RUN == 1 ]] && return 0
    start=${EPOCHREALTIME/./}
    "$@" || {
        rc=$?
        echo "# [$_STAGE] FAILED (exit $rc) after $(_human $((${EPOCHREALTIME/./} - start)))" >&2
        exit "$rc"
    }
    local took
    took=$(_human $((${EPOCHREALTIME/./} - start)))
    echo "# [$_STAGE] took $took"
    _TIMES+=("$_STAGE $took")
}

finish() {
    [[ $DRY_RUN == 1 ]] && return 0
    echo
    local all="" t
    for t in "${_TIMES[@]}"; do all+="${all:+, }$t"; done
    echo "# stage times: $all"
}

# The CLIs, and the encode and train commands: under torchrun (NPROC > 1) each rank runs
# `python -m ditdata.cli` / `-m dittrain.cli`.
setup_commands() {
    find_cli DITDATA ditdata
    find_cli DITTRAIN dittrain
    if ((NPROC > 1)); then
        find_cli TORCHRUN torchrun
        encode_cmd=("$TORCHRUN" --standalone --nproc_per_node "$NPROC" -m ditdata.cli encode)
        train_cmd=("$TORCHRUN" --standalone --nproc_per_node "$NPROC" -m dittrain.cli run)
        sample_cmd=("$TORCHRUN" --standalone --nproc_per_node "$NPROC" -m dittrain.cli sample)
    else
        encode_cmd=("$DITDATA" encode)
        train_cmd=("$DITTRAIN" run)
        sample_cmd=("$DITTRAIN" sample)
    fi
}
