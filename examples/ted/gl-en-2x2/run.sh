#!/usr/bin/env bash
# The 2x2 on TED gl-en: {ScaleNorm, LayerNorm} x {scaled dot product, QKNorm}, everything else equal
# (PreNorm, FixNorm, shared embeddings, word dropout, data, sentencepiece model, budget, seeds).
# Runs JOBS trainings side by side, THREADS threads each; every finished run leaves its record in
# this folder (an entry of runs.json and its detokenized test hypotheses), and a run whose record is
# here is skipped: rerunning continues where the last invocation stopped, on any machine. A run
# killed half-way resumes from its last checkpoint while WORK still holds it.
#
#   DATA_DIR=path/to/ted-gl-en bash examples/ted/gl-en-2x2/run.sh
#
# Settings (environment): DATA_DIR (plain text {train,dev,test}.{gl,en}; without it the TED archive
#   is downloaded as in ted/run.sh), SEEDS (default "1 2 3"), JOBS (default 2), THREADS (default 1),
#   PRESET (default cpu) and its values (see examples/common.sh), WORK (default work/gl-en-2x2),
#   RECORDS (default this folder), COMMIT=1 to git-commit each record as it lands.
# The report (README.md and training-curves.png here) is rewritten from runs.json at the end.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/../../common.sh"

RECORDS=${RECORDS:-$here}
SEEDS=${SEEDS:-1 2 3}
JOBS=${JOBS:-2}
THREADS=${THREADS:-1}
WORK=${WORK:-$ROOT/work/gl-en-2x2}
set_pair gl-en
set_preset "${PRESET:-cpu}"
require_one_schedule  # PRESET=paper_controlled at the paper's size, not paper
setup_work
prepare
mkdir -p "$RECORDS"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

run_one() {
    local norm=$1 attention=$2 seed=$3 spec name arch flags dir
    # the arms of ted/ablation.sh 2x2 (same names: a WORK shared with it trains each once)
    spec=$(two_by_two_arm "$norm.$attention")
    IFS=: read -r name arch flags <<< "$spec"
    dir=$WORK/arms/$name-seed$seed
    export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
    # shellcheck disable=SC2086  # flags is a flag list
    step "$name.seed$seed.train" binarize train_arm "$dir" "$arch" $flags
    # The model at the budget's end: every run is scored after the same number of updates.
    step "$name.seed$seed.generate" "$name.seed$seed.train" generate_arm "$dir" checkpoint_last.pt
    local summary
    summary=$(python -m experiments.gl_en_2x2 record "$RECORDS" --arm-dir "$dir" --norm "$norm" --attention "$attention" \
        --seed "$seed" --data "$WORK/raw" --preset "$PRESET" --commands "$WORK/commands.sh")
    log "recorded: $summary"
    [ "${COMMIT:-0}" != 1 ] || commit_records "gl-en 2x2, $summary"
}

# Commit this folder only (other changes in the tree are left alone); retried while another git
# command holds the index.
commit_records() {
    local try
    for try in 1 2 3 4 5 6 7 8 9 10; do
        if git -C "$RECORDS" add -- . && git -C "$RECORDS" commit -q -m "$1" -- . ; then
            log "committed: $1"; return
        fi
        sleep 5
    done
    log "warning: could not commit the record ($1); it is in $RECORDS"
}

mapfile -t todo < <(python -m experiments.gl_en_2x2 pending "$RECORDS" --seeds $SEEDS)
log "2x2: ${#todo[@]} runs without a record in $RECORDS; $JOBS at a time, $THREADS thread(s) each"
failed=0
for run in "${todo[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || failed=1; done
    read -r norm attention seed <<< "$run"
    log "2x2: starting $norm + $attention, seed $seed"
    # shellcheck disable=SC2086
    ( run_one $run ) 2> >(sed -u "s/^/[$norm+$attention seed $seed] /" >&2) &
done
while [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n || failed=1; done
[ "$failed" = 0 ] || die "2x2: a run failed (its log is above; rerun to retry it)"
python -m experiments.gl_en_2x2 report "$RECORDS" --data "$WORK/raw"
