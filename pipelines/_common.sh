# shellcheck shell=bash
# pipelines/_common.sh: the few shell helpers the recipes share. Sourced, never run.
#
# Each stage's command reads its settings from a TOML file (`--config FILE`, keys: the command's
# flag names; `dittrain run`'s in tables named after its --help sections): the recipe's own in
# pipelines/configs/RECIPE/STAGE.toml, or the user's (--STAGE-config FILE). The file is the one
# place a recipe's defaults live: a stage's command is `--config FILE`, what only the recipe
# knows (paths, the machine), and the settings the user set through the recipe's flags or
# environment, which win over the file.
#
#   param VAR --flag DEFAULT "help" [shown default]   a value: --flag X, --flag=X or VAR=X in the environment
#   switch VAR --flag 0|1 "help"                      on/off: --flag / --no-flag, or VAR=1 / VAR=0
#   list VAR --flag "a|b" "help"                      '|'-separated; each --flag X adds one item
#   config STAGE CLI SUBCOMMAND                       STAGE_CONFIG (--STAGE-config FILE): the settings file of
#                                                     the stage's `CLI SUBCOMMAND`, by default $CONFIGS/STAGE.toml
#   setting [switch|list] VAR --flag STAGES --cmd-flag[=key] "help"
#                           a setting of the STAGES' (comma-separated) commands: its default is the
#                           stage file's `key` (the command's flag without dashes, unless =key says
#                           otherwise), shown by --help; the stage passes --cmd-flag VALUE (a switch:
#                           --cmd-flag / --no-cmd-flag; a list: --cmd-flag ITEM for each) only when the
#                           user set it, and not when set to nothing
#   flag_alias VAR --old    --old is another name of VAR's flag (and OLD of its variable)
#   run_params STAGES / store_params / train_params / sample_params
#                           the parameters both recipes declare, in groups (each further down)
#   parse_params "$@"       flags win over the environment, which wins over the default; defaults are
#                           evaluated in declaration order, so one may name an earlier one ('$OUT/store');
#                           a setting left unset holds its file's value (for the stage headers)
#   inherit VAR FROM [VALUE]  one choice for two stages: VAR, when not set, takes FROM's value (or VALUE)
#                           when FROM was set
#   settings STAGE          the array `given`: the STAGE's settings the user set, as its command's flags
#   check_configs           (not in a dry run) each wanted stage's file is read by its command now, so a
#                           wrong key fails before the first stage, not hours later
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

# The sourcing recipe's settings files: pipelines/configs/RECIPE/ (RECIPE: its name without .sh)
CONFIGS=$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)/configs/$(basename "${BASH_SOURCE[1]}" .sh)
_PARAMS=()
declare -A _FLAG=() _DEFAULT=() _SHOWN=() _HELP=() _KIND=() _SET=() _FROM_FLAG=() _ALIAS=()
declare -A _STAGES=() _CMD_FLAG=() _KEY=() _CONFIG_CMD=() _TOML=() _TOML_READ=()
_CONFIG_STAGES=()
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

config() {
    local var=${1^^}_CONFIG
    param "$var" "--$1-config" "\$CONFIGS/$1.toml" "the settings of \`$2 $3\` (a TOML file; the flags below win over it)" \
        "${CONFIGS#"$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/"}/$1.toml"
    _CONFIG_STAGES+=("$1"); _CONFIG_CMD[$1]="$2 $3"
}

setting() {
    local kind=value
    if [[ $1 == switch || $1 == list ]]; then kind=$1; shift; fi
    param "$1" "$2" "" "$5"
    _KIND[$1]=$kind; _STAGES[$1]=$3; _CMD_FLAG[$1]=${4%%=*}; _KEY[$1]=${4#--}; _KEY[$1]=${_KEY[$1]#*=}
}

flag_alias() { _ALIAS[$2]=$1; }

die() { echo "$(basename "$0"): $*" >&2; exit 2; }

# _config_file STAGE: the settings file the stage reads (its --STAGE-config, else the recipe's)
_config_file() {
    local var=${1^^}_CONFIG
    if [[ -n ${!var:-} ]]; then echo "${!var}"; else eval "echo \"${_DEFAULT[$var]}\""; fi
}

# _toml FILE KEY: the value of KEY in a settings file (any table; a string without its quotes,
# true/false as 1/0, a list's items joined by '|'), empty when not there. Read once per file, for
# --help and the stage headers only: the commands read the files themselves.
_toml() {
    if [[ -z ${_TOML_READ[$1]:-} ]]; then
        _TOML_READ[$1]=1
        local key value
        while IFS=$'\t' read -r key value; do _TOML[$1|$key]=$value; done < <(_toml_values "$1")
    fi
    echo "${_TOML[$1|$2]:-}"
}

# _toml_values FILE: "key<TAB>value" for each `key = value` line of a TOML file (see _toml)
_toml_values() {
    [[ -f $1 ]] || return 0
    awk '
    function trim(s) { sub(/^[ \t]+/, "", s); sub(/[ \t]+$/, "", s); return s }
    # s without its comment, quotes and brackets, commas between items as "|"; depth: open brackets
    function parse(s,   out, i, c, q) {
        out = ""; q = ""
        for (i = 1; i <= length(s); i++) {
            c = substr(s, i, 1)
            if (q != "") { if (c == q) q = ""; else out = out c }
            else if (c == "\"" || c == "\047") q = c
            else if (c == "#") break
            else if (c == "[") depth++
            else if (c == "]") depth--
            else out = out (c == "," ? "|" : c)
        }
        return out
    }
    function emit(   n, i, parts, out) {
        sub(/[ \t|]+$/, "", value)
        n = split(value, parts, "|"); out = ""
        for (i = 1; i <= n; i++) out = out (i > 1 ? "|" : "") trim(parts[i])
        if (out == "true") out = 1; else if (out == "false") out = 0
        print key "\t" out
    }
    depth > 0 { value = value parse($0); if (depth <= 0) emit(); next }  # a list over several lines
    /^[ \t]*[A-Za-z0-9_-]+[ \t]*=/ {
        key = $0; sub(/[ \t]*=.*/, "", key); key = trim(key); gsub(/_/, "-", key)
        value = $0; sub(/^[^=]*=/, "", value)
        depth = 0; value = parse(value)
        if (depth <= 0) emit()
    }' "$1"
}

_on_off_word() { [[ $1 == 1 ]] && echo on || echo off; }

usage() {
    # $USAGE (set by the recipe) first, then one line per parameter.
    printf '%s\n\nOptions (each flag'"'"'s value name is also its environment variable; flags win):\n' "$USAGE"
    printf '  %-38s %s\n' "--dry-run" "print the commands without running them (DRY_RUN=1)"
    printf '  %-38s %s\n' "-h, --help" "this help"
    local v left shown file old help
    for v in "${_PARAMS[@]}"; do
        left="${_FLAG[$v]} $v"
        [[ ${_KIND[$v]} == list ]] && left+=" ..."
        [[ ${_KIND[$v]} == switch ]] && left="${_FLAG[$v]}, --no-${_FLAG[$v]#--}"
        if [[ -n ${_STAGES[$v]:-} ]]; then  # a setting: its default is in its stage's file
            file=$(_config_file "${_STAGES[$v]%%,*}")
            shown=$(_toml "$file" "${_KEY[$v]}")
            [[ ${_KIND[$v]} == switch && -n $shown ]] && shown=$(_on_off_word "$shown")
            shown="${file##*/}: ${shown:-not set}"
            [[ ${_KIND[$v]} == switch ]] && shown="$v; $shown"
        elif [[ ${_KIND[$v]} == switch ]]; then
            shown="$v: $(_on_off_word "${_DEFAULT[$v]}")"
        else
            shown="default: ${_SHOWN[$v]:-none}"
        fi
        help=${_HELP[$v]}
        for old in "${!_ALIAS[@]}"; do [[ ${_ALIAS[$old]} == "$v" ]] && help+=" (also $old)"; done
        printf '  %-38s %s [%s]\n' "$left" "$help" "$shown"
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
    for arg in "${!_ALIAS[@]}"; do
        by_flag[$arg]=${_ALIAS[$arg]}
        v=${arg#--}; v=${v^^}; v=${v//-/_}  # the old name's variable (AMP) counts too
        if [[ -z ${_SET[${_ALIAS[$arg]}]:-} && -n ${!v:-} ]]; then
            printf -v "${_ALIAS[$arg]}" '%s' "${!v}"; _SET[${_ALIAS[$arg]}]=1
        fi
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
        if [[ -z ${_SET[$v]:-} && -z ${_STAGES[$v]:-} ]]; then
            eval "printf -v \"\$v\" '%s' \"${_DEFAULT[$v]}\""
        fi
    done
    for v in "${_PARAMS[@]}"; do  # a setting left unset: its file's value, for the stage headers
        if [[ -z ${_SET[$v]:-} && -n ${_STAGES[$v]:-} ]]; then
            printf -v "$v" '%s' "$(_toml "$(_config_file "${_STAGES[$v]%%,*}")" "${_KEY[$v]}")"
        fi
    done
    [[ $DRY_RUN == 1 ]] && echo "# dry run: the commands are printed, nothing is run (each reads its settings from --config FILE; the flags after it win)"
    return 0
}

inherit() {
    [[ -z ${_SET[$1]:-} && -n ${_SET[$2]:-} ]] || return 0
    printf -v "$1" '%s' "${3-${!2}}"
    _SET[$1]=1
}

settings() {
    given=()
    local v item items
    for v in "${_PARAMS[@]}"; do
        [[ ,${_STAGES[$v]:-}, == *,$1,* && -n ${_SET[$v]:-} && -n ${!v} ]] || continue
        case ${_KIND[$v]} in
            switch) given+=("$(on_off "$v" "${_CMD_FLAG[$v]}")") ;;
            list)
                IFS='|' read -r -a items <<<"${!v}"
                for item in "${items[@]}"; do given+=("${_CMD_FLAG[$v]}" "$item"); done ;;
            *) given+=("${_CMD_FLAG[$v]}" "${!v}") ;;
        esac
    done
}

check_configs() {
    [[ $DRY_RUN == 1 ]] && return 0
    local s file cmd cli
    for s in "${_CONFIG_STAGES[@]}"; do
        want "$s" || continue
        file=$(_config_file "$s")
        read -r -a cmd <<<"${_CONFIG_CMD[$s]}"
        cli=${cmd[0]^^}  # DITDATA or DITTRAIN
        # --config is read before --help: a wrong key or value is one line, and nothing runs
        "${!cli}" "${cmd[@]:1}" --config "$file" --help >/dev/null \
            || die "--$s-config $file: not a valid settings file for \`${_CONFIG_CMD[$s]}\` (above); nothing was run"
    done
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

# run_params STAGES: the latent store, the run and its samples (after OUT and the image
# folders), the stages (STAGES: the default list) and the machine they run on (not in the
# settings files)
run_params() {
    param STORE_DIR --store '$OUT/store' "latent store (ditdata encode)"
    param RUN_DIR --run '$OUT/run' "training run: checkpoints, metrics, EMA weights, sample grids"
    param SAMPLES_OUT --samples-out '$RUN_DIR/final' "final samples: grid.png and samples/"
    param STAGES --stages "$1" "which stages to run"
    param DEVICE --device "" "cpu, cuda, cuda:1 (the stages that run a model)" "auto, or a settings file's"
    param NPROC --nproc 1 "processes (GPUs) for encode and train; above 1 they run under torchrun"
    param WORKERS --workers '$(( $(nproc) < 8 ? $(nproc) : 8 ))' "fetch processes and image decoding workers" "CPU cores, at most 8"
}

# store_params: how encode writes the latent store (after `config encode ...`)
store_params() {
    setting BACKEND --backend encode --backend "store backend: zarr (random access) or wds (tar streaming)"
    setting ENCODE_BATCH --encode-batch encode --batch-size "images per autoencoder forward"
    param EXTRA_ENCODE_ARGS --encode-args "" "more options for ditdata encode"
}

# train_params: dittrain run's settings (after `config train ...`; defaults: the recipe's train.toml)
train_params() {
    setting MODEL --model train --model "DiT size and patch (dittrain models)"
    setting BATCH --batch train --batch-size "GLOBAL batch per optimizer step"
    setting ACCUM --accum train --accumulation-steps "gradient accumulation steps (the batch is split into ACCUM micro-batches)"
    setting GRAD_CKPT --grad-ckpt train --grad-checkpointing "gradient checkpointing: none, every (block), k (every k-th block), attn, mlp, selective"
    setting STEPS --steps train --max-steps "optimizer steps"
    setting LR --lr train --lr "AdamW learning rate"
    setting WEIGHT_DECAY --weight-decay train --weight-decay "AdamW weight decay"
    setting GRAD_CLIP --grad-clip train --grad-clip "max gradient norm (0: none)"
    setting EMA --ema train --ema "EMA decay"
    setting OBJECTIVE --objective train --objective "ddpm (epsilon + learned sigma) or flow (rectified flow)"
    setting PRECISION --precision train --precision "autocast: bf16, fp16 (with a grad scaler), fp32 or auto"
    flag_alias PRECISION --amp
    setting COMPILE --compile train --compile "torch.compile: off, blocks, model or auto"
    setting LOADER --loader train --loader "auto (keep the store in RAM when it fits), resident or streaming"
    setting SAVE_EVERY --save-every train --save-every "checkpoint every N steps"
    setting SAMPLE_EVERY --sample-every train --sample-every "EMA sample grid every N steps (0: never)"
    setting LOG_EVERY --log-every train --log-every "metrics line every N steps"
    setting SEED --seed train,sample,fid --seed "training and sampling seed"
    param EXTRA_TRAIN_ARGS --train-args "" "more options for dittrain run"
}

# sample_params: dittrain sample's settings for the final grid (after `config sample ...` and
# the recipe's own: what to sample)
sample_params() {
    setting CFG --cfg sample --cfg "classifier-free guidance scale"
    setting SAMPLE_STEPS --sample-steps sample --steps "sampling steps"
    param EXTRA_SAMPLE_ARGS --sample-args "" "more options for dittrain sample"
}

# ---- the stages the recipes share: each runs when `want`ed ----
# Each command: --config FILE, the paths, what the recipe adds (ARGS), the machine (--device when
# set, workers), the settings the user set (`settings`), then EXTRA_STAGE_ARGS.

# fetch_stage "what" VAR "message" ARGS...: `ditdata fetch $VAR` into SHARDS_DIR with ARGS,
# skipped when SHARDS_DIR holds a finished fetch; VAR (the input) must be set (need)
fetch_stage() {
    want fetch || return 0
    local what=$1 var=$2 message=$3
    shift 3
    stage fetch "$what"
    skip_if_done "$SHARDS_DIR/dataset.json" "a finished fetch" && return 0
    need "$var" "$message"
    settings fetch
    run "$DITDATA" fetch "${!var}" --config "$FETCH_CONFIG" --out "$SHARDS_DIR" "$@" --processes "$WORKERS" \
        "${given[@]}" "${extra_fetch[@]}"
}

# encode_stage "what" ARGS...: SHARDS_DIR -> the latent store in STORE_DIR (ARGS: the recipe's
# own, e.g. --select), skipped when the store is finished (an interrupted encode resumes)
encode_stage() {
    want encode || return 0
    stage encode "$1"
    shift
    # a finished store: skip loading the autoencoder just to find every shard done
    skip_if_done "$STORE_DIR/manifest.json" "a finished store; for other settings choose another --store" \
        && return 0
    settings encode
    run "${encode_cmd[@]}" "$SHARDS_DIR" --config "$ENCODE_CONFIG" --out "$STORE_DIR" "$@" "${device[@]}" \
        --workers "$WORKERS" "${given[@]}" "${extra_encode[@]}"
}

# train_stage: MODEL on the store into RUN_DIR, continued from its latest checkpoint when it has one
train_stage() {
    want train || return 0
    stage train "$MODEL on $STORE_DIR -> $RUN_DIR"
    resume_flag "$RUN_DIR"
    settings train
    # A signal for the whole job (Ctrl-C, Slurm's SIGTERM or --signal=USR1, timeout) reaches the
    # trainer, which saves and exits 75; a trap keeps this shell alive to say so (run) instead of
    # dying first (the trainer, exec'd, gets the default handlers back and installs its own).
    trap ':' TERM USR1
    run "${train_cmd[@]}" --config "$TRAIN_CONFIG" --latents "$STORE_DIR" --out "$RUN_DIR" "${device[@]}" \
        "${given[@]}" "${resume[@]}" "${extra_train[@]}"
    trap - TERM USR1
}

# sample_stage "what" ARGS...: the final grid of RUN_DIR's EMA weights in SAMPLES_OUT (ARGS: the
# recipe's own)
sample_stage() {
    want sample || return 0
    stage sample "$1, cfg $CFG -> $SAMPLES_OUT"
    shift
    settings sample
    run "$DITTRAIN" sample --config "$SAMPLE_CONFIG" --ckpt "$RUN_DIR" --out "$SAMPLES_OUT" "$@" "${device[@]}" \
        "${given[@]}" "${extra_sample[@]}"
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

# A rerun passes `--resume` with the same command, rather than `--resume --out RUN` alone: the
# run's record is compared with the settings file and flags as they are now. Values equal to the
# record are no change; an edited file or flag that changes what is learned is refused with the
# differences (add --train-args --allow-changes to apply them) instead of being ignored without a
# word, and a safe one (--steps, --save-every, ...) applies, as the rerun's command says.
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

STOPPED_STATUS=75  # dittrain.train.loop.STOPPED_STATUS: a signal stopped the run after a checkpoint

run() {
    local line="" word start rc
    for word in "$@"; do line+="${line:+ }$(_quote "$word")"; done
    echo "$line"
    [[ $DRY_RUN == 1 ]] && return 0
    start=${EPOCHREALTIME/./}
    "$@" || {
        rc=$?
        if ((rc == STOPPED_STATUS)) && [[ $_STAGE == train ]]; then
            echo "# [$_STAGE] stopped by a signal (checkpoint saved); rerun the same command to continue" >&2
            exit "$rc"
        fi
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

# The CLIs, the encode and train commands (under torchrun when NPROC > 1 each rank runs
# `python -m ditdata.cli` / `-m dittrain.cli`), and device=(--device DEVICE) when DEVICE is set.
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
    device=()
    [[ -n $DEVICE ]] && device=(--device "$DEVICE")
    return 0
}
