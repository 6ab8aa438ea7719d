#!/usr/bin/env bash
# Decode the UA-GEC test set with beam-5, greedy and IAD (stock fairseq-generate through our
# task), check IAD's output is identical to greedy, then run the side-by-side benchmark.
#
# usage: examples/gec/iad.sh [DATA_BIN] [CHECKPOINT] [OUT_DIR]
#   defaults: data-prep/ua-gec/bin, checkpoints/gec-cpu/checkpoint_best.pt, results/gec
#   THREADS (default 2), BENCH_SENTENCES (default: the whole test set), REPEATS (default 3)
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
DATA=${1:-data-prep/ua-gec/bin}
CKPT=${2:-checkpoints/gec-cpu/checkpoint_best.pt}
OUT=${3:-results/gec}
THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
[ -f "$CKPT" ] || { echo "iad.sh: error: no checkpoint $CKPT (train one with examples/gec/train-baseline.sh)" >&2; exit 1; }
mkdir -p "$OUT"

decode() {  # name, extra fairseq-generate flags...
  local name=$1; shift
  fairseq-generate "$DATA" --user-dir "$HERE/fairseq_pardec" --task translation_pardec -s src -t tgt \
    --path "$CKPT" --gen-subset test --batch-size 32 --max-len-a 1.2 --max-len-b 10 \
    --remove-bpe --cpu "$@" > "$OUT/generate-$name.txt" 2> "$OUT/generate-$name.log"
  grep -E "pardec generator|Translated" "$OUT/generate-$name.log" | sed "s/^/[$name] /"
}
decode beam5 --generator beam --beam 5
decode greedy --generator greedy
decode iad --generator iad

hyps() { grep -P '^H-' "$1" | sort -t- -k2 -n | cut -f3; }
if cmp -s <(hyps "$OUT/generate-greedy.txt") <(hyps "$OUT/generate-iad.txt"); then
  echo "iad output is identical to greedy on every sentence"
else
  echo "iad.sh: error: iad differs from greedy (a bug: please report it)" >&2; exit 1
fi

python -m fairseq_pardec.benchmark "$DATA" --path "$CKPT" -s src -t tgt \
  --generators beam:beam=5 greedy iad --batch-sizes 1 32 --repeats "${REPEATS:-3}" \
  --threads "$THREADS" ${BENCH_SENTENCES:+--max-sentences $BENCH_SENTENCES} --cpu --out-dir "$OUT/benchmark"
