#!/usr/bin/env bash
# Transformer translation baseline on ddtp-de-en (German -> English), stock fairseq-train.
#
# usage: examples/translation/train-baseline.sh [DATA_BIN] [SAVE_DIR]
#   DATA_BIN  output of examples/data/prepare-ddtp.sh (default: data-prep/ddtp-de-en/bin)
#   PRESET=cpu (default; ~20 min on 2 cores) or PRESET=gpu (transformer_base); see train-transformer.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
exec bash "$HERE/examples/train-transformer.sh" "${1:-data-prep/ddtp-de-en/bin}" \
  "${2:-checkpoints/ddtp-de-en-${PRESET:-cpu}}" de en "${@:3}"
