"""CUDA without a GPU: clear sentences instead of crashes, and the logic around the driver.

Three kinds of test, none of which proves CUDA itself (tests/gpu/ does, on a GPU):
- the real module on this machine (no driver here, or one without devices): import loads
  nothing, ``available()`` is False with one sentence, CUDA tensors and device pointers
  are clear InvalidArgument errors;
- ``fake_libcuda``: a TEST DOUBLE of libcuda.so.1 written in C below (host malloc plays
  device memory), loaded through MOONCAKE_LIBCUDA in a child process. It proves our
  dlopen/dlsym glue, argument passing, error formatting and context save/restore;
- ``FakeCudaDriver``: a Python TEST DOUBLE of the driver module, for the IPC cache logic.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from helpers import skip_or_fail

from mooncake_plugins.errors import InvalidArgument
from mooncake_plugins.transfer import cuda, memory

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (the driver is opened once per process)."""
    full = {k: v for k, v in os.environ.items()
            if k not in ("MOONCAKE_LIBCUDA", "MOONCAKE_PUREPYTHON", "FAKE_CUDA_DEVICES")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=60)


def _why(**env: str) -> str:
    proc = _run("from mooncake_plugins.transfer import cuda\n"
                "print(cuda.available(), cuda.why_unavailable(), sep='|')", **env)
    assert proc.returncode == 0, proc.stderr
    available, why = proc.stdout.strip().split("|", 1)
    assert available == "False"
    return why


# -- the real module on this machine -----------------------------------------------------------

@pytest.fixture(scope="module")
def no_cuda() -> str:
    """This machine's reason CUDA is off; skips the module's no-CUDA tests on a GPU host."""
    if cuda.available():
        pytest.skip("CUDA works on this machine: tests/gpu covers it")
    return cuda.why_unavailable()


def test_unavailable_is_one_sentence(no_cuda: str) -> None:
    assert no_cuda.startswith(("no CUDA driver (", "no CUDA device (",
                               "CUDA needs the native build ("))
    assert no_cuda.endswith(")") and "\n" not in no_cuda
    with pytest.raises(cuda.CudaUnavailable, match=r"^(no CUDA|CUDA needs)"):
        cuda.Stream()
    with pytest.raises(cuda.CudaUnavailable):
        cuda.pinned_buffer(4096)
    with pytest.raises(cuda.CudaUnavailable):
        cuda.driver_info()


def test_explicit_library_missing() -> None:
    why = _why(MOONCAKE_LIBCUDA="/nonexistent/libcuda.so.1")
    assert why.startswith("no CUDA driver (libcuda.so.1 not found: "
                          "MOONCAKE_LIBCUDA=/nonexistent/libcuda.so.1: ")
    assert "No such file" in why


def test_explicit_library_not_cuda() -> None:
    libc = next((p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/lib/aarch64-linux-gnu/libc.so.6",
                             "/lib64/libc.so.6", "/usr/lib/libc.so.6") if os.path.exists(p)), None)
    if libc is None:
        pytest.skip("no libc.so.6 at a known path")
    why = _why(MOONCAKE_LIBCUDA=libc)
    assert why == (f"no CUDA driver (MOONCAKE_LIBCUDA={libc} is not a CUDA driver: "
                   "symbol cuInit missing)")


def test_pure_python_mode_has_no_cuda() -> None:
    why = _why(MOONCAKE_PUREPYTHON="1")
    assert why == ("CUDA needs the native build (MOONCAKE_PUREPYTHON=1 selects the pure-Python "
                   "data path, which has no CUDA)")


def test_host_memory_is_host_without_cuda(no_cuda: str) -> None:
    buf = bytearray(8192)
    address, nbytes = memory.address_of(buf)
    info = cuda.pointer_info(address)
    assert (info.kind, info.device, info.location) == ("host", -1, "cpu")
    assert memory.kind_of(address, nbytes) == "host"
    assert memory.location_of(address, nbytes) == "cpu"
    assert memory.resolve_location(address, nbytes, "*") == "cpu"
    assert memory.resolve_location(address, nbytes, "cpu:1") == "cpu:1"
    with pytest.raises(InvalidArgument, match="is host memory, registered as 'cuda:0'"):
        memory.resolve_location(address, nbytes, "cuda:0")
    with pytest.raises(InvalidArgument, match="bad location"):
        memory.resolve_location(address, nbytes, "gpu0")


def test_device_pointer_without_cuda_is_an_error(no_cuda: str) -> None:
    # A typical CUDA virtual address: nothing is mapped there in a process without CUDA.
    for address in (0x7F00_0000_0000, 0x2_0000_0000, 8):
        with pytest.raises(InvalidArgument, match="not readable memory of this process"):
            memory.kind_of(address, 1 << 20)
    with pytest.raises(InvalidArgument, match="bad address"):
        memory.kind_of(-1)
    with pytest.raises(InvalidArgument, match="bad address"):
        cuda.pointer_info(1 << 64)


class _FakeCudaTensor:
    """Looks like a torch CUDA tensor to code that does not import torch."""

    is_cuda = True

    def __init__(self, device: object) -> None:
        self.device = device

    def data_ptr(self) -> int:
        return 0x7F00_0000_0000

    def is_contiguous(self) -> bool:
        return True

    def numel(self) -> int:
        return 1024

    def element_size(self) -> int:
        return 2


class _Device:
    def __init__(self, type_: str, index: int | None) -> None:
        self.type, self.index = type_, index


@pytest.mark.parametrize("device", ["cuda:1", _Device("cuda", 1), None])
def test_cuda_tensor_without_cuda_is_an_error(no_cuda: str, device: object) -> None:
    tensor = _FakeCudaTensor(device)
    index = 0 if device is None else 1
    expected = f"a CUDA tensor (cuda:{index}) needs CUDA, and {no_cuda}"
    with pytest.raises(InvalidArgument) as err:
        memory.address_of(tensor)
    assert str(err.value) == expected
    with pytest.raises(InvalidArgument) as err:
        memory.tensor_location(tensor)
    assert str(err.value) == expected


def test_other_device_tensors_keep_the_refusal() -> None:
    tensor = _FakeCudaTensor(_Device("mps", 0))
    tensor.is_cuda = False
    with pytest.raises(InvalidArgument, match="GPU tensors need the cuda_ipc transport"):
        memory.address_of(tensor)
    with pytest.raises(InvalidArgument, match="mps tensors are not supported"):
        memory.tensor_location(tensor)


def test_in_process_switch_to_pure_python_and_back(no_cuda: str) -> None:
    before = cuda.IMPLEMENTATION
    try:
        cuda.use(False)
        assert not cuda.available()
        assert cuda.why_unavailable().startswith("CUDA needs the native build (")
    finally:
        cuda.use(before == "native")
    assert cuda.why_unavailable() == no_cuda


# -- fake_libcuda: a C test double of the driver -----------------------------------------------

FAKE_LIBCUDA_C = r"""
/* fake_libcuda: a TEST DOUBLE of libcuda.so.1 for test_cuda_deviceless.py.
   Host malloc plays device memory. FAKE_CUDA_DEVICES: -1 = cuInit fails (no device),
   N = N devices (default 1). It proves the caller's glue, not CUDA. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;

static int devices, inited;
static char contexts[8];
static __thread void *current;
struct alloc { uintptr_t base; size_t n; int type, dev, owned; };
static struct alloc allocs[256];

static struct alloc *find(uintptr_t p) {
    for (int i = 0; i < 256; i++)
        if (allocs[i].n && p >= allocs[i].base && p < allocs[i].base + allocs[i].n) return &allocs[i];
    return NULL;
}
static int add(uintptr_t base, size_t n, int type, int owned) {
    for (int i = 0; i < 256; i++)
        if (!allocs[i].n) {
            allocs[i].base = base; allocs[i].n = n; allocs[i].type = type; allocs[i].owned = owned;
            allocs[i].dev = current ? (int)((char *)current - contexts) : 0;
            return 0;
        }
    return 2;
}
static const char *name_of(CUresult e) {
    switch (e) {
    case 0: return "CUDA_SUCCESS"; case 1: return "CUDA_ERROR_INVALID_VALUE";
    case 2: return "CUDA_ERROR_OUT_OF_MEMORY"; case 3: return "CUDA_ERROR_NOT_INITIALIZED";
    case 100: return "CUDA_ERROR_NO_DEVICE"; case 101: return "CUDA_ERROR_INVALID_DEVICE";
    case 201: return "CUDA_ERROR_INVALID_CONTEXT"; case 600: return "CUDA_ERROR_NOT_READY";
    default: return NULL;
    }
}
static const char *text_of(CUresult e) {
    switch (e) {
    case 0: return "no error"; case 1: return "invalid argument"; case 2: return "out of memory";
    case 3: return "initialization error"; case 100: return "no CUDA-capable device is detected";
    case 101: return "invalid device ordinal"; case 201: return "invalid device context";
    case 600: return "device not ready"; default: return NULL;
    }
}
#define NEED_CTX if (!current) return 201

CUresult cuInit(unsigned f) {
    const char *e = getenv("FAKE_CUDA_DEVICES");
    devices = e ? atoi(e) : 1;
    if (devices < 0) return 100;
    inited = 1; return 0;
}
CUresult cuDriverGetVersion(int *v) { *v = 12080; return 0; }
CUresult cuGetErrorName(CUresult e, const char **s) { *s = name_of(e); return *s ? 0 : 1; }
CUresult cuGetErrorString(CUresult e, const char **s) { *s = text_of(e); return *s ? 0 : 1; }
CUresult cuDeviceGetCount(int *c) { if (!inited) return 3; *c = devices; return 0; }
CUresult cuDeviceGet(int *d, int o) { if (o < 0 || o >= devices) return 101; *d = o; return 0; }
CUresult cuDeviceGetName(char *n, int len, int d) { snprintf(n, len, "Fake CUDA Device %d", d); return 0; }
CUresult cuDeviceGetPCIBusId(char *b, int len, int d) { snprintf(b, len, "0000:%02X:00.0", 0x18 + d); return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { *c = &contexts[d]; return 0; }
CUresult cuCtxGetCurrent(void **c) { *c = current; return 0; }
CUresult cuCtxSetCurrent(void *c) { current = c; return 0; }
CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, CUdeviceptr p) {
    NEED_CTX;  /* stricter than CUDA: exercises the caller's retry in a context */
    struct alloc *a = find(p);
    if (!a) return 0;  /* unknown pointer: results stay zero, as CUDA documents */
    for (unsigned i = 0; i < n; i++) {
        switch (attrs[i]) {
        case 2: *(unsigned *)data[i] = a->type; break;
        case 9: *(int *)data[i] = a->dev; break;
        case 8: *(unsigned char *)data[i] = 0; break;
        case 11: *(CUdeviceptr *)data[i] = a->base; break;
        case 12: *(size_t *)data[i] = a->n; break;
        case 10: *(unsigned char *)data[i] = a->type == 2; break;
        }
    }
    return 0;
}
CUresult cuMemGetAddressRange_v2(CUdeviceptr *b, size_t *n, CUdeviceptr p) {
    NEED_CTX; struct alloc *a = find(p);
    if (!a || a->type != 2) return 1;
    *b = a->base; *n = a->n; return 0;
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    NEED_CTX; if (n == 0) return 1; if (n > ((size_t)1 << 32)) return 2;
    void *m = malloc(n); *p = (uintptr_t)m; return add((uintptr_t)m, n, 2, 1);
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    NEED_CTX; struct alloc *a = find(p);
    if (!a || a->base != p || a->type != 2) return 1;
    free((void *)a->base); a->n = 0; return 0;
}
CUresult cuMemHostAlloc(void **p, size_t n, unsigned f) {
    NEED_CTX; *p = malloc(n); return add((uintptr_t)*p, n, 1, 1);
}
CUresult cuMemFreeHost(void *p) {
    NEED_CTX; struct alloc *a = find((uintptr_t)p);
    if (!a || !a->owned) return 1;
    free(p); a->n = 0; return 0;
}
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned f) { NEED_CTX; return add((uintptr_t)p, n, 1, 0); }
CUresult cuMemHostUnregister(void *p) {
    NEED_CTX; struct alloc *a = find((uintptr_t)p);
    if (!a || a->owned) return 1;
    a->n = 0; return 0;
}
CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    NEED_CTX; struct alloc *a = find(p);
    if (!a || a->type != 2 || a->base != p) return 1;
    memset(h, 0, sizeof *h); memcpy(h->reserved, "FAKEIPC", 8); memcpy(h->reserved + 8, &p, 8);
    return 0;
}
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
    NEED_CTX; if (memcmp(h.reserved, "FAKEIPC", 8) || flags != 1) return 1;
    memcpy(p, h.reserved + 8, 8); return 0;
}
CUresult cuIpcCloseMemHandle(CUdeviceptr p) { NEED_CTX; return 0; }
CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { NEED_CTX; memmove((void *)d, (void *)s, n); return 0; }
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) {
    NEED_CTX; if (!st) return 1; memmove((void *)d, (void *)s, n); return 0;
}
CUresult cuStreamCreate(void **s, unsigned f) { NEED_CTX; if (f != 1) return 1; *s = malloc(1); return 0; }
CUresult cuStreamDestroy_v2(void *s) { NEED_CTX; free(s); return 0; }
CUresult cuStreamSynchronize(void *s) { NEED_CTX; return 0; }
CUresult cuStreamQuery(void *s) { NEED_CTX; return 0; }
CUresult cuStreamWaitEvent(void *s, void *e, unsigned f) { NEED_CTX; return 0; }
CUresult cuEventCreate(void **e, unsigned f) { NEED_CTX; *e = calloc(1, 1); return 0; }
CUresult cuEventDestroy_v2(void *e) { NEED_CTX; free(e); return 0; }
CUresult cuEventRecord(void *e, void *s) { NEED_CTX; *(char *)e = 1; return 0; }
CUresult cuEventSynchronize(void *e) { NEED_CTX; *(char *)e = 0; return 0; }
CUresult cuEventQuery(void *e) { NEED_CTX; return *(char *)e ? 600 : 0; }
CUresult cuEventElapsedTime_v2(float *ms, void *a, void *b) { NEED_CTX; *ms = 1.5f; return 0; }

/* test hooks, not CUDA */
void *fake_current(void) { return current; }
void *fake_context(int d) { return &contexts[d]; }
"""


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Build the C test double once; its path (named like the real one)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        skip_or_fail("no C compiler (cc/gcc) to build the fake_libcuda test double")
    folder = tmp_path_factory.mktemp("fake_libcuda")
    source = folder / "fake_libcuda.c"
    source.write_text(FAKE_LIBCUDA_C)
    library = folder / "libcuda.so.1"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(source)],
                   check=True, capture_output=True, timeout=120)
    return str(library)


def _native_built() -> None:
    if cuda.IMPLEMENTATION != "native":
        pytest.skip("the native cuda module is not in use (MOONCAKE_PUREPYTHON=1 or no build)")


def test_fake_driver_without_devices(fake_libcuda: str) -> None:
    _native_built()
    why = _why(MOONCAKE_LIBCUDA=fake_libcuda, FAKE_CUDA_DEVICES="-1")
    assert why == ("no CUDA device (cuInit: CUDA_ERROR_NO_DEVICE (no CUDA-capable device is "
                   f"detected); driver {fake_libcuda})")
    why = _why(MOONCAKE_LIBCUDA=fake_libcuda, FAKE_CUDA_DEVICES="0", CUDA_VISIBLE_DEVICES="")
    assert why == (f"no CUDA device (driver 12080 at {fake_libcuda} sees 0 devices; "
                   "CUDA_VISIBLE_DEVICES='')")


def test_import_loads_no_driver(fake_libcuda: str) -> None:
    _native_built()
    proc = _run("""
        from mooncake_plugins.transfer import cuda, memory, engine
        memory.kind_of(*memory.address_of(bytearray(64)))
        maps = open('/proc/self/maps').read()
        print(cuda.driver_in_process(), 'libcuda' in maps)
        cuda.available()
        maps = open('/proc/self/maps').read()
        print(cuda.driver_in_process(), 'libcuda' in maps)
    """, MOONCAKE_LIBCUDA=fake_libcuda)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "True", "True"]


def test_forked_child_reports_cuda_unavailable(fake_libcuda: str) -> None:
    _native_built()
    proc = _run("""
        import os, sys
        from mooncake_plugins.transfer import cuda
        assert cuda.available()
        pid = os.fork()
        if pid == 0:
            print(cuda.available(), cuda.why_unavailable(), sep="|")
            sys.stdout.flush()
            os._exit(0)
        os.waitpid(pid, 0)
        print(cuda.available())
    """, MOONCAKE_LIBCUDA=fake_libcuda)
    assert proc.returncode == 0, proc.stderr
    child, parent = proc.stdout.strip().splitlines()
    assert child == ("False|no CUDA device (CUDA was initialised before this process was "
                     "forked, and a forked child cannot use it: start it with the 'spawn' method)")
    assert parent == "True"


FAKE_SESSION = """
import ctypes, json, threading
from mooncake_plugins.errors import InvalidArgument
from mooncake_plugins.transfer import cuda, memory

out = {}
lib = ctypes.CDLL(cuda.library_candidates()[0])  # the same loaded double: its test hooks
lib.fake_current.restype = ctypes.c_void_p
lib.fake_context.restype = ctypes.c_void_p
lib.fake_context.argtypes = [ctypes.c_int]
lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]

info = cuda.driver_info()
out["driver"] = [info.version, info.device_count, cuda.device_name(1), cuda.device_pci_bus_id(1)]

dev = cuda.DeviceBuffer(1 << 20, device=1)
p = cuda.pointer_info(dev.address + 4096)
out["device_ptr"] = [p.kind, p.device, p.base == dev.address, p.nbytes, p.ipc_capable, p.location]
out["current_after"] = lib.fake_current()  # no context before: none after
out["kind"] = [memory.kind_of(dev.address, 1 << 20), memory.location_of(dev.address),
               memory.resolve_location(dev.address, 4096, "cuda"),
               memory.resolve_location(dev.address, 4096, "*")]
errors = []
for args in ((dev.address, 4096, "cpu"), (dev.address, 4096, "cuda:0"),
             (dev.address, 2 << 20, "*")):
    try:
        memory.resolve_location(*args)
    except InvalidArgument as exc:
        errors.append(str(exc))
out["location_errors"] = errors

# the caller's current context survives a call on another device
lib.cuCtxSetCurrent(lib.fake_context(0))
extra = cuda.DeviceBuffer(64, device=1)
out["current_kept"] = lib.fake_current() == lib.fake_context(0)
extra.close()

host = bytearray(b"x" * 4096)
haddr, _ = memory.address_of(host)
hp = cuda.pointer_info(haddr)
out["host_ptr"] = [hp.kind, hp.pinned]

pinned = cuda.pinned_buffer(8192)
pp = cuda.pointer_info(pinned.address)
out["pinned_ptr"] = [pp.kind, pp.pinned, pp.nbytes]
view = memoryview(pinned)
view[:5] = b"hello"
try:
    pinned.close()
    out["close_with_view"] = "closed"
except BufferError as exc:
    out["close_with_view"] = str(exc)
view.release()

with cuda.Stream(device=1) as stream, cuda.Event(1, timing=True) as start, \\
        cuda.Event(1, timing=True) as end:
    start.record(stream)
    cuda.copy_async(dev.address, pinned.address, 5, stream)
    cuda.copy_async(pinned.address + 100, dev.address, 5, stream)
    end.record(stream)
    out["event_query_before"] = end.query()
    end.synchronize()
    out["event_query_after"] = end.query()
    out["elapsed"] = start.elapsed_ms(end)
    stream.synchronize()
    out["stream_query"] = stream.query()
out["roundtrip"] = bytes(memoryview(pinned)[100:105]).decode()
pinned.close()

cuda.pin(haddr, 4096)
out["pinned_host"] = cuda.pointer_info(haddr).pinned
cuda.unpin(haddr)

try:
    cuda.DeviceBuffer(1 << 40, device=0)
except cuda.CudaError as exc:
    out["oom"] = [str(exc), exc.cuda_code, exc.cuda_name, exc.code]
try:
    cuda.Stream(device=5)
except ValueError as exc:
    out["bad_device"] = str(exc)

handle = cuda.export_ipc(dev.address + 4096)
wire = cuda.IpcHandle.from_wire(handle.to_wire())
cache = cuda.IpcCache()
mapped = cache.open("peer-a", wire)
out["ipc"] = [wire.base == dev.address, wire.nbytes, wire.device, wire.bus_id,
              mapped == dev.address, cache.local_device(wire), cache.open("peer-a", wire) == mapped,
              cache.opened]
cache.close()
try:
    cuda.export_ipc(haddr)
except InvalidArgument as exc:
    out["ipc_host"] = str(exc)

# GIL: a thread keeps running while another is inside driver calls
stop = threading.Event()
count = [0]
def spin():
    while not stop.is_set():
        count[0] += 1
t = threading.Thread(target=spin)
t.start()
for _ in range(200):
    cuda.pointer_info(dev.address)
stop.set()
t.join()
out["spun"] = count[0] > 0
dev.close()
print(json.dumps(out))
"""


def test_fake_driver_session(fake_libcuda: str) -> None:
    """The whole Python face over the C double, in a child process."""
    _native_built()
    proc = _run(FAKE_SESSION, MOONCAKE_LIBCUDA=fake_libcuda, FAKE_CUDA_DEVICES="2")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["driver"] == [12080, 2, "Fake CUDA Device 1", "0000:19:00.0"]
    assert out["device_ptr"] == ["cuda", 1, True, 1 << 20, True, "cuda:1"]
    assert out["current_after"] is None
    assert out["current_kept"] is True
    assert out["kind"] == ["cuda", "cuda:1", "cuda:1", "cuda:1"]
    assert out["location_errors"][0].endswith("is CUDA memory (cuda:1), registered as 'cpu'")
    assert out["location_errors"][1].endswith("is on cuda:1, registered as 'cuda:0'")
    assert "runs past its CUDA allocation" in out["location_errors"][2]
    assert out["host_ptr"] == ["host", False]
    assert out["pinned_ptr"] == ["host", True, 8192]
    assert out["close_with_view"] == "1 view(s) of the pinned buffer are alive"
    assert out["event_query_before"] is False and out["event_query_after"] is True
    assert out["elapsed"] == 1.5 and out["stream_query"] is True
    assert out["roundtrip"] == "hello"
    assert out["pinned_host"] is True
    assert out["oom"] == ["cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (out of memory)", 2,
                          "CUDA_ERROR_OUT_OF_MEMORY", -1]
    assert out["bad_device"] == "no CUDA device 5: this process sees 2"
    assert out["ipc"] == [True, 1 << 20, 1, "0000:19:00.0", True, 1, True, 1]
    assert "is host memory, not CUDA device memory" in out["ipc_host"]
    assert out["spun"] is True


# -- FakeCudaDriver: a Python test double for the IPC cache --------------------------------------

class FakeCudaDriver:
    """TEST DOUBLE of the driver's IPC calls: hands out addresses, records every call.
    It proves the cache's bookkeeping, not CUDA."""

    def __init__(self, bus_ids: tuple[str, ...] = ("0000:18:00.0", "0000:19:00.0")) -> None:
        self.bus_ids = bus_ids
        self.opens: list[tuple[bytes, int]] = []
        self.closes: list[tuple[int, int]] = []
        self._next = 0x7000_0000_0000
        self._lock = threading.Lock()

    def ipc_open(self, handle: bytes, device: int) -> int:
        with self._lock:
            self.opens.append((handle, device))
            self._next += 1 << 30
            return self._next

    def ipc_close(self, address: int, device: int) -> None:
        self.closes.append((address, device))

    def device_count(self) -> int:
        return len(self.bus_ids)

    def device_pci_bus_id(self, device: int) -> str:
        return self.bus_ids[device]


def _handle(base: int, tag: bytes = b"a", bus_id: str = "0000:19:00.0") -> cuda.IpcHandle:
    return cuda.IpcHandle(tag * 64, 0, bus_id, base, 1 << 20)


def test_ipc_cache_opens_once_per_peer_allocation() -> None:
    drv = FakeCudaDriver()
    cache = cuda.IpcCache(drv)
    first = cache.open("peer-a", _handle(0x1000))
    assert cache.open("peer-a", _handle(0x1000)) == first
    second = cache.open("peer-a", _handle(0x9000))
    other_peer = cache.open("peer-b", _handle(0x1000))
    assert len({first, second, other_peer}) == 3
    assert len(drv.opens) == 3 and cache.opened == 3 and len(cache) == 3
    assert ("peer-a", 0x1000) in cache
    # mapped into the local GPU with the exporter's bus id
    assert {device for _, device in drv.opens} == {1}
    assert cache.open("peer-c", _handle(0x1000, bus_id="0000:99:00.0")) and drv.opens[-1][1] == 0
    assert cache.open("peer-c", _handle(0x5000), device=0) and drv.opens[-1][1] == 0
    cache.close()
    assert len(cache) == 0 and len(drv.closes) == 5


def test_ipc_cache_forget_closes_only_that_peer() -> None:
    drv = FakeCudaDriver()
    cache = cuda.IpcCache(drv)
    a1 = cache.open("peer-a", _handle(0x1000))
    a2 = cache.open("peer-a", _handle(0x2000))
    b1 = cache.open("peer-b", _handle(0x1000))
    assert cache.forget("peer-a") == 2
    assert sorted(address for address, _ in drv.closes) == sorted([a1, a2])
    assert cache.forget("peer-a") == 0
    assert ("peer-b", 0x1000) in cache
    again = cache.open("peer-a", _handle(0x1000))  # reopened after forget
    assert again not in (a1, a2) and len(drv.opens) == 4
    cache.close()
    assert sorted(address for address, _ in drv.closes) == sorted([a1, a2, b1, again])


def test_ipc_cache_replaces_a_stale_handle() -> None:
    drv = FakeCudaDriver()
    cache = cuda.IpcCache(drv)
    old = cache.open("peer-a", _handle(0x1000, b"a"))
    new = cache.open("peer-a", _handle(0x1000, b"b"))  # the peer reallocated at that base
    assert new != old and drv.closes == [(old, 1)] and len(cache) == 1
    cache.close()


def test_ipc_cache_open_races_map_once() -> None:
    drv = FakeCudaDriver()
    cache = cuda.IpcCache(drv)
    barrier = threading.Barrier(8)
    results: list[int] = []

    def worker() -> None:
        barrier.wait()
        results.append(cache.open("peer-a", _handle(0x1000)))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(drv.opens) == 1
    cache.close()


def test_ipc_cache_builds_without_cuda() -> None:
    cache = cuda.IpcCache()  # the driver is looked up on first open only
    assert len(cache) == 0 and cache.forget("nobody") == 0
    cache.close()


@pytest.mark.parametrize("wire, error", [
    (None, "expected 5 fields"),
    ([b"x" * 63, 0, "0000:18:00.0", 0, 1], "64 bytes"),
    ([b"x" * 64, -1, "0000:18:00.0", 0, 1], "bad device"),
    ([b"x" * 64, 0, "0000:18:00.0", True, 1], "bad base"),
    ([b"x" * 64, 0, 7, 0, 1], "bad bus id"),
    ([b"x" * 64, 0, "0000:18:00.0", (1 << 64) - 1, 2], "past 2\\*\\*64"),
])
def test_ipc_handle_from_wire_checks_fields(wire: object, error: str) -> None:
    with pytest.raises(InvalidArgument, match=error):
        cuda.IpcHandle.from_wire(wire)


def test_ipc_handle_wire_roundtrip() -> None:
    handle = _handle(0x1000)
    assert cuda.IpcHandle.from_wire(handle.to_wire()) == handle
