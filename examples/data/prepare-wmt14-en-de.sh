#!/usr/bin/env bash
# WMT14 English-German (about 4.5M sentence pairs) -> Moses tokenisation -> joint BPE -> fairseq binary.
#
#   *** NEEDS INTERNET (statmt.org, github.com, sacrebleu's test-set hosts).  It was NOT run while
#   *** writing it (the build machine reaches package registries only); only its syntax was checked.
#   *** Expect hours on 2 cores and ~10 GB of disk.  The offline recipes here are prepare-ddtp.sh
#   *** (de-en) and prepare-uagec.sh.
#
# usage: prepare-wmt14-en-de.sh [OUT_DIR]          (default: ./data-prep/wmt14-en-de)
#
# Data (the usual WMT14 setting, as in Vaswani et al. 2017 and fairseq's --icml17 variant of
# examples/translation/prepare-wmt14en2de.sh):
#   train  Europarl v7 + Common Crawl + News Commentary v9, de-en
#   valid  newstest2013 (3000 lines)          via `sacrebleu -t wmt13 -l en-de --echo src|ref`
#   test   newstest2014, "full" (3003 lines)  via `sacrebleu -t wmt14/full -l en-de --echo src|ref`
# (fairseq's script instead holds out every 100th training line as valid and uses News
# Commentary v12; either is common.)
# Processing: Moses normalize-punctuation, remove-non-printing-char and tokenizer.perl -a (Moses
# scripts are cloned from github; needs git and perl), then train pairs are cleaned with
# clean-corpus-n.perl (ratio 1.5, 1..250 tokens; valid/test are never filtered), then
# bpe-binarize.sh en de ... with BPE_MERGES joint merges (default 32000) and a joined dictionary.
# Evaluate with sacrebleu on detokenised output (remove BPE, then Moses detokenizer.perl), or report
# tokenised BLEU the way fairseq does; say which.
#
# Outputs:
#   OUT_DIR/orig/   downloaded archives and their contents     OUT_DIR/mosesdecoder/   Moses scripts
#   OUT_DIR/raw/{train,valid,test}.{en,de}   tokenised, cleaned text (input of bpe-binarize.sh)
#   OUT_DIR/bpe/, OUT_DIR/bin/               BPE codes/text and fairseq-preprocess output
# Environment: BPE_MERGES (default 32000), WORKERS (default 2; also Moses tokenizer threads),
#   MOSES_SCRIPTS (an existing mosesdecoder/scripts dir: skips the clone).
# Re-running skips finished steps (downloads, extraction, each tokenised file, BPE, binarisation).
set -euo pipefail

die() { echo "prepare-wmt14-en-de.sh: error: $*" >&2; exit 1; }
log() { echo "[prepare-wmt14 $(date +%H:%M:%S)] $*" >&2; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:-data-prep/wmt14-en-de}
BPE_MERGES=${BPE_MERGES:-32000}
WORKERS=${WORKERS:-2}
SRC=en TGT=de
mkdir -p "$OUT/orig" "$OUT/raw" "$OUT/tmp"
OUT=$(cd "$OUT" && pwd)
ORIG=$OUT/orig TMP=$OUT/tmp RAW=$OUT/raw

for tool in perl tar sacrebleu; do
    command -v "$tool" >/dev/null || die "'$tool' not found on PATH"
done
if command -v wget >/dev/null; then
    fetch() { wget -q --show-progress -O "$2" "$1"; }
elif command -v curl >/dev/null; then
    fetch() { curl -fL --retry 3 -o "$2" "$1"; }
else
    die "need wget or curl"
fi

# --- Moses scripts -----------------------------------------------------------------------
if [ -z "${MOSES_SCRIPTS:-}" ]; then
    if [ ! -d "$OUT/mosesdecoder/scripts" ]; then
        command -v git >/dev/null || die "'git' not found (or set MOSES_SCRIPTS)"
        log "cloning Moses (scripts only are used)"
        git clone --depth 1 https://github.com/moses-smt/mosesdecoder.git "$OUT/mosesdecoder"
    fi
    MOSES_SCRIPTS=$OUT/mosesdecoder/scripts
fi
NORM_PUNC=$MOSES_SCRIPTS/tokenizer/normalize-punctuation.perl
REM_NON_PRINT=$MOSES_SCRIPTS/tokenizer/remove-non-printing-char.perl
TOKENIZER=$MOSES_SCRIPTS/tokenizer/tokenizer.perl
CLEAN=$MOSES_SCRIPTS/training/clean-corpus-n.perl
for f in "$NORM_PUNC" "$REM_NON_PRINT" "$TOKENIZER" "$CLEAN"; do
    [ -f "$f" ] || die "missing Moses script: $f"
done

# --- downloads ---------------------------------------------------------------------------
ARCHIVES=(
    "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz"
    "http://statmt.org/wmt13/training-parallel-commoncrawl.tgz"
    "http://statmt.org/wmt14/training-parallel-nc-v9.tgz"
)
CORPORA=(  # file prefixes inside the archives, each with .de and .en
    "training/europarl-v7.de-en"
    "commoncrawl.de-en"
    "training/news-commentary-v9.de-en"
)
for url in "${ARCHIVES[@]}"; do
    file=$ORIG/$(basename "$url")
    if [ -s "$file.done" ]; then
        log "exists, skipping: $file"
        continue
    fi
    log "downloading $url"
    fetch "$url" "$file.part" || die "download failed: $url"
    mv "$file.part" "$file"
    tar -xzf "$file" -C "$ORIG" || die "cannot extract $file"
    date > "$file.done"
done
for c in "${CORPORA[@]}"; do
    for l in $SRC $TGT; do
        [ -s "$ORIG/$c.$l" ] || die "missing corpus file after extraction: $ORIG/$c.$l"
    done
done

# --- tokenisation ------------------------------------------------------------------------
tokenize() {  # tokenize LANG < raw > tokenised
    perl "$NORM_PUNC" -l "$1" | perl "$REM_NON_PRINT" | perl "$TOKENIZER" -q -threads "$WORKERS" -a -l "$1"
}
for l in $SRC $TGT; do
    if [ -s "$TMP/train.tok.$l" ]; then
        log "exists, skipping: $TMP/train.tok.$l"
    else
        log "tokenising train.$l (slow: millions of lines)"
        for c in "${CORPORA[@]}"; do cat "$ORIG/$c.$l"; done | tokenize "$l" > "$TMP/train.tok.$l.part"
        mv "$TMP/train.tok.$l.part" "$TMP/train.tok.$l"
    fi
done
n_src=$(wc -l < "$TMP/train.tok.$SRC"); n_tgt=$(wc -l < "$TMP/train.tok.$TGT")
[ "$n_src" -eq "$n_tgt" ] || die "train.tok.$SRC has $n_src lines, train.tok.$TGT has $n_tgt"

for pair in "valid wmt13" "test wmt14/full"; do
    read -r split testset <<< "$pair"
    for l in $SRC $TGT; do
        if [ "$l" = "$SRC" ]; then side=src; else side=ref; fi
        if [ -s "$RAW/$split.$l" ]; then
            log "exists, skipping: $RAW/$split.$l"
            continue
        fi
        log "$split.$l <- sacrebleu -t $testset -l $SRC-$TGT --echo $side"
        sacrebleu -t "$testset" -l "$SRC-$TGT" --echo "$side" > "$TMP/$split.$l" \
            || die "sacrebleu could not fetch $testset"
        tokenize "$l" < "$TMP/$split.$l" > "$RAW/$split.$l.part"
        mv "$RAW/$split.$l.part" "$RAW/$split.$l"
    done
done

# --- cleaning (train only) -----------------------------------------------------------------
if [ -s "$RAW/train.$SRC" ] && [ -s "$RAW/train.$TGT" ]; then
    log "exists, skipping: $RAW/train.{$SRC,$TGT}"
else
    log "cleaning train: ratio 1.5, 1..250 tokens"
    perl "$CLEAN" -ratio 1.5 "$TMP/train.tok" "$SRC" "$TGT" "$TMP/train.clean" 1 250
    mv "$TMP/train.clean.$SRC" "$RAW/train.$SRC"
    mv "$TMP/train.clean.$TGT" "$RAW/train.$TGT"
fi
for split in train valid test; do
    echo "$split: $(wc -l < "$RAW/$split.$SRC") pairs"
done

# --- joint BPE + binarisation --------------------------------------------------------------
WORKERS=$WORKERS bash "$HERE/bpe-binarize.sh" "$SRC" "$TGT" "$RAW" "$OUT" "$BPE_MERGES"
log "done: fairseq data in $OUT/bin (train with --share-all-embeddings)"
