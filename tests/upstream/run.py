"""Run the original Mooncake's own Python tests against a `mooncake` package.

The 21 files: the 16 the original's CI runs on its CPU wheel (scripts/run_tests.sh,
scripts/test_installation.sh and .github/workflows/ci.yml of kvcache-ai/Mooncake) and the
5 accelerator-free test files it does not name there (four of mooncake-wheel/tests and
scripts/test_upsert_api.py);
run the way that CI runs them: the same services (HTTP metadata server on 8080, mooncake_master
with the same flags, the mooncake_client host), ports, environment and arguments. Each file
runs in a network namespace of its own (``unshare --net``: loopback and a veth pair), so the
fixed ports never collide with anything else on the machine and no traffic leaves it.

The original's code is not part of this repository. Its ``mooncake-wheel/tests`` and
``scripts`` at a pinned commit are in ``../shared/upstream/mooncake`` beside the clone (CI
has it; see the README there), the default; ``--src`` or ``MOONCAKE_UPSTREAM_SRC`` name
another copy (e.g. a checkout of kvcache-ai/Mooncake). Both folders are copied to a
temporary directory for the run, so the source stays untouched (it may be read-only).

    python tests/upstream/run.py                        # our package, all 21
    python tests/upstream/run.py -k dummy -v            # a subset, with each file's output
    python tests/upstream/run.py --python /path/to/venv/bin/python   # e.g. the original wheel

Prints a table and writes JSON (``--json``); exits 1 when a file fails (other than those
listed with ``--known-failing``), 3 when no copy of the original's tests is found.
"passed, some skipped" is the test file's own skip (e.g. a CUDA-only case), as on the
original wheel.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_SRC = Path(__file__).resolve().parents[2].parent / "shared" / "upstream" / "mooncake"
SOURCE_DIRS = ("mooncake-wheel/tests", "scripts")  # what the specs below run, under the source
META = "http://127.0.0.1:8080/metadata"
FIXED_PORTS = "8080,9003,50051-50052"   # metadata, master metrics, master RPC, dummy client
# run_tests.sh: every store test gets these
RUN_TESTS_ENV = {"MC_METADATA_SERVER": META, "DEFAULT_KV_LEASE_TTL": "500", "MC_STORE_MEMCPY": "false"}
# ci.yml: the steps after "Start Mooncake Master"
CI_ENV = {"MOONCAKE_MASTER": "127.0.0.1:50051", "MOONCAKE_TE_META_DATA_SERVER": META,
          "MOONCAKE_PROTOCOL": "tcp", "LOCAL_HOSTNAME": "127.0.0.1"}
CI_MASTER = ["--default_kv_lease_ttl=500", "--eviction_high_watermark_ratio=0.95",
             "--cluster_id=ci_test_cluster", "--port", "50051",
             "--enable_http_metadata_server=true"]


@dataclass
class Spec:
    """One upstream test file and what its CI starts around it."""

    name: str
    path: str                       # relative to the upstream checkout
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    metadata_server: bool = False   # mooncake_http_metadata_server --port 8080
    master: list[str] | None = None  # mooncake_master flags, None: no master
    client: bool = False            # mooncake_client (the dummy clients' host)
    runner: str = "script"          # script | pytest | unittest-module
    copies: int = 1                 # concurrent copies, each with its own args
    per_copy_args: list[list[str]] = field(default_factory=list)
    pre: list[str] = field(default_factory=list)   # background helper script before the test
    timeout_s: int = 600


WHEEL = "mooncake-wheel/tests"
SPECS = [
    # scripts/test_installation.sh
    Spec("fast_copy", f"{WHEEL}/test_fast_copy.py"),
    Spec("import_structure", f"{WHEEL}/test_import_structure.py"),
    Spec("mooncake_config", f"{WHEEL}/test_mooncake_config.py"),
    # scripts/run_tests.sh
    Spec("transfer_engine", f"{WHEEL}/transfer_engine_initiator_test.py", metadata_server=True,
         env={"MC_METADATA_SERVER": META, "MC_FORCE_TCP": "true"},
         pre=[f"{WHEEL}/transfer_engine_target.py"]),
    Spec("distributed_object_store", f"{WHEEL}/test_distributed_object_store.py",
         metadata_server=True, master=["--default_kv_lease_ttl=500"], env=RUN_TESTS_ENV),
    Spec("replicated_distributed_object_store",
         f"{WHEEL}/test_replicated_distributed_object_store.py", metadata_server=True,
         master=["--default_kv_lease_ttl=500"], env=RUN_TESTS_ENV),
    Spec("put_get_tensor", f"{WHEEL}/test_put_get_tensor.py", metadata_server=True,
         master=["--default_kv_lease_ttl=500"], env=RUN_TESTS_ENV),
    Spec("safetensor_functions", f"{WHEEL}/test_safetensor_functions.py", metadata_server=True,
         master=["--default_kv_lease_ttl=500"], env=RUN_TESTS_ENV),
    Spec("dummy_client", f"{WHEEL}/test_dummy_client.py", metadata_server=True,
         master=["--default_kv_lease_ttl=500"], client=True, env=RUN_TESTS_ENV),
    Spec("multi_dummy_clients", f"{WHEEL}/test_multi_dummy_clients.py", metadata_server=True,
         master=["--default_kv_lease_ttl=500"], client=True, env=RUN_TESTS_ENV, copies=2,
         per_copy_args=[["--client-id", "client1"], ["--client-id", "client2"]]),
    Spec("ssd_offload_in_evict", f"{WHEEL}/test_ssd_offload_in_evict.py", metadata_server=True,
         master=["--default_kv_lease_ttl=500", "--root_fs_dir=/tmp/mooncake_test_ssd"],
         env=RUN_TESTS_ENV),
    Spec("cli", f"{WHEEL}/test_cli.py", metadata_server=True),
    # .github/workflows/ci.yml
    Spec("tensor_api", "scripts/test_tensor_api.py", args=["-n", "1"], master=CI_MASTER, env=CI_ENV),
    Spec("async_store", "scripts/test_async_store.py", master=CI_MASTER, env=CI_ENV),
    Spec("copy_move_api", "scripts/test_copy_move_api.py", master=CI_MASTER, env=CI_ENV),
    Spec("drain_http_api", "scripts/test_drain_http_api.py", args=["--timeout-sec", "90"],
         master=CI_MASTER, env=CI_ENV),
    Spec("upsert_api", "scripts/test_upsert_api.py", args=["-v"], master=CI_MASTER, env=CI_ENV),
    # pytest/unittest files of mooncake-wheel/tests that need no accelerator
    Spec("buffer_pool_native", f"{WHEEL}/test_buffer_pool_native.py", runner="pytest",
         master=["--default_kv_lease_ttl=500"]),
    Spec("structured_object_store", f"{WHEEL}/test_structured_object_store.py", runner="pytest",
         master=["--default_kv_lease_ttl=500"], metadata_server=True, env=RUN_TESTS_ENV),
    Spec("dataproto_catalog", f"{WHEEL}/test_dataproto_catalog.py", runner="pytest"),
    Spec("http_metadata_server", f"{WHEEL}/test_http_metadata_server.py"),
]


def find_source(src: str | None) -> Path:
    """Where the original's tests are: ``src``, else ``MOONCAKE_UPSTREAM_SRC``, else
    ``../shared/upstream/mooncake`` beside the clone (whether it holds them is
    :func:`missing`'s question)."""
    return Path(src or os.environ.get("MOONCAKE_UPSTREAM_SRC") or DEFAULT_SRC)


def missing(src: Path) -> list[str]:
    """The folders of :data:`SOURCE_DIRS` that ``src`` lacks."""
    return [d for d in SOURCE_DIRS if not (src / d).is_dir()]


def stage(src: Path) -> Path:
    """A writable copy of the test folders (the tests write beside themselves, and so
    does Python's bytecode cache); the caller removes it."""
    out = Path(tempfile.mkdtemp(prefix="mooncake-upstream-"))
    for d in SOURCE_DIRS:
        # files without the source's modes (read-only there); folders get theirs back below
        shutil.copytree(src / d, out / d, ignore=shutil.ignore_patterns("__pycache__"),
                        copy_function=shutil.copyfile)
    for folder, _, _ in os.walk(out):
        os.chmod(folder, 0o755)
    return out


class Services:
    """Background processes of one test; all are killed (with their groups) on exit."""

    def __init__(self, bindir: Path, logdir: Path) -> None:
        self.bindir, self.logdir, self.procs = bindir, logdir, []

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: Path,
              port: int | None = None) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        log.close()
        self.procs.append(proc)
        if port is not None:
            deadline = time.monotonic() + 30
            while not _listening(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not listen on {port}: "
                                       + (self.logdir / f"{name}.log").read_text()[-2000:])
                time.sleep(0.05)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 15)
                except ProcessLookupError:
                    pass
        for proc in reversed(self.procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def _listening(port: int) -> bool:
    import socket
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def run_inner(spec: Spec, src: Path, python: str, logdir: Path) -> tuple[int, str]:
    """Inside the test's own network namespace: services, then the test file(s)."""
    bindir = Path(python).parent
    env = {**os.environ, **spec.env, "PATH": f"{bindir}:{os.environ['PATH']}",
           "PYTHONUNBUFFERED": "1"}
    cwd = src / Path(spec.path).parent
    services = Services(bindir, logdir)
    try:
        if spec.metadata_server:
            services.start("metadata", [str(bindir / "mooncake_http_metadata_server"),
                                        "--port", "8080"], env, cwd, port=8080)
        if spec.master is not None:
            if any("root_fs_dir" in f for f in spec.master):
                Path("/tmp/mooncake_test_ssd").mkdir(exist_ok=True)
            services.start("master", [str(bindir / "mooncake_master"), *spec.master], env, cwd,
                           port=50051)
        if spec.client:
            services.start("client", [str(bindir / "mooncake_client")], env, cwd, port=50052)
        for i, pre in enumerate(spec.pre):
            services.start(f"pre{i}", [python, str(src / pre)], env, cwd)
            time.sleep(2)
        file = str(src / spec.path)
        if spec.runner == "pytest":
            cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", file, *spec.args]
        else:
            cmd = [python, file, *spec.args]
        argvs = [cmd + extra for extra in spec.per_copy_args] if spec.copies > 1 else [cmd]
        procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                  cwd=cwd, start_new_session=True) for a in argvs]
        outputs, rc = [], 0
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=spec.timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                out, _ = proc.communicate()
                out += f"\n[run.py] timed out after {spec.timeout_s} s\n".encode()
            outputs.append(out.decode(errors="replace"))
            rc = rc or proc.returncode
        return rc, "\n".join(outputs)
    finally:
        services.stop()


def summarize(rc: int, output: str) -> str:
    """passed / failed / passed with N skipped, from the exit code and the runner's words
    (unittest: ``OK (skipped=N)``; pytest: ``N skipped``)."""
    if rc != 0:
        return "failed"
    skipped = sum(int(n) for n in re.findall(r"skipped=(\d+)|(\d+) skipped", output[-3000:])
                  for n in n if n)
    return f"passed, {skipped} skipped" if skipped else "passed"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", help="a checkout of kvcache-ai/Mooncake, or any folder with its "
                                  "mooncake-wheel/tests and scripts (default: "
                                  "../shared/upstream/mooncake beside the clone)")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter whose environment has the mooncake package and its CLIs")
    ap.add_argument("-k", dest="only", default="", help="comma-separated name substrings")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each file's output")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("-j", "--jobs", type=int, default=1,
                    help="files run at once, each in its own namespace and its own copy of "
                         "the tests (default 1)")
    ap.add_argument("--known-failing", default="",
                    help="file of 'name: reason' lines; those files may fail without failing "
                         "the run (CI uses tests/upstream/known_failing.txt)")
    ap.add_argument("--inner", default="", help=argparse.SUPPRESS)
    ap.add_argument("--logdir", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.python = os.path.abspath(a.python)  # not resolved: a venv's python is a symlink

    if a.inner:  # already inside the namespace
        spec = next(s for s in SPECS if s.name == a.inner)
        rc, out = run_inner(spec, Path(a.src), a.python, Path(a.logdir))
        sys.stdout.write(out)
        return rc

    src = find_source(a.src)
    if missing(src):
        print(f"upstream tests: NOT RUN: {src} lacks {', '.join(missing(src))} (the default is "
              f"../shared/upstream/mooncake beside the clone; --src or MOONCAKE_UPSTREAM_SRC "
              f"name another copy)", file=sys.stderr)
        return 3
    wanted = [s for s in SPECS if not a.only or any(k in s.name for k in a.only.split(","))]
    if not wanted:
        print(f"upstream tests: -k {a.only!r} names none of: "
              f"{', '.join(s.name for s in SPECS)}", file=sys.stderr)
        return 2
    if a.jobs < 1:
        print(f"upstream tests: --jobs must be at least 1, not {a.jobs}", file=sys.stderr)
        return 2
    return _run_all(a, wanted, src)


def _run_all(a: argparse.Namespace, wanted: list[Spec], src: Path) -> int:
    """Each spec in a network namespace of its own, ``a.jobs`` at a time; the table (a
    line per file as it ends), then the exit status."""
    with ThreadPoolExecutor(a.jobs) as pool:
        results = list(pool.map(lambda spec: _run_one(a, spec, src), wanted))
    known = _known_failing(a.known_failing)
    passed = [r["name"] for r in results if r["status"] != "failed"]
    failed = [r["name"] for r in results if r["status"] == "failed"]
    print(f"\n{len(passed)} of {len(results)} upstream test files passed")
    for name in failed:
        print(f"  failed: {name}" + (f" (known: {known[name]})" if name in known else ""))
    for name in passed:
        if name in known:
            print(f"  {name} passes now: remove it from {a.known_failing}")
    if a.json:
        Path(a.json).write_text(json.dumps({"python": a.python, "results": results}, indent=1))
    return 1 if any(name not in known for name in failed) else 0


_print_lock = threading.Lock()


def _run_one(a: argparse.Namespace, spec: Spec, src: Path) -> dict:
    """One spec in a network namespace of its own, on a copy of the tests of its own
    (they write beside themselves); its result line, and its output where it failed."""
    staged = stage(src)
    logdir = Path(tempfile.mkdtemp(prefix=f"mooncake-upstream-{spec.name}-"))
    try:
        inner = [sys.executable, __file__, "--inner", spec.name, "--src", str(staged),
                 "--python", a.python, "--logdir", str(logdir)]
        # loopback, plus a veth pair with a private address (both ends inside): the
        # original's engine wants one non-loopback address; nothing leaves the namespace.
        # The services' fixed ports are reserved there: an ephemeral port (a connection's
        # local end) once took 50052 before the client could listen on it
        shell = (f"echo {FIXED_PORTS} > /proc/sys/net/ipv4/ip_local_reserved_ports && "
                 "ip link set lo up && ip link add mc0 type veth peer name mc1 && "
                 "ip addr add 10.213.0.1/24 dev mc0 && ip link set mc0 up && "
                 "ip link set mc1 up && exec "
                 + " ".join(map(_quote, inner)))
        start = time.monotonic()
        proc = subprocess.run(["unshare", "--net", "--", "sh", "-c", shell],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        seconds = time.monotonic() - start
        output = proc.stdout.decode(errors="replace")
        status = summarize(proc.returncode, output)
        shown = ""
        if a.verbose or proc.returncode != 0:
            shown = output[-(8000 if a.verbose else 3000):]
            for log in sorted(logdir.glob("*.log")) if proc.returncode != 0 else []:
                shown += f"\n--- {log.name} (tail) ---\n" + log.read_text(errors="replace")[-800:]
            shown = "    " + shown.replace("\n", "\n    ") + "\n"
        with _print_lock:
            print(f"{spec.name:38} {status:22} {seconds:7.1f} s\n{shown}", end="", flush=True)
        return {"name": spec.name, "file": spec.path, "status": status,
                "rc": proc.returncode, "seconds": round(seconds, 1)}
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
        shutil.rmtree(staged, ignore_errors=True)


def _known_failing(path: str) -> dict[str, str]:
    """``name: reason`` per line; blank lines and # comments are skipped."""
    if not path:
        return {}
    known = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, reason = line.partition(":")
            known[name.strip()] = reason.strip()
    return known


def _quote(text: str) -> str:
    import shlex
    return shlex.quote(text)


if __name__ == "__main__":
    sys.exit(main())
