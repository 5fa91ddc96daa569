#!/usr/bin/env bash
# Serve KIMI-K3-CODER-REAP-320-MXFP4 with vLLM (>= 0.33.0) on one node of 8 GPUs, OpenAI-compatible on :8000.
#   deployment/serve_vllm.sh [MODEL_DIR_OR_REPO] [extra vllm flags...]
# Only uniform prunes serve here: vLLM sizes every MoE layer from text_config.num_experts.
# SM120 (RTX PRO 6000 Blackwell): the MXFP4 experts run on the "marlin" MoE kernels (--moe-backend marlin); the fused
# attention-residual kernels target SM90/SM100, so on SM120 the depth mixes take the reference path — expect a higher
# TPOT there, not wrong output.
set -euo pipefail
MODEL="${1:-moonshotai-community/KIMI-K3-CODER-REAP-320-MXFP4}"
shift || true
ARGS=()
if [[ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1)" == 12.* ]]; then
  ARGS+=(--moe-backend marlin)
fi
exec vllm serve "$MODEL" \
  --trust-remote-code \
  --tensor-parallel-size 8 \
  --gpu-memory-utilization 0.94 \
  --max-model-len 32768 \
  --reasoning-parser kimi_k3 \
  --tool-call-parser kimi_k3 --enable-auto-tool-choice \
  --host 0.0.0.0 --port "${PORT:-8000}" \
  "${ARGS[@]}" "$@"
