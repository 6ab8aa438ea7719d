#!/usr/bin/env bash
# Generalized aggressive decoding (GAD, GAD++) on ddtp-de-en, German -> English.
#   teacher (the baseline) -> distilled training data (examples/distill.sh, beam 5)
#   -> AR verifier trained on the distilled data -> GLAT drafter trained on the same data
#      (encoder and embeddings initialised from the verifier, as the GAD authors advise)
#   -> decode test with greedy, beam-5, gad and gad++ in one benchmark, plus a block-size sweep
#      (k = 5, 10, 15, 25; the paper's Table 2).
#
# usage: examples/translation/gad.sh [DATA_DIR] [TEACHER_CKPT] [OUT]
#   DATA_DIR      output folder of examples/data/prepare-ddtp.sh (needs bin/ and bpe/)
#   TEACHER_CKPT  checkpoints/ddtp-de-en-${PRESET}/checkpoint_best.pt (train-baseline.sh)
#   PRESET=cpu (d256, 3+3 layers; MAX_MINUTES per model, default 20) or gpu (Transformer-base)
#   THREADS, REPEATS (3), BENCH_SENTENCES (default: whole test set), KS ("5 10 15 25")
# Fast path on top of a model you already have (no teacher, no retrained verifier):
#   VERIFIER=path/to/checkpoint.pt examples/translation/gad.sh [DATA_DIR] [IGNORED] [OUT]
#   runs examples/translation/drafters-on-verifier.sh gad (self-distillation, a block-causal
#   drafter reading the verifier's encoder, about an hour on 2 CPU cores).
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
if [ -n "${VERIFIER:-}" ]; then
  exec bash "$HERE/examples/translation/drafters-on-verifier.sh" gad "${1:-data-prep/ddtp-de-en}" "${3:-results/gad-fast}"
fi
DIR=${1:-data-prep/ddtp-de-en}
PRESET=${PRESET:-cpu}
TEACHER=${2:-checkpoints/ddtp-de-en-$PRESET/checkpoint_best.pt}
OUT=${3:-results/gad}
THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
[ -f "$TEACHER" ] || { echo "gad.sh: error: no teacher checkpoint $TEACHER (examples/translation/train-baseline.sh)" >&2; exit 1; }
mkdir -p "$OUT"
log() { echo "[gad $(date +%H:%M:%S)] $*" >&2; }

DISTILLED=$OUT/distilled
if [ ! -f "$DISTILLED/bin/dict.de.txt" ]; then
  log "distilling the training set with the teacher (beam 5)"
  THREADS=$THREADS CPU=${CPU_ONLY:+1} bash "$HERE/examples/distill.sh" "$DIR/bin" "$TEACHER" "$DIR/bpe" "$DISTILLED" de en
fi

VERIFIER=$OUT/verifier/checkpoint_best.pt
if [ ! -f "$VERIFIER" ]; then
  log "training the AR verifier on distilled data"
  bash "$HERE/examples/train-transformer.sh" "$DISTILLED/bin" "$OUT/verifier" de en > "$OUT/train-verifier.log" 2>&1
fi

DRAFTER=$OUT/drafter/checkpoint_best.pt
if [ ! -f "$DRAFTER" ]; then
  log "training the GLAT drafter (k = 25) on distilled data"
  ARCH=glat_drafter bash "$HERE/examples/train-transformer.sh" "$DISTILLED/bin" "$OUT/drafter" de en \
    --criterion glat_loss --drafter-block-size 25 --init-from-verifier "$VERIFIER" \
    --glat-anneal-updates 20000 > "$OUT/train-drafter.log" 2>&1
fi

log "benchmark: greedy, beam-5, gad, gad++ (batch 1 and 32)"
bench() { python -m fairseq_pardec.benchmark "$DIR/bin" --path "$VERIFIER" -s de -t en --threads "$THREADS" \
  --repeats "${REPEATS:-3}" ${BENCH_SENTENCES:+--max-sentences $BENCH_SENTENCES} --max-len-a 1.2 --max-len-b 10 "$@"; }
bench --generators greedy beam:beam=5 "gad:label=gad-k25,drafter_path='$DRAFTER',block_size=25" \
  "gad:label=gad++top3-tau1,drafter_path='$DRAFTER',block_size=25,gad_beta=3,gad_tau=1.0" \
  "gad:label=gad++top5-tau3,drafter_path='$DRAFTER',block_size=25,gad_beta=5,gad_tau=3.0" \
  --batch-sizes 1 32 --out-dir "$OUT/bench"

log "block-size sweep (GAD++ top-3, tau 1.0, batch 1)"
specs=(greedy)
for k in ${KS:-5 10 15 25}; do specs+=("gad:label=gad++k$k,drafter_path='$DRAFTER',block_size=$k,gad_beta=3,gad_tau=1.0"); done
bench --generators "${specs[@]}" --batch-sizes 1 --out-dir "$OUT/sweep"
