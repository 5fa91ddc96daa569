#!/usr/bin/env bash
# Serve KIMI-K3-CODER-REAP-320-MXFP4 with SGLang (>= 0.5.23) on one node of 8 GPUs, OpenAI-compatible on :30000.
#   deployment/serve_sglang.sh [MODEL_DIR_OR_REPO] [extra sglang flags...]
# Only uniform prunes serve here: SGLang sizes every MoE layer from text_config.num_experts.
# SM120 (RTX PRO 6000 Blackwell): the MXFP4 experts run on the "marlin" MoE kernels; SGLang's fused
# attention-residual (Block Attention Residuals) kernels target SM90/SM100, so on SM120 the depth mixes take its
# reference path — expect a higher TPOT there, not wrong output.
set -euo pipefail
MODEL="${1:-moonshotai-community/KIMI-K3-CODER-REAP-320-MXFP4}"
shift || true
ARGS=()
if [[ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1)" == 12.* ]]; then
  ARGS+=(--moe-runner-backend marlin)   # SM120: no native MXFP4 MoE path in SGLang, marlin dequantizes in-kernel
fi
exec python -m sglang.launch_server \
  --model-path "$MODEL" \
  --trust-remote-code \
  --tp-size 8 \
  --mem-fraction-static 0.94 \
  --context-length 32768 \
  --reasoning-parser kimi_k3 \
  --tool-call-parser kimi_k3 \
  --host 0.0.0.0 --port "${PORT:-30000}" \
  "${ARGS[@]}" "$@"
