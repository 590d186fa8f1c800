#!/usr/bin/env bash
# The prepared RDMA check (issue 26), for a machine with an RDMA NIC (or one where the
# kernel lets root make a Soft-RoCE device). Checks device discovery, GID choice and NIC
# ranking against the system's own tools and tries Soft-RoCE on a veth pair (check.py),
# then runs the rdma transport's data path: WRITE and READ, bytes equal and GB/s, in one
# process and two (datapath.py). Fetches nothing.
# Writes rdma_result.json and rdma_datapath.json under $OUT (else tests/rdma/results/).
# Exit 0 when it ran.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
RESULTS="${OUT:-$ROOT/tests/rdma/results}"
mkdir -p "$RESULTS"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY=$(command -v python3 || command -v python)
if ! "$PY" -c "import mooncake_plugins._native.verbs" >/dev/null 2>&1; then
    echo "== building the native modules in place (the verbs module needs them)"
    "$PY" setup.py -q build_ext --inplace -j 8 >"$RESULTS/build.log" 2>&1 \
        || { tail -n 30 "$RESULTS/build.log" >&2; echo "run.sh: the build failed" >&2; exit 3; }
fi
echo "== RDMA devices in /sys/class/infiniband: $(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ' || true)"
timeout 120 "$PY" tests/rdma/check.py --out "$RESULTS/rdma_result.json"
echo "== wrote $RESULTS/rdma_result.json"
echo "== the rdma transport's data path"
timeout 300 "$PY" tests/rdma/datapath.py --out "$RESULTS/rdma_datapath.json"
echo "== wrote $RESULTS/rdma_datapath.json"
