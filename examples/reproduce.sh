#!/usr/bin/env bash
# One command from nothing to the results table of docs/results.md: every method of the README on
# real data, measured side by side with python -m fairseq_pardec.benchmark.
#
# usage: examples/reproduce.sh [cpu|gpu]            (default cpu)
#
#   1. data       examples/data/prepare-ddtp.sh (apt indexes) and prepare-uagec.sh (pip ua-gec)
#   2. teacher    Transformer on ddtp-de-en (German -> English), regular data
#      gec        Transformer on UA-GEC (the IAD verifier)
#   3. distill    the teacher decodes the ddtp training set with beam 5 (examples/distill.sh)
#   4. verifier   the teacher fine-tuned on the distilled data: greedy/beam reference, GAD
#                 verifier, base of the blockwise models
#   5. models     on the distilled data: GLAT drafter (encoder from the verifier); blockwise
#                 frozen (identity p_1, k=4) and fine-tuned (k=6) from the verifier; IBDecoder
#                 (h=2), +SA (h=2, c=2), IMDecoder (h=4), double-token, vanilla SA (h=1, c=2),
#                 each started from the teacher's parameters; the IBDecoder ablations (standard
#                 mask, flat positions); blockwise Table 1 (examples/translation/blockwise.sh)
#   6. benchmark  ddtp test: greedy, beam 4/5, gad, gad++, blockwise x2, the IBDecoder family at
#                 beam 1 and 4 -- one process, batch 1 and 32; UA-GEC test: beam 5, greedy, iad;
#                 then the GAD block-size sweep, the IBDecoder ablations, blockwise Table 1
#   7. page       results page RESULTS_PAGE (default WORK/results.md; docs/results.md is one) and
#                 its quality-vs-speed PNGs, from the benchmark JSON
#
# Resumable: a step whose output exists is skipped (delete the folder of a step to redo it).
# Progress: one timestamped line per step on stderr and in WORK/reproduce.log; each step's own
# log is next to its output.
#
# Presets
#   cpu  d256 3+3-layer models with a time budget each (fairseq --stop-time-hours): teacher, GEC
#        model and drafter 60 min, verifier and IBDecoder models 20 min, blockwise 10 min; two
#        trainings at a time with one thread each (2 cores); benchmark on BENCH_SENTENCES=200
#        test sentences (the batch-1 sweeps on SWEEP_SENTENCES=100), 2 threads. With two at a
#        time the budgets take about 3.7 hours, plus data preparation, distillation and
#        benchmarking (about 2 hours), under 7 hours on 2 cores.
#   gpu  paper-sized models (transformer_base sizes, fp16, up to 100k updates each, patience 10),
#        one training at a time, whole test sets, benchmark in fp16.
# Environment: WORK (default reproduce-<preset>), BENCH_SENTENCES, REPEATS (default 3),
#   THREADS (benchmark threads, default 2), DDTP_DATA / UAGEC_DATA (use an existing
#   prepare-*.sh output folder instead of building one under WORK), RESULTS_PAGE (where the page
#   goes; WORK/NOTES.md, if you write one, is included in it verbatim).
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
PRESET=${1:-cpu}
case "$PRESET" in cpu|gpu) ;; *) echo "reproduce.sh: error: preset must be cpu or gpu (got $PRESET)" >&2; exit 1 ;; esac
WORK=${WORK:-reproduce-$PRESET}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
DDTP=${DDTP_DATA:-$WORK/data/ddtp-de-en}
UAGEC=${UAGEC_DATA:-$WORK/data/ua-gec}
THREADS=${THREADS:-2}
REPEATS=${REPEATS:-3}
if [ "$PRESET" = cpu ]; then
  PAR=2 BENCH_SENTENCES=${BENCH_SENTENCES:-200} DEVICE_FLAGS=(--cpu) CPU_ENV=(CPU=1)
  BIG=60 MID=20 SMALL=10 ANNEAL=1000   # the glancing ratio anneals within the drafter's budget
  SWEEP_SENTENCES=${SWEEP_SENTENCES:-100}  # the batch-1 sweeps decode each sentence 9-12 times
else
  PAR=1 BENCH_SENTENCES=${BENCH_SENTENCES:-} DEVICE_FLAGS=(--fp16) CPU_ENV=()
  SWEEP_SENTENCES=${SWEEP_SENTENCES:-$BENCH_SENTENCES}
  ANNEAL=100000
fi
export PRESET
log() { echo "[reproduce $(date +%H:%M:%S)] $*" | tee -a "$WORK/reproduce.log" >&2; }
fail() { log "FAILED: $*"; exit 1; }

# run step functions side by side (cpu: two at a time, one thread each), stop on the first failure
together() {
  if [ "$PAR" -gt 1 ] && [ $# -gt 1 ]; then
    local pids=() f
    for f in "$@"; do OMP_NUM_THREADS=1 "$f" & pids+=($!); done
    local ok=1 p
    for p in "${pids[@]}"; do wait "$p" || ok=0; done
    [ $ok = 1 ] || fail "a training step failed (see its log above)"
  else
    for f in "$@"; do "$f"; done
  fi
}

# train NAME DATA_BIN SAVE_DIR MINUTES SRC TGT [ARCH] -- extra fairseq-train flags
train() {
  local name=$1 data=$2 save=$3 minutes=$4 src=$5 tgt=$6 arch=$7; shift 7
  [ "${1:-}" = -- ] && shift
  # DONE marks a finished training; without it an interrupted one resumes from checkpoint_last.pt
  if [ -f "$save/DONE" ]; then log "skip $name (exists: $save/DONE)"; return; fi
  log "train $name${minutes:+ (until $minutes min of recorded training time)} -> $save (log: $save.log)"
  mkdir -p "$save"
  ARCH=$arch MAX_MINUTES=$minutes bash "$HERE/examples/train-transformer.sh" "$data" "$save" "$src" "$tgt" "$@" \
    >> "$save.log" 2>&1 || { tail -5 "$save.log" >&2; fail "train $name (log: $save.log)"; }
  [ -f "$save/checkpoint_best.pt" ] || fail "train $name wrote no checkpoint (log: $save.log)"
  local summary
  summary=$(grep -o 'valid on .valid. subset.*' "$save.log" | tail -1 | grep -o 'ppl [0-9.]*\|num_updates [0-9]*' | paste -sd' ')
  echo "$summary" > "$save/DONE"
  log "done $name: $summary"
}

trained_minutes() {  # training time recorded in a checkpoint, in whole minutes (rounded up)
  python3 -c "import sys, torch; s = torch.load(sys.argv[1], map_location='cpu', weights_only=False); print(int(s['extra_state']['previous_training_time'] // 60) + 1)" "$1"
}

# ---------------------------------------------------------------- 1. data
if [ -f "$DDTP/bin/dict.de.txt" ]; then log "skip ddtp data (exists: $DDTP/bin)"; else
  log "prepare ddtp-de-en -> $DDTP"
  bash "$HERE/examples/data/prepare-ddtp.sh" "$DDTP" > "$WORK/prepare-ddtp.log" 2>&1 || fail "prepare-ddtp.sh (log: $WORK/prepare-ddtp.log)"
fi
if [ -f "$UAGEC/bin/dict.src.txt" ]; then log "skip ua-gec data (exists: $UAGEC/bin)"; else
  log "prepare ua-gec -> $UAGEC"
  bash "$HERE/examples/data/prepare-uagec.sh" "$UAGEC" > "$WORK/prepare-uagec.log" 2>&1 || fail "prepare-uagec.sh (log: $WORK/prepare-uagec.log)"
fi

# ---------------------------------------------------------------- 2.-5. models
D=$WORK/ddtp
DIST=$D/distilled/bin
VERIFIER=$D/verifier/checkpoint_best.pt
teacher()  { train teacher "$DDTP/bin" "$D/teacher" "${BIG:-}" de en transformer; }
gec()      { train gec "$UAGEC/bin" "$WORK/gec/model" "${BIG:-}" src tgt transformer; }
# The verifier is the teacher fine-tuned on the distilled data (fairseq's --finetune-from-model:
# fresh optimizer and schedule, resumable). fairseq carries the teacher's training time over, so
# on the CPU the budget is added to it.
verifier() { local budget=${MID:-}
             [ -n "$budget" ] && budget=$(( $(trained_minutes "$D/teacher/checkpoint_best.pt") + MID ))
             train verifier "$DIST" "$D/verifier" "$budget" de en transformer -- \
               --finetune-from-model "$D/teacher/checkpoint_best.pt"; }
# The drafter gets the long budget: a non-autoregressive drafter learns slowest, and GAD's speed
# is its mean accepted length.
drafter()  { train drafter "$DIST" "$D/drafter" "${BIG:-}" de en glat_drafter -- \
               --criterion glat_loss --drafter-block-size 25 --init-from-verifier "$VERIFIER" \
               --glat-anneal-updates "$ANNEAL"; }
blockwise_frozen() { train blockwise-frozen-k4 "$DIST" "$D/blockwise-frozen-k4" "${SMALL:-}" de en blockwise_transformer -- \
               --proposal-heads 4 --identity-first-head --freeze-base --init-from-transformer "$VERIFIER" \
               --criterion blockwise_cross_entropy --warmup-updates 100; }
blockwise_finetune() { train blockwise-finetune-k6 "$DIST" "$D/blockwise-finetune-k6" "${SMALL:-}" de en blockwise_transformer -- \
               --proposal-heads 6 --init-from-transformer "$VERIFIER" \
               --criterion blockwise_cross_entropy --warmup-updates 100; }
blockwise_both() { blockwise_frozen; blockwise_finetune; }
# IBDecoder models start from the teacher's parameters (--init-from-transformer) and learn the
# interleaved order on the distilled data.
ibtrain() { local name=$1; shift
            train "$name" "$DIST" "$D/$name" "${MID:-}" de en ibdecoder -- \
              --init-from-transformer "$D/teacher/checkpoint_best.pt" "$@"; }
ib()           { ibtrain ibdecoder --ib-directions 2 --ib-words-per-direction 1 --ib-positions signed; }
ib_sa()        { ibtrain ibdecoder-sa --ib-directions 2 --ib-words-per-direction 2 --ib-positions signed; }
imdecoder()    { ibtrain imdecoder --ib-directions 4 --ib-words-per-direction 1 --ib-positions signed; }
double_token() { ibtrain double-token --ib-directions 2 --ib-words-per-direction 1 --ib-positions learned; }
vanilla_sa()   { ibtrain vanilla-sa --ib-directions 1 --ib-words-per-direction 2 --ib-positions vanilla; }
distill() {
  if [ -f "$DIST/dict.de.txt" ]; then log "skip distill (exists: $DIST)"; return; fi
  log "distill: the teacher decodes the training set with beam 5 (log: $D/distill.log)"
  env THREADS="$THREADS" "${CPU_ENV[@]}" bash "$HERE/examples/distill.sh" "$DDTP/bin" "$D/teacher/checkpoint_best.pt" \
    "$DDTP/bpe" "$D/distilled" de en > "$D/distill.log" 2>&1 || fail "distill (log: $D/distill.log)"
}

# IBDecoder ablations (the IBDecoder paper's Table 2): the standard causal mask, flat positions
ablation_mask()      { ibtrain ablation-vanilla-mask --ib-directions 2 --ib-words-per-direction 1 --ib-positions signed --ib-vanilla-mask; }
ablation_positions() { ibtrain ablation-vanilla-positions --ib-directions 2 --ib-words-per-direction 1 --ib-positions vanilla; }
ablations() { ablation_mask; ablation_positions; }
# Blockwise Table 1 (examples/translation/blockwise.sh): frozen / fine-tuned x regular / distilled
# data; on the CPU one model with 10 heads per cell, decoded at k = 2..10 (SHARED_HEADS=1, one
# random head per target position), the paper's one model per k with the gpu preset.
blockwise_sweep() {  # MODES BENCH(0: train only) THREADS LOG
  local shared=1 log=$WORK/blockwise-$4.log; [ "$PRESET" = gpu ] && shared=0
  log "blockwise sweep: $1, $([ "$2" = 1 ] && echo benchmark || echo train) (log: $log)"
  env SHARED_HEADS=$shared MODES="$1" BENCH="$2" MAX_MINUTES="${SMALL:-}" THREADS="$3" \
    BENCH_SENTENCES="${SWEEP_SENTENCES:-}" REPEATS="$REPEATS" DISTILLED_BASE="$VERIFIER" \
    bash "$HERE/examples/translation/blockwise.sh" "$DDTP/bin" "$D/teacher/checkpoint_best.pt" "$DIST" \
    "$WORK/blockwise" > "$log" 2>&1 || { tail -5 "$log" >&2; fail "blockwise.sh (log: $log)"; }
}
blockwise_sweep_frozen()   { blockwise_sweep frozen 0 1 train-frozen; }
blockwise_sweep_finetune() { blockwise_sweep finetune 0 1 train-finetune; }

ib_middle() { ib_sa; imdecoder; ablations; }   # next to the drafter, whose budget is 3x theirs
ib_last()   { double_token; vanilla_sa; }

together teacher gec
OMP_NUM_THREADS=$THREADS distill
together verifier ib
together drafter ib_middle
together blockwise_both ib_last
together blockwise_sweep_frozen blockwise_sweep_finetune

# ---------------------------------------------------------------- 6. benchmarks
bench() {  # NAME DATA_BIN CKPT SRC TGT generator specs...   (BATCHES: batch sizes, default "1 32")
  local name=$1 data=$2 ckpt=$3 src=$4 tgt=$5; shift 5
  local out=$WORK/bench/$name batches=${BATCHES:-1 32}
  if [ -f "$out/results.json" ]; then log "skip benchmark $name (exists: $out/results.json)"; return; fi
  log "benchmark $name (${BENCH_SENTENCES:-all} test sentences, batch ${batches// /, }, median of $REPEATS; log: $out.log)"
  mkdir -p "$WORK/bench"
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=$THREADS python -m fairseq_pardec.benchmark "$data" --path "$ckpt" -s "$src" -t "$tgt" \
    --generators "$@" --batch-sizes $batches --repeats "$REPEATS" --threads "$THREADS" \
    ${BENCH_SENTENCES:+--max-sentences $BENCH_SENTENCES} "${DEVICE_FLAGS[@]}" --no-progress \
    --out-dir "$out.tmp" > "$out.log" 2>&1 || { tail -5 "$out.log" >&2; fail "benchmark $name (log: $out.log)"; }
  rm -rf "$out" && mv "$out.tmp" "$out"
}
ibspecs=()
for name in ibdecoder ibdecoder-sa imdecoder double-token vanilla-sa; do
  ibspecs+=("greedy:label=$name-b1,path=$D/$name/checkpoint_best.pt" "beam:label=$name-b4,beam=4,path=$D/$name/checkpoint_best.pt")
done
bench ddtp-de-en "$DDTP/bin" "$VERIFIER" de en \
  greedy beam:beam=5 beam:label=beam4,beam=4 \
  "gad:label=gad-k25,drafter_path=$D/drafter/checkpoint_best.pt,block_size=25" \
  "gad:label=gad++top3-tau1,drafter_path=$D/drafter/checkpoint_best.pt,block_size=25,gad_beta=3,gad_tau=1.0" \
  "blockwise:label=blockwise-frozen-k4,path=$D/blockwise-frozen-k4/checkpoint_best.pt" \
  "blockwise:label=blockwise-finetune-k6,path=$D/blockwise-finetune-k6/checkpoint_best.pt" \
  "blockwise:label=blockwise-finetune-k6-top2,blockwise_topk=2,path=$D/blockwise-finetune-k6/checkpoint_best.pt" \
  "${ibspecs[@]}"
bench ua-gec "$UAGEC/bin" "$WORK/gec/model/checkpoint_best.pt" src tgt beam:beam=5 greedy iad

# GAD block-size sweep at batch 1 (the GAD paper's Table 2 is GAD++ top-3, tau 1), lossless GAD
# at the same k, and a looser GAD++
sweep=(greedy "gad:label=gad++top5-tau3-k25,drafter_path=$D/drafter/checkpoint_best.pt,block_size=25,gad_beta=5,gad_tau=3.0")
for k in 5 10 15 25; do
  sweep+=("gad:label=gad-k$k,drafter_path=$D/drafter/checkpoint_best.pt,block_size=$k"
          "gad:label=gad++top3-tau1-k$k,drafter_path=$D/drafter/checkpoint_best.pt,block_size=$k,gad_beta=3,gad_tau=1.0")
done
BATCHES=1 BENCH_SENTENCES=$SWEEP_SENTENCES bench ddtp-gad-sweep "$DDTP/bin" "$VERIFIER" de en "${sweep[@]}"
BATCHES=1 bench ddtp-ib-ablations "$DDTP/bin" "$VERIFIER" de en beam:label=beam4,beam=4 \
  "beam:label=ibdecoder-b4,beam=4,path=$D/ibdecoder/checkpoint_best.pt" \
  "beam:label=ablation-vanilla-mask-b4,beam=4,path=$D/ablation-vanilla-mask/checkpoint_best.pt" \
  "beam:label=ablation-vanilla-positions-b4,beam=4,path=$D/ablation-vanilla-positions/checkpoint_best.pt"
blockwise_sweep "frozen finetune" 1 "$THREADS" bench   # BLEU, mean accepted block, speedup per k

# ---------------------------------------------------------------- 7. page
PAGE=${RESULTS_PAGE:-$WORK/results.md}
python3 "$HERE/examples/results_page.py" "$WORK" "$PRESET" "$PAGE" > "$PAGE.tmp" && mv "$PAGE.tmp" "$PAGE"
log "done: $PAGE"
