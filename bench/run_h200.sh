#!/usr/bin/env bash
# How bench/results/{layer,decode}_h200.* were made: the GPU tests, the real-shape layer benchmark, then the
# real-width whole-model decode benchmark, on a machine with no network (fla-core travels as a wheel in the
# git-ignored .whl/). Writes logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kimi-k3-bench}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export KIMI_K3_QUICK_TUNE=${KIMI_K3_QUICK_TUNE:-1} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu,clocks.sm --format=csv
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    timeout "${TESTS_TIMEOUT:-180}" python3 -m pytest -q -rA -s -p no:cacheprovider tests/test_gpu_paths.py ${TESTS_K:+-k "$TESTS_K"} \
        > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests exit $?"
    grep -E "greedy|fla kda in model|static-cache|passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -20
fi
budget=${BENCH_BUDGET:-150}
timeout $((budget + 60)) python3 -m bench.layer --budget-s "$budget" --out "$OUT/layer_h200.json" ${BENCH_ARGS:-} \
    > "$OUT/layer_h200.log" 2>&1
echo "layer bench exit $?"
sed -n '/=== one layer/,$p' "$OUT/layer_h200.log" | grep -v "^   gemv\|^   dot_scaled"
grep -E "Error|error|Traceback" "$OUT/layer_h200.log" | head -5
timeout "${DECODE_TIMEOUT:-200}" python3 -m bench.decode --ab --profile --steps 12 --generate ${GENERATE:-128} ${DECODE_ARGS:-} \
    --out "$OUT/decode_h200.json" > "$OUT/decode_h200.log" 2>&1
echo "decode bench exit $?"
grep -E "^b[18] |kernels,|layers|built|Error|tok/s" "$OUT/decode_h200.log"
