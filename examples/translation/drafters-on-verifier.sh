#!/usr/bin/env bash
# Fast path: make an EXISTING fairseq transformer decode faster, losslessly, with a drafter
# trained in about an hour on top of it (GAD) or with light proposal heads on its frozen base
# (blockwise). The verifier is never retrained, so its output does not change.
#
#   1. self-distillation: the verifier decodes its own training sources greedily
#      (examples/distill.sh, BEAM=1, --generator lean_greedy); drafters learn exactly what
#      the verifier outputs, i.e. what exact verification accepts
#   2. gad:       a block-causal GLAT drafter (its prefix is cached while decoding) that reads
#                 the verifier's encoder output and starts from the verifier's decoder
#      blockwise: proposal heads on the frozen verifier, identity p_1 (lossless): HEADS=recurrent
#                 (one step shared by the heads, each reading the state and token of the one
#                 before it) or HEADS=light (one small residual block per head)
#   3. benchmark: greedy, beam 5, lean_greedy, lookup (no drafter model: the baseline a trained
#      drafter has to beat) and the new generator(s), batch 1 and 32
#
# usage: VERIFIER=ckpt.pt examples/translation/drafters-on-verifier.sh METHOD [DATA_DIR] [OUT]
#   METHOD    gad, blockwise or both
#   DATA_DIR  the verifier's data (bin/ and bpe/ as examples/data/prepare-ddtp.sh writes them)
#   OUT       results/drafters
# Environment: SRC=de TGT=en; PRESET=cpu (MAX_MINUTES per trained model, default 60; THREADS,
#   default 2: two models train side by side with METHOD=both, one thread each) or gpu
#   (drafters up to 20k updates); K (drafter slots / heads, default 8); DRAFTER_LAYERS (default:
#   1 with PRESET=cpu, else the verifier's decoder layers); HEADS (recurrent or light, default
#   recurrent); DRAFT_VOCAB (shortlist of the
#   benchmark's vocabN rows, default 2000); DISTILL_SENTENCES=N self-distils (and trains on) only the
#   first N training sentences (the verifier decodes ~20-40 sentences/s on 2 CPU cores);
#   BENCH=0 trains only; REPEATS, BENCH_SENTENCES.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
METHOD=${1:?usage: VERIFIER=ckpt.pt drafters-on-verifier.sh gad|blockwise|both [DATA_DIR] [OUT]}
DIR=${2:-data-prep/ddtp-de-en}
OUT=${3:-results/drafters}
SRC=${SRC:-de} TGT=${TGT:-en}
PRESET=${PRESET:-cpu}
THREADS=${THREADS:-2}
K=${K:-8}
HEADS=${HEADS:-recurrent}
case "$HEADS" in light|recurrent) ;; *) echo "drafters-on-verifier.sh: error: HEADS must be light or recurrent (got $HEADS)" >&2; exit 1 ;; esac
case "$METHOD" in gad|blockwise|both) ;; *) echo "drafters-on-verifier.sh: error: METHOD must be gad, blockwise or both (got $METHOD)" >&2; exit 1 ;; esac
[ -n "${VERIFIER:-}" ] && [ -f "$VERIFIER" ] || { echo "drafters-on-verifier.sh: error: set VERIFIER to the trained checkpoint (got '${VERIFIER:-}')" >&2; exit 1; }
[ -f "$DIR/bin/dict.$SRC.txt" ] || { echo "drafters-on-verifier.sh: error: no binarized data in $DIR/bin" >&2; exit 1; }
mkdir -p "$OUT"
log() { echo "[drafters $(date +%H:%M:%S)] $*" >&2; }
layers=$(python3 - "$VERIFIER" <<'PY'
import sys, torch
state = torch.load(sys.argv[1], map_location="cpu", weights_only=False)
cfg = state.get("cfg") or {}
model = cfg.get("model") if hasattr(cfg, "get") else None
print(getattr(model, "decoder_layers", None) or (model or {}).get("decoder_layers")
      or getattr(state.get("args"), "decoder_layers", 6))
PY
)
# one drafter layer on the CPU: at batch 1 it drafts as many accepted tokens as three for a
# smaller share of the time (ddtp-de-en, commit 489c373, 2026-11-23: 0.93x against 0.72x greedy)
if [ "$PRESET" = cpu ]; then layers=1; fi
DRAFTER_LAYERS=${DRAFTER_LAYERS:-$layers}

BIN=$DIR/bin BPE=$DIR/bpe
if [ -n "${DISTILL_SENTENCES:-}" ]; then
  BIN=$OUT/subset/bin BPE=$OUT/subset/bpe
  if [ ! -f "$BIN/dict.$SRC.txt" ]; then
    log "the first $DISTILL_SENTENCES training sentences"
    mkdir -p "$BPE"
    for l in "$SRC" "$TGT"; do head -n "$DISTILL_SENTENCES" "$DIR/bpe/train.$l" > "$BPE/train.$l"; done
    fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" --trainpref "$BPE/train" \
      --srcdict "$DIR/bin/dict.$SRC.txt" --tgtdict "$DIR/bin/dict.$TGT.txt" --destdir "$BIN.tmp" \
      --workers "$THREADS" > "$OUT/subset.log" 2>&1
    cp "$DIR"/bin/valid.* "$DIR"/bin/test.* "$BIN.tmp/" && mv "$BIN.tmp" "$BIN"
  fi
fi
SELF=$OUT/self-distilled
if [ ! -f "$SELF/bin/dict.$SRC.txt" ]; then
  log "self-distillation: the verifier decodes its training sources greedily"
  OMP_NUM_THREADS=$THREADS BEAM=1 GENERATOR=lean_greedy THREADS=$THREADS GEN_ARGS="--max-len-a 1.2 --max-len-b 10" \
    CPU=${CPU_ONLY:+1} bash "$HERE/examples/distill.sh" "$BIN" "$VERIFIER" "$BPE" "$SELF" "$SRC" "$TGT"
fi

if [ "$PRESET" = gpu ]; then budget=(--max-update 20000); else budget=(); fi
one=$THREADS; [ "$METHOD" = both ] && one=1

train_gad() {
  [ -f "$OUT/gad/checkpoint_last.pt" ] && [ -z "${RESUME:-}" ] && return
  log "GAD drafter: block-causal, verifier's encoder, decoder from the verifier ($DRAFTER_LAYERS layers, k=$K)"
  OMP_NUM_THREADS=$one ARCH=glat_drafter MAX_MINUTES=${MAX_MINUTES:-60} bash "$HERE/examples/train-transformer.sh" \
    "$SELF/bin" "$OUT/gad" "$SRC" "$TGT" --criterion glat_loss --drafter-block-size "$K" \
    --drafter-attention block-causal --drafter-encoder verifier --init-from-verifier "$VERIFIER" \
    --init-drafter-decoder --decoder-layers "$DRAFTER_LAYERS" --glat-anneal-updates 3000 \
    --lr 5e-4 "${budget[@]}" > "$OUT/train-gad.log" 2>&1
}
train_heads() {
  [ -f "$OUT/heads-$HEADS/checkpoint_last.pt" ] && [ -z "${RESUME:-}" ] && return
  log "$HEADS proposal heads (k=$K) on the frozen verifier"
  OMP_NUM_THREADS=$one ARCH=blockwise_transformer MAX_MINUTES=${MAX_MINUTES:-60} bash "$HERE/examples/train-transformer.sh" \
    "$SELF/bin" "$OUT/heads-$HEADS" "$SRC" "$TGT" --proposal-heads "$K" --identity-first-head --freeze-base \
    --proposal-layer "$HEADS" --init-from-transformer "$VERIFIER" --criterion blockwise_cross_entropy \
    --head-sampling position --warmup-updates 100 "${budget[@]}" > "$OUT/train-heads-$HEADS.log" 2>&1
}
case "$METHOD" in
  gad) train_gad ;;
  blockwise) train_heads ;;
  both) train_gad & gad_pid=$!; train_heads & heads_pid=$!; wait $gad_pid; wait $heads_pid ;;
esac
[ "${BENCH:-1}" = 0 ] && exit 0

log "benchmark: greedy, beam 5, lean_greedy and the new generators (batch 1 and 32)"
specs=(greedy beam:beam=5 lean_greedy)
# lookup drafting: the source, the output itself, and an n-gram table of the training targets
# plus the verifier's own outputs (nothing trained)
cat "$SELF/raw/train.$TGT" "$DIR/bpe/train.$TGT" > "$OUT/draft-corpus.$TGT"
specs+=("lookup:label=lookup,draft_corpus='$OUT/draft-corpus.$TGT'")
# adaptive draft caps (no block_size), with and without a shortlist of DRAFT_VOCAB frequent types
V=${DRAFT_VOCAB:-2000}
if [ "$METHOD" != blockwise ]; then
  specs+=("gad:label=gad-cached-adaptive,drafter_path='$OUT/gad/checkpoint_last.pt'"
          "gad:label=gad-cached-adaptive-vocab$V,drafter_path='$OUT/gad/checkpoint_last.pt',draft_vocab=$V"
          "gad:label=gad++top3-tau1-vocab$V,drafter_path='$OUT/gad/checkpoint_last.pt',gad_beta=3,gad_tau=1.0,draft_vocab=$V")
fi
if [ "$METHOD" != gad ]; then
  H=$OUT/heads-$HEADS/checkpoint_last.pt
  specs+=("blockwise:label=blockwise-$HEADS-k$K-fixed,path='$H',block_size=$K"
          "blockwise:label=blockwise-$HEADS-adaptive,path='$H'"
          "blockwise:label=blockwise-$HEADS-adaptive-vocab$V,path='$H',draft_vocab=$V")
fi
OMP_NUM_THREADS=$THREADS python -m fairseq_pardec.benchmark "$DIR/bin" --path "$VERIFIER" -s "$SRC" -t "$TGT" \
  --threads "$THREADS" --repeats "${REPEATS:-3}" ${BENCH_SENTENCES:+--max-sentences $BENCH_SENTENCES} \
  --max-len-a 1.2 --max-len-b 10 --generators "${specs[@]}" --batch-sizes 1 32 --out-dir "$OUT/bench"
