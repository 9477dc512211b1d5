#!/usr/bin/env bash
# The one GPU command: transformer_qknorm against stock fairseq at real sizes, fp16 and bf16, in a
# call that ends within TIME_LIMIT seconds whatever happens. BENCHMARKS.md (Results: GPU) says what
# it measures and how to read it.
#
#   bash scripts/gpu_wheels.sh                               # .whl/, for a GPU machine without network
#   DATA_DIR=path/to/ted-gl-en bash examples/ted/gl-en-2x2-gpu/run.sh prepare   # .gpu-data/ (its raw/ text)
#   bash benchmarks/gpu_call.sh                              # on the GPU machine: writes OUT/
#
# 1. installs fairseq from .whl/ and this project, when fairseq is not importable (scripts/gpu_python.sh,
#    as the gl-en 2x2's GPU call does);
# 2. measures the parts of benchmarks/gpu_call.py's plan, the most wanted first (gl-en and base
#    training, their beam search, big and the language model), every arm of a part in one process,
#    interleaved; OUT/gpu-table.json and OUT/gpu-table.md are rewritten as each part lands, and
#    OUT/gpu-profile.txt holds the torch profiler's tables of the slowest QK-norm arm and stock where
#    an arm is below 0.97x of stock;
# 3. when that process ends before its time (a crash, or a part hung past its time, whose stacks it
#    prints), starts it again on the parts left, the failed part recorded as such;
# 4. at the end marks the parts that never finished, and says on its last line how many were measured.
# OUT/gpu-call.log holds everything the command printed. The exit status is 0 when every part was
# measured with every arm.
#
# Settings (environment): TIME_LIMIT (seconds for the whole command, default 540), OUT (default
# work/gpu-call), LENGTHS_FROM (SRC,TGT: the parallel text whose sentence lengths the translation
# batches copy; default .gpu-data/raw/train.gl,.gpu-data/raw/train.en, else $BENCH_LENGTHS_FROM),
# WORK (default work/gpu-call-work: an install's own folders), GPU_CALL_FLAGS (more flags for
# benchmarks.gpu_call, e.g. "--parts train-glen-fp16 --rounds 3"). SMOKE=1: every part at a tiny
# size, on the CPU where there is no GPU: the dry run (tests/experiments/test_gpu_call.py).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/../examples/common.sh"
source "$ROOT/scripts/gpu_python.sh"

START=$(date +%s)
SMOKE=${SMOKE:-0}
TIME_LIMIT=${TIME_LIMIT:-540}
FINISH_SECONDS=10  # kept at the end to mark what never finished and write the last table
RESTARTS=3         # at most this many restarts of the measuring process
OUT=${OUT:-$ROOT/work/gpu-call}
WORK=${WORK:-$ROOT/work/gpu-call-work}
[[ $TIME_LIMIT =~ ^[1-9][0-9]*$ ]] || die "TIME_LIMIT=$TIME_LIMIT: expected a positive whole number of seconds"
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
export WORK
exec > >(tee -a "$OUT/gpu-call.log") 2> >(tee -a "$OUT/gpu-call.log" >&2)

default_lengths=$ROOT/.gpu-data/raw/train.gl,$ROOT/.gpu-data/raw/train.en
[ -f "${default_lengths%,*}" ] || default_lengths=${BENCH_LENGTHS_FROM:-}
LENGTHS_FROM=${LENGTHS_FROM:-$default_lengths}
[ -n "$LENGTHS_FROM" ] || die "no sentence lengths: carry .gpu-data (examples/ted/gl-en-2x2-gpu/run.sh prepare) or set LENGTHS_FROM=SRC,TGT"

seconds_left() { echo $((START + TIME_LIMIT - FINISH_SECONDS - $(date +%s))); }
parts_recorded() { grep -c '"status": "\(measured\|failed\|cut off\|not run\)"' "$OUT/gpu-table.json" 2> /dev/null || echo 0; }

use_python
install_missing
read -ra extra <<< "${GPU_CALL_FLAGS:-}"
command="TIME_LIMIT=$TIME_LIMIT bash benchmarks/gpu_call.sh"
[ -z "${GPU_CALL_FLAGS:-}" ] || command="GPU_CALL_FLAGS=\"$GPU_CALL_FLAGS\" $command"
[ "$SMOKE" != 1 ] || command="SMOKE=1 $command"
flags=(--out "$OUT" --lengths-from "$LENGTHS_FROM" --command "$command" "${extra[@]}")
[ "$SMOKE" != 1 ] || flags+=(--smoke)
rm -f "$OUT/gpu-table.json" "$OUT/gpu-table.md"
resume=() restarts=0 before=0
while :; do
    left=$(seconds_left)
    [ "$left" -ge 30 ] || { log "measuring: ${left}s left, not started again"; break; }
    before=$(parts_recorded)
    status=0
    # its own limit 5 s before ours: it stops its parts in time; timeout ends it if it does not
    (cd "$ROOT" && timeout -k 5 "$left" python -m benchmarks.gpu_call "${flags[@]}" "${resume[@]}" --seconds $((left - 5))) || status=$?
    [ "$status" != 0 ] || break
    case $status in 124) why=" (its time ran out)" ;; 137) why=" (killed)" ;; *) why="" ;; esac
    log "measuring: exit $status$why"
    restarts=$((restarts + 1))
    # again only when it recorded a part more, or ended during one (which the next records as
    # failed): a crash before its first part would repeat until the end
    if [ "$restarts" -gt "$RESTARTS" ] || [ ! -f "$OUT/gpu-table.json" ] \
        || { [ "$(parts_recorded)" = "$before" ] && ! grep -q '"status": "running"' "$OUT/gpu-table.json"; }; then
        break
    fi
    resume=(--resume)
    log "measuring: started again on the parts left"
done
[ -f "$OUT/gpu-table.json" ] || die "nothing measured (above)"
status=0
summary=$(cd "$ROOT" && python -m benchmarks.gpu_report "$OUT/gpu-table.json" --markdown "$OUT/gpu-table.md" --finish 2>&1) || status=$?
log "done in $(($(date +%s) - START)) s; in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
[ "$status" = 0 ] || die "$summary"
log "$summary"
