#!/usr/bin/env bash
# Transformer GEC baseline on UA-GEC (source -> corrected target), stock fairseq-train.
#
# usage: examples/gec/train-baseline.sh [DATA_BIN] [SAVE_DIR]
#   DATA_BIN  output of examples/data/prepare-uagec.sh (default: data-prep/ua-gec/bin)
#   PRESET=cpu (default; ~20 min on 2 cores) or PRESET=gpu (transformer_base); see train-transformer.sh
# Source and target share one dictionary (--joined-dictionary): the IAD copy drafter wants source
# ids to be target ids, and --share-all-embeddings needs it.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
exec bash "$HERE/examples/train-transformer.sh" "${1:-data-prep/ua-gec/bin}" \
  "${2:-checkpoints/gec-${PRESET:-cpu}}" src tgt "${@:3}"
