#!/usr/bin/env bash
# The IBDecoder family on ddtp-de-en (German -> English), trained on distilled data:
# our version of Zhang, Titov, Sennrich (2020) Table 1 (B, h, c, BLEU, latency, speedup) and the
# Table 2 ablations (vanilla mask, vanilla positions), plus double-token and vanilla SA.
#
# usage: examples/translation/ibdecoder.sh [DATA_BIN] [DISTILLED_BIN] [TRANSFORMER_CKPT] [OUT]
#   DATA_BIN          data-prep/ddtp-de-en/bin (valid/test references)
#   DISTILLED_BIN     results/gad/distilled/bin (examples/distill.sh output)
#   TRANSFORMER_CKPT  a Transformer trained on the same distilled data (the speed reference);
#                     default: results/gad/verifier/checkpoint_best.pt
#   MODELS (default: all below), PRESET=cpu|gpu, MAX_MINUTES per model, THREADS, REPEATS,
#   BENCH_SENTENCES, BEAMS (default "4 1")
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
DATA=${1:-data-prep/ddtp-de-en/bin}
DISTILLED=${2:-results/gad/distilled/bin}
TRANSFORMER=${3:-results/gad/verifier/checkpoint_best.pt}
OUT=${4:-results/ibdecoder}
THREADS=${THREADS:-2}
export OMP_NUM_THREADS=$THREADS
[ -f "$DISTILLED/dict.de.txt" ] || { echo "ibdecoder.sh: error: no distilled data in $DISTILLED (examples/distill.sh)" >&2; exit 1; }
mkdir -p "$OUT"

# name: fairseq-train flags
declare -A FLAGS=(
  [ibdecoder]="--ib-directions 2 --ib-words-per-direction 1 --ib-positions signed"
  [ibdecoder-sa]="--ib-directions 2 --ib-words-per-direction 2 --ib-positions signed"
  [imdecoder]="--ib-directions 4 --ib-words-per-direction 1 --ib-positions signed"
  [double-token]="--ib-directions 2 --ib-words-per-direction 1 --ib-positions learned"
  [vanilla-sa]="--ib-directions 1 --ib-words-per-direction 2 --ib-positions vanilla"
  [ablation-vanilla-mask]="--ib-directions 2 --ib-words-per-direction 1 --ib-positions signed --ib-vanilla-mask"
  [ablation-vanilla-positions]="--ib-directions 2 --ib-words-per-direction 1 --ib-positions vanilla"
)
MODELS=${MODELS:-"ibdecoder ibdecoder-sa imdecoder double-token vanilla-sa ablation-vanilla-mask ablation-vanilla-positions"}

for name in $MODELS; do
  save=$OUT/ckpt/$name
  if [ ! -f "$save/checkpoint_best.pt" ]; then
    echo "[ibdecoder] training $name" >&2
    # shellcheck disable=SC2086
    ARCH=ibdecoder bash "$HERE/examples/train-transformer.sh" "$DISTILLED" "$save" de en \
      ${FLAGS[$name]} > "$OUT/train-$name.log" 2>&1 || { tail -20 "$OUT/train-$name.log" >&2; exit 1; }
  fi
done

for beam in ${BEAMS:-4 1}; do
  specs=()
  [ -f "$TRANSFORMER" ] && specs+=("transformer")
  for name in $MODELS; do specs+=("$name"); done
  for name in "${specs[@]}"; do
    ckpt=$OUT/ckpt/$name/checkpoint_best.pt
    [ "$name" = transformer ] && ckpt=$TRANSFORMER
    dest=$OUT/bench-b$beam-$name
    [ -f "$dest/results.json" ] && continue
    python -m fairseq_pardec.benchmark "$DATA" --path "$ckpt" -s de -t en \
      --generators "beam:label=$name,beam=$beam" --batch-sizes 1 32 --repeats "${REPEATS:-3}" \
      --threads "$THREADS" ${BENCH_SENTENCES:+--max-sentences $BENCH_SENTENCES} --no-progress \
      --out-dir "$dest" > /dev/null
  done
done

python3 - "$OUT" "${BEAMS:-4 1}" <<'PY'
import glob, json, os, sys
out, beams = sys.argv[1], sys.argv[2].split()
print("| model | B | batch | BLEU | latency ms/sent | sent/s | speedup vs transformer | words/step |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for beam in beams:
    rows = {}
    for path in glob.glob(os.path.join(out, "bench-b%s-*" % beam, "results.json")):
        for r in json.load(open(path))["rows"]:
            rows[(r["generator"], r["batch_size"])] = r
    for (name, batch), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0] != "transformer", kv[0][0])):
        ref = rows.get(("transformer", batch))
        speed = ref["wall_time_s"] / r["wall_time_s"] if ref else float("nan")
        print("| %s | %s | %d | %.2f | %.1f | %.1f | %.2f | %.2f |" % (name, beam, batch, r["bleu"],
              r["latency_ms_per_sentence"], r["sentences_per_s"], speed, r["mean_accepted_tokens"]))
PY
