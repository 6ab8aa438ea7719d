#!/usr/bin/env bash
# Decode the UA-GEC test set with beam-5, greedy, IAD and lookup (stock fairseq-generate through
# our task), compare IAD's and lookup's output with greedy, then run the side-by-side benchmark.
# lookup drafts from the source like IAD and also from the output itself, which catches a model's
# repetition loops (docs/results-history.md, UA-GEC, "iad and lookup").
#
# usage: examples/gec/iad.sh [DATA_BIN] [CHECKPOINT] [OUT_DIR]
#   defaults: data-prep/ua-gec/bin, checkpoints/gec-cpu/checkpoint_best.pt, results/gec
#   THREADS (default 2), BENCH_SENTENCES (default: the whole test set), REPEATS (default 3)
#   DEVICE=cpu (default) or gpu; FP16=1 decodes in float16 on the GPU
# In float32 IAD and lookup must equal greedy on every sentence (a difference is a bug and fails the
# script); in float16 a verified block and a one-token step round differently, so the share of
# identical sentences and where the others first differ are reported instead.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
DATA=${1:-data-prep/ua-gec/bin}
CKPT=${2:-checkpoints/gec-cpu/checkpoint_best.pt}
OUT=${3:-results/gec}
THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
DEVICE_FLAGS=(--cpu) BENCH_FLAGS=(--cpu) STRICT=--strict
[ "${DEVICE:-cpu}" = gpu ] && DEVICE_FLAGS=() BENCH_FLAGS=()
if [ -n "${FP16:-}" ]; then DEVICE_FLAGS+=(--fp16) BENCH_FLAGS+=(--fp16) STRICT=; fi
[ -f "$CKPT" ] || { echo "iad.sh: error: no checkpoint $CKPT (train one with examples/gec/train-baseline.sh)" >&2; exit 1; }
mkdir -p "$OUT"

decode() {  # name, extra fairseq-generate flags...
  local name=$1; shift
  fairseq-generate "$DATA" --user-dir "$HERE/fairseq_pardec" --task translation_pardec -s src -t tgt \
    --path "$CKPT" --gen-subset test --batch-size 32 --max-len-a 1.2 --max-len-b 10 \
    --remove-bpe "${DEVICE_FLAGS[@]}" "$@" > "$OUT/generate-$name.txt" 2> "$OUT/generate-$name.log"
  grep -E "pardec generator|Translated" "$OUT/generate-$name.log" | sed "s/^/[$name] /"
}
decode beam5 --generator beam --beam 5
decode greedy --generator greedy
decode iad --generator iad
decode lookup --generator lookup

for name in iad lookup; do
  echo -n "$name vs greedy: "
  python "$HERE/examples/compare_hypotheses.py" "$OUT/generate-greedy.txt" "$OUT/generate-$name.txt" $STRICT
done

# CTranslate2 on the same checkpoint, when its extra is installed (pip install -e '.[ct2]')
GENERATORS=(beam:beam=5 greedy iad lookup)
python -c "import ctranslate2" 2>/dev/null && GENERATORS+=(ct2 ct2:compute_type=int8)
python -m fairseq_pardec.benchmark "$DATA" --path "$CKPT" -s src -t tgt \
  --generators "${GENERATORS[@]}" --batch-sizes 1 32 --repeats "${REPEATS:-3}" \
  --threads "$THREADS" ${BENCH_SENTENCES:+--max-sentences $BENCH_SENTENCES} "${BENCH_FLAGS[@]}" --out-dir "$OUT/benchmark"
