#!/usr/bin/env bash
# Interrupted training, measured. One recipe arm (QKNorm, the toy pair) is trained twice per seed
# through the recipe's own steps (examples/common.sh), on the same data: once straight through, and
# once killed three times, rerunning the same command after each kill:
#   attempt 1: kill -9 half-way through fairseq's copy of a checkpoint to its other name, at the
#              first save that has one (checkpoint_best.pt -> checkpoint_last.pt: the first
#              validation; a fresh run always has a best checkpoint then);
#   attempt 2: kill -9 of fairseq-train mid-epoch, KILL_AFTER updates after it resumed;
#   attempt 3: kill -9 half-way through the first checkpoint write (torch.save of NAME.pt.tmp);
#   attempt 4: no fault: runs to the end.
# Attempts 1 and 3 are injected deterministically (tests/experiments/fault_injection/sitecustomize.py). Writes
# WORK/interrupt.{md,json}: per attempt the checkpoint it resumed from, the updates lost, every
# checkpoint file checked complete after the kill; dev BLEU and weights of both runs at the end, and
# over several seeds, the interrupted-minus-uninterrupted dev BLEU against the spread between seeds
# (what "within noise" means). A seed whose attempts are all recorded is skipped on a rerun.
#
#   examples/interrupt/run.sh              the experiment (PRESET=toy, WORK=work/interrupt-PRESET)
#   examples/interrupt/run.sh train NAME [SEED]   one arm, WORK/arms/NAME-seedSEED (SEED default 1),
#                                          through the recipe's steps: the command killed and rerun
#   examples/interrupt/run.sh report       WORK/interrupt.{md,json} again, from a finished experiment
# Settings (environment): PRESET (default toy), SEEDS (default 1; e.g. "1 2 3"), KILL_AFTER (default:
# one and a half epochs, from the uninterrupted run), DATA_DIR, and the preset's values (MAX_UPDATE,
# EXTRA_TRAIN_FLAGS, ...) as for examples/ted/run.sh.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

set_pair toy
set_preset "${PRESET:-toy}"
WORK=${WORK:-$ROOT/work/interrupt-$PRESET}
export LOG_INTERVAL=${LOG_INTERVAL:-1}  # every update in the log: where each kill landed
SELF=$ROOT/examples/interrupt/run.sh
FAULTS=$ROOT/tests/experiments/fault_injection

train_one() {
    setup_work
    prepare
    local seed=${2:-1}
    step "$1.seed$seed.train" binarize train_arm "$WORK/arms/$1-seed$seed" "$QKNORM_ARCH"
}

# record_attempt S N RC OFFSET, after attempt N of seed S: its exit status, its part of train.log
# (the recipe appends when it resumes and starts a new log when it starts afresh) and every
# checkpoint file, complete (a whole zip archive, as torch.save writes) or not.
record_attempt() {
    local seed=$1 n=$2 rc=$3 offset=$4 dir=$WORK/arms/interrupted-seed$1 out=$WORK/attempts/seed$1
    echo "$rc" > "$out/$n.rc"
    if [ "$(stat -c %s "$dir/train.log")" -gt "$offset" ] && head -c "$offset" "$dir/train.log" | cmp -s - "$out/all.log"; then
        tail -c +$((offset + 1)) "$dir/train.log" > "$out/$n.log"
    else
        cp "$dir/train.log" "$out/$n.log"
    fi
    cp "$dir/train.log" "$out/all.log"
    python -m experiments.interrupt_report files "$dir" > "$out/$n.files"
}

log_size() { stat -c %s "$WORK/arms/interrupted-seed$1/train.log" 2>/dev/null || echo 0; }

# attempt S N ENV...: rerun the same command (seed S), with ENV.
attempt() {
    local seed=$1 n=$2 offset rc=0; shift 2
    offset=$(log_size "$seed")
    log "seed $seed, attempt $n: ${*:-no fault}"
    env "$@" bash "$SELF" train interrupted "$seed" || rc=$?
    record_attempt "$seed" "$n" "$rc" "$offset"
}

# attempt_killed_mid_epoch S N: rerun the same command; SIGKILL its fairseq-train (a child of the
# recipe's shell) once its part of the log shows KILL_AFTER updates past the first it made.
attempt_killed_mid_epoch() {
    local seed=$1 n=$2 log=$WORK/arms/interrupted-seed$1/train.log offset pid trainer updates first rc=0
    offset=$(log_size "$seed")
    log "seed $seed, attempt $n: kill -9 of fairseq-train $KILL_AFTER updates after it resumed"
    bash "$SELF" train interrupted "$seed" & pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        updates=$(tail -c +$((offset + 1)) "$log" 2>/dev/null | grep -o "num_updates=[0-9]*" | cut -d= -f2 || true)
        first=$(head -1 <<< "$updates") updates=$(tail -1 <<< "$updates")
        if [ -n "$first" ] && [ "$updates" -ge $((first - 1 + KILL_AFTER)) ]; then
            trainer=$(pgrep -P "$pid" -f fairseq-train || true)
            if [ -n "$trainer" ]; then
                kill -9 "$trainer"
                log "killed fairseq-train (pid $trainer), its log at $updates updates"
            fi
            break
        fi
        sleep 0.1
    done
    wait "$pid" || rc=$?
    record_attempt "$seed" "$n" "$rc" "$offset"
}

experiment() {
    setup_work
    prepare
    local seed
    for seed in $SEEDS; do
        if [ -f "$WORK/attempts/seed$seed/4.rc" ]; then
            log "seed $seed: done before, skipped (delete $WORK/attempts/seed$seed to redo)"
        else
            interrupt_seed "$seed"
        fi
    done
    report
}

# interrupt_seed S: the uninterrupted arm of seed S, then the interrupted one, attempt by attempt.
interrupt_seed() {
    local seed=$1 start=$SECONDS epoch out=$WORK/attempts/seed$1 faults="$FAULTS${PYTHONPATH:+:$PYTHONPATH}"
    local trained_before=no
    [ -f "$WORK/stamps/uninterrupted.seed$seed.train" ] && trained_before=yes
    bash "$SELF" train uninterrupted "$seed"
    # its wall time, unless its step was done before (then it keeps the one it had)
    [ $trained_before = yes ] || echo $((SECONDS - start)) > "$WORK/uninterrupted-seed$seed.seconds"
    epoch=$(grep -om1 "epoch 001: *[0-9]* / *[0-9]*" "$WORK/arms/uninterrupted-seed$seed/train.log" | grep -o "[0-9]*$")
    KILL_AFTER=${KILL_AFTER:-$((epoch + epoch / 2))}
    rm -rf "$out" "$WORK/arms/interrupted-seed$seed" "$WORK/stamps/interrupted.seed$seed.train"
    mkdir -p "$out"
    : > "$out/all.log"
    start=$SECONDS
    attempt "$seed" 1 PYTHONPATH="$faults" FAIRSEQ_KILL_DURING=copy:1
    attempt_killed_mid_epoch "$seed" 2
    attempt "$seed" 3 PYTHONPATH="$faults" FAIRSEQ_KILL_DURING=save:1
    echo "$KILL_AFTER" > "$out/kill_after"
    attempt "$seed" 4
    echo $((SECONDS - start)) > "$WORK/interrupted-seed$seed.seconds"
}

# WORK/interrupt.{json,md} from the attempts' records and both arms' logs and final checkpoints.
report() {
    python -m experiments.interrupt_report report "$WORK"
}

case "${1:-}" in
    train) [ $# -eq 2 ] || [ $# -eq 3 ] || die "usage: examples/interrupt/run.sh train NAME [SEED]"; train_one "$2" "${3:-1}" ;;
    "") experiment ;;
    report) report ;;
    *) die "usage: examples/interrupt/run.sh [train NAME [SEED] | report]" ;;
esac
