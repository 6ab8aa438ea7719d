#!/usr/bin/env bash
# Joint BPE + fairseq binarisation with ONE shared dictionary for source and target.
#
# usage: bpe-binarize.sh SRC TGT RAW_DIR OUT_DIR [BPE_MERGES]
#
#   RAW_DIR/{train,valid,test}.{SRC,TGT}  raw UTF-8 text, one segment per line (input)
#   OUT_DIR/bpe/codes                     joint BPE codes (subword-nmt learn-bpe on train.SRC + train.TGT)
#   OUT_DIR/bpe/{train,valid,test}.{SRC,TGT}   BPE-segmented text ("@@ " continuation marker)
#   OUT_DIR/bin/                          fairseq-preprocess output (--joined-dictionary):
#                                         dict.SRC.txt == dict.TGT.txt, *.bin/*.idx, preprocess.log
#
# BPE_MERGES defaults to 8000 (right for the ~30k-pair corpora here; use ~32000 for WMT-size data).
# No pre-tokenisation: BPE is learned and applied on the whitespace-split raw text, so punctuation
# attached to a word becomes its own subword ("word," -> "word@@ ,"); to get plain text back,
# remove the markers (sed -r 's/(@@ )|(@@ ?$)//g', or fairseq's --post-process subword_nmt).
# A shared dictionary is what the copy drafter (IAD, used for GEC) needs: source token ids must be
# target token ids.
#
# Steps whose outputs exist and are newer than their inputs are skipped (re-running is cheap;
# changed raw files or BPE_MERGES redo what depends on them; delete OUT_DIR/bpe to force a redo).
# Tools: subword-nmt and fairseq-preprocess from PATH (override with $SUBWORD_NMT and
# $FAIRSEQ_PREPROCESS); $WORKERS (default 2) parallel workers.
set -euo pipefail

die() { echo "bpe-binarize.sh: error: $*" >&2; exit 1; }
log() { echo "[bpe-binarize $(date +%H:%M:%S)] $*" >&2; }

if [ $# -lt 4 ] || [ $# -gt 5 ]; then die "usage: bpe-binarize.sh SRC TGT RAW_DIR OUT_DIR [BPE_MERGES]"; fi
SRC=$1 TGT=$2 RAW=$3 OUT=$4 MERGES=${5:-8000}
WORKERS=${WORKERS:-2}
SUBWORD_NMT=${SUBWORD_NMT:-subword-nmt}
FAIRSEQ_PREPROCESS=${FAIRSEQ_PREPROCESS:-fairseq-preprocess}

[ "$SRC" != "$TGT" ] || die "SRC and TGT must differ (got '$SRC' twice)"
[[ "$MERGES" =~ ^[0-9]+$ ]] || die "BPE_MERGES must be a number (got '$MERGES')"
for split in train valid test; do
    for l in "$SRC" "$TGT"; do
        [ -s "$RAW/$split.$l" ] || die "missing or empty input file: $RAW/$split.$l"
    done
    n_src=$(wc -l < "$RAW/$split.$SRC"); n_tgt=$(wc -l < "$RAW/$split.$TGT")
    [ "$n_src" -eq "$n_tgt" ] || die "$RAW/$split.$SRC has $n_src lines but $RAW/$split.$TGT has $n_tgt"
done
command -v "$SUBWORD_NMT" >/dev/null || die "'$SUBWORD_NMT' not found on PATH (pip install subword-nmt, or activate the venv)"
command -v "$FAIRSEQ_PREPROCESS" >/dev/null || die "'$FAIRSEQ_PREPROCESS' not found on PATH (install fairseq, or activate the venv)"

BPE=$OUT/bpe
BIN=$OUT/bin
mkdir -p "$BPE"

# up_to_date OUTPUT INPUT...: OUTPUT exists, is non-empty and newer than every INPUT
up_to_date() {
    local out=$1; shift
    [ -s "$out" ] || return 1
    local f
    for f in "$@"; do [ "$out" -nt "$f" ] || return 1; done
}

# 1. learn joint BPE on the concatenated training data of both sides
if up_to_date "$BPE/codes" "$RAW/train.$SRC" "$RAW/train.$TGT" \
        && [ "$(cat "$BPE/codes.merges" 2>/dev/null)" = "$MERGES" ]; then
    log "up to date, skipping: $BPE/codes"
else
    log "learning $MERGES joint BPE merges on train.$SRC + train.$TGT"
    cat "$RAW/train.$SRC" "$RAW/train.$TGT" \
        | TQDM_DISABLE=1 "$SUBWORD_NMT" learn-bpe -s "$MERGES" > "$BPE/codes.tmp"
    echo "$MERGES" > "$BPE/codes.merges"
    mv "$BPE/codes.tmp" "$BPE/codes"
fi

# 2. apply it to every split and side
for split in train valid test; do
    for l in "$SRC" "$TGT"; do
        if up_to_date "$BPE/$split.$l" "$BPE/codes" "$RAW/$split.$l"; then
            log "up to date, skipping: $BPE/$split.$l"
            continue
        fi
        log "applying BPE: $split.$l"
        "$SUBWORD_NMT" apply-bpe -c "$BPE/codes" --num-workers "$WORKERS" \
            < "$RAW/$split.$l" > "$BPE/$split.$l.tmp"
        mv "$BPE/$split.$l.tmp" "$BPE/$split.$l"
    done
done

# 3. binarise with one dictionary shared by source and target
# (fairseq-preprocess writes test.SRC-TGT.TGT.bin last, so it marks a complete run)
if up_to_date "$BIN/test.$SRC-$TGT.$TGT.bin" "$BPE"/{train,valid,test}."$SRC" "$BPE"/{train,valid,test}."$TGT" \
        && [ -s "$BIN/dict.$SRC.txt" ]; then
    log "up to date, skipping: $BIN (fairseq-preprocess output)"
else
    log "fairseq-preprocess --joined-dictionary -> $BIN"
    rm -rf "$BIN"
    "$FAIRSEQ_PREPROCESS" --source-lang "$SRC" --target-lang "$TGT" \
        --trainpref "$BPE/train" --validpref "$BPE/valid" --testpref "$BPE/test" \
        --destdir "$BIN" --joined-dictionary --workers "$WORKERS" >&2
fi
cmp -s "$BIN/dict.$SRC.txt" "$BIN/dict.$TGT.txt" || die "dictionaries differ: $BIN/dict.$SRC.txt vs dict.$TGT.txt"
log "done: $BIN ($(wc -l < "$BIN/dict.$SRC.txt") dictionary entries, shared by $SRC and $TGT)"
