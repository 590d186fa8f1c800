"""Copy ceilings of this GPU through our CUDA module; writes the one JSON of tests/gpu/run.sh.

D2D, pinned H2D and pinned D2H copies at 4 MiB and 64 MiB, timed with CUDA events on one
of our streams: a warm-up, then five trials of N back-to-back copies, the median reported
in GB/s (10**9 bytes copied per second; a D2D copy reads and writes each byte, so the
memory traffic is twice its figure). The bytes of each direction are checked once.

Usage: python tests/gpu/ceilings.py --out result.json [--pytest-rc N --pytest-log FILE]
Exit: 0 measured, 1 a check or the pytest run failed, 2 no CUDA here (the JSON says why).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mooncake_plugins.transfer import cuda  # noqa: E402

MIB = 1 << 20
SIZES = ((4 * MIB, 200), (64 * MIB, 40))  # (nbytes, copies per trial)
TRIALS = 5


def _pattern(nbytes: int) -> bytes:
    block = bytes((i * 131 + 7) % 251 for i in range(4096))
    return (block * (nbytes // 4096 + 1))[:nbytes]


def _measure(stream: cuda.Stream, dst: int, src: int, nbytes: int, copies: int) -> float:
    """Median GB/s over TRIALS of ``copies`` copies between two events."""
    with cuda.Event(stream.device, timing=True) as start, cuda.Event(stream.device, timing=True) as end:
        for _ in range(3):
            cuda.copy_async(dst, src, nbytes, stream)
        stream.synchronize()
        rates = []
        for _ in range(TRIALS):
            start.record(stream)
            for _ in range(copies):
                cuda.copy_async(dst, src, nbytes, stream)
            end.record(stream)
            end.synchronize()
            ms = start.elapsed_ms(end)
            rates.append(nbytes * copies / (ms / 1e3) / 1e9)
    return statistics.median(rates)


def measure_all() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    largest = max(n for n, _ in SIZES)
    src = cuda.pinned_buffer(largest)
    dst = cuda.pinned_buffer(largest)
    try:
        with memoryview(src) as view:
            view[:] = _pattern(largest)
        with cuda.DeviceBuffer(largest) as a, cuda.DeviceBuffer(largest) as b, cuda.Stream() as s:
            for nbytes, copies in SIZES:
                expected = _pattern(largest)[:nbytes]
                # (op, destination, source, device memory whose bytes show the result)
                for op, to, frm, shows in (("h2d_pinned", a.address, src.address, a.address),
                                           ("d2d", b.address, a.address, b.address),
                                           ("d2h_pinned", dst.address, b.address, b.address)):
                    gbps = _measure(s, to, frm, nbytes, copies)
                    with memoryview(dst) as view:
                        view[:nbytes] = bytes(nbytes)
                    cuda.copy_async(dst.address, shows, nbytes, s)
                    s.synchronize()
                    with memoryview(dst) as view:
                        ok = bytes(view[:nbytes]) == expected
                    rows.append({"op": op, "nbytes": nbytes, "copies": copies, "trials": TRIALS,
                                 "gb_per_s": round(gbps, 2), "bytes_ok": ok})
    finally:
        src.close()
        dst.close()
    return rows


def _pytest_part(rc: int | None, log: str | None) -> dict[str, object]:
    summary = ""
    if log and os.path.exists(log):
        lines = [ln.strip() for ln in Path(log).read_text(errors="replace").splitlines() if ln.strip()]
        summary = lines[-1] if lines else ""
    return {"rc": rc, "summary": summary, "log": log}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    parser.add_argument("--pytest-rc", type=int, default=None)
    parser.add_argument("--pytest-log", default=None)
    args = parser.parse_args(argv)
    began = time.monotonic()
    result: dict[str, object] = {
        "script": "tests/gpu/run.sh",
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "cuda_module": cuda.IMPLEMENTATION,
        "pytest": _pytest_part(args.pytest_rc, args.pytest_log),
    }
    code = 0
    if not cuda.available():
        result["cuda"] = {"available": False, "reason": cuda.why_unavailable()}
        result["ceilings"] = []
        code = 2
    else:
        info = cuda.driver_info()
        result["cuda"] = {"available": True, "driver_path": info.path,
                          "driver_version": info.version, "devices": info.device_count,
                          "device": cuda.device_name(0), "bus_id": cuda.device_pci_bus_id(0)}
        try:
            rows = measure_all()
        except Exception as exc:  # keep the JSON: the failure is the result
            result["ceilings"] = []
            result["error"] = f"{type(exc).__name__}: {exc}"
            code = 1
        else:
            result["ceilings"] = rows
            if not all(r["bytes_ok"] for r in rows):
                code = 1
    if code == 0 and args.pytest_rc not in (None, 0):
        code = 1
    result["ok"] = code == 0
    result["wall_s"] = round(time.monotonic() - began, 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    cuda_part = result["cuda"]
    assert isinstance(cuda_part, dict)
    if cuda_part["available"]:
        print(f"{cuda_part['device']} ({cuda_part['bus_id']}), driver {cuda_part['driver_version']}")
        print(f"{'copy':<12} {'size':>8} {'GB/s':>9}  bytes")
        for row in result["ceilings"]:  # type: ignore[union-attr]
            print(f"{row['op']:<12} {row['nbytes'] // MIB:>5} MiB {row['gb_per_s']:>9.2f}  "
                  f"{'ok' if row['bytes_ok'] else 'WRONG'}")
        if "error" in result:
            print("ceilings failed:", result["error"])
    else:
        print(f"CUDA unavailable: {cuda_part['reason']}")
    print(f"pytest: {result['pytest']['summary'] or 'not run'}")  # type: ignore[index]
    print(f"result: {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
