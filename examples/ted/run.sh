#!/usr/bin/env bash
# The paper's comparison on one language pair: baseline (PreNorm + FixNorm + ScaleNorm, scaled dot
# product) against QKNorm (PreNorm + FixNorm + LayerNorm + QKNorm), from raw parallel text to a
# results table, through fairseq-preprocess / fairseq-train / fairseq-generate and sacrebleu.
#
#   examples/ted/run.sh PAIR        PAIR: gl-en sk-en ar-en en-he (TED, Qi et al. 2018), en-vi
#                                   (IWSLT'15, Stanford), toy (the generated default corpus)
# Settings (environment): PRESET=paper|paper_controlled|cpu|toy|smoke (default paper: each arm with the
#   paper code's own learning-rate schedule; paper_controlled: one for both), SEEDS="1 2" (default 1),
#   DATA_DIR (plain text {train,dev,test}.{src,tgt lang}: no download), TED_ARCHIVE (a local
#   ted_talks.tar.gz), WORK (default work/PAIR-PRESET), CACHE_DIR (downloads), and the preset's
#   values (MODEL_FLAGS, STOP_HOURS, MAX_UPDATE, ...: see examples/common.sh).
# Finished steps are skipped when rerun; see examples/README.md.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

[ $# -eq 1 ] || die "usage: examples/ted/run.sh PAIR (gl-en sk-en ar-en en-he en-vi toy)"
set_pair "$1"
set_preset "${PRESET:-paper}"
setup_work
prepare
run_arms main "baseline:$BASELINE_ARCH" "qknorm:$QKNORM_ARCH"
cat "$WORK/main/results.md"
