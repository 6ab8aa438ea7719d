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
# Environment: PYTHON, UA_GEC_VERSION (default 2.1.3), BPE_MERGES (default 8000), WORKERS (default 2),
#   SPLIT: which train documents become valid (test is always the official test split):
#     bundled (default)  the 40 documents of the bundled copy shared/data/ua-gec, listed in
#                        splits/ua-gec.tsv: the raw files are then byte-identical to that copy,
#                        so models trained here can be evaluated on the bundled data and back;
#     hash               documents in sha256(doc id) order until about 1000 pairs (README recipe);
#     FILE               a "doc_id<TAB>valid" list.
#   SPLIT_FROM=DIR       derive the valid documents from an existing copy DIR/valid.{src,tgt}.
# Re-running skips steps whose outputs exist and are up to date.
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

# which units are held out (see the extractor's docstring and split-args.sh)
# shellcheck source=examples/data/split-args.sh
source "$HERE/split-args.sh"
split_args_for ua-gec

# 2. raw sentence pairs
RAW=$OUT/raw
EXTRACT_ARGS="${split_args[*]:-hash}"
if [ -s "$RAW/test.tgt" ] && [ "$(cat "$RAW/extract-args.txt" 2>/dev/null)" = "$EXTRACT_ARGS" ]; then
    log "exists, skipping extraction: $RAW"
else
    log "extracting sentence pairs -> $RAW"
    "$PYTHON" "$HERE/uagec_extract.py" --out "$RAW.tmp" "${split_args[@]}" >&2
    echo "$EXTRACT_ARGS" > "$RAW.tmp/extract-args.txt"
    rm -rf "$RAW"
    mv "$RAW.tmp" "$RAW"
fi
for split in train valid test; do
    echo "$split: $(wc -l < "$RAW/$split.src") pairs"
done

# 3. joint BPE + binarisation
bash "$HERE/bpe-binarize.sh" src tgt "$RAW" "$OUT" "$BPE_MERGES"
log "done: fairseq data in $OUT/bin"
