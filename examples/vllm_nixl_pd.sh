#!/usr/bin/env bash
# vLLM prefill/decode disaggregation with vLLM's own NixlConnector on our NIXL backend.
# Only vLLM's flags: our vllm.general_plugins entry point points NIXL at our plugin
# (NIXL_PLUGIN_DIR) in every vLLM process. The same kv-transfer-config as
# tests/integrations/vllm/test_pd_nixl.py, which runs it on CPU.
#   usage: examples/vllm_nixl_pd.sh MODEL
# Then put a P/D proxy in front (vLLM ships one for the NixlConnector:
# tests/v1/kv_connector/nixl_integration/toy_proxy_server.py in vLLM's repository):
# it sends each request to the prefill with {"do_remote_decode": true}, then to the decode
# with the kv_transfer_params the prefill returned.
set -euo pipefail
MODEL=${1:?usage: $0 MODEL}
export NIXL_MOONCAKE_IP_ADDR=${NIXL_MOONCAKE_IP_ADDR:-127.0.0.1}   # our backend's address
kv() {  # role
  echo '{"kv_connector": "NixlConnector", "kv_role": "'"$1"'", "kv_buffer_device": "cpu",
         "kv_connector_extra_config": {"backends": ["MOONCAKE"]}}'
}
VLLM_NIXL_SIDE_CHANNEL_PORT=5601 vllm serve "$MODEL" --port 8100 \
  --kv-transfer-config "$(kv kv_producer)" &
VLLM_NIXL_SIDE_CHANNEL_PORT=5602 vllm serve "$MODEL" --port 8200 \
  --kv-transfer-config "$(kv kv_consumer)" &
trap 'kill $(jobs -p) 2>/dev/null' EXIT
wait
