"""A TEST DOUBLE of libibverbs, standing in for an RDMA device on machines that have none (CI).

``verbs_double.c`` is a small C library exporting the part of the libibverbs ABI the RDMA
transport uses, compiled against ``native/verbs_abi.h`` as the verbs module is (our
declarations of the ABI, compared with rdma-core's header by ``test_verbs_abi.py``), so it
builds wherever a C compiler does; ``library()`` builds it as ``libibverbs.so.1`` and
``environment()`` gives the variables that make a process load it (``MOONCAKE_LIBIBVERBS``)
and configure it.

What it models: devices with one active RoCE (Ethernet) port and two GIDs; PDs, MRs with
random rkeys, CQs, RC queue pairs and their state machine (RESET, INIT, RTR, RTS, ERR) with
the IB spec's attribute masks; RDMA WRITE and READ between processes of one host, run at once
inside ``ibv_post_send`` with process_vm_writev/readv; lkey, rkey, range and access checks;
error completions (LOC_PROT_ERR, REM_ACCESS_ERR, RETRY_EXC_ERR for a dead or unready peer),
the QP going to ERR and flushing what follows; send-queue depth (ENOMEM); revocation of an
rkey when its MR is deregistered; an injected link failure (``VERBS_DOUBLE_FAIL_AFTER=n``);
a live-object count (``verbs_double_live()``) for leak checks. Processes of one test find each
other's MRs and QPs as files in a shared state directory (``VERBS_DOUBLE_DIR``).

What it does not model: a network (no packets, latency, bandwidth, PSNs, retries or
timeouts: a request completes before ``ibv_post_send`` returns), other hosts, SEND/RECV,
atomics, inline data, SRQs, completion channels, async events, dmabuf MRs (always
EOPNOTSUPP), memory pinning, GPU memory. Passing tests here prove the transport's logic,
not RDMA: tests/rdma runs on real hardware.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCE = Path(__file__).with_name("verbs_double.c")
NATIVE = Path(__file__).resolve().parents[2] / "native"   # verbs_abi.h
_lock = threading.Lock()


def library() -> str:
    """Path of the built double (``libibverbs.so.1``), compiling it on first use.

    The build is cached under the system temp directory, keyed by a hash of the C source
    and the ABI header, and published atomically (compiled under a temporary name, then renamed), so parallel
    test processes can call this at once. Raises RuntimeError when it cannot be built."""
    source = SOURCE.read_bytes() + (NATIVE / "verbs_abi.h").read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    out_dir = Path(tempfile.gettempdir()) / f"verbs-double-{os.getuid()}-{digest}"
    lib = out_dir / "libibverbs.so.1"
    with _lock:
        if lib.exists():
            return str(lib)
        out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = out_dir / f".libibverbs.so.1.{os.getpid()}.{threading.get_ident()}"
        cmd = [os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O2", "-Wall", "-Werror",
               f"-I{NATIVE}", "-o", str(tmp), str(SOURCE)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"cannot build the libibverbs test double: {exc}") from exc
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"cannot build the libibverbs test double ({' '.join(cmd)}):\n"
                               f"{done.stderr.strip()}")
        os.replace(tmp, lib)
        return str(lib)


def environment(state_dir: str, devices: str = "double0") -> dict[str, str]:
    """Environment variables for a process that should use the double: the library to load,
    the state directory shared by all processes of one test (created here if missing), and
    the device names (comma-separated; "" means no device)."""
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    return {"MOONCAKE_LIBIBVERBS": library(), "VERBS_DOUBLE_DIR": str(state_dir),
            "VERBS_DOUBLE_DEVICES": devices}


def _read_record(path: str | os.PathLike, kind: str) -> dict[str, int] | None:
    try:
        words = Path(path).read_text().split()
    except OSError:  # revoked (deregistered / destroyed) meanwhile
        return None
    if words[:2] != ["verbs-double", kind]:
        return None
    return {key: int(value, 0) for key, _, value in (w.partition("=") for w in words[2:])}


def read_mr(path: str | os.PathLike) -> dict[str, int] | None:
    """A published memory region (a state directory's ``mr-<rkey as 8 hex digits>`` file) as
    {"pid", "addr", "length", "access"}, or None when it is gone or not a record."""
    return _read_record(path, "mr")


def read_qp(path: str | os.PathLike) -> dict[str, int] | None:
    """A published queue pair (``qp-<qpn as 6 hex digits>``) as {"pid", "dev", "state"
    (enum ibv_qp_state: 0 RESET, 1 INIT, 2 RTR, 3 RTS, 6 ERR), "dest_qpn", "access"}, or None."""
    return _read_record(path, "qp")
