#!/usr/bin/env bash
# Sequence-level knowledge distillation (Kim & Rush 2016): a teacher decodes the training set with
# beam 5 through fairseq-generate; its output replaces the training targets, binarized with the SAME
# dictionary; valid and test stay the original (human) references.
#
# Self-distillation for drafters and proposal heads: give the verifier itself as TEACHER_CKPT with
# BEAM=1 (GENERATOR=lean_greedy decodes the same greedy output faster): the targets are then
# exactly what the verifier outputs, i.e. what a lossless draft must match to be accepted.
#
# usage: examples/distill.sh DATA_BIN TEACHER_CKPT BPE_DIR OUT_DIR SRC TGT
#   DATA_BIN   fairseq-preprocess output the teacher was trained on (dict.SRC.txt, dict.TGT.txt)
#   BPE_DIR    the BPE text it was binarized from (BPE_DIR/train.SRC), as written by bpe-binarize.sh
#   OUT_DIR    gets raw/train.{SRC,TGT} (BPE text) and bin/ (train distilled; valid/test copied)
#   BEAM (default 5), GENERATOR (a --generator of ours, e.g. lean_greedy with BEAM=1; default
#   fairseq's beam search), GEN_ARGS (more fairseq-generate flags, e.g. "--max-len-a 1.2
#   --max-len-b 10" as the verifier is used), MAX_TOKENS (default 8000), THREADS; CPU=1 forces
#   the CPU
# Sentences the teacher cannot decode (too long for the model) keep their original target.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
[ $# -eq 6 ] || { echo "usage: distill.sh DATA_BIN TEACHER_CKPT BPE_DIR OUT_DIR SRC TGT" >&2; exit 1; }
DATA=$1 TEACHER=$2 BPE=$3 OUT=$4 SRC=$5 TGT=$6
for f in "$DATA/dict.$SRC.txt" "$DATA/dict.$TGT.txt" "$TEACHER" "$BPE/train.$SRC" "$BPE/train.$TGT"; do
  [ -f "$f" ] || { echo "distill.sh: error: missing $f" >&2; exit 1; }
done
mkdir -p "$OUT/raw" "$OUT/bin"
log() { echo "[distill $(date +%H:%M:%S)] $*" >&2; }

if [ ! -s "$OUT/raw/generate-train.txt" ]; then
  log "teacher decodes the training set (beam ${BEAM:-5}${GENERATOR:+, --generator $GENERATOR})"
  fairseq-generate "$DATA" --user-dir "$HERE/fairseq_pardec" --task translation_pardec \
    -s "$SRC" -t "$TGT" --path "$TEACHER" --gen-subset train --beam "${BEAM:-5}" \
    ${GENERATOR:+--generator "$GENERATOR"} ${GEN_ARGS:-} \
    --max-tokens "${MAX_TOKENS:-8000}" --skip-invalid-size-inputs-valid-test \
    ${CPU:+--cpu} > "$OUT/raw/generate-train.tmp" 2> "$OUT/raw/generate-train.log"
  mv "$OUT/raw/generate-train.tmp" "$OUT/raw/generate-train.txt"
fi

log "distilled targets (BPE text, line order of $BPE/train.$TGT)"
python3 - "$OUT/raw/generate-train.txt" "$BPE/train.$SRC" "$BPE/train.$TGT" "$OUT/raw/train" "$SRC" "$TGT" <<'PY'
import sys
gen, src_path, tgt_path, out, src, tgt = sys.argv[1:]
hyps = {}
with open(gen, encoding="utf-8") as f:
    for line in f:
        if line.startswith("H-"):
            head, _score, text = line.rstrip("\n").split("\t", 2)
            hyps[int(head[2:])] = text
sources = open(src_path, encoding="utf-8").read().split("\n")[:-1]
targets = open(tgt_path, encoding="utf-8").read().split("\n")[:-1]
kept = 0
with open(out + "." + src, "w", encoding="utf-8") as fs, open(out + "." + tgt, "w", encoding="utf-8") as ft:
    for i, (s, t) in enumerate(zip(sources, targets)):
        text = hyps.get(i)
        if text is not None and text.strip():
            kept += 1
        else:
            text = t
        fs.write(s + "\n")
        ft.write(text + "\n")
print("distilled %d of %d training targets (the rest keep the reference)" % (kept, len(sources)), file=sys.stderr)
PY

log "binarize with the teacher's dictionary"
rm -rf "$OUT/bin.tmp"
fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" --trainpref "$OUT/raw/train" \
  --srcdict "$DATA/dict.$SRC.txt" --tgtdict "$DATA/dict.$TGT.txt" --destdir "$OUT/bin.tmp" \
  --workers "${THREADS:-2}" > "$OUT/preprocess.log" 2>&1
cp "$DATA"/valid.* "$DATA"/test.* "$OUT/bin.tmp/"
rm -rf "$OUT/bin" && mv "$OUT/bin.tmp" "$OUT/bin"
log "done: $OUT/bin"
