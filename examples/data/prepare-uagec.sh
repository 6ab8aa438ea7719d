#!/usr/bin/env bash
# UA-GEC (Ukrainian grammatical error correction) -> raw sentence pairs -> joint BPE -> fairseq binary.
#
# usage: prepare-uagec.sh [OUT_DIR]          (default: ./data-prep/ua-gec)
#
# Needs only PyPI: installs the `ua-gec` package (it ships the corpus, ~140 MB) into the
# current Python environment ($PYTHON, default: `python`, else `python3`), then runs
# uagec_extract.py (gec-only layer, annotator 1; see that file and shared/data/ua-gec/README.md)
# and bpe-binarize.sh with SRC=src TGT=tgt and a joined dictionary (needed by the copy drafter).
#
# Outputs:
#   OUT_DIR/raw/{train,valid,test}.{src,tgt}   raw text pairs, OUT_DIR/raw/stats.txt
#   OUT_DIR/bpe/                               BPE codes and segmented text
#   OUT_DIR/bin/                               fairseq-preprocess output (use as DATA for fairseq-train)
# Environment: PYTHON, UA_GEC_VERSION (default 2.1.3), BPE_MERGES (default 8000),
#   SPLIT_FROM=DIR to reuse the valid documents of an existing copy (e.g. shared/data/ua-gec)
#   instead of the hash choice; with it the raw files are byte-identical to that copy.
# Re-running skips steps whose outputs exist (delete OUT_DIR/raw to re-extract).
set -euo pipefail

die() { echo "prepare-uagec.sh: error: $*" >&2; exit 1; }
log() { echo "[prepare-uagec $(date +%H:%M:%S)] $*" >&2; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:-data-prep/ua-gec}
PYTHON=${PYTHON:-$(command -v python || command -v python3 || true)}
UA_GEC_VERSION=${UA_GEC_VERSION:-2.1.3}
BPE_MERGES=${BPE_MERGES:-8000}
[ -n "$PYTHON" ] || die "no python found (set \$PYTHON)"
[ -f "$HERE/uagec_extract.py" ] || die "missing $HERE/uagec_extract.py"

# 1. the corpus, from PyPI
have=$("$PYTHON" -c 'import ua_gec; print(ua_gec.__version__)' 2>/dev/null || true)
if [ "$have" = "$UA_GEC_VERSION" ]; then
    log "ua-gec $have already installed in $PYTHON"
else
    log "installing ua-gec==$UA_GEC_VERSION with $PYTHON -m pip"
    "$PYTHON" -m pip install --quiet "ua-gec==$UA_GEC_VERSION" || die "pip install ua-gec==$UA_GEC_VERSION failed"
fi

# 2. raw sentence pairs
RAW=$OUT/raw
if [ -s "$RAW/test.tgt" ] && [ -s "$RAW/stats.txt" ]; then
    log "exists, skipping extraction: $RAW"
else
    log "extracting sentence pairs -> $RAW"
    "$PYTHON" "$HERE/uagec_extract.py" --out "$RAW.tmp" ${SPLIT_FROM:+--split-from "$SPLIT_FROM"} >&2
    rm -rf "$RAW"
    mv "$RAW.tmp" "$RAW"
fi
for split in train valid test; do
    echo "$split: $(wc -l < "$RAW/$split.src") pairs"
done

# 3. joint BPE + binarisation
bash "$HERE/bpe-binarize.sh" src tgt "$RAW" "$OUT" "$BPE_MERGES"
log "done: fairseq data in $OUT/bin"
