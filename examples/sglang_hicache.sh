#!/usr/bin/env bash
# SGLang (0.5.23) hierarchical cache with its L3 tier in the mooncake_plugins store,
# through our HiCache backend (integrations/mooncake_sglang).
#
#   pip install -e '.[sglang]'        # in SGLang's environment (a GPU host)
#   MODEL=Qwen/Qwen3-8B examples/sglang_hicache.sh dynamic      # SGLang's dynamic loader
#   MODEL=Qwen/Qwen3-8B examples/sglang_hicache.sh entrypoint   # SGLang's "mooncake" name
#
# Both start the same backend; they differ only in how SGLang is told to load it.
set -euo pipefail

MODEL=${MODEL:?set MODEL to a model path or Hugging Face id}
MODE=${1:-dynamic}
PORT=${MASTER_PORT:-50051}
MASTER=127.0.0.1:$PORT

# The store: a master, and a client lending 16 GB that the pages live in, so they
# outlive every SGLang server (a restarted server, or a second one, reads them back).
mooncake-master --rpc_port "$PORT" &
until (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; do sleep 0.2; done
mooncake_client --master_server_address "$MASTER" --global_segment_size 16GB &
trap 'kill $(jobs -p) 2>/dev/null' EXIT

# What SGLang's HiCache needs either way: the host tier, and a page-major layout so
# pages move zero-copy (page_first_direct works too; layer_first uses a copying path).
HICACHE=(--enable-hierarchical-cache --hicache-ratio 2 --hicache-mem-layout page_first)

case "$MODE" in
  dynamic)
    # SGLang's "dynamic" backend imports the class named in the extra config; the other
    # keys are our settings (global_segment_size 0: this server lends no memory).
    python -m sglang.launch_server --model-path "$MODEL" "${HICACHE[@]}" \
      --hicache-storage-backend dynamic \
      --hicache-storage-backend-extra-config '{
        "backend_name": "mooncake_plugins",
        "module_path": "mooncake_sglang.backend",
        "class_name": "MooncakePluginsHiCache",
        "interface_v1": 1,
        "master_server_address": "'"$MASTER"'",
        "global_segment_size": 0}'
    ;;
  entrypoint)
    # Our sglang.srt.plugins entry point registers the backend under SGLang's own
    # "mooncake" name when MOONCAKE_PLUGINS_HICACHE=1 (without it, "mooncake" stays
    # SGLang's in-tree backend, which also runs on the drop-in mooncake package).
    MOONCAKE_PLUGINS_HICACHE=1 python -m sglang.launch_server --model-path "$MODEL" \
      "${HICACHE[@]}" --hicache-storage-backend mooncake \
      --hicache-storage-backend-extra-config \
        '{"master_server_address": "'"$MASTER"'", "global_segment_size": 0}'
    ;;
  *)
    echo "usage: MODEL=... $0 [dynamic|entrypoint]" >&2
    exit 2
    ;;
esac
