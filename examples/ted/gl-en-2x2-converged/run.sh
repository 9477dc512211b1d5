#!/usr/bin/env bash
# The gl-en 2x2 trained until dev BLEU stops improving: {ScaleNorm, LayerNorm} x {scaled dot
# product, QKNorm}, with the data, sentencepiece model, preset, optimizer and learning-rate schedule
# of examples/ted/gl-en-2x2/, and one stopping rule for every run (experiments/gl_en_2x2_converged.py):
# validate every VALID_EPOCHS epochs with the true dev BLEU; stop when its best has not improved for
# PATIENCE validations, or at MAX_UPDATE updates.
#
#   DATA_DIR=path/to/ted-gl-en bash examples/ted/gl-en-2x2-converged/run.sh
#
# Resumable: rerun the same command. A stopped run (its record says plateau or cap) is skipped; an
# unfinished one resumes from its checkpoint_last.pt while WORK holds it, and restarts from its
# first update when WORK lost it (a new machine; its curve so far stays in the record, and the report
# says which runs restarted). Every validation rewrites the run's entry of runs.json here (COMMIT=1
# also git-commits it), so no measured point is lost. Checkpoints stay in WORK, outside the
# repository: only records and hypotheses are committed.
#
# Settings (environment): DATA_DIR, CELLS (default: the paper's system and its LayerNorm control
#   first, "layernorm.dot layernorm.qknorm scalenorm.dot scalenorm.qknorm"), SEEDS (default 1),
#   JOBS (default 2) runs side by side, THREADS (default 1) each, PATIENCE (default 8),
#   MAX_UPDATE (default 13600), PRESET (default cpu) and its values (examples/common.sh),
#   WORK (default work/gl-en-2x2-converged), RECORDS (default this folder), COMMIT=1,
#   ATEN_CPU_CAPABILITY (default avx2; see below).
# The report (README.md and its figures here) is rewritten from runs.json at the end.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/../../common.sh"

# torch's AVX2 kernels on every x86-64 CPU, where it would pick AVX512 on CPUs that have it: the two
# round differently, so a run restarted or resumed on another machine would leave its curve. Pinned,
# it repeats it (docs/pitfalls.md); the records name the kernels that ran.
export ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-avx2}
RECORDS=${RECORDS:-$here}
SEEDS=${SEEDS:-1}
CELLS=${CELLS:-layernorm.dot layernorm.qknorm scalenorm.dot scalenorm.qknorm}
JOBS=${JOBS:-2}
THREADS=${THREADS:-1}
PATIENCE=${PATIENCE:-8}
MAX_UPDATE=${MAX_UPDATE:-13600}
WORK=${WORK:-$ROOT/work/gl-en-2x2-converged}
set_pair gl-en
set_preset "${PRESET:-cpu}"
require_one_schedule  # PRESET=paper_controlled at the paper's size, not paper
setup_work
prepare
mkdir -p "$RECORDS"
# fairseq-train saves a checkpoint at every validation, for the driver to score on dev.
CHECKPOINT_FLAGS="--save-interval $VALID_EPOCHS"

set_arm() {  # NORM ATTENTION SEED: sets DIR (the run's folder in WORK), ARCH and FLAGS
    local spec name
    spec=$(two_by_two_arm "$1.$2")
    IFS=: read -r name ARCH FLAGS <<< "$spec"
    DIR=$WORK/arms/$name-seed$3
}

run_one() {
    local norm=$1 attention=$2 seed=$3 commit=()
    set_arm "$norm" "$attention" "$seed"
    # shellcheck disable=SC2086  # FLAGS is a flag list
    train_command "$DIR/checkpoints" "$seed" "$ARCH" $FLAGS
    printf '%q ' "${TRAIN_COMMAND[@]}" >> "$WORK/commands.sh"; echo >> "$WORK/commands.sh"
    [ "${COMMIT:-0}" != 1 ] || commit=(--commit)
    python -m experiments.gl_en_2x2_converged run "$RECORDS" --arm-dir "$DIR" --norm "$norm" --attention "$attention" \
        --seed "$seed" --data "$WORK/raw" --bin "$WORK/bin" --spm "$WORK/spm.model" --user-dir "$USER_DIR" \
        --device-flags="$DEVICE_FLAGS" --preset "$PRESET" --threads "$THREADS" --patience "$PATIENCE" \
        --max-update "$MAX_UPDATE" "${commit[@]}" -- "${TRAIN_COMMAND[@]}"
}

# shellcheck disable=SC2086
mapfile -t todo < <(python -m experiments.gl_en_2x2_converged pending "$RECORDS" --seeds $SEEDS --cells $CELLS)
log "2x2 to convergence: ${#todo[@]} runs not stopped yet in $RECORDS; $JOBS at a time, $THREADS thread(s) each"
failed=0
for run in "${todo[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || failed=1; done
    read -r norm attention seed <<< "$run"
    log "starting $norm + $attention, seed $seed"
    # shellcheck disable=SC2086
    ( run_one $run ) 2> >(sed -u "s/^/[$norm+$attention seed $seed] /" >&2) &
done
while [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n || failed=1; done
[ "$failed" = 0 ] || die "a run failed (its log is above; rerun to resume it)"
python -m experiments.gl_en_2x2_converged report "$RECORDS" --data "$WORK/raw"
