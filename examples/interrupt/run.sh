#!/usr/bin/env bash
# Interrupted training, measured. One recipe arm (QKNorm, the toy pair) is trained twice through the
# recipe's own steps (examples/common.sh), on the same data and seed: once straight through, and once
# killed three times, rerunning the same command after each kill:
#   attempt 1: kill -9 half-way through fairseq's copy of a checkpoint to its other name, at the
#              first save that has one (checkpoint_best.pt -> checkpoint_last.pt: the first
#              validation; a fresh run always has a best checkpoint then);
#   attempt 2: kill -9 of fairseq-train mid-epoch, KILL_AFTER updates after it resumed;
#   attempt 3: kill -9 half-way through the first checkpoint write (torch.save of NAME.pt.tmp);
#   attempt 4: no fault: runs to the end.
# Attempts 1 and 3 are injected deterministically (tests/fault_injection/sitecustomize.py). Writes
# WORK/interrupt.{md,json}: per attempt the checkpoint it resumed from, the updates lost, every
# checkpoint file checked complete after the kill; dev BLEU and weights of both runs at the end.
#
#   examples/interrupt/run.sh              the experiment (PRESET=toy, WORK=work/interrupt-PRESET)
#   examples/interrupt/run.sh train NAME [SEED]  one arm, WORK/arms/NAME-seedSEED (default 1), through
#                                          the recipe's steps: the command that is killed and rerun
#   examples/interrupt/run.sh report       WORK/interrupt.{md,json} again, from a finished experiment
# Settings (environment): PRESET (default toy), REFERENCE_SEEDS (default 1: the seeds trained
# uninterrupted; seed 1 is the one interrupted, the others say how far dev BLEU moves between seeds,
# i.e. what "within noise" means), KILL_AFTER (default: one and a half epochs, from the
# uninterrupted run), DATA_DIR, and the preset's values (MAX_UPDATE, EXTRA_TRAIN_FLAGS, ...) as for
# examples/ted/run.sh.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

set_pair toy
set_preset "${PRESET:-toy}"
WORK=${WORK:-$ROOT/work/interrupt-$PRESET}
export LOG_INTERVAL=${LOG_INTERVAL:-1}  # every update in the log: where each kill landed
SELF=$ROOT/examples/interrupt/run.sh
FAULTS=$ROOT/tests/fault_injection
REFERENCE_SEEDS=${REFERENCE_SEEDS:-1}
[[ " $REFERENCE_SEEDS " == *" 1 "* ]] || die "REFERENCE_SEEDS='$REFERENCE_SEEDS': expected seeds that include 1 (the interrupted run's seed)"

train_one() {
    setup_work
    prepare
    local seed=${2:-1}
    step "$1.seed$seed.train" binarize train_arm "$WORK/arms/$1-seed$seed" "$QKNORM_ARCH"
}

# After attempt N: its exit status, its part of train.log (the recipe appends when it resumes and
# starts a new log when it starts afresh) and every checkpoint file, complete (a whole zip archive,
# as torch.save writes) or not.
record_attempt() {
    local n=$1 rc=$2 offset=$3 dir=$WORK/arms/interrupted-seed1
    echo "$rc" > "$WORK/attempts/$n.rc"
    if [ "$(stat -c %s "$dir/train.log")" -gt "$offset" ] && head -c "$offset" "$dir/train.log" | cmp -s - "$WORK/attempts/all.log"; then
        tail -c +$((offset + 1)) "$dir/train.log" > "$WORK/attempts/$n.log"
    else
        cp "$dir/train.log" "$WORK/attempts/$n.log"
    fi
    cp "$dir/train.log" "$WORK/attempts/all.log"
    python - "$dir" > "$WORK/attempts/$n.files" <<'PY'
import pathlib, sys, zipfile
for d in ("checkpoints.tmp", "checkpoints"):
    for p in sorted((pathlib.Path(sys.argv[1]) / d).glob("checkpoint*")):
        ok = zipfile.is_zipfile(p) and zipfile.ZipFile(p).testzip() is None
        print(f"{d}/{p.name}", p.stat().st_size, "complete" if ok else "truncated")
PY
}

log_size() { stat -c %s "$WORK/arms/interrupted-seed1/train.log" 2>/dev/null || echo 0; }

# attempt N ENV...: rerun the same command, with ENV.
attempt() {
    local n=$1 offset rc=0; shift
    offset=$(log_size)
    log "attempt $n: ${*:-no fault}"
    env "$@" bash "$SELF" train interrupted || rc=$?
    record_attempt "$n" "$rc" "$offset"
}

# attempt_killed_mid_epoch N: rerun the same command; SIGKILL its fairseq-train (a child of the
# recipe's shell) once its part of the log shows KILL_AFTER updates past the first it made.
attempt_killed_mid_epoch() {
    local n=$1 log=$WORK/arms/interrupted-seed1/train.log offset pid trainer updates first rc=0
    offset=$(log_size)
    log "attempt $n: kill -9 of fairseq-train $KILL_AFTER updates after it resumed"
    bash "$SELF" train interrupted & pid=$!
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
    record_attempt "$n" "$rc" "$offset"
}

experiment() {
    setup_work
    prepare
    local start=$SECONDS epoch faults="$FAULTS${PYTHONPATH:+:$PYTHONPATH}"
    bash "$SELF" train uninterrupted
    echo $((SECONDS - start)) > "$WORK/uninterrupted.seconds"
    epoch=$(grep -om1 "epoch 001: *[0-9]* / *[0-9]*" "$WORK/arms/uninterrupted-seed1/train.log" | grep -o "[0-9]*$")
    KILL_AFTER=${KILL_AFTER:-$((epoch + epoch / 2))}
    for seed in $REFERENCE_SEEDS; do
        [ "$seed" = 1 ] || bash "$SELF" train uninterrupted "$seed"
    done
    rm -rf "$WORK/attempts" "$WORK/arms/interrupted-seed1" "$WORK/stamps/interrupted.seed1.train"
    mkdir -p "$WORK/attempts"
    : > "$WORK/attempts/all.log"
    start=$SECONDS
    attempt 1 PYTHONPATH="$faults" FAIRSEQ_KILL_DURING=copy:1
    attempt_killed_mid_epoch 2
    attempt 3 PYTHONPATH="$faults" FAIRSEQ_KILL_DURING=save:1
    attempt 4
    echo $((SECONDS - start)) > "$WORK/interrupted.seconds"
    echo "$KILL_AFTER" > "$WORK/attempts/kill_after"
    report
}

# WORK/interrupt.{json,md} from the attempts' records and both arms' logs and final checkpoints.
report() {
    python - "$WORK" <<'PY'
import json, pathlib, re, sys

import torch

import fairseq_qknorm  # noqa: F401  (allow-lists fairseq's checkpoint contents for torch.load)

work = pathlib.Path(sys.argv[1])
kill_after = int((work / "attempts/kill_after").read_text())
faults = {1: "kill -9 half-way through the first checkpoint copy", 2: f"kill -9 mid-epoch, {kill_after} updates after the resume",
          3: "kill -9 half-way through the first torch.save", 4: "none"}


def validations(text):
    """[updates, dev BLEU] of the validations the final model descends from: a resume from a
    checkpoint of U updates drops the validations after U of the attempt that was killed."""
    kept = []
    for line in text.splitlines():
        loaded = re.search(r"Loaded checkpoint \S+ \(epoch \d+ @ (\d+) updates\)", line)
        if loaded:
            kept = [v for v in kept if v[0] <= int(loaded[1])]
        valid = re.search(r"valid on 'valid' subset .*?\| bleu ([\d.]+) .*?\| num_updates (\d+)", line)
        if valid:
            kept.append([int(valid[2]), float(valid[1])])
    return kept


def parse(text):
    updates = [int(u) for u in re.findall(r"num_updates[= ](\d+)", text)]
    loaded = re.search(r"Loaded checkpoint (\S+) \(epoch (\d+) @ (\d+) updates\)", text)
    saved = re.findall(r"Saved checkpoint \S+ \(epoch (\d+) @ (\d+) updates", text)
    valid = re.findall(r"valid on 'valid' subset .*?\| bleu ([\d.]+) .*?\| num_updates (\d+)", text)
    epoch = re.search(r"epoch \d+: +\d+ / +(\d+)", text)
    return {"last_logged_updates": max(updates, default=0),
            "resumed_from": loaded and {"file": pathlib.Path(loaded[1]).name, "epoch": int(loaded[2]), "updates": int(loaded[3])},
            "fresh_start": "No existing checkpoint found" in text,
            "last_saved_updates": int(saved[-1][1]) if saved else None,
            "dev_bleu": [[int(u), float(b)] for b, u in valid],
            "updates_per_epoch": int(epoch[1]) if epoch else None}


attempts = []
for n in (1, 2, 3, 4):
    entry = {"attempt": n, "fault": faults[n], "rc": int((work / f"attempts/{n}.rc").read_text()),
             "files": (work / f"attempts/{n}.files").read_text().split("\n")[:-1],
             **parse((work / f"attempts/{n}.log").read_text())}
    if n > 1:  # the work of the attempt before that this one does not start from
        entry["updates_lost"] = attempts[-1]["last_logged_updates"] - (entry["resumed_from"] or {"updates": 0})["updates"]
    attempts.append(entry)

runs = {}
references = sorted(work.glob("arms/uninterrupted-seed*"), key=lambda d: int(d.name.rsplit("seed", 1)[1]))
for arm in [*references, work / "arms/interrupted-seed1"]:
    text = (arm / "train.log").read_text()
    dev = validations(text)
    seconds = work / f"{arm.name.split('-')[0]}.seconds"
    runs[arm.name] = {"final_updates": parse(text)["last_logged_updates"], "dev_bleu_final": dev[-1][1],
                      "dev_bleu_best": max(b for _, b in dev), "dev_bleu": dev,
                      "seconds": int(seconds.read_text()) if arm.name.endswith("seed1") else None}
states = [torch.load(work / f"arms/{name}-seed1/checkpoints/checkpoint_last.pt")["model"] for name in ("uninterrupted", "interrupted")]
max_diff = max((states[0][k].float() - states[1][k].float()).abs().max().item() for k in states[0])
reference_bleu = [runs[d.name]["dev_bleu_final"] for d in references]
result = {"attempts": attempts, "runs": runs, "max_abs_weight_difference": max_diff, "kill_after": kill_after,
          "uninterrupted_final_dev_bleu_range": [min(reference_bleu), max(reference_bleu)]}
(work / "interrupt.json").write_text(json.dumps(result, indent=1) + "\n")

md = ["| attempt | fault | exit | resumed from | updates lost | log reached | files after (final names) |", "|---|---|---|---|---|---|---|"]
for a in attempts:
    r = a["resumed_from"]
    resumed = f"{r['file']} (epoch {r['epoch']} @ {r['updates']})" if r else ("nothing (fresh start)" if a["fresh_start"] else "-")
    files = ", ".join(f for f in a["files"] if ".tmp " not in f.replace("checkpoints.tmp/", ""))
    md.append(f"| {a['attempt']} | {a['fault']} | {a['rc']} | {resumed} | {a.get('updates_lost', '-')} | {a['last_logged_updates']} | {files} |")
md += ["", "| run | updates | final dev BLEU | best dev BLEU | wall (s) |", "|---|---|---|---|---|"]
for name, r in runs.items():
    md.append(f"| {name} | {r['final_updates']} | {r['dev_bleu_final']:.2f} | {r['dev_bleu_best']:.2f} | {r['seconds'] if r['seconds'] is not None else '-'} |")
md += ["", f"final dev BLEU of the {len(references)} uninterrupted seed(s): {min(reference_bleu):.2f} to {max(reference_bleu):.2f}",
       f"max |weight difference| between the two seed-1 final checkpoints: {max_diff:.3g}"]
(work / "interrupt.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
PY
}

case "${1:-}" in
    train) [ $# -eq 2 ] || [ $# -eq 3 ] || die "usage: examples/interrupt/run.sh train NAME [SEED]"; train_one "$2" "${3:-1}" ;;
    "") experiment ;;
    report) report ;;
    *) die "usage: examples/interrupt/run.sh [train NAME [SEED] | report]" ;;
esac
