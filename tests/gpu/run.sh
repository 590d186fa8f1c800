#!/usr/bin/env bash
# The prepared GPU check of the CUDA module, for one H100/H200 machine (well under 8 min).
#
# Fetches nothing: it needs a python with pytest, Cython and setuptools (the lent machines'
# image has them, and torch). The native modules are built in place (about a minute) only
# when the copied ones do not import there (another Python, or none built). Then:
#   1. python -m pytest tests/gpu -m cuda   (the root tests/conftest.py is not loaded)
#   2. python tests/gpu/ceilings.py         (D2D, pinned H2D/D2H at 4 and 64 MiB, GB/s)
#   3. python benchmarks/gpu_bench.py       (cuda_ipc and staged tcp/shm against those; one
#      4k-token Llama-8B KV loaded through the store against recomputing it)
# and writes gpu_result.json under $OUT (else tests/gpu/results/), with the pytest summary
# and the figures, plus pytest.log and gpu_bench.json beside it.
# Exit: 0 all passed and measured; 1 a test or check failed; 2 no CUDA here (the reason
# is printed and in the JSON); 3 the build failed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
RESULTS="${OUT:-$ROOT/tests/gpu/results}"
mkdir -p "$RESULTS"
JSON="$RESULTS/gpu_result.json"
LOG="$RESULTS/pytest.log"
export PYTHONPATH="$ROOT:$ROOT/integrations${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
started=$(date +%s)

# A python that has torch if there is one (the torch test then runs too), else any.
PY=""
for candidate in ${PYTHON:-} python3 python; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    [ -z "$PY" ] && PY="$candidate"
    if "$candidate" -c "import torch" >/dev/null 2>&1; then PY="$candidate"; break; fi
done
if [ -z "$PY" ]; then echo "run.sh: no python found" >&2; exit 3; fi
echo "== python: $(command -v "$PY") ($("$PY" -c 'import platform; print(platform.python_version())'))"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

if ! "$PY" -c "import mooncake_plugins._native.cuda, mooncake_plugins._native.buffers" >/dev/null 2>&1; then
    echo "== building the native modules in place"
    if ! "$PY" setup.py -q build_ext --inplace -j 8 >"$RESULTS/build.log" 2>&1; then
        tail -n 30 "$RESULTS/build.log" >&2
        echo "run.sh: the native build failed (log: $RESULTS/build.log)" >&2
        exit 3
    fi
fi

echo "== pytest tests/gpu -m cuda"
set +e
timeout 300 "$PY" -m pytest tests/gpu -m cuda -rs -q -p no:cacheprovider \
    --confcutdir=tests/gpu 2>&1 | tee "$LOG"
pytest_rc=${PIPESTATUS[0]}
set -e

echo "== copy ceilings"
set +e
timeout 180 "$PY" tests/gpu/ceilings.py --out "$JSON" --pytest-rc "$pytest_rc" --pytest-log "$LOG"
rc=$?
set -e
echo "== gpu_bench: cuda_ipc and staged tcp/shm against the copy ceilings"
set +e
timeout 200 "$PY" benchmarks/gpu_bench.py --duration 1 --out "$RESULTS/gpu_bench.json"
bench_rc=$?
set -e
if [ "$rc" -eq 0 ] && [ "$bench_rc" -ne 0 ]; then rc=1; fi
echo "== run.sh done in $(( $(date +%s) - started )) s: exit $rc"
exit "$rc"
