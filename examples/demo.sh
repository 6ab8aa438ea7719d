#!/usr/bin/env bash
# The main job (`make demo`): on the bundled real data (data/uagec-mini, UA-GEC, CC BY 4.0)
#   1. learn BPE and binarize with one shared dictionary,
#   2. train a small GEC transformer with the stock fairseq-train for DEMO_UPDATES updates
#      (default 800: a model that copies what needs no correction; a number of updates, not of
#      minutes, so a busy machine takes longer but trains the same model),
#   3. decode the first DEMO_SENTENCES (default 150) test sentences with fairseq beam-5 and
#      greedy, lean_greedy, iad, lookup, auto and CTranslate2 (its own process) at batch 1 and 32
#      in one benchmark, and print its table,
#   4. end with the verdict: the fastest lossless generator and auto (the README's choice),
#      x greedy, x CTranslate2.
# Everything goes to $OUT (default demo-out/). Re-running skips finished steps.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-demo-out}
THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
mkdir -p "$OUT"
log() { echo "[demo $(date +%H:%M:%S)] $*" >&2; }

log "1/4 BPE + binarize data/uagec-mini -> $OUT/data"
WORKERS=$THREADS bash "$HERE/examples/data/bpe-binarize.sh" src tgt "$HERE/data/uagec-mini" "$OUT/data" 2000

UPDATES=${DEMO_UPDATES:-800}
if [ ! -f "$OUT/ckpt/checkpoint_last.pt" ] || [ -n "${RETRAIN:-}" ] \
   || ! grep -q "num_updates $UPDATES " "$OUT/train.log" 2>/dev/null; then
  log "2/4 train a small transformer for $UPDATES updates (stock fairseq-train)"
  # the whole log goes to train.log; one line per epoch to the terminal. No time limit: the model
  # must not depend on how busy the machine is.
  PRESET=tiny MAX_MINUTES=100000 bash "$HERE/examples/train-transformer.sh" \
    "$OUT/data/bin" "$OUT/ckpt" src tgt --max-update "$UPDATES" --no-epoch-checkpoints 2>&1 \
    | tee "$OUT/train.log" \
    | { grep --line-buffered -E "\| valid on 'valid' subset" || true; } \
    | sed -u -E "s/.*epoch 0*([0-9]+) \| valid on 'valid' subset \| loss ([0-9.]+) .*\| ppl ([0-9.]+) .*\| num_updates ([0-9]+).*/[demo] epoch \1: valid loss \2, ppl \3, \4 updates/" >&2 \
    || { tail -20 "$OUT/train.log" >&2; exit 1; }
  [ -f "$OUT/ckpt/checkpoint_last.pt" ] || { tail -20 "$OUT/train.log" >&2; exit 1; }
else
  log "2/4 $OUT/ckpt/checkpoint_last.pt has $UPDATES updates (RETRAIN=1 to train again)"
fi

log "3/4 decode test with beam-5, greedy, lean_greedy, iad, lookup, auto and CTranslate2 at batch 1 and 32"
# the last checkpoint, not the best: a fixed number of updates is what makes the demo repeatable
python -m fairseq_pardec.benchmark "$OUT/data/bin" --path "$OUT/ckpt/checkpoint_last.pt" \
  --generators beam:beam=5 greedy lean_greedy iad lookup auto ct2 --batch-sizes 1 32 \
  --max-sentences "${DEMO_SENTENCES:-150}" --repeats 3 --threads "$THREADS" --no-step-table \
  --out-dir "$OUT/benchmark"
log "4/4 table, JSON and plot in $OUT/benchmark/"
python "$HERE/examples/demo_verdict.py" "$OUT/benchmark/results.json"
