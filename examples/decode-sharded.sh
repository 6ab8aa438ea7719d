#!/usr/bin/env bash
# Decode a large raw text file in N parallel shards (CPU processes or one process per GPU) with
# the stock fairseq-interactive and our task, then merge the hypotheses back into input order.
#
#   1. INPUT is cut into N contiguous parts of ceil(lines / N) lines (fewer parts when the file
#      has fewer lines than N)
#   2. one fairseq-interactive per part, all at once, each with your model/generator flags
#   3. each part's D- lines (detokenized hypotheses) are put back in line order, checked (every
#      input line exactly one hypothesis) and written to a temporary file that is moved onto
#      OUTPUT only when every shard succeeded: OUTPUT is either complete or untouched
#
# usage: examples/decode-sharded.sh N INPUT OUTPUT DATA_BIN [fairseq-interactive flags ...]
#   N         number of shards (parallel processes), >= 1
#   INPUT     source text, one sentence per line, as the model reads it (BPE'd, or pass --bpe /
#             --tokenizer flags that fairseq-interactive applies)
#   OUTPUT    one hypothesis per INPUT line, same order (the best of --nbest)
#   DATA_BIN  the fairseq-preprocess output holding the model's dictionaries
#   the rest  passed to every shard unchanged, e.g. --path ckpt.pt -s src -t tgt --generator iad
#             --batch-size 32; give --batch-size or --max-tokens (fairseq-interactive's default is
#             one sentence per batch) and keep --batch-size <= BUFFER_SIZE
# Environment:
#   GPUS="0 1 2 3" (or "0,1,2,3")  one process per listed GPU (CUDA_VISIBLE_DEVICES); shard i runs
#                  on GPUS[i mod count], so N = count gives one process per GPU. Unset: CPU only,
#                  no process sees a GPU
#   THREADS        torch threads per CPU process (default: CPU cores / N, at least 1)
#   BUFFER_SIZE    fairseq-interactive --buffer-size, the sentences batched together (default 2000)
#   FIELD=D        D (detokenized, default) or H (after --post-process only) hypotheses
#   FAIRSEQ_INTERACTIVE  the command (default fairseq-interactive)
#   KEEP=1         keep the work directory (parts, shard outputs and logs) after success
# Our --user-dir and --task translation_pardec come first, so a --task of yours wins.
# Merging by line number makes the result independent of N only up to batching: each shard
# batches its own lines, so a generator whose output depends on the batch (sampling; numerics
# of padded batches) can differ from an unsharded run. See docs/sharded-decoding.md.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
die() { echo "decode-sharded.sh: error: $*" >&2; exit 1; }
[ $# -ge 4 ] || die "usage: decode-sharded.sh N INPUT OUTPUT DATA_BIN [fairseq-interactive flags ...]"
N=$1 INPUT=$2 OUTPUT=$3 DATA=$4
shift 4
case "$N" in '' | *[!0-9]*) die "N must be a positive integer (got '$N')" ;; esac
N=$((10#$N))
[ "$N" -ge 1 ] || die "N must be >= 1 (got $N)"
[ -f "$INPUT" ] || die "no input file $INPUT"
[ -d "$DATA" ] || die "no data directory $DATA (the fairseq-preprocess output with the dictionaries)"
OUTDIR=$(dirname "$OUTPUT")
[ -d "$OUTDIR" ] || die "no directory $OUTDIR for the output"
[ ! -d "$OUTPUT" ] || die "OUTPUT $OUTPUT is a directory"
case "${FIELD:-D}" in D | H) FIELD=${FIELD:-D} ;; *) die "FIELD must be D or H (got $FIELD)" ;; esac
for flag in "$@"; do
  case "$flag" in --input | --input=*) die "the shards' --input is set by this script; drop $flag" ;; esac
done
INTERACTIVE=${FAIRSEQ_INTERACTIVE:-fairseq-interactive}
command -v "${INTERACTIVE%% *}" > /dev/null || die "$INTERACTIVE not found (activate the venv with fairseq)"
GPUS=${GPUS:-}
read -r -a GPU_LIST <<< "${GPUS//,/ }"
cores=$(nproc 2> /dev/null || getconf _NPROCESSORS_ONLN 2> /dev/null || echo 1)
THREADS=${THREADS:-$(( cores / N > 0 ? cores / N : 1 ))}

# lines = newline count, plus one for a last line without its newline (wc -l misses it)
lines=$(awk 'END { print NR }' "$INPUT")
# the work directory sits next to OUTPUT so the final mv is a rename on one file system
WORK=$(mktemp -d "$OUTPUT.shards.XXXXXX" 2> /dev/null) || die "cannot create a work directory next to $OUTPUT"
pids=()
cleanup() {
  local status=$?
  for pid in "${pids[@]}"; do
    [ -n "$pid" ] && kill "$pid" 2> /dev/null || true
  done
  if [ "$status" -eq 0 ] && [ -z "${KEEP:-}" ]; then rm -rf "$WORK"; fi
  # a failed run leaves no temporary output behind, only the logs
  rm -f "$WORK/merged.tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "$lines" -eq 0 ]; then
  : > "$WORK/merged.tmp"
  mv "$WORK/merged.tmp" "$OUTPUT"
  echo "decode-sharded.sh: $INPUT is empty; wrote an empty $OUTPUT" >&2
  exit 0
fi
per=$(( (lines + N - 1) / N ))
# alphabetic suffixes (aaaaaa, aaaaab, ...): the glob lists the parts in input order
split -l "$per" -a 6 "$INPUT" "$WORK/part."
parts=("$WORK"/part.*)
where="CPU, $THREADS threads each"
[ ${#GPU_LIST[@]} -eq 0 ] || where="GPUs ${GPU_LIST[*]}"
echo "[decode-sharded $(date +%H:%M:%S)] $lines lines in ${#parts[@]} shards of <= $per lines ($where)" >&2

for i in "${!parts[@]}"; do
  if [ ${#GPU_LIST[@]} -gt 0 ]; then device=${GPU_LIST[$(( i % ${#GPU_LIST[@]} ))]}; else device=; fi
  # shellcheck disable=SC2086  # FAIRSEQ_INTERACTIVE may be a command with arguments
  env CUDA_VISIBLE_DEVICES="$device" OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS" \
    $INTERACTIVE "$DATA" --user-dir "$HERE/fairseq_pardec" --task translation_pardec \
    --buffer-size "${BUFFER_SIZE:-2000}" "$@" --input "${parts[$i]}" \
    > "$WORK/out.$i" 2> "$WORK/log.$i" &
  pids[i]=$!
done

# poll instead of waiting in order: a shard that fails stops the others at once, not after
# the shards before it have finished
running=${#pids[@]}
while [ "$running" -gt 0 ]; do
  running=0
  for i in "${!pids[@]}"; do
    pid=${pids[$i]}
    [ -n "$pid" ] || continue
    if kill -0 "$pid" 2> /dev/null; then running=$((running + 1)); continue; fi
    status=0
    wait "$pid" || status=$?
    pids[i]=
    if [ "$status" -ne 0 ]; then
      # errors go to stderr; stdout only holds fairseq-interactive's log lines and hypotheses
      last=$(grep -v '^[[:space:]]*$' "$WORK/log.$i" 2> /dev/null | tail -n 1 || true)
      die "shard $i of ${#parts[@]} failed (exit $status): ${last:-no output} (logs in $WORK)"
    fi
  done
  [ "$running" -eq 0 ] || sleep 1
done

for i in "${!parts[@]}"; do
  n=$(awk 'END { print NR }' "${parts[$i]}")
  # the first hypothesis of each id is the best (--nbest prints them best first)
  awk -F '\t' -v n="$n" -v field="$FIELD" -v shard="$i" -v offset=$(( i * per )) '
    index($0, field "-") == 1 {
      id = substr($1, length(field) + 2) + 0
      if (id in hyp) next
      rest = substr($0, index($0, "\t") + 1)  # after the id: score TAB text
      tab = index(rest, "\t")
      hyp[id] = tab ? substr(rest, tab + 1) : ""
    }
    END {
      for (j = 0; j < n; j++) if (!(j in hyp)) {
        printf "decode-sharded.sh: error: no hypothesis for input line %d (shard %d; too long for the model?)\n", offset + j + 1, shard > "/dev/stderr"
        exit 1
      }
      for (j = 0; j < n; j++) print hyp[j]
    }' "$WORK/out.$i" >> "$WORK/merged.tmp" || exit 1
  grep -h "pardec generator=" "$WORK/out.$i" "$WORK/log.$i" 2> /dev/null \
    | sed "s/^.*pardec generator=/[decode-sharded] shard $i: generator=/" >&2 || true
done
mv "$WORK/merged.tmp" "$OUTPUT"
echo "[decode-sharded $(date +%H:%M:%S)] $lines hypotheses in $OUTPUT" >&2
