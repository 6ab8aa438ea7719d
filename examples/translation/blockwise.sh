#!/usr/bin/env bash
# Blockwise parallel decoding on ddtp-de-en (German -> English): our version of Stern et al.
# (2018) Table 1 (BLEU / mean accepted block size) plus wall-clock speedup (Fig. 4).
#
# usage: examples/translation/blockwise.sh [DATA_BIN] [BASELINE_CKPT] [DISTILLED_BIN] [OUT]
#   DATA_BIN       data-prep/ddtp-de-en/bin                      (examples/data/prepare-ddtp.sh)
#   BASELINE_CKPT  checkpoints/ddtp-de-en-cpu/checkpoint_best.pt (examples/translation/train-baseline.sh)
#   DISTILLED_BIN  data-prep/ddtp-de-en-distilled/bin            (examples/distill.sh; skipped if absent)
#   OUT            results/blockwise
# Environment:
#   KS="2 4 6 8 10"  MODES="frozen finetune"  PRESET=cpu|gpu (must match the baseline's sizes)
#   DISTILLED_BASE  the base model of the distilled runs (default BASELINE_CKPT; the paper's is
#                   a baseline trained on the distilled data)
#   SHARED_HEADS=1  one model with max(KS) heads per (data, mode), decoded at every k in KS
#                   (one random head per target position, --head-sampling position, so every
#                   head learns in every batch for the price of one): 1/5 of the training of
#                   the paper's one model per k (SHARED_HEADS=0, the default)
#   BENCH=0         train only (run two with different MODES side by side on a CPU, then once
#                   more with BENCH=1 to measure them one after the other)
#   MAX_MINUTES per model on the CPU (default 6); THREADS; REPEATS (default 3); BENCH_SENTENCES
# Frozen = base parameters frozen, identity p_1 (lossless w.r.t. the base); finetune = all
# parameters trained (p_1 changes). Every model starts from its base (--init-from-transformer).
# Prints the table (markdown) at the end; OUT/bench-*/results.json hold the measurements.
# Fast path on top of a model you already have: VERIFIER=path/to/checkpoint.pt blockwise.sh
#   [DATA_BIN] [IGNORED] [IGNORED] [OUT] runs examples/translation/drafters-on-verifier.sh
#   blockwise (self-distillation, recurrent or light heads on the frozen model, HEADS=; lossless).
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
if [ -n "${VERIFIER:-}" ]; then
  exec bash "$HERE/examples/translation/drafters-on-verifier.sh" blockwise \
    "$(dirname "${1:-data-prep/ddtp-de-en/bin}")" "${4:-results/blockwise-fast}"
fi
DATA=${1:-data-prep/ddtp-de-en/bin}
BASE=${2:-checkpoints/ddtp-de-en-${PRESET:-cpu}/checkpoint_best.pt}
DISTILLED=${3:-data-prep/ddtp-de-en-distilled/bin}
OUT=${4:-results/blockwise}
KS=${KS:-"2 4 6 8 10"}
MODES=${MODES:-"frozen finetune"}
THREADS=${THREADS:-2}
SHARED_HEADS=${SHARED_HEADS:-0}
export OMP_NUM_THREADS=$THREADS
[ -f "$BASE" ] || { echo "blockwise.sh: error: no baseline checkpoint $BASE" >&2; exit 1; }
DISTILLED_BASE=${DISTILLED_BASE:-$BASE}
datas=(regular)
if [ -f "$DISTILLED/dict.de.txt" ]; then
  [ -f "$DISTILLED_BASE" ] || { echo "blockwise.sh: error: no DISTILLED_BASE checkpoint $DISTILLED_BASE" >&2; exit 1; }
  datas+=(distilled)
fi
mkdir -p "$OUT"
kmax=$(printf '%s\n' $KS | sort -n | tail -1)

# train NAME BIN BASE_CKPT MODE HEADS
train() {
  local name=$1 bin=$2 base=$3 mode=$4 heads=$5 save=$OUT/ckpt/$1 extra=()
  [ -f "$save/checkpoint_best.pt" ] && return
  echo "[blockwise $(date +%H:%M:%S)] training $name" >&2
  # frozen: identity p_1; one random head per batch (the paper); a shared model stands for all
  # k, so every head trains in every batch: one random head per position (the mean over 10
  # heads costs 10 vocabulary projections: 30 updates in 10 CPU minutes instead of ~300)
  [ "$mode" = frozen ] && extra=(--freeze-base --identity-first-head)
  [ "$SHARED_HEADS" = 1 ] && extra+=(--head-sampling position)
  ARCH=blockwise_transformer MAX_MINUTES=${MAX_MINUTES:-6} bash "$HERE/examples/train-transformer.sh" \
    "$bin" "$save" de en --proposal-heads "$heads" --init-from-transformer "$base" \
    --criterion blockwise_cross_entropy --warmup-updates 100 "${extra[@]}" \
    > "$OUT/train-$name.log" 2>&1 || { tail -20 "$OUT/train-$name.log" >&2; exit 1; }
}

# bench NAME K...: greedy (p_1 alone) and blockwise at each k, batch 1, one process
bench() {
  local name=$1; shift
  [ "${BENCH:-1}" = 1 ] || return 0
  [ -f "$OUT/bench-$name/results.json" ] && return
  echo "[blockwise $(date +%H:%M:%S)] benchmark $name" >&2
  local specs=(greedy) k
  for k in "$@"; do specs+=("blockwise:label=blockwise-k$k,block_size=$k"); done
  python -m fairseq_pardec.benchmark "$DATA" --path "$OUT/ckpt/$name/checkpoint_best.pt" -s de -t en \
    --generators "${specs[@]}" --batch-sizes 1 --repeats "${REPEATS:-3}" \
    --threads "$THREADS" ${BENCH_SENTENCES:+--max-sentences $BENCH_SENTENCES} \
    --no-progress --out-dir "$OUT/bench-$name.tmp" > "$OUT/bench-$name.log" 2>&1 \
    || { tail -20 "$OUT/bench-$name.log" >&2; exit 1; }
  rm -rf "$OUT/bench-$name" && mv "$OUT/bench-$name.tmp" "$OUT/bench-$name"
}

for data in "${datas[@]}"; do
  bin=$DATA base=$BASE
  [ "$data" = distilled ] && bin=$DISTILLED base=$DISTILLED_BASE
  for mode in $MODES; do
    if [ "$SHARED_HEADS" = 1 ]; then
      train "$data-$mode-shared-k$kmax" "$bin" "$base" "$mode" "$kmax"
      bench "$data-$mode-shared-k$kmax" $KS
    else
      for k in $KS; do
        train "$data-$mode-k$k" "$bin" "$base" "$mode" "$k"
        bench "$data-$mode-k$k" "$k"
      done
    fi
  done
done

python3 "$HERE/examples/blockwise_table.py" "$OUT"
