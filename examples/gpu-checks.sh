#!/usr/bin/env bash
# GPU checks of the static decoder step, in under 8 minutes on one GPU:
#   1. the CUDA tests (pytest -m cuda tests/test_cuda.py tests/test_cuda_guard.py): graph replay
#      against eager, bucket padding, rows leaving mid-bucket, no device read inside a call, the
#      engine against fairseq greedy in float32, the float16 divergence audit, the CUDA step's
#      measured rounding against its declared margin and the guard on crafted near-ties;
#   2. the step table on CUDA for a d256 3+3 Transformer built in the process (random weights,
#      8,000 words; a step's cost does not depend on what the weights learned): ms per call at
#      batch 1 and 32, fairseq's step beside the engine's blocks of 1/4/8/16, float32 and
#      float16, and the kernel time of a one-position call (torch profiler);
#   3. with checkpoints prepared by ../shared/gpu/prepare.sh (.gpu/models/NAME/), the benchmark's
#      own step table and generators (fairseq greedy, lean_greedy, iad, lookup and auto with the
#      measured prices) on their first 60 test sentences, at most two models.
# On the GPU machine: bash .gpu/on-device.sh bash examples/gpu-checks.sh (carry .gpu along).
# Results go to $OUT (default gpu-out/), 8 files at most: checks.txt (the log), pytest-cuda.txt,
# step-table.md/.json, bench-NAME.md/.json per model.
set -u
HERE=$(cd "$(dirname "$0")/.." && pwd)
cd "$HERE"
export OUT=${OUT:-gpu-out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
started=$(date +%s)
log() { echo "[gpu-checks +$(( $(date +%s) - started ))s] $*" | tee -a "$OUT/checks.txt" >&2; }

log "torch $($PYTHON -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")' 2>&1)"

log "1/3 pytest -m cuda tests/test_cuda.py tests/test_cuda_guard.py"
timeout 240 "$PYTHON" -m pytest -m cuda -q -rs -s tests/test_cuda.py tests/test_cuda_guard.py \
    > "$OUT/pytest-cuda.txt" 2>&1
log "    exit $? ($(tail -n 1 "$OUT/pytest-cuda.txt"))"

log "2/3 step table on CUDA (in-process d256 3+3 model)"
timeout 150 "$PYTHON" - > "$OUT/step-table.md" 2>> "$OUT/checks.txt" <<'PY'
import json, os, sys
sys.path.insert(0, "tests")
import torch
from helpers import make_dictionary, make_task, random_batch, tiny_transformer
from fairseq_pardec.benchmark import step_table

torch.backends.cuda.matmul.allow_tf32 = False  # float32 products in float32 (fairseq's default)
d = make_dictionary(8000)
rows = []
for dtype in (torch.float32, torch.float16):
    model = tiny_transformer(make_task(d), seed=0, encoder_embed_dim=256, decoder_embed_dim=256,
                             encoder_ffn_embed_dim=1024, decoder_ffn_embed_dim=1024,
                             encoder_layers=3, decoder_layers=3).cuda().to(dtype)
    for batch in (1, 32):
        sample = random_batch(d, [20 + i % 20 for i in range(batch)], seed=batch)
        sample = {"net_input": {k: v.cuda() for k, v in sample["net_input"].items()}}
        costs = step_table.step_costs(model, sample, prefix=16, repeats=50)
        costs.update(batch_size=batch, prefix=16, dtype=str(dtype).split(".")[-1])
        rows.append(costs)
        print(json.dumps(costs), file=sys.stderr, flush=True)
for dtype in ("float32", "float16"):
    print("### %s, %s\n" % (torch.cuda.get_device_name(0), dtype))
    table = [r for r in rows if r["dtype"] == dtype]
    print(step_table.markdown(table, {}))
    print("kernel ms of a one-position call: " + ", ".join(
        "batch %d %.3f" % (r["batch_size"], r.get("block 1 kernels", float("nan"))) for r in table))
    print()
with open(os.path.join(os.environ.get("OUT", "gpu-out"), "step-table.json"), "w") as f:
    json.dump(rows, f, indent=1)
PY
log "    exit $?"

log "3/3 the benchmark on prepared checkpoints"
count=0
for dir in .gpu/models/*/; do
    [ -f "$dir/ckpt.pt" ] || continue
    [ $count -lt 2 ] || break
    name=$(basename "$dir")
    remaining=$(( 450 - ($(date +%s) - started) ))
    if [ $remaining -lt 60 ]; then log "    $name: skipped, ${remaining}s left"; break; fi
    # at most 8 files come back from the machine: the tables, and the log's end on failure
    timeout $remaining "$PYTHON" -m fairseq_pardec.benchmark "$dir" --path "$dir/ckpt.pt" \
        --generators greedy lean_greedy iad lookup auto --batch-sizes 1 32 --max-sentences 60 \
        --repeats 1 --warmup-sentences 8 --no-progress --out-dir "/tmp/bench-$name" \
        > "/tmp/bench-$name.txt" 2>&1
    status=$?
    log "    $name: exit $status"
    [ $status -eq 0 ] || tail -n 30 "/tmp/bench-$name.txt" >> "$OUT/checks.txt"
    cp "/tmp/bench-$name/results.md" "$OUT/bench-$name.md" 2>/dev/null
    cp "/tmp/bench-$name/results.json" "$OUT/bench-$name.json" 2>/dev/null
    count=$((count + 1))
done
[ $count -gt 0 ] || log "    no checkpoint under .gpu/models (run ../shared/gpu/prepare.sh here first)"
log "done"
