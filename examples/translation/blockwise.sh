#!/usr/bin/env bash
# Blockwise parallel decoding on ddtp-de-en (German -> English): our version of Stern et al.
# (2018) Table 1 (BLEU / mean accepted block size) plus wall-clock speedup (Fig. 4).
#
# usage: examples/translation/blockwise.sh [DATA_BIN] [BASELINE_CKPT] [DISTILLED_BIN] [OUT]
#   DATA_BIN       data-prep/ddtp-de-en/bin                      (examples/data/prepare-ddtp.sh)
#   BASELINE_CKPT  checkpoints/ddtp-de-en-cpu/checkpoint_best.pt (examples/translation/train-baseline.sh)
#   DISTILLED_BIN  data-prep/ddtp-de-en-distilled/bin            (examples/distill.sh; skipped if absent)
#   OUT            results/blockwise
#   KS="2 4 6 8 10"  MODES="frozen finetune"  PRESET=cpu|gpu (must match the baseline's sizes)
#   MAX_MINUTES per model on the CPU (default 6); THREADS; REPEATS (default 3); BENCH_SENTENCES
# Frozen = base parameters frozen, identity p_1 (lossless w.r.t. the baseline); finetune = all
# parameters trained (p_1 changes). Every model starts from the baseline (--init-from-transformer).
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
DATA=${1:-data-prep/ddtp-de-en/bin}
BASE=${2:-checkpoints/ddtp-de-en-${PRESET:-cpu}/checkpoint_best.pt}
DISTILLED=${3:-data-prep/ddtp-de-en-distilled/bin}
OUT=${4:-results/blockwise}
KS=${KS:-"2 4 6 8 10"}
MODES=${MODES:-"frozen finetune"}
THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
[ -f "$BASE" ] || { echo "blockwise.sh: error: no baseline checkpoint $BASE" >&2; exit 1; }
datas=(regular)
[ -f "$DISTILLED/dict.de.txt" ] && datas+=(distilled)
mkdir -p "$OUT"

for data in "${datas[@]}"; do
  bin=$DATA; [ "$data" = distilled ] && bin=$DISTILLED
  for mode in $MODES; do
    for k in $KS; do
      name=$data-$mode-k$k
      save=$OUT/ckpt/$name
      if [ ! -f "$save/checkpoint_best.pt" ]; then
        echo "[blockwise] training $name" >&2
        extra=()
        [ "$mode" = frozen ] && extra=(--freeze-base --identity-first-head)
        ARCH=blockwise_transformer MAX_MINUTES=${MAX_MINUTES:-6} bash "$HERE/examples/train-transformer.sh" \
          "$bin" "$save" de en --proposal-heads "$k" --init-from-transformer "$BASE" \
          --criterion blockwise_cross_entropy --warmup-updates 100 "${extra[@]}" \
          > "$OUT/train-$name.log" 2>&1 || { tail -20 "$OUT/train-$name.log" >&2; exit 1; }
      fi
      if [ ! -f "$OUT/bench-$name/results.json" ]; then
        python -m fairseq_pardec.benchmark "$DATA" --path "$save/checkpoint_best.pt" -s de -t en \
          --generators greedy blockwise --batch-sizes 1 --repeats "${REPEATS:-3}" \
          --threads "$THREADS" ${BENCH_SENTENCES:+--max-sentences $BENCH_SENTENCES} \
          --no-progress --out-dir "$OUT/bench-$name" > /dev/null
      fi
    done
  done
done

python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
print("| data | mode | k | BLEU greedy (p_1) | BLEU blockwise | mean accepted | speedup vs greedy | overhead efficiency |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for path in sorted(glob.glob(os.path.join(out, "bench-*", "results.json")),
                   key=lambda p: (p.split("bench-")[1].rsplit("-k", 1)[0], int(p.rsplit("-k", 1)[1].split("/")[0]))):
    name = path.split("bench-")[1].split("/")[0]
    data, mode, k = name.split("-")
    rows = {r["generator"]: r for r in json.load(open(path))["rows"]}
    g, b = rows["greedy"], rows["blockwise"]
    eff = b["speedup_vs_greedy"] / b["mean_accepted_tokens"]
    print("| %s | %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f |" % (data, mode, k[1:], g["bleu"], b["bleu"],
          b["mean_accepted_tokens"], b["speedup_vs_greedy"], eff))
PY
