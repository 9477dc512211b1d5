#!/usr/bin/env bash
# The gl-en 2x2 ({ScaleNorm, LayerNorm} x {scaled dot product, QKNorm}) at the paper's size
# (transformer_*_paper_glen: 4+4 layers, 512, 4 heads, dropout 0.4) on one GPU, in one command that
# ends within TIME_LIMIT seconds. README.md beside this file says how to call it on a lent GPU.
#
#   bash scripts/gpu_wheels.sh                                               # here: .whl/
#   DATA_DIR=path/to/ted-gl-en bash examples/ted/gl-en-2x2-gpu/run.sh prepare # here: .gpu-data/
#   bash examples/ted/gl-en-2x2-gpu/run.sh                                   # there: writes OUT/
#
# `run` (the default):
#   1. installs fairseq from .whl/ and this project, when fairseq is not importable;
#   2. runs the CUDA mixed-precision tests and the benchmark's --device cuda path, CHECK_SECONDS each;
#   3. probes: every run trains PROBE_UPDATES updates side by side, then validates once; from the
#      measured speed experiments/gpu_budget.py sizes the budget: the most whole epochs that every
#      run finishes in the time left, the same for all, validated at most DEV_POINTS times;
#   4. trains the four cells x SEEDS side by side with that budget, translates the test set and
#      records every run as ../gl-en-2x2/run.sh does (experiments/gl_en_2x2.py: runs.json and the
#      hypotheses); OUT/gl-en-2x2-gpu.tar.gz (records/ and logs/) is rewritten as each run lands.
# `prepare`: sentencepiece and fairseq-preprocess on DATA_DIR into .gpu-data/, which then travels
#   with the call; there, those steps are found done and skipped.
#
# Settings (environment): OUT (default work/gl-en-2x2-gpu), TIME_LIMIT (seconds for the whole
#   command, default 540), SEEDS (default: as many as the cores allow, at most 3), PRECISION (fp16
#   on a GPU, bf16 on a CPU), LR (default 1e-3, as ../gl-en-2x2), DEV_POINTS (default 4),
#   PROBE_UPDATES (default 100), CHECK_SECONDS (default 120), END_RESERVE (seconds kept after
#   training for translation, scoring and packing, default 75), DATA_DIR, WORK (default .gpu-data),
#   and common.sh's values. SMOKE=1: the smoke preset's tiny model, one seed and at most 2 epochs,
#   a dry run of every step on a CPU (tests/experiments/test_gpu_script.py).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/../../common.sh"

MODE=${1:-run}
SMOKE=${SMOKE:-0}
PACK=gl-en-2x2-gpu.tar.gz
if [ "$SMOKE" = 1 ]; then WORK=${WORK:-$ROOT/work/gl-en-2x2-gpu-smoke}; else WORK=${WORK:-$ROOT/.gpu-data}; fi
export WORK

set_pair gl-en

# `python` must be the interpreter that holds torch (a machine may name it python3 only).
use_python() {
    mkdir -p "$WORK/.bin"
    python -c 'import torch' 2> /dev/null && return
    local py shim=$WORK/.bin
    py=$(python3 -c 'import sys; print(sys.executable)') || die "no python3 on PATH"
    printf '#!/bin/sh\nexec %q "$@"\n' "$py" > "$shim/python"
    chmod +x "$shim/python"
    export PATH="$shim:$PATH"
}

# fairseq from the carried wheels, and this project, into the interpreter's own environment (where
# the tests look for fairseq-train); a read-only environment gets them under a folder of its own.
install_missing() {
    python -c 'import fairseq' 2> /dev/null && return
    local wheels=$ROOT/.whl purelib site
    ls "$wheels"/*.whl > /dev/null 2>&1 || die "fairseq is not installed and $wheels holds no wheels (run scripts/gpu_wheels.sh and carry .whl)"
    log "install: $(ls "$wheels"/*.whl | wc -l) wheels from .whl, and this project"
    pip_install() { python -m pip install -q --disable-pip-version-check --no-index --no-deps --no-cache-dir "$@"; }
    purelib=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if [ -w "$purelib" ]; then
        pip_install --no-compile "$wheels"/*.whl
        pip_install --no-build-isolation "$ROOT"
    else
        site=$WORK/.site
        pip_install --no-compile --upgrade --target "$site" "$wheels"/*.whl
        pip_install --no-build-isolation --upgrade --target "$site" "$ROOT"
        export PYTHONPATH="$site:$PYTHONPATH" PATH="$site/bin:$PATH"
    fi
    python -c 'import fairseq' || die "fairseq still does not import after installing the wheels"
    PATH="$(python -c 'import sysconfig; print(sysconfig.get_paths()["scripts"])'):$PATH"  # fairseq-train, ...
}

# The preset's values, the GPU's precision and LR, and what the budget leaves open; exported, as
# every run is a process of its own (`run.sh one`) that reads them back through set_preset.
settings() {
    if [ "$SMOKE" = 1 ]; then
        BASE_PRESET=smoke RECORD_PRESET=smoke-gpu
        TIME_LIMIT=${TIME_LIMIT:-1800} PROBE_UPDATES=${PROBE_UPDATES:-4} LOG_INTERVAL=${LOG_INTERVAL:-1}
        MAX_EPOCHS=${MAX_EPOCHS:-2} SEEDS=${SEEDS:-1} END_RESERVE=${END_RESERVE:-60}
    else
        BASE_PRESET=paper RECORD_PRESET=paper-gpu
        TIME_LIMIT=${TIME_LIMIT:-540} PROBE_UPDATES=${PROBE_UPDATES:-100} LOG_INTERVAL=${LOG_INTERVAL:-20}
        MAX_EPOCHS=${MAX_EPOCHS:-} SEEDS=${SEEDS:-$(python -m experiments.gpu_budget seeds)} END_RESERVE=${END_RESERVE:-75}
    fi
    if [ -z "${PRECISION:-}" ]; then  # fp16 needs CUDA; bf16 on CUDA has not run yet
        PRECISION=bf16
        python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' && PRECISION=fp16
    fi
    case $PRECISION in bf16|fp16) ;; *) die "PRECISION=$PRECISION: expected bf16 or fp16" ;; esac
    for n in "$TIME_LIMIT" "$PROBE_UPDATES" "$END_RESERVE" "${CHECK_SECONDS:=120}" "${DEV_POINTS:=4}"; do
        [[ $n =~ ^[1-9][0-9]*$ ]] || die "TIME_LIMIT, PROBE_UPDATES, END_RESERVE, CHECK_SECONDS, DEV_POINTS: expected positive whole numbers, got '$n'"
    done
    export LR=${LR:-1e-3} VALID_UPDATE_INTERVAL=0 LOG_INTERVAL OMP_NUM_THREADS=${THREADS:-1} MKL_NUM_THREADS=${THREADS:-1}
    # Checkpoints: the best one only, without the optimizer's state (nothing resumes in one call).
    export EXTRA_TRAIN_FLAGS="--$PRECISION --no-last-checkpoints --no-save-optimizer-state${EXTRA_TRAIN_FLAGS:+ $EXTRA_TRAIN_FLAGS}"
    set_preset "$BASE_PRESET"
    export BASE_PRESET RECORD_PRESET MODEL_FLAGS MAX_TOKENS WARMUP MAX_UPDATE STOP_HOURS VALID_EPOCHS BPE_SIZE STOP_MIN_LR
}

# Every log so far into LOGS (flat: the records' names), and LOGS with the records into OUT/PACK,
# one packer at a time.
pack() {
    local dir name
    for dir in "$WORK"/probe/* "$WORK"/arms/*; do
        [ -f "$dir/train.log" ] || continue
        name=$(basename "$dir")
        [[ $dir == */probe/* ]] && name=probe-$name
        cp "$dir/train.log" "$LOGS/$name.train.log"
        [ ! -f "$dir/generate.log" ] || cp "$dir/generate.log" "$LOGS/$name.generate.log"
    done
    [ ! -f "$WORK/commands.sh" ] || cp "$WORK/commands.sh" "$LOGS/commands.sh"
    (
        command -v flock > /dev/null && flock 9
        tar -czf "$OUT/$PACK.tmp" --exclude=.runs.lock -C "$STAGE" records logs && mv -f "$OUT/$PACK.tmp" "$OUT/$PACK"
    ) 9> "$STAGE/.pack.lock"
}

# one PHASE NORM ATTENTION SEED: one run (a process of its own, under `timeout`). probe: train only;
# final: train, translate the test set, record, pack.
one() {
    [ $# -eq 4 ] || die "usage: run.sh one probe|final NORM ATTENTION SEED"
    local phase=$1 norm=$2 attention=$3 seed=$4 spec arch flags summary
    set_preset "$BASE_PRESET"
    spec=$(two_by_two_arm "$norm.$attention")
    IFS=: read -r _ arch flags <<< "$spec"
    local dir=$WORK/arms/$norm-$attention-seed$seed
    case $phase in probe) dir=$WORK/probe/$norm-$attention-seed$seed ;; final) ;; *) die "unknown phase '$phase'" ;; esac
    # shellcheck disable=SC2086  # flags is a flag list
    train_arm "$dir" "$arch" $flags
    [ "$phase" = probe ] && return
    generate_arm "$dir"  # the best checkpoint: the only one this script keeps
    summary=$(python -m experiments.gl_en_2x2 record "$RECORDS" --arm-dir "$dir" --norm "$norm" --attention "$attention" \
        --checkpoint checkpoint_best.pt --seed "$seed" --data "$WORK/raw" --preset "$RECORD_PRESET" --commands "$WORK/commands.sh")
    log "recorded: $summary"
    pack
}

# launch PHASE SECONDS: every run without a record, side by side, a moment apart (their start-ups
# read the same files), each killed with all it started after SECONDS; prints how many failed.
launch() {
    local phase=$1 seconds=$2 norm attention seed pids=() failed=0 pid
    while read -r norm attention seed; do
        timeout -k 5 "$seconds" bash "$here/run.sh" one "$phase" "$norm" "$attention" "$seed" \
            2> >(sed -u "s/^/[$norm+$attention seed $seed] /" >&2) >&2 &
        pids+=("$!")
        sleep 0.3
    done < <(python -m experiments.gl_en_2x2 pending "$RECORDS" --seeds $SEEDS)
    for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
    echo "$failed"
}

left() { echo $((START + TIME_LIMIT - $(date +%s) - $1)); }

checks() {
    local device=cuda tests bench status
    [[ " $DEVICE_FLAGS " != *" --cpu "* ]] || device=cpu
    log "checks: tests/plugin/test_mixed_precision.py -k cuda and benchmarks.run --device $device --quick, ${CHECK_SECONDS}s each, side by side"
    (cd "$ROOT" && timeout -k 5 "$CHECK_SECONDS" python -m pytest -q -rs -p no:cacheprovider -k cuda tests/plugin/test_mixed_precision.py) \
        > "$OUT/mixed-precision.log" 2>&1 &
    tests=$!
    (cd "$ROOT" && timeout -k 5 "$CHECK_SECONDS" python -m benchmarks.run --device "$device" --quick --arms qknorm \
        --threads 1 --lengths-from "$WORK/raw/train.$SRC,$WORK/raw/train.$TGT" --results-dir "$STAGE/benchmark") \
        > "$OUT/benchmark.log" 2>&1 &
    bench=$!
    status=0; wait "$tests" || status=$?
    log "checks: mixed-precision tests exit $status: $(tail -1 "$OUT/mixed-precision.log")"
    CHECKS_FAILED=$((status != 0))
    status=0; wait "$bench" || status=$?
    log "checks: benchmark exit $status: $(grep -v '^ *$' "$OUT/benchmark.log" | tail -1)"
    [ "$status" = 0 ] || CHECKS_FAILED=1
    for f in "$STAGE"/benchmark/*.json; do [ -f "$f" ] && cp "$f" "$OUT/benchmark-$device-quick.json"; done
}

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
    export USER_DIR DEVICE_FLAGS OUT STAGE=$WORK/gpu-run RECORDS=$WORK/gpu-run/records LOGS=$WORK/gpu-run/logs
    prepare
    rm -rf "$STAGE" "$WORK/probe" "$WORK/arms" "$OUT/$PACK"
    mkdir -p "$RECORDS" "$LOGS"
    checks
    local runs failed budget
    runs=$(python -m experiments.gl_en_2x2 pending "$RECORDS" --seeds $SEEDS | wc -l)
    log "probe: $runs runs (seeds $SEEDS) side by side, $PROBE_UPDATES updates and one validation each"
    failed=$(export MAX_UPDATE=$PROBE_UPDATES WARMUP=$((PROBE_UPDATES * 10)) STOP_HOURS=""; launch probe "$(left 10)")
    [ "$failed" = 0 ] || { pack; die "probe: $failed of $runs runs failed (logs in $OUT/$PACK)"; }
    budget=$(python -m experiments.gpu_budget size "$WORK"/probe/* --deadline $((START + TIME_LIMIT - END_RESERVE)) \
        --out "$RECORDS/budget.json" --dev-points "$DEV_POINTS" ${MAX_EPOCHS:+--max-epochs "$MAX_EPOCHS"}) \
        || { pack; die "no budget (above)"; }
    read -r MAX_UPDATE VALID_EPOCHS WARMUP STOP_HOURS <<< "$budget"
    cp "$RECORDS/budget.json" "$OUT/budget.json"
    failed=$(launch final "$(left 10)")
    pack
    python -m experiments.gpu_budget summary "$RECORDS" --budget "$RECORDS/budget.json" --logs "$LOGS" \
        && cp "$RECORDS/summary.md" "$OUT/summary.md" && pack || true
    log "done in $(($(date +%s) - START)) s: $((runs - failed)) of $runs runs recorded; records and logs in $OUT/$PACK"
    [ "$failed" = 0 ] && [ "$CHECKS_FAILED" = 0 ] || die "$failed run(s) failed, checks failed: $CHECKS_FAILED (logs above and in $OUT)"
}

prepare_here() {
    [ -n "${DATA_DIR:-}" ] || die "prepare: DATA_DIR=path/to/ted-gl-en (plain text {train,dev,test}.{gl,en}) is needed"
    settings
    setup_work
    prepare
    log "prepared $WORK ($(du -sh "$WORK" | cut -f1)); it travels with .whl (scripts/gpu_wheels.sh): see README.md beside run.sh"
}

case $MODE in
    run) run_all ;;
    prepare) prepare_here ;;
    one) shift; one "$@" ;;
    *) die "unknown mode '$MODE' (expected: run, prepare)" ;;
esac
