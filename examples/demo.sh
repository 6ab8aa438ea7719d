#!/usr/bin/env bash
# The main job (`make demo`): on the bundled real data (data/uagec-mini, UA-GEC, CC BY 4.0)
#   1. learn BPE and binarize with one shared dictionary,
#   2. train a small GEC transformer with the stock fairseq-train (DEMO_MINUTES, default 8),
#   3. decode the test set with every generator in one process and print the benchmark table.
# Everything goes to $OUT (default demo-out/). Re-running skips finished steps.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-demo-out}
THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
mkdir -p "$OUT"
log() { echo "[demo $(date +%H:%M:%S)] $*" >&2; }

log "1/3 BPE + binarize data/uagec-mini -> $OUT/data"
WORKERS=$THREADS bash "$HERE/examples/data/bpe-binarize.sh" src tgt "$HERE/data/uagec-mini" "$OUT/data" 2000

if [ ! -f "$OUT/ckpt/checkpoint_best.pt" ] || [ -n "${RETRAIN:-}" ]; then
  log "2/3 train a small transformer for ${DEMO_MINUTES:-8} minutes (stock fairseq-train)"
  # the whole log goes to train.log; one line per epoch to the terminal
  PRESET=tiny MAX_MINUTES=${DEMO_MINUTES:-8} bash "$HERE/examples/train-transformer.sh" \
    "$OUT/data/bin" "$OUT/ckpt" src tgt 2>&1 | tee "$OUT/train.log" \
    | { grep --line-buffered -E "\| valid on 'valid' subset" || true; } \
    | sed -u -E "s/.*epoch 0*([0-9]+) \| valid on 'valid' subset \| loss ([0-9.]+) .*\| ppl ([0-9.]+) .*\| num_updates ([0-9]+).*/[demo] epoch \1: valid loss \2, ppl \3, \4 updates/" >&2 \
    || { tail -20 "$OUT/train.log" >&2; exit 1; }
  [ -f "$OUT/ckpt/checkpoint_best.pt" ] || { tail -20 "$OUT/train.log" >&2; exit 1; }
else
  log "2/3 $OUT/ckpt/checkpoint_best.pt exists (RETRAIN=1 to train again)"
fi

log "3/3 decode test with beam-5, greedy and iad at batch 1 and 32 (median of 3 alternating runs)"
python -m fairseq_pardec.benchmark "$OUT/data/bin" --path "$OUT/ckpt/checkpoint_best.pt" \
  --generators beam:beam=5 greedy iad --batch-sizes 1 32 --repeats 3 --threads "$THREADS" \
  --out-dir "$OUT/benchmark"
log "table, JSON and plot in $OUT/benchmark/"
