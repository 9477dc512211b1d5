#!/usr/bin/env bash
# The gl-en 2x2 ({ScaleNorm, LayerNorm} x {scaled dot product, QKNorm}) at the paper's size
# (transformer_*_paper_glen: 4+4 layers, 512, 4 heads, dropout 0.4) on one GPU, in one command that
# ends within TIME_LIMIT seconds. README.md beside this file says how to prepare, run and read it.
#
#   bash scripts/gpu_wheels.sh                                               # .whl/, for a GPU machine without network
#   DATA_DIR=path/to/ted-gl-en bash examples/ted/gl-en-2x2-gpu/run.sh prepare # .gpu-data/
#   bash examples/ted/gl-en-2x2-gpu/run.sh                                   # on the GPU machine: writes OUT/
#
# `run` (the default):
#   1. installs fairseq from .whl/ and this project, when fairseq is not importable;
#   2. probes: every run trains PROBE_UPDATES updates side by side, validates once, translates the
#      test set and is recorded (apart from the results). From what that took,
#      experiments/gpu_budget.py sizes the budget: the most whole epochs that every run trains,
#      validated at most DEV_POINTS times, so that every run is also translated and recorded in time;
#   3. trains the four cells x SEEDS side by side with that budget, translates the test set and
#      records every run as ../gl-en-2x2/run.sh does (experiments/gl_en_2x2.py: runs.json and the
#      hypotheses); OUT/gl-en-2x2-gpu.tar.gz (records/ and logs/) is rewritten as each run lands;
#   4. in the CHECK_SECONDS kept for them and whatever else is left: the CUDA cases of the
#      mixed-precision and attention tests and a small benchmark (train and generate, the training's
#      precision), side by side; when the probe leaves no epoch, step 3 is skipped and these still run.
# Beside steps 2-4 (FP16_SWEEP=1), on FP16_SWEEP_CORES cores of their own: the fp16 learning-rate sweep
# (experiments/fp16_sweep.py: stock attention, QKNorm and QK LayerNorm at peak rates 0.3, 0.1, 0.03,
# two seeds) on CUDA, one process per arm and seed, until the end; OUT/fp16-sweep.tar.gz.
# Every step has its own time limit; a failed or slow check, or a failed run, is logged and the call
# goes on. The exit status is 0 when every run was recorded and both checks passed.
# `prepare`: sentencepiece and fairseq-preprocess on DATA_DIR into .gpu-data/, which then travels
#   with the call; there, those steps are found done and skipped.
#
# Settings (environment): TIME_LIMIT (seconds for the whole command, default 540), SEEDS (default: as
#   many as the cores allow, at most 3, one per 1,200 s of TIME_LIMIT), PRECISION (fp16 on a GPU, bf16
#   on a CPU), LR (default 1e-3, as ../gl-en-2x2), DEV_POINTS (default 4), PROBE_UPDATES (default 40), MAX_EPOCHS (none),
#   CHECK_SECONDS (time kept for the checks, default 45; 0: none), FP16_SWEEP (1: run the fp16 sweep;
#   default 1 on CUDA with TIME_LIMIT >= 1200), FP16_SWEEP_CORES (default 6), FP16_SWEEP_ARMS (default: stock qknorm
#   qk_layernorm), FP16_SWEEP_FLAGS (more flags for it), END_RESERVE (seconds kept after
#   training for translating and recording; default: what the probe took), OUT (default
#   work/gl-en-2x2-gpu), DATA_DIR, WORK (default .gpu-data), and common.sh's values (MAX_TOKENS, ...).
#   SMOKE=1: the smoke preset's tiny model, one seed and at most 2 epochs, a dry run of every step on
#   a CPU (tests/experiments/test_gpu_script.py).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/../../common.sh"
# use_python, install_missing: the Python of a GPU machine without network
source "$ROOT/scripts/gpu_python.sh"

MODE=${1:-run}
SMOKE=${SMOKE:-0}
PACK=gl-en-2x2-gpu.tar.gz
FINISH_SECONDS=10  # kept at the very end for the summary and the last pack
if [ "$SMOKE" = 1 ]; then WORK=${WORK:-$ROOT/work/gl-en-2x2-gpu-smoke}; else WORK=${WORK:-$ROOT/.gpu-data}; fi
export WORK

set_pair gl-en

# The preset's values, the GPU's precision and LR, and what the budget leaves open; exported, as
# every run is a process of its own (`run.sh one`) that reads them back through set_preset.
settings() {
    if [ "$SMOKE" = 1 ]; then
        BASE_PRESET=smoke RECORD_PRESET=smoke-gpu
        # generous: on a busy CPU every start-up of torch and fairseq takes minutes
        TIME_LIMIT=${TIME_LIMIT:-3600} PROBE_UPDATES=${PROBE_UPDATES:-4} LOG_INTERVAL=${LOG_INTERVAL:-1}
        MAX_EPOCHS=${MAX_EPOCHS-2} SEEDS=${SEEDS:-1} CHECK_SECONDS=${CHECK_SECONDS:-300}
    else
        BASE_PRESET=paper_controlled RECORD_PRESET=paper-gpu
        # what the call measured on an H200 to finish in the default 9 minutes (README, Status)
        TIME_LIMIT=${TIME_LIMIT:-540} PROBE_UPDATES=${PROBE_UPDATES:-40} LOG_INTERVAL=${LOG_INTERVAL:-20}
        MAX_EPOCHS=${MAX_EPOCHS:-} CHECK_SECONDS=${CHECK_SECONDS:-45}
    fi
    local cuda=0
    python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' && cuda=1
    # the sweep takes six cores for about two minutes: beside the 2x2 from 20 minutes of TIME_LIMIT on
    local sweep=$cuda
    [ "$TIME_LIMIT" -ge 1200 ] 2> /dev/null || sweep=0
    FP16_SWEEP=${FP16_SWEEP:-$sweep} FP16_SWEEP_CORES=${FP16_SWEEP_CORES:-6} FP16_SWEEP_ARMS=${FP16_SWEEP_ARMS:-stock qknorm qk_layernorm}
    [ "$FP16_SWEEP" = 1 ] || FP16_SWEEP_CORES=0
    [ "$SMOKE" = 1 ] || SEEDS=${SEEDS:-$(python -m experiments.gpu_budget seeds --cores $(($(nproc) - FP16_SWEEP_CORES)) --time-limit "$TIME_LIMIT")}
    if [ -z "${PRECISION:-}" ]; then  # fp16 needs CUDA; bf16 on CUDA has not run yet
        PRECISION=bf16
        [ "$cuda" = 0 ] || PRECISION=fp16
    fi
    case $PRECISION in bf16|fp16) ;; *) die "PRECISION=$PRECISION: expected bf16 or fp16" ;; esac
    local n
    for n in "$TIME_LIMIT" "$PROBE_UPDATES" "${DEV_POINTS:=4}" ${MAX_EPOCHS:+"$MAX_EPOCHS"}; do
        [[ $n =~ ^[1-9][0-9]*$ ]] || die "TIME_LIMIT, PROBE_UPDATES, DEV_POINTS, MAX_EPOCHS: expected positive whole numbers, got '$n'"
    done
    for n in "$CHECK_SECONDS" ${END_RESERVE:+"$END_RESERVE"}; do
        [[ $n =~ ^[0-9]+$ ]] || die "CHECK_SECONDS, END_RESERVE: expected whole numbers of seconds, got '$n'"
    done
    export LR=${LR:-1e-3} VALID_UPDATE_INTERVAL=0 LOG_INTERVAL OMP_NUM_THREADS=${THREADS:-1} MKL_NUM_THREADS=${THREADS:-1}
    # Checkpoints: the best one only, without the optimizer's state (nothing resumes in one call).
    export EXTRA_TRAIN_FLAGS="--$PRECISION --no-last-checkpoints --no-save-optimizer-state${EXTRA_TRAIN_FLAGS:+ $EXTRA_TRAIN_FLAGS}"
    set_preset "$BASE_PRESET"
    export BASE_PRESET RECORD_PRESET MODEL_FLAGS MAX_TOKENS WARMUP MAX_UPDATE STOP_HOURS VALID_EPOCHS BPE_SIZE STOP_MIN_LR
}

# Every log so far into LOGS (flat: the records' names), and LOGS with the records into OUT/PACK.
# Under the lock that `experiments.gl_en_2x2 record` takes to write RECORDS, so that no packer reads
# a file that another run is writing. A failed pack is logged; the next one tries again.
pack() {
    (
        set -e
        command -v flock > /dev/null && flock 9
        local dir name
        for dir in "$WORK"/probe/* "$WORK"/arms/*; do
            [ -f "$dir/train.log" ] || continue
            name=$(basename "$dir")
            [[ $dir == */probe/* ]] && name=probe-$name
            cp "$dir/train.log" "$LOGS/$name.train.log"
            [ ! -f "$dir/generate.log" ] || cp "$dir/generate.log" "$LOGS/$name.generate.log"
        done
        [ ! -f "$WORK/commands.sh" ] || cp "$WORK/commands.sh" "$LOGS/commands.sh"
        tar -czf "$OUT/$PACK.tmp" --exclude=.runs.lock -C "$STAGE" records logs
        mv -f "$OUT/$PACK.tmp" "$OUT/$PACK"
    ) 9> "$RECORDS/.runs.lock" || log "warning: packing $OUT/$PACK failed (above); the next pack tries again"
}

seconds_until() { local s=$(($1 - $(date +%s))); echo $((s > 1 ? s : 1)); }

# one PHASE NORM ATTENTION SEED: one run (a process of its own, under `timeout`): train, translate
# the test set, record. probe: recorded apart, in PROBE_RECORDS, with the seconds from the end of
# training to the record (DIR/end_seconds); final: recorded in RECORDS, then packed.
one() {
    [ $# -eq 4 ] || die "usage: run.sh one probe|final NORM ATTENTION SEED"
    local phase=$1 norm=$2 attention=$3 seed=$4 spec arch flags summary records=$RECORDS
    set_preset "$BASE_PRESET"
    spec=$(two_by_two_arm "$norm.$attention")
    IFS=: read -r _ arch flags <<< "$spec"
    local dir=$WORK/arms/$norm-$attention-seed$seed
    case $phase in
        probe) dir=$WORK/probe/$norm-$attention-seed$seed records=$PROBE_RECORDS ;;
        final) ;;
        *) die "unknown phase '$phase'" ;;
    esac
    if [ -n "${TRAIN_UNTIL:-}" ]; then
        # fairseq-train's own --stop-time-hours ends training in time; this (called by train_arm in
        # place of the command) kills one that overruns, so that every run that did finish training
        # keeps the time to be translated and recorded before the deadline.
        fairseq-train() {
            local status=0
            timeout -k 5 "$(seconds_until "$TRAIN_UNTIL")" fairseq-train "$@" || status=$?
            [ "$status" != 124 ] && [ "$status" != 137 ] || log "fairseq-train: killed at the end of the training time"
            return "$status"
        }
    fi
    # shellcheck disable=SC2086  # flags is a flag list
    train_arm "$dir" "$arch" $flags
    generate_arm "$dir"  # the best checkpoint: the only one this script keeps
    summary=$(python -m experiments.gl_en_2x2 record "$records" --arm-dir "$dir" --norm "$norm" --attention "$attention" \
        --checkpoint checkpoint_best.pt --seed "$seed" --data "$WORK/raw" --preset "$RECORD_PRESET" --commands "$WORK/commands.sh")
    log "recorded: $summary"
    if [ "$phase" = probe ]; then  # from the end of training (train_arm writes train_seconds then)
        echo $(($(date +%s) - $(stat -c %Y "$dir/train_seconds"))) > "$dir/end_seconds.tmp"
        mv "$dir/end_seconds.tmp" "$dir/end_seconds"
    else
        pack
    fi
}

# launch PHASE UNTIL: every run without a record, side by side, a moment apart (their start-ups read
# the same files), each killed with all it started at UNTIL (epoch seconds); prints how many failed.
launch() {
    local phase=$1 until=$2 norm attention seed pids=() names=() failed=0 i status
    while read -r norm attention seed; do
        timeout -k 5 "$(seconds_until "$until")" bash "$here/run.sh" one "$phase" "$norm" "$attention" "$seed" \
            2> >(sed -u "s/^/[$norm+$attention seed $seed] /" >&2) >&2 &
        pids+=("$!") names+=("$norm + $attention, seed $seed")
        sleep 0.3
    done < <(python -m experiments.gl_en_2x2 pending "$RECORDS" --seeds $SEEDS)
    for i in "${!pids[@]}"; do
        status=0
        wait "${pids[$i]}" || status=$?
        [ "$status" = 0 ] || { failed=$((failed + 1)); log "$phase: ${names[$i]}: exit $status$(timed_out "$status")"; }
    done
    echo "$failed"
}

# checks SECONDS: the CUDA cases of the mixed-precision tests and a small benchmark (train and
# generate, one precision, the paper's arm and its baselines), side by side, each killed after
# SECONDS; their logs and the benchmark's JSON go to OUT. Sets CHECKS_FAILED; never fails itself.
checks() {
    local seconds=$1 device=cuda dtype=$PRECISION tests bench status json
    CHECKS_FAILED=1
    [[ " $DEVICE_FLAGS " != *" --cpu "* ]] || device=cpu dtype=fp32  # the benchmark's CPU path is fp32
    if [ "$seconds" -lt 10 ]; then
        log "checks: not run, ${seconds}s left"
        return 0
    fi
    log "checks: the mixed-precision tests (-k cuda) and benchmarks.run --device $device --dtype $dtype --quick, ${seconds}s at most, side by side"
    (cd "$ROOT" && timeout -k 5 "$seconds" python -m pytest -q -rs -p no:cacheprovider -k cuda \
        tests/plugin/test_mixed_precision.py tests/plugin/test_attention.py) \
        > "$OUT/mixed-precision.log" 2>&1 &
    tests=$!
    local until=$(($(date +%s) + seconds))
    (
        cd "$ROOT"
        # SDPA's cost of a new batch shape per backend, the plugin's choice among them (README, Status):
        # a table at the top of the benchmark's log, on CUDA only.
        if [ "$device" = cuda ]; then
            timeout -k 5 60 python -m benchmarks.sdpa_new_shapes --device cuda || echo "benchmarks.sdpa_new_shapes: exit $?"
        fi
        timeout -k 5 "$(seconds_until "$until")" python -m benchmarks.run --device "$device" --dtype "$dtype" --quick \
            --benchmarks train generate --arms qknorm --workers 4 --threads 1 \
            --lengths-from "$WORK/raw/train.$SRC,$WORK/raw/train.$TGT" --results-dir "$STAGE/benchmark"
    ) > "$OUT/benchmark.log" 2>&1 &
    bench=$!
    status=0
    wait "$tests" || status=$?
    log "checks: mixed-precision tests exit $status$(timed_out "$status"): $(tail -1 "$OUT/mixed-precision.log")"
    CHECKS_FAILED=$((status != 0))
    status=0
    wait "$bench" || status=$?
    log "checks: benchmark exit $status$(timed_out "$status"): $(grep -v '^ *$' "$OUT/benchmark.log" | tail -1)"
    [ "$status" = 0 ] || CHECKS_FAILED=1
    for json in "$STAGE"/benchmark/*.json; do
        if [ -f "$json" ]; then cp "$json" "$OUT/benchmark-$device-quick.json"; fi
    done
    return 0
}

# fp16_sweep UNTIL: the fp16 learning-rate sweep in the background, one process per arm and seed
# (results.json rewritten after every run, so what finished by UNTIL comes back); sets SWEEP_PID.
# Its data is made once, before the processes start. fp16_sweep_pack: its folder into OUT.
fp16_sweep() {
    local until=$1 dir=$WORK/fp16-sweep device=cuda arm seed flags
    [[ " $DEVICE_FLAGS " != *" --cpu "* ]] || device=cpu
    read -ra flags <<< "${FP16_SWEEP_FLAGS:-}"
    rm -rf "$dir"
    mkdir -p "$dir"
    log "fp16 sweep: $FP16_SWEEP_ARMS x seeds 1 2, peak rates 0.3 0.1 0.03${FP16_SWEEP_FLAGS:+ ($FP16_SWEEP_FLAGS)}, on $device, beside the 2x2, until the end"
    (
        cd "$ROOT"
        timeout -k 5 "$(seconds_until "$until")" python -c \
            'import sys; from pathlib import Path; from experiments.lr_sweep import prepare_data; prepare_data(Path(sys.argv[1]))' \
            "$dir/data" > "$dir/prepare.log" 2>&1 || { echo "fp16 sweep: no data ($dir/prepare.log)" >> "$dir/prepare.log"; exit 1; }
        for seed in 1 2; do
            for arm in $FP16_SWEEP_ARMS; do
                mkdir -p "$dir/$arm-seed$seed"
                timeout -k 5 "$(seconds_until "$until")" python -m experiments.fp16_sweep --device "$device" \
                    --work-dir "$dir/data" --out-dir "$dir/$arm-seed$seed" --arms "$arm" --seeds "$seed" \
                    --lrs 0.3 0.1 0.03 "${flags[@]}" > "$dir/$arm-seed$seed/sweep.log" 2>&1 &
            done
        done
        wait
    ) &
    SWEEP_PID=$! SWEEP_OWNER=$BASHPID
}

# fp16_sweep_end: wait for the sweep (it stops at its deadline) and pack it, once.
fp16_sweep_end() {
    [ -n "${SWEEP_PID:-}" ] && [ "$BASHPID" = "$SWEEP_OWNER" ] || return 0  # not from a subshell
    wait "$SWEEP_PID" || true
    SWEEP_PID=
    fp16_sweep_pack
}

# The call's last line says how it ended, so the sweep is packed before it, whichever way it ends.
die() {
    fp16_sweep_end
    echo "error: $*" >&2
    exit 1
}

fp16_sweep_pack() {
    local dir=$WORK/fp16-sweep runs
    [ -d "$dir" ] || return 0
    runs=$(cat "$dir"/*/results.json 2> /dev/null | grep -o '"outcome": "[a-z ]*"' | sort | uniq -c | tr -s ' ' | paste -sd, -) || true
    tar -czf "$OUT/fp16-sweep.tar.gz" --exclude=fp16-sweep/data -C "$WORK" fp16-sweep \
        && log "fp16 sweep: packed into $OUT/fp16-sweep.tar.gz (runs by outcome:${runs:- none})" \
        || log "warning: packing the fp16 sweep failed (above)"
}

timed_out() { [ "$1" != 124 ] && [ "$1" != 137 ] || echo " (timed out)"; }

run_all() {
    export START=${START:-$(date +%s)}
    OUT=${OUT:-$ROOT/work/gl-en-2x2-gpu}
    mkdir -p "$OUT"
    OUT=$(cd "$OUT" && pwd)
    exec > >(tee -a "$OUT/run.log") 2> >(tee -a "$OUT/run.log" >&2)
    use_python
    install_missing
    settings
    [ -n "${DATA_DIR:-}" ] || [ ! -d "$WORK/raw" ] || DATA_DIR=$WORK/raw  # re-prepared from it if needed
    setup_work
    export USER_DIR DEVICE_FLAGS OUT STAGE=$WORK/gpu-run RECORDS=$WORK/gpu-run/records LOGS=$WORK/gpu-run/logs \
        PROBE_RECORDS=$WORK/probe-records
    prepare
    rm -rf "$STAGE" "$WORK/probe" "$PROBE_RECORDS" "$WORK/arms" "$OUT/$PACK" "$OUT/fp16-sweep.tar.gz"
    mkdir -p "$RECORDS" "$LOGS" "$PROBE_RECORDS"
    local end=$((START + TIME_LIMIT)) recorded_by runs probed=() dir failed budget
    SWEEP_PID=
    if [ "$FP16_SWEEP" = 1 ]; then
        fp16_sweep $((end - FINISH_SECONDS - 5))
        # however the call ends (a failed probe too, or a failed command under set -e): the sweep
        # runs on to its deadline, then is packed
        trap fp16_sweep_end EXIT
    fi
    recorded_by=$((end - CHECK_SECONDS - FINISH_SECONDS))  # every run translated and recorded by then
    runs=$(python -m experiments.gl_en_2x2 pending "$RECORDS" --seeds $SEEDS | wc -l) || die "no list of runs (above)"
    log "probe: $runs runs (seeds $SEEDS) side by side: $PROBE_UPDATES updates, one validation, the test set translated and recorded"
    # At most half the time left: a probe that takes longer leaves too little to train.
    failed=$(export MAX_UPDATE=$PROBE_UPDATES WARMUP=$((PROBE_UPDATES * 10)) STOP_HOURS=""
        launch probe $(($(date +%s) + (recorded_by - $(date +%s)) / 2)))
    for dir in "$WORK"/probe/*; do
        if [ -f "$dir/end_seconds" ]; then probed+=("$dir"); fi
    done
    [ "${#probed[@]}" -gt 0 ] || { pack; die "probe: none of the $runs runs finished (logs in $OUT/$PACK)"; }
    [ "$failed" = 0 ] || log "warning: probe: $failed of $runs runs failed (logs in $OUT/$PACK); the budget comes from the other ${#probed[@]}"
    if ! budget=$(python -m experiments.gpu_budget size "${probed[@]}" \
        --deadline "$recorded_by" --out "$RECORDS/budget.json" --dev-points "$DEV_POINTS" \
        ${MAX_EPOCHS:+--max-epochs "$MAX_EPOCHS"} ${END_RESERVE:+--end-seconds "$END_RESERVE"}); then
        # No epoch fits: nothing is trained, but the checks need no budget and still run in the time left.
        pack
        log "error: no budget (above): no run trained; the checks run in the time left"
        checks $((end - $(date +%s) - 5))
        fp16_sweep_end
        die "no budget: no run trained; checks failed: $CHECKS_FAILED (logs above and in $OUT)"
    fi
    local max_epoch
    read -r MAX_UPDATE max_epoch VALID_EPOCHS WARMUP STOP_HOURS TRAIN_UNTIL <<< "$budget"
    cp "$RECORDS/budget.json" "$OUT/budget.json"
    # --max-epoch as well as --max-update: an fp16 update skipped for an overflow uses a batch but is
    # not counted, and would otherwise carry every run into one more epoch than the budget.
    export TRAIN_UNTIL EXTRA_TRAIN_FLAGS="$EXTRA_TRAIN_FLAGS --max-epoch $max_epoch"
    failed=$(launch final "$recorded_by")
    unset TRAIN_UNTIL
    if python -m experiments.gpu_budget summary "$RECORDS" --budget "$RECORDS/budget.json" --logs "$LOGS"; then
        cp "$RECORDS/summary.md" "$OUT/summary.md"
    else
        log "warning: no summary (above)"
    fi
    pack
    log "runs: $((runs - failed)) of $runs recorded in $(($(date +%s) - START)) s; records and logs in $OUT/$PACK"
    checks $((end - $(date +%s) - 5))
    fp16_sweep_end
    log "done in $(($(date +%s) - START)) s"
    [ "$failed" = 0 ] && [ "$CHECKS_FAILED" = 0 ] || die "$failed run(s) failed, checks failed: $CHECKS_FAILED (logs above and in $OUT)"
}

prepare_here() {
    [ -n "${DATA_DIR:-}" ] || die "prepare: DATA_DIR=path/to/ted-gl-en (plain text {train,dev,test}.{gl,en}) is needed"
    settings
    setup_work
    prepare
    log "prepared $WORK ($(du -sh "$WORK" | cut -f1)); carry it with the call (README.md beside run.sh)"
}

case $MODE in
    run) run_all ;;
    prepare) prepare_here ;;
    one) shift; one "$@" ;;
    *) die "unknown mode '$MODE' (expected: run, prepare)" ;;
esac
