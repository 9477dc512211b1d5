# Shared pieces of the recipes (sourced, not run): settings, the step runner, data, subwords,
# training, generation and scoring. The recipes (ted/run.sh, ted/ablation.sh, quickstart.sh) only
# choose a pair, a preset and the arms to train.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
export PATH="$VENV/bin:$PATH"
export PYTHONUNBUFFERED=1
# The recipes' Python (data checks, results, reports) is the repository's experiments/ package.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
CACHE_DIR=${CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/fairseq-qknorm}

log() { echo "| $(date -u +%H:%M:%S) $*" >&2; }
die() { echo "error: $*" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------
# Pairs: languages, the paper's per-pair architecture and validation interval (in updates).
# ---------------------------------------------------------------------------------------------
set_pair() {
    PAIR=$1
    ARCH_SUFFIX=""
    case $PAIR in
        gl-en) SRC=gl TGT=en VALID_UPDATES=100 ARCH_SUFFIX=_glen ;;
        sk-en) SRC=sk TGT=en VALID_UPDATES=600 ;;
        ar-en) SRC=ar TGT=en VALID_UPDATES=2000 ;;
        en-he) SRC=en TGT=he VALID_UPDATES=2000 ;;
        en-vi) SRC=en TGT=vi VALID_UPDATES=1500 ;;
        toy) SRC=src TGT=tgt VALID_UPDATES=100 ;;
        *) die "unknown pair '$PAIR' (expected one of: gl-en sk-en ar-en en-he en-vi toy)" ;;
    esac
    BASELINE_ARCH=transformer_scalenorm_paper$ARCH_SUFFIX
    QKNORM_ARCH=transformer_qknorm_paper$ARCH_SUFFIX
}

# The 2x2 ({ScaleNorm, LayerNorm} x {scaled dot product, QKNorm}) as recipe arms NAME:ARCH:FLAGS,
# one per cell NORM.ATTENTION; ted/ablation.sh 2x2 and the gl-en 2x2 campaigns train these.
TWO_BY_TWO_CELLS="scalenorm.dot scalenorm.qknorm layernorm.dot layernorm.qknorm"
two_by_two_arm() {
    case $1 in
        scalenorm.dot) echo "baseline:$BASELINE_ARCH:" ;;
        scalenorm.qknorm) echo "scalenorm-qknorm:$QKNORM_ARCH:--norm-type scalenorm" ;;
        layernorm.dot) echo "layernorm-dot:$QKNORM_ARCH:--qk-norm none --qk-scale none" ;;
        layernorm.qknorm) echo "qknorm:$QKNORM_ARCH:" ;;
        *) die "unknown 2x2 cell '$1' (expected one of: $TWO_BY_TWO_CELLS)" ;;
    esac
}

# ---------------------------------------------------------------------------------------------
# Presets: sizes, budgets and the learning-rate schedule differ, never the pipeline. Every value can
# be overridden by the environment variable of the same name (e.g. STOP_HOURS=2 PRESET=cpu ...).
#   MODEL_FLAGS  size flags added after --arch (empty: the paper's size)
#   MAX_TOKENS   tokens per batch;  WARMUP  linear warm-up updates (scaled with the budget)
#   MAX_UPDATE   updates per arm (0: none), the same for both arms so they are comparable;
#   STOP_HOURS   wall-clock cap per arm (empty: none), a safety net: an arm it stops is cut short
#   VALID_EPOCHS validate every N epochs (0: not at epoch ends, only every VALID_UPDATES updates)
#   BPE_SIZE     joint sentencepiece vocabulary;  LR  peak learning rate
# The schedule (SCHEDULE, set by the preset):
#   plateau  (cpu, toy, smoke) every arm: linear warm-up to LR, then fairseq's reduce_lr_on_plateau
#            (x0.8 after 4 epoch-end validations in a row without a new best dev BLEU), stop at STOP_MIN_LR.
#            A budget of minutes cannot afford 8,000 warm-up updates: a shorter one, a higher peak.
#   paper    (paper) each arm as the paper's own code trains it (configurations.py, controller.py),
#            the plugin's paper_warmup_flat and paper_constant schedulers: the QKNorm system warms
#            up over WARMUP (8,000) updates to LR = d^-0.5 * WARMUP^-0.5 (4.94e-4, d = 512) and stays
#            flat; the baseline (BASELINE_ARCH) trains at BASELINE_LR (3e-4) from the first update.
#            Both: x0.8 after a validation whose dev BLEU is below the minimum of the 3 before it;
#            stop below STOP_LR (QKNorm system) or BASELINE_STOP_LR (baseline), or after
#            MAX_PAPER_EPOCHS epochs: the paper code's epoch is the pair's VALID_UPDATES updates and a
#            validation (MAX_UPDATE = MAX_PAPER_EPOCHS x VALID_UPDATES).
#   paper_controlled  (paper_controlled) as paper, with the QKNorm system's schedule, stop and
#            epoch cap for every arm: the 2x2 ({ScaleNorm, LayerNorm} x {dot, QKNorm}) needs one
#            schedule for all four cells, else the schedule is a third thing that differs.
# ---------------------------------------------------------------------------------------------
set_preset() {
    PRESET=$1
    local model warmup lr=3e-4 max_update stop_hours valid_epochs bpe max_tokens=4096 valid_updates=$VALID_UPDATES
    local schedule=plateau
    case $PRESET in
        paper|paper_controlled)  # the paper's sizes (the arch defaults) and the paper code's schedules, for a GPU
            model="" warmup=8000 lr="" max_update="" stop_hours="" valid_epochs=0 bpe=8000 schedule=$PRESET ;;
        cpu)    # ~45 min per arm on 2 CPU cores (gl-en): the paper's layers and heads at a quarter of
                # the width (a wider model gets too few updates in the budget), dropout 0.1 instead of
                # the paper's 0.4 (at this width and budget 0.4 kept both arms from learning, measured:
                # ted/RESULTS.md); a short budget needs a short warm-up and a higher peak rate
            model="--encoder-embed-dim 128 --decoder-embed-dim 128 --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512 --dropout 0.1 --attention-dropout 0.1 --activation-dropout 0.1"
            warmup=400 lr=1e-3 max_update=1400 stop_hours="" valid_epochs=2 bpe=8000 valid_updates=0 ;;
        toy)    # the quickstart: the generated corpus, a few minutes per arm on 2 cores
            model="--encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 128 --decoder-embed-dim 128 --encoder-ffn-embed-dim 256 --decoder-ffn-embed-dim 256 --encoder-attention-heads 4 --decoder-attention-heads 4 --dropout 0.1"
            warmup=100 lr=1e-3 max_update=300 stop_hours="" valid_epochs=10 bpe=500 valid_updates=0 ;;
        smoke)  # seconds: checks the plumbing (CI), not the model
            model="--encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 --decoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64 --encoder-attention-heads 2 --decoder-attention-heads 2"
            warmup=10 lr=1e-3 max_update=30 stop_hours="" valid_epochs=1 bpe=200 max_tokens=1024 valid_updates=0 ;;
        *) die "unknown PRESET '$PRESET' (expected one of: paper paper_controlled cpu toy smoke)" ;;
    esac
    SCHEDULE=$schedule
    MODEL_FLAGS=${MODEL_FLAGS-$model}
    WARMUP=${WARMUP:-$warmup}
    STOP_HOURS=${STOP_HOURS-$stop_hours}
    VALID_EPOCHS=${VALID_EPOCHS:-$valid_epochs}
    VALID_UPDATES=${VALID_UPDATE_INTERVAL:-$valid_updates}
    BPE_SIZE=${BPE_SIZE:-$bpe}
    MAX_TOKENS=${MAX_TOKENS:-$max_tokens}
    if [ "$SCHEDULE" = plateau ]; then
        LR=${LR:-$lr}
        # Transformers without Tears' stop rate, for the plateau schedule.
        STOP_MIN_LR=${STOP_MIN_LR:-5e-5}
    else
        # The paper code's values (configurations.py): the QKNorm configurations' peak
        # d^-0.5 * warmup^-0.5 (d = 512, the width of every paper architecture) and stop_lr (1e-5;
        # gl-en 5e-5), the baseline's (base()) constant 3e-4 and stop_lr 5e-5; max_epochs 200
        # (gl-en 1,000) for both.
        LR=${LR:-$(awk -v w="$WARMUP" 'BEGIN { printf "%.6g", 1 / sqrt(512 * w) }')}
        BASELINE_LR=${BASELINE_LR:-3e-4}
        BASELINE_STOP_LR=${BASELINE_STOP_LR:-5e-5}
        if [ "$PAIR" = gl-en ]; then
            STOP_LR=${STOP_LR:-5e-5} MAX_PAPER_EPOCHS=${MAX_PAPER_EPOCHS:-1000}
        else
            STOP_LR=${STOP_LR:-1e-5} MAX_PAPER_EPOCHS=${MAX_PAPER_EPOCHS:-200}
        fi
        max_update=$((MAX_PAPER_EPOCHS * VALID_UPDATES))  # the epoch cap, in updates (0 without fixed epochs: none)
    fi
    MAX_UPDATE=${MAX_UPDATE:-$max_update}
    SEEDS=${SEEDS:-${SEED:-1}}
    # Decoding as in the paper: beam 4, length penalty 0.6, at most source length + 50 tokens.
    BEAM=4 LENPEN=0.6 MAX_LEN_B=50
}

# The 2x2 recipes train every cell with one schedule: not with the paper preset's two.
require_one_schedule() {
    [ "$SCHEDULE" != paper ] || die "PRESET=$PRESET trains the baseline and the QKNorm system with the paper code's two schedules; the 2x2 needs one for every cell: PRESET=paper_controlled"
}

setup_work() {
    WORK=${WORK:-$ROOT/work/$PAIR-$PRESET}
    mkdir -p "$WORK/stamps"
    WORK=$(cd "$WORK" && pwd)
    USER_DIR=$(fairseq-qknorm-user-dir)
    if [ -z "${DEVICE_FLAGS+x}" ]; then
        if python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
            DEVICE_FLAGS=""
        else
            DEVICE_FLAGS="--cpu"
        fi
    fi
    log "pair $PAIR ($SRC->$TGT), preset $PRESET, work dir $WORK"
}

# ---------------------------------------------------------------------------------------------
# Steps. `step NAME AFTER FUNCTION ARGS...` runs FUNCTION ARGS unless WORK/stamps/NAME holds the
# same signature: the command, the settings it depends on, and the signature of step AFTER (the
# step whose output it reads; "-" for none), so redoing a step redoes what was built from it.
# Functions write to temporary names and rename when complete: a step killed half-way leaves no
# stamp and is redone, never trusted (training resumes from its last complete checkpoint).
# FUNCTION sees the signature as STEP_SIGNATURE. A function whose result depends on settings beyond
# its arguments names them in FUNCTION_settings (see train_arm_settings).
# ---------------------------------------------------------------------------------------------
declare -A SIGNATURES
step() {
    local name=$1 after=$2; shift 2
    local stamp="$WORK/stamps/$name" settings="BPE_SIZE=$BPE_SIZE"
    if declare -F "$1_settings" > /dev/null; then settings+=" $("$1_settings")"; fi
    local signature lock
    signature=$(printf '%s\n' "${SIGNATURES[$after]:-}" "$*" "$settings" | sha1sum | cut -c1-16)
    # Two runs on one WORK (say, one per arm or seed) must not do a step at the same time: measured,
    # two fairseq-preprocess into one folder break each other. The second waits, then finds the step
    # done. The lock goes with its process, also on kill -9. (No flock, as on macOS: no lock.)
    if command -v flock > /dev/null; then
        exec {lock}> "$stamp.lock"
        flock -n "$lock" || { log "$name: another run of this WORK is doing it, waiting"; flock "$lock"; }
    fi
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$signature" ]; then
        log "$name: done before, skipped (delete $stamp to redo)"
    else
        rm -f "$stamp"
        log "$name: running"
        STEP_SIGNATURE=$signature "$@"
        echo "$signature" > "$stamp.tmp" && mv "$stamp.tmp" "$stamp"
    fi
    [ -n "${lock:-}" ] && exec {lock}>&-
    SIGNATURES[$name]=$signature
}

# Run a command and append it, shell-quoted, to WORK/commands.sh (the results list it).
run_logged() {
    printf '%q ' "$@" >> "$WORK/commands.sh"
    echo >> "$WORK/commands.sh"
    "$@"
}

# ---------------------------------------------------------------------------------------------
# Data: WORK/raw/{train,dev,test}.{SRC,TGT}. DATA_DIR (plain text named by language code) wins;
# otherwise TED pairs come from TED_ARCHIVE (a local ted_talks.tar.gz) or a cached download,
# en-vi from the Stanford release, toy from fairseq-qknorm-toy-corpus.
# ---------------------------------------------------------------------------------------------
TED_URL=${TED_URL:-http://phontron.com/data/ted_talks.tar.gz}
TED_SIZE=352222045  # bytes of ted_talks.tar.gz as served by phontron.com (no checksum is published)
IWSLT_URL=${IWSLT_URL:-https://nlp.stanford.edu/projects/nmt/data/iwslt15.en-vi}
# sha1 of the Stanford files, as recorded by the gluon-nlp dataset registry.
declare -A IWSLT_SHA1=(
    [train.en]=675d16d057f2b6268fb294124b1646d311477325 [train.vi]=bb6e21d4b02b286f2a570374b0bf22fb070589fd
    [tst2012.en]=e381f782d637b8db827d7b4d8bb3494822ec935e [tst2012.vi]=4511988ce67591dc8bcdbb999314715f21e5a1e1
    [tst2013.en]=d320db4c8127a85de81802f239a6e6b1af473c3d [tst2013.vi]=af212c48a68465ceada9263a049f2331f8af6290
)

# fetch URL DEST CHECK: download once into the cache, resuming a broken download (DEST.part), and
# verify with CHECK (a function taking the file) before the file gets its final name.
fetch() {
    local url=$1 dest=$2 check=$3
    if [ -f "$dest" ]; then
        "$check" "$dest" || die "$dest: cached file fails its check; delete it to download again"
        return
    fi
    mkdir -p "$(dirname "$dest")"
    log "downloading $url -> $dest (resumable: rerun to continue)"
    local quiet=()
    [ -t 2 ] || quiet=(--silent --show-error)  # a progress meter on a terminal only: logs keep curl's error line
    curl -fL --retry 3 -C - "${quiet[@]}" -o "$dest.part" "$url" || {
        local status=$? kept=""
        [ -s "$dest.part" ] && kept=" ($(stat -c %s "$dest.part") bytes kept in $dest.part: rerun to resume)"
        die "download of $url failed (curl exit $status)$kept; offline? give local files instead: DATA_DIR=plain text or TED_ARCHIVE=ted_talks.tar.gz (examples/README.md)"
    }
    if ! "$check" "$dest.part"; then
        rm -f "$dest.part"
        die "$url: the downloaded file fails its check (deleted); see examples/README.md to use a local copy"
    fi
    mv "$dest.part" "$dest"
}

check_ted_archive() {
    local file=$1 size want got
    size=$(stat -c %s "$file")
    [ "$size" = "$TED_SIZE" ] || { echo "error: $file: $size bytes, expected $TED_SIZE (ted_talks.tar.gz)" >&2; return 1; }
    got=$(sha256sum "$file" | cut -d' ' -f1)
    # No checksum is published for this archive: TED_SHA256 pins one if you have it; otherwise the
    # first verified download records its own (trust on first use) and later runs compare to it.
    want=${TED_SHA256:-$(cat "$CACHE_DIR/ted_talks.tar.gz.sha256" 2>/dev/null || true)}
    if [ -n "$want" ] && [ "$got" != "$want" ]; then
        echo "error: $file: sha256 $got, expected $want" >&2
        return 1
    fi
    [ -n "$want" ] || { echo "$got" > "$CACHE_DIR/ted_talks.tar.gz.sha256"; log "recorded sha256 $got of ted_talks.tar.gz"; }
}

check_iwslt_file() {
    local file=$1 name
    name=$(basename "${file%.part}")
    [ "$(sha1sum "$file" | cut -d' ' -f1)" = "${IWSLT_SHA1[$name]}" ] || { echo "error: $file: sha1 differs from the Stanford release's" >&2; return 1; }
}

check_plain_text_dir() {
    local dir=$1 split lang
    for split in train dev test; do
        for lang in "$SRC" "$TGT"; do
            [ -s "$dir/$split.$lang" ] || die "DATA_DIR=$dir: missing or empty $split.$lang (expected {train,dev,test}.{$SRC,$TGT})"
        done
    done
}

get_raw_data() {
    local out=$WORK/raw tmp=$WORK/raw.tmp text=$WORK/raw.tmp/source lang
    rm -rf "$tmp"; mkdir -p "$text"
    if [ -n "${DATA_DIR:-}" ]; then
        check_plain_text_dir "$DATA_DIR"
        text=$DATA_DIR
    elif [ "$PAIR" = toy ]; then
        run_logged fairseq-qknorm-toy-corpus "$text" --train "${TOY_TRAIN:-4000}" --dev "${TOY_DEV:-300}" --test "${TOY_TEST:-300}" >&2
    elif [ "$PAIR" = en-vi ]; then
        local name stanford_split
        declare -A split_of=([tst2012]=dev [tst2013]=test [train]=train)
        for stanford_split in train tst2012 tst2013; do
            for lang in en vi; do
                name=$stanford_split.$lang
                fetch "$IWSLT_URL/$name" "$CACHE_DIR/iwslt15-en-vi/$name" check_iwslt_file
                cp "$CACHE_DIR/iwslt15-en-vi/$name" "$text/${split_of[$stanford_split]}.$lang"
            done
        done
    else
        local archive=${TED_ARCHIVE:-$CACHE_DIR/ted_talks.tar.gz}
        if [ -n "${TED_ARCHIVE:-}" ]; then
            [ -f "$TED_ARCHIVE" ] || die "TED_ARCHIVE=$TED_ARCHIVE: no such file"
        else
            fetch "$TED_URL" "$archive" check_ted_archive
        fi
        run_logged python -m experiments.ted "$archive" --src "$SRC" --tgt "$TGT" --out "$text" >&2
    fi
    # Every source goes through the same checks: invalid UTF-8, unequal line counts and a carriage
    # return inside a line are errors naming the file (and line); a pair with an empty side is dropped
    # from train (counted) and an error in dev/test (experiments/check_text.py says why).
    run_logged python -m experiments.check_text "$text" --src "$SRC" --tgt "$TGT" --out "$tmp/checked" \
        | while IFS= read -r line; do log "$line"; done
    rm -rf "$out"; mv "$tmp/checked" "$out"; rm -rf "$tmp"
}

# ---------------------------------------------------------------------------------------------
# Subwords: one joint sentencepiece BPE model; encode; binarize with a joined dictionary.
# ---------------------------------------------------------------------------------------------
train_spm() {
    run_logged fairseq-qknorm-spm-train --input "$WORK/raw/train.$SRC,$WORK/raw/train.$TGT" \
        --model_prefix "$WORK/spm" --vocab_size "$BPE_SIZE" --model_type bpe
}

encode_spm() {
    local tmp=$WORK/sp.tmp split lang
    rm -rf "$tmp"; mkdir -p "$tmp"
    for split in train dev test; do
        for lang in "$SRC" "$TGT"; do
            run_logged fairseq-qknorm-spm-encode --model "$WORK/spm.model" "$WORK/raw/$split.$lang" > "$tmp/$split.$lang"
        done
    done
    rm -rf "$WORK/sp"; mv "$tmp" "$WORK/sp"
}

binarize() {
    rm -rf "$WORK/bin.tmp"
    run_logged fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" \
        --trainpref "$WORK/sp/train" --validpref "$WORK/sp/dev" --testpref "$WORK/sp/test" \
        --joined-dictionary --destdir "$WORK/bin.tmp" --workers 2 > "$WORK/preprocess.log" 2>&1 \
        || { tail -5 "$WORK/preprocess.log" >&2; die "fairseq-preprocess failed (log: $WORK/preprocess.log)"; }
    rm -rf "$WORK/bin"; mv "$WORK/bin.tmp" "$WORK/bin"
}

prepare() {
    step data - get_raw_data
    step spm data train_spm
    step encode spm encode_spm
    step binarize encode binarize
}

# ---------------------------------------------------------------------------------------------
# Processes: NPROC (default 1) fairseq-train processes under torchrun, fairseq's own distributed
# data parallel training: one per GPU (NCCL) or, with --cpu, CPU processes (gloo). fairseq sums the
# gradients of all ranks, so each rank gets MAX_TOKENS / NPROC tokens (rounded down) and an update
# still holds MAX_TOKENS, the paper's batch. fairseq cannot infer a rank on CPU (it divides by the
# GPU count), so a shell wrapper hands torchrun's RANK / LOCAL_RANK to each fairseq-train.
# legacy_ddp all-reduces the gradients after each backward pass; it works on CPU and GPU alike.
# ---------------------------------------------------------------------------------------------
set_processes() {
    NPROC=${NPROC:-1}
    [[ $NPROC =~ ^[1-9][0-9]*$ ]] || die "NPROC=$NPROC: expected a number of processes (1 or more)"
    RANK_MAX_TOKENS=$((MAX_TOKENS / NPROC))
    LAUNCH=() DISTRIBUTED_FLAGS=()
    [ "$NPROC" = 1 ] && return
    local backend=gloo gpus
    if [[ " $DEVICE_FLAGS " != *" --cpu "* ]]; then
        backend=nccl
        gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
        [ "$NPROC" -le "$gpus" ] || die "NPROC=$NPROC: torch sees $gpus GPU(s); NCCL needs one GPU per process (DEVICE_FLAGS=--cpu for CPU processes)"
    fi
    LAUNCH=(torchrun --standalone --nproc-per-node "$NPROC" --no-python
            sh -c 'exec "$0" "$@" --distributed-rank "$RANK" --device-id "$LOCAL_RANK"')
    DISTRIBUTED_FLAGS=(--distributed-world-size "$NPROC" --distributed-init-method env:// --distributed-no-spawn
                       --distributed-backend "$backend" --ddp-backend legacy_ddp)
    log "$NPROC processes ($backend), --max-tokens $RANK_MAX_TOKENS per process"
}

# ---------------------------------------------------------------------------------------------
# Training: train_arm DIR ARCH [EXTRA FLAGS...]. Checkpoints go to DIR/checkpoints.tmp and are
# renamed when training has finished; the wall time goes to DIR/train_seconds. A training killed
# half-way resumes, when its step is rerun with the same signature, from checkpoints.tmp/
# checkpoint_last.pt: fairseq restores model, optimizer, schedule and data position, and its files
# under final names are complete (fairseq_qknorm/fairseq_patches.py); train.log goes on.
# ---------------------------------------------------------------------------------------------
train_arm_settings() {
    local settings="$MODEL_FLAGS $MAX_TOKENS $WARMUP $MAX_UPDATE $STOP_HOURS $VALID_EPOCHS $VALID_UPDATES $LR ${STOP_MIN_LR:-} ${EXTRA_TRAIN_FLAGS:-}"
    # The paper code's schedules have values of their own; the plateau schedule's stamps stay as they were.
    [ "$SCHEDULE" = plateau ] || settings+=" SCHEDULE=$SCHEDULE $BASELINE_LR $STOP_LR $BASELINE_STOP_LR"
    # A process count other than 1 batches differently; 1 adds nothing, so older stamps stay valid.
    [ "${NPROC:-1}" = 1 ] || settings+=" NPROC=$NPROC"
    echo "$settings"
}

# schedule_flags ARCH: the learning-rate schedule of an arm with architecture ARCH (SCHEDULE above),
# in the array SCHEDULE_FLAGS.
schedule_flags() {
    local arch=$1
    case $SCHEDULE in
        plateau)
            SCHEDULE_FLAGS=(--lr "$LR" --lr-scheduler reduce_lr_on_plateau --lr-shrink 0.8 --lr-patience 3
                --warmup-updates "$WARMUP" --warmup-init-lr "$(awk -v lr="$STOP_MIN_LR" 'BEGIN { print lr * 1.01 }')" --stop-min-lr "$STOP_MIN_LR") ;;
        paper|paper_controlled)
            if [ "$SCHEDULE" = paper ] && [ "$arch" = "$BASELINE_ARCH" ]; then
                SCHEDULE_FLAGS=(--lr "$BASELINE_LR" --lr-scheduler paper_constant --stop-lr "$BASELINE_STOP_LR")
            else
                SCHEDULE_FLAGS=(--lr "$LR" --lr-scheduler paper_warmup_flat --warmup-updates "$WARMUP" --stop-lr "$STOP_LR")
            fi
            # The decay rule of both (the schedulers' defaults, spelled out for the logged command).
            SCHEDULE_FLAGS+=(--lr-shrink 0.8 --lr-patience 3) ;;
        *) die "unknown SCHEDULE '$SCHEDULE'" ;;
    esac
}

# train_command SAVE_DIR SEED ARCH [EXTRA FLAGS...]: the fairseq-train command line of every recipe
# (optimizer, schedule, criterion, batches, validation with --eval-bleu, budget), in the array
# TRAIN_COMMAND. CHECKPOINT_FLAGS (default --no-epoch-checkpoints) says which checkpoints to keep.
train_command() {
    local save_dir=$1 seed=$2 arch=$3; shift 3
    # VALID_EPOCHS=0: no validation at fairseq's epoch ends (an interval no run reaches).
    local validation=(--validate-interval "$VALID_EPOCHS")
    [ "$VALID_EPOCHS" -gt 0 ] || validation=(--validate-interval 1000000)
    # Every validation is saved (checkpoint_best.pt can be any of them); of the checkpoints named by
    # update, fairseq keeps the last only.
    [ "$VALID_UPDATES" -gt 0 ] && validation+=(--validate-interval-updates "$VALID_UPDATES"
        --save-interval-updates "$VALID_UPDATES" --keep-interval-updates 1)
    schedule_flags "$arch"
    # The paper code's schedules decay on its dev BLEU, multi-bleu.perl on the tokenized text:
    # sacrebleu without a tokenization of its own (the corpora are Moses-tokenized).
    local dev_bleu=()
    [ "$SCHEDULE" = plateau ] || dev_bleu=(--eval-tokenized-bleu)
    local budget=()
    [ "$MAX_UPDATE" -gt 0 ] && budget+=(--max-update "$MAX_UPDATE")
    [ -n "$STOP_HOURS" ] && budget+=(--stop-time-hours "$STOP_HOURS")
    set_processes
    # A sentence longer than the model's positions (or MAX_TOKENS) is skipped in train, as fairseq
    # always does, and in validation (dev BLEU over the rest) rather than stopping training at its
    # first validation; fairseq's warnings, repeated by train_arm, say how many.
    # --update-epoch-batch-itr True: fairseq groups each epoch's batches from --seed and that epoch, not
    # once per process from the epoch it starts in, so a run resumed from checkpoint_last.pt replays the
    # uninterrupted run bit for bit (examples/interrupt/RESULTS.md).
    # shellcheck disable=SC2206  # MODEL_FLAGS / DEVICE_FLAGS / CHECKPOINT_FLAGS / EXTRA_TRAIN_FLAGS are flag lists
    TRAIN_COMMAND=("${LAUNCH[@]}" fairseq-train "$WORK/bin" --user-dir "$USER_DIR" --arch "$arch" $MODEL_FLAGS "$@"
        --source-lang "$SRC" --target-lang "$TGT"
        --optimizer adam --clip-norm 1.0 "${SCHEDULE_FLAGS[@]}"
        --criterion label_smoothed_cross_entropy --label-smoothing 0.1
        --max-tokens "$RANK_MAX_TOKENS" --required-batch-size-multiple 1 --skip-invalid-size-inputs-valid-test
        --eval-bleu --eval-bleu-args "{\"beam\": $BEAM, \"lenpen\": $LENPEN, \"max_len_a\": 1, \"max_len_b\": $MAX_LEN_B}" --eval-bleu-remove-bpe sentencepiece "${dev_bleu[@]}"
        --best-checkpoint-metric bleu --maximize-best-checkpoint-metric
        "${validation[@]}" "${budget[@]}"
        --save-dir "$save_dir" ${CHECKPOINT_FLAGS:---no-epoch-checkpoints} --seed "$seed"
        --log-format simple --log-interval "${LOG_INTERVAL:-20}" --num-workers 0
        $DEVICE_FLAGS "${DISTRIBUTED_FLAGS[@]}" --update-epoch-batch-itr True ${EXTRA_TRAIN_FLAGS:-})
}

train_arm() {
    local dir=$1 arch=$2; shift 2
    local seed=${dir##*seed}
    mkdir -p "$dir"
    # Called outside step() (no signature): always afresh.
    if [ -z "${STEP_SIGNATURE:-}" ] || [ "$(cat "$dir/checkpoints.tmp/step_signature" 2>/dev/null)" != "$STEP_SIGNATURE" ]; then
        # not this step's own unfinished run (none, or other settings): start afresh
        rm -rf "$dir/checkpoints.tmp" "$dir/train.log"
        mkdir -p "$dir/checkpoints.tmp"
        echo "${STEP_SIGNATURE:-}" > "$dir/checkpoints.tmp/step_signature"
    fi
    rm -rf "$dir/checkpoints"
    local start=$SECONDS
    train_command "$dir/checkpoints.tmp" "$seed" "$arch" "$@"
    run_logged "${TRAIN_COMMAND[@]}" >> "$dir/train.log" 2>&1 \
        || { tail -20 "$dir/train.log" >&2; die "fairseq-train failed (log: $dir/train.log)"; }
    [ -f "$dir/checkpoints.tmp/checkpoint_best.pt" ] || die "no checkpoint_best.pt after training (log: $dir/train.log)"
    { grep -o "[0-9,]* samples have invalid sizes and will be skipped.*" "$dir/train.log" || true; } | sort -u \
        | while IFS= read -r line; do log "warning: fairseq-train: $line (longer than the model allows)"; done
    echo $((SECONDS - start)) > "$dir/train_seconds"
    mv "$dir/checkpoints.tmp" "$dir/checkpoints"
    if [[ $arch == transformer_qknorm* && " $* " != *" --qk-scale none "* ]]; then
        # The learned g per attention module; informative only: a failure here must not stop the run.
        if fairseq-qknorm-inspect g "$dir/checkpoints/checkpoint_best.pt" > "$dir/inspect.txt" 2> "$dir/inspect.log"; then
            cat "$dir/inspect.txt" >&2
        else
            rm -f "$dir/inspect.txt"
            log "warning: fairseq-qknorm-inspect failed (see $dir/inspect.log); continuing"
        fi
    fi
}

# generate_arm DIR [CHECKPOINT]: translate the test set with DIR/checkpoints/CHECKPOINT (default
# checkpoint_best.pt; beam 4), undo sentencepiece: DIR/test.hyp.
generate_arm() {
    local dir=$1 checkpoint=${2:-checkpoint_best.pt} n_hyp n_src status=0 skipped
    run_logged fairseq-generate "$WORK/bin" --user-dir "$USER_DIR" --path "$dir/checkpoints/$checkpoint" \
        --source-lang "$SRC" --target-lang "$TGT" --gen-subset test \
        --beam "$BEAM" --lenpen "$LENPEN" --max-len-a 1 --max-len-b "$MAX_LEN_B" --batch-size 64 --required-batch-size-multiple 1 \
        --skip-invalid-size-inputs-valid-test $DEVICE_FLAGS > "$dir/generate.out" 2> "$dir/generate.log" || status=$?
    # A test pair longer than the model allows (either side) is never dropped from the scored test set:
    # fairseq skips it (--skip-invalid-size-inputs-valid-test, instead of a traceback) and the recipe
    # stops, also when fairseq-generate then fails (it divides by zero when it skipped every sentence).
    skipped=$(grep -o "[0-9,]* samples have invalid sizes.*" "$dir/generate.log" | head -1 || true)
    [ "$status" = 0 ] || [ -n "$skipped" ] || { tail -20 "$dir/generate.log" >&2; die "fairseq-generate failed (log: $dir/generate.log)"; }
    [ -z "$skipped" ] || die "$dir: test sentences longer than the model allows ($skipped; ids count lines from 0): a test set is never cut; train with larger --max-source-positions/--max-target-positions (EXTRA_TRAIN_FLAGS) or split those lines"
    grep '^H-' "$dir/generate.out" | sed 's/^H-//' | sort -n -k1,1 | cut -f3 > "$dir/test.sp.hyp"
    n_hyp=$(wc -l < "$dir/test.sp.hyp"); n_src=$(wc -l < "$WORK/raw/test.$SRC")
    [ "$n_hyp" = "$n_src" ] || die "$dir: fairseq-generate wrote $n_hyp hypotheses for $n_src test sentences"
    run_logged fairseq-qknorm-spm-decode --model "$WORK/spm.model" "$dir/test.sp.hyp" > "$dir/test.hyp.tmp"
    mv "$dir/test.hyp.tmp" "$dir/test.hyp"
}

# run_arms RUN NAME:ARCH[:EXTRA FLAGS] ...: train and translate every arm for every seed in SEEDS
# (WORK/arms/NAME-seedS: an arm is trained once and shared by every run that names it), score
# them (the first is the reference of the significance tests), write WORK/RUN/results.{md,json}.
run_arms() {
    local run=$1; shift
    local spec name arch flags seed dir systems scored_after
    for seed in $SEEDS; do
        systems=() scored_after=""
        for spec in "$@"; do
            IFS=: read -r name arch flags <<< "$spec"
            dir=$WORK/arms/$name-seed$seed
            # shellcheck disable=SC2086
            step "$name.seed$seed.train" binarize train_arm "$dir" "$arch" $flags
            step "$name.seed$seed.generate" "$name.seed$seed.train" generate_arm "$dir"
            scored_after+=$(sha1sum < "$dir/test.hyp")  # scores are redone when a translation changed
            systems+=("$dir/test.hyp")
        done
        SIGNATURES[$run.seed$seed.hyps]=$scored_after
        step "$run.seed$seed.score" "$run.seed$seed.hyps" score_systems "$WORK/$run/seed$seed" "${systems[@]}"
    done
    python -m experiments.results pair "$WORK" "$run" --pair "$PAIR" --preset "$PRESET" \
        --seeds $SEEDS --arms "${@%%:*}"
}

# Two scores per system: sacrebleu's default 13a tokenization on the text as released, and
# --tokenize none (the paper's tokenized BLEU, the corpora being Moses-tokenized already).
score_systems() {
    local out=$1; shift
    local tok
    mkdir -p "$out"
    for tok in 13a none; do
        run_logged fairseq-qknorm-score --ref "$WORK/raw/test.$TGT" "$@" --json --tokenize "$tok" > "$out/score.$tok.json.tmp"
        mv "$out/score.$tok.json.tmp" "$out/score.$tok.json"
    done
}
