#!/usr/bin/env bash
# Transformer GEC baseline on UA-GEC (source -> corrected target), stock fairseq-train.
#
# usage: examples/gec/train-baseline.sh [DATA_BIN] [SAVE_DIR]
#   DATA_BIN  output of examples/data/prepare-uagec.sh (default: data-prep/ua-gec/bin)
#   PRESET=cpu (default; ~20 min on 2 cores) or PRESET=gpu (transformer_base); see train-transformer.sh
#
# For IAD the model must copy what needs no correction, and an undertrained GEC model rewrites
# too much: give it time. MAX_MINUTES counts fairseq's recorded training time across restarts,
# so re-running with a larger MAX_MINUTES resumes from SAVE_DIR/checkpoint_last.pt, e.g. in the
# background: OMP_NUM_THREADS=1 MAX_MINUTES=240 nohup examples/gec/train-baseline.sh ... &
# Measured on UA-GEC, cpu preset (docs/results-history.md): after 5 epochs (870 updates) iad gained 2.39
# tokens per iteration at batch 1, after 9 epochs (1566 updates) see the results table.
# Source and target share one dictionary (--joined-dictionary): the IAD copy drafter wants source
# ids to be target ids, and --share-all-embeddings needs it.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
exec bash "$HERE/examples/train-transformer.sh" "${1:-data-prep/ua-gec/bin}" \
  "${2:-checkpoints/gec-${PRESET:-cpu}}" src tgt "${@:3}"
