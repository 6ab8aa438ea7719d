#!/usr/bin/env bash
# Transformer GEC baseline on UA-GEC with the stock fairseq-train.
#
# usage: examples/gec/train-baseline.sh [DATA_BIN] [SAVE_DIR]
#   DATA_BIN  output of examples/data/prepare-uagec.sh (default: data-prep/ua-gec/bin)
#   PRESET=cpu  d256, 3+3 layers, ~20 min on 2 CPU cores (MAX_MINUTES caps the wall time)
#   PRESET=gpu  transformer_base (paper-sized; the IAD paper uses transformer_big for English GEC)
# Source and target share one dictionary (prepare-uagec.sh binarizes with --joined-dictionary):
# the IAD copy drafter needs source ids to be target ids, and --share-all-embeddings uses it.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
DATA=${1:-data-prep/ua-gec/bin}
SAVE=${2:-checkpoints/gec-${PRESET:-cpu}}
PRESET=${PRESET:-cpu}
[ -f "$DATA/dict.src.txt" ] || { echo "train-baseline.sh: error: no binarized data in $DATA (run examples/data/prepare-uagec.sh first)" >&2; exit 1; }

common=(--user-dir "$HERE/fairseq_pardec" --task translation_pardec -s src -t tgt
        --share-all-embeddings --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0
        --lr-scheduler inverse_sqrt --criterion label_smoothed_cross_entropy --label-smoothing 0.1
        --save-dir "$SAVE" --no-epoch-checkpoints --log-format simple --log-interval 100
        --seed 1)
case "$PRESET" in
  cpu)
    # ~3,200 target tokens/s on 2 cores; stops after MAX_MINUTES of training (fairseq --stop-time-hours)
    minutes=${MAX_MINUTES:-20}
    hours=$(python3 -c "print(round($minutes/60, 4))")
    fairseq-train "$DATA" "${common[@]}" --arch transformer \
      --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 --decoder-embed-dim 256 \
      --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024 \
      --encoder-attention-heads 4 --decoder-attention-heads 4 \
      --dropout 0.1 --lr 1e-3 --warmup-updates 1000 --max-tokens 4096 \
      --max-epoch 30 --stop-time-hours "$hours" --num-workers 0 --cpu ;;
  gpu)
    fairseq-train "$DATA" "${common[@]}" --arch transformer \
      --dropout 0.3 --lr 7e-4 --warmup-updates 4000 --max-tokens 8192 --max-update 50000 \
      --fp16 --patience 10 ;;
  *) echo "train-baseline.sh: error: PRESET must be cpu or gpu (got $PRESET)" >&2; exit 1 ;;
esac
echo "checkpoint: $SAVE/checkpoint_best.pt"
