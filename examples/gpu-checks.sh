#!/usr/bin/env bash
# GPU checks, in one run of under 10 minutes on one GPU (the device tool's limit):
#   0. with training data prepared under .gpu/train/NAME/ (bin/ with the train split, languages
#      src and tgt, and a `preset` file: a first line of environment settings for
#      examples/train-transformer.sh, "PRESET=base MAX_MINUTES=3.5", then the extra fairseq-train
#      arguments, one a line), trains
#      each model in the background with examples/train-transformer.sh while 1 runs, then packs
#      it with examples/checkpoint_int8.py (pieces under $OUT, the machine keeps nothing) and
#      unpacks it to .gpu/models/NAME/ckpt.pt, so that 2-4 decode the weights that come back;
#   1. the CUDA tests (pytest -m cuda tests/test_cuda.py tests/test_cuda_guard.py): graph replay
#      against eager, bucket padding, rows leaving mid-bucket, no device read inside a call, the
#      engine against fairseq greedy in float32, the float16 divergence audit, the CUDA step's
#      measured rounding against its declared margin, the guard on crafted near-ties, and the
#      synchronising calls per iteration of every generator under torch's sync detector;
#   2. the step table on CUDA for Transformers built in the process (random weights, 8,000
#      words; a step's cost does not depend on what the weights learned): d256 3+3 and
#      transformer_wmt_en_de sizes, ms per call at batch 1 and 32, fairseq's step beside the
#      engine's blocks of 1/2/4/8/16, float32 and float16;
#   3. per model under .gpu/models/NAME/: the CUDA float32 spread, |static step - fairseq's
#      step| over every position of the first 60 test sentences (examples/margin_spread.py --cuda);
#   4. per model, the benchmark (fairseq greedy, lean_greedy, iad, lookup, auto) on the first 60
#      test sentences at batch 1 and 32, float32, then float16 on the first model, while time lasts.
# Trainings run beside the tests (which time nothing); nothing is timed while a training runs.
# On the GPU machine: bash .gpu/on-device.sh bash examples/gpu-checks.sh (carry .gpu along).
# Results go to $OUT (default gpu-out/), 8 files at most: checks.txt (the log), results.tgz
# (every table and log), and the packed checkpoints of the largest model (NAME.partNN; smaller
# ones go into results.tgz).
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
cd "$HERE"
export OUT=${OUT:-gpu-out}
PYTHON=${PYTHON:-python3}
BUDGET=${BUDGET:-560}  # seconds this script may take in all
mkdir -p "$OUT" /tmp/res
started=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - started) )); }
log() { echo "[gpu-checks +$(( $(date +%s) - started ))s] $*" | tee -a "$OUT/checks.txt" >&2; }
finish() {
  log "done; packing the results"
  cp "$OUT/checks.txt" /tmp/res/ 2>/dev/null
  tar czf "$OUT/results.tgz" -C /tmp res
  ls -la "$OUT" >&2
}
trap finish EXIT

log "torch $($PYTHON -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")' 2>&1)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> /tmp/res/machine.txt 2>&1
lscpu | grep -i "model name" >> /tmp/res/machine.txt 2>&1

log "0/4 trainings"
declare -A training
for dir in .gpu/train/*/; do
  [ -f "$dir/preset" ] || continue
  name=$(basename "$dir")
  mapfile -t args < "$dir/preset"
  # shellcheck disable=SC2086  # the first line holds several settings
  ( export ${args[0]}; rm -f /tmp/train-$name.done
    bash examples/train-transformer.sh "$dir/bin" "/tmp/ckpt-$name" src tgt "${args[@]:1}" \
      > "/tmp/res/train-$name.log" 2>&1; echo $? > "/tmp/train-$name.done" ) &
  training[$name]=$!
  log "    $name: started (${args[*]})"
  sleep 2  # one fairseq start at a time reads the data
done

log "1/4 pytest -m cuda tests/test_cuda.py tests/test_cuda_guard.py"
timeout 200 "$PYTHON" -m pytest -m cuda -q -rs -s tests/test_cuda.py tests/test_cuda_guard.py \
    > /tmp/res/pytest-cuda.txt 2>&1
log "    exit $? ($(tail -n 1 /tmp/res/pytest-cuda.txt))"
grep -h "CUDA syncs\|CUDA |log-prob" /tmp/res/pytest-cuda.txt | tee -a "$OUT/checks.txt" >&2

for name in "${!training[@]}"; do
  wait "${training[$name]}"
  status=$(cat "/tmp/train-$name.done" 2>/dev/null || echo "?")
  log "    training $name: exit $status; $(grep -o 'num_updates [0-9]*' "/tmp/res/train-$name.log" | tail -1); $(grep ' valid on' "/tmp/res/train-$name.log" | tail -1 | grep -o 'loss [0-9.]*')"
  ckpt=/tmp/ckpt-$name/checkpoint_best.pt
  [ -f "$ckpt" ] || { tail -n 20 "/tmp/res/train-$name.log" >> "$OUT/checks.txt"; continue; }
  size=$(stat -c %s "$ckpt")
  if [ "$name" = "${BIG:-gec-base}" ]; then dest=$OUT; else dest=/tmp/res; fi
  "$PYTHON" examples/checkpoint_int8.py pack "$ckpt" "$dest/$name" >> "$OUT/checks.txt" 2>&1
  mkdir -p ".gpu/models/$name/bin"
  for f in .gpu/train/$name/bin/*; do
    case $(basename "$f") in train.*) ;; *) cp "$f" ".gpu/models/$name/bin/";; esac
  done
  "$PYTHON" examples/checkpoint_int8.py unpack ".gpu/models/$name/ckpt.pt" "$dest/$name".part* \
    >> "$OUT/checks.txt" 2>&1
  log "    $name: packed ($size bytes trained)"
done

log "2/4 step table on CUDA (in-process d256 3+3 and transformer_wmt_en_de sizes)"
timeout $(( $(left) > 120 ? 100 : 40 )) "$PYTHON" - > /tmp/res/step-table.md 2>> "$OUT/checks.txt" <<'PY'
import json, sys
sys.path.insert(0, "tests")
import torch
from helpers import make_dictionary, make_task, random_batch, tiny_transformer
from fairseq_pardec.benchmark import step_table

torch.backends.cuda.matmul.allow_tf32 = False  # float32 products in float32 (fairseq's default)
d = make_dictionary(8000)
sizes = {"d256 3+3": dict(encoder_embed_dim=256, decoder_embed_dim=256, encoder_ffn_embed_dim=1024,
                          decoder_ffn_embed_dim=1024, encoder_layers=3, decoder_layers=3),
         "base 6+6": dict(encoder_embed_dim=512, decoder_embed_dim=512, encoder_ffn_embed_dim=2048,
                          decoder_ffn_embed_dim=2048, encoder_layers=6, decoder_layers=6,
                          encoder_attention_heads=8, decoder_attention_heads=8)}
rows = []
for size, dims in sizes.items():
    for dtype in (torch.float32, torch.float16):
        model = tiny_transformer(make_task(d), seed=0, **dims).cuda().to(dtype).eval()
        for batch in (1, 32):
            sample = random_batch(d, [20 + i % 20 for i in range(batch)], seed=batch)
            sample = {"net_input": {k: v.cuda() for k, v in sample["net_input"].items()}}
            costs = step_table.step_costs(model, sample, prefix=16, repeats=30)
            costs.update(size=size, batch_size=batch, prefix=16, dtype=str(dtype).split(".")[-1])
            rows.append(costs)
            print(json.dumps(costs), file=sys.stderr, flush=True)
        del model
for size in sizes:
    for dtype in ("float32", "float16"):
        print("### %s, %s, %s\n" % (torch.cuda.get_device_name(0), size, dtype))
        table = [r for r in rows if r["dtype"] == dtype and r["size"] == size]
        print(step_table.markdown(table, {}))
        print("kernel ms of a one-position call: " + ", ".join(
            "batch %d %.3f" % (r["batch_size"], r.get("block 1 kernels", float("nan"))) for r in table))
        print()
with open("/tmp/res/step-table.json", "w") as f:
    json.dump(rows, f, indent=1)
PY
log "    exit $?"

log "3/4 the CUDA float32 spread against fairseq's step"
for dir in .gpu/models/*/; do
  [ -f "$dir/ckpt.pt" ] || continue
  name=$(basename "$dir")
  [ "$(left)" -gt 150 ] || { log "    $name: skipped, $(left)s left"; continue; }
  timeout 60 "$PYTHON" examples/margin_spread.py "$dir/bin" --path "$dir/ckpt.pt" -s src -t tgt \
      --sentences 60 --cuda --json "/tmp/res/spread-$name.json" > "/tmp/res/spread-$name.txt" 2>&1
  log "    $name: exit $?"
  grep "positions" "/tmp/res/spread-$name.txt" | tee -a "$OUT/checks.txt" >&2
done

log "4/4 the benchmark on the models"
bench() {  # NAME PRECISION_FLAG...
  local name=$1; shift
  local dir=.gpu/models/$name tag=$name${1:+-fp16}
  [ -f "$dir/ckpt.pt" ] || return
  local remaining=$(( $(left) - 5 ))
  if [ $remaining -lt 50 ]; then log "    $tag: skipped, ${remaining}s left"; return; fi
  timeout $remaining "$PYTHON" -m fairseq_pardec.benchmark "$dir/bin" --path "$dir/ckpt.pt" \
      -s src -t tgt --generators greedy lean_greedy iad lookup auto --batch-sizes 1 32 \
      --max-sentences 60 --repeats 1 --warmup-sentences 8 --no-progress "$@" \
      --out-dir "/tmp/bench-$tag" > "/tmp/res/bench-$tag.txt" 2>&1
  log "    $tag: exit $?"
  cp "/tmp/bench-$tag/results.md" "/tmp/res/bench-$tag.md" 2>/dev/null
  cp "/tmp/bench-$tag/results.json" "/tmp/res/bench-$tag.json" 2>/dev/null
}
for name in ${MODELS:-gec-base ddtp-d256}; do bench "$name"; done
bench "${BIG:-gec-base}" --fp16
for dir in .gpu/models/*/; do
  name=$(basename "$dir")
  case " ${MODELS:-gec-base ddtp-d256} " in *" $name "*) ;; *) bench "$name";; esac
done
