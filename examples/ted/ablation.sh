#!/usr/bin/env bash
# One ablation on one pair, through the same pipeline as run.sh (same data, subwords, training,
# scoring, results format). Arms are shared: the baseline and QKNorm of run.sh are reused, not
# retrained, when run.sh ran first in the same WORK.
#
#   examples/ted/ablation.sh NAME PAIR
#     2x2        {ScaleNorm, LayerNorm} x {scaled dot product, QKNorm} (the paper did not run it)
#     no-g       QKNorm without g: q.k of unit vectors, fixed scale 1 (the paper's ablation)
#     length99   g0 from the 99th length percentile instead of the 97.5th (the paper's ablation)
#     heads16    QKNorm with 16 heads instead of 8 (the paper's ablation)
#     qk-norms   q and k normalized per head by LayerNorm or RMSNorm instead of L2, learned g kept
# Settings: as run.sh (PRESET, SEEDS, DATA_DIR, WORK, ...; the default PRESET of 2x2 is paper_controlled,
# one schedule for every cell). Results: WORK/NAME/results.md.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

[ $# -eq 2 ] || die "usage: examples/ted/ablation.sh NAME PAIR (NAME: 2x2 no-g length99 heads16 qk-norms)"
ablation=$1
set_pair "$2"
# The 2x2 needs one schedule for every cell: at the paper's size, paper_controlled.
if [ "$ablation" = 2x2 ]; then set_preset "${PRESET:-paper_controlled}"; require_one_schedule; else set_preset "${PRESET:-paper}"; fi
baseline="baseline:$BASELINE_ARCH"
qknorm="qknorm:$QKNORM_ARCH"
case $ablation in
    2x2) arms=(); for cell in $TWO_BY_TWO_CELLS; do arms+=("$(two_by_two_arm "$cell")"); done ;;
    no-g) arms=("$qknorm" "qknorm-no-g:$QKNORM_ARCH:--qk-scale fixed --qk-scale-init 1") ;;
    length99) arms=("$qknorm" "qknorm-length99:$QKNORM_ARCH:--qk-length-percentile 99") ;;
    heads16) arms=("$qknorm" "qknorm-16heads:$QKNORM_ARCH:--encoder-attention-heads 16 --decoder-attention-heads 16") ;;
    qk-norms) arms=("$qknorm" "qk-layernorm:$QKNORM_ARCH:--qk-norm layernorm" "qk-rmsnorm:$QKNORM_ARCH:--qk-norm rmsnorm") ;;
    *) die "unknown ablation '$ablation' (expected one of: 2x2 no-g length99 heads16 qk-norms)" ;;
esac
setup_work
prepare
run_arms "$ablation" "${arms[@]}"
cat "$WORK/$ablation/results.md"
