"""CUDA for the engine: pointer kinds, IPC handles, streams, events, pinned memory.

Calls the CUDA driver (``libcuda.so.1``) through ``_native.cuda``, which dlopens it at first
use: importing this module loads nothing, and the wheel needs no CUDA at build or install
time. The driver API serves every CUDA 12 and 13 runtime a framework brings.

Where the driver is looked for (:func:`library_candidates`): ``MOONCAKE_LIBCUDA`` when set
(that file only); else ``libcuda.so.1`` through the dynamic loader (LD_LIBRARY_PATH,
ld.so.cache), ``$CUDA_HOME/lib64/libcuda.so.1``, ``/usr/lib/<triplet>/libcuda.so.1``,
``/usr/lib64/libcuda.so.1``, ``/usr/lib/wsl/lib/libcuda.so.1``. The toolkit's
``lib64/stubs`` library is never used (it only answers CUDA_ERROR_STUB_LIBRARY).

Without a usable driver, :func:`available` is False and :func:`why_unavailable` says why in
one sentence ("no CUDA driver (...)", "no CUDA device (...)"); every other call raises
:class:`CudaUnavailable` with it. ``MOONCAKE_PUREPYTHON=1`` (or a build without the
native modules) has no CUDA at all: "CUDA needs the native build (...)". There is no
ctypes fallback: the pure-Python mode exists to run without compiled code, not to reach
GPUs.

Threads: every function may be called from any thread; driver calls run without the GIL,
in the primary context of the device they name, and leave the caller's current context as
it was. A process forked after CUDA was initialised cannot use it (CUDA's rule): in such a
child this module reports CUDA unavailable instead of crashing.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import PURE_PYTHON, libcuda_path
from ..errors import InvalidArgument, MooncakeError, TransportUnavailable

log = logging.getLogger(__name__)

LIBRARY = "libcuda.so.1"
IPC_HANDLE_NBYTES = 64

# CUmemorytype values reported by pointer attributes (0: memory CUDA does not know).
_MEMORYTYPE_HOST = 1
_MEMORYTYPE_DEVICE = 2
_MEMORYTYPE_UNIFIED = 4


class CudaError(MooncakeError, RuntimeError):
    """A CUDA driver call failed: ``"<call>: <CUDA_ERROR_NAME> (<description>)"``.

    Attributes:
        cuda_code: the CUresult (positive; ``code`` stays the package's negative code).
        cuda_name: its name, e.g. ``"CUDA_ERROR_OUT_OF_MEMORY"``.
    """

    def __init__(self, message: str, cuda_code: int = -1, cuda_name: str = "") -> None:
        super().__init__(message)
        self.cuda_code = cuda_code
        self.cuda_name = cuda_name


class CudaUnavailable(TransportUnavailable):
    """No usable CUDA here: no driver, no device, a pure-Python build, or a forked child."""


# -- selecting and loading the driver ---------------------------------------------------------

_native: Any = None
_native_error = ""
IMPLEMENTATION = ""

_lock = threading.Lock()
_state = "unloaded"  # -> "ready" | "failed"
_reason = ""
_info: "DriverInfo | None" = None
_driver_seen = False  # a driver was found loaded in this process (it is never unloaded)


@dataclass(frozen=True)
class DriverInfo:
    """The loaded driver: where it came from, its version (e.g. 12080) and device count."""

    path: str
    version: int
    device_count: int


def use(native: bool) -> None:
    """Bind to the native driver module, or to the pure-Python mode (no CUDA).

    Raises:
        ImportError: ``native`` but ``_native.cuda`` is not built (``pip install -e .``).
    """
    global _native, IMPLEMENTATION, _state, _reason
    module = None
    if native:
        from .._native import cuda as module  # loads no CUDA library: that happens in _load
    with _lock:
        _native = module
        IMPLEMENTATION = "native" if native else "python"
        if _state != "ready":
            _state, _reason = "unloaded", ""


def _use_default() -> None:
    global _native_error
    if not PURE_PYTHON:
        try:
            use(True)
            return
        except ImportError as exc:  # pragma: no cover - depends on the build
            _native_error = str(exc)
            log.warning("native cuda module unavailable (%s); CUDA is off", exc)
    use(False)


def library_candidates(env: Any = None) -> list[str]:
    """Where the driver is looked for, in order (see the module docstring)."""
    explicit = libcuda_path(env)
    env = os.environ if env is None else env
    if explicit:
        return [explicit]
    paths = [LIBRARY]
    cuda_home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if cuda_home:
        paths.append(os.path.join(cuda_home, "lib64", LIBRARY))
    triplet = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(
        platform.machine(), "")
    if triplet:
        paths.append(f"/usr/lib/{triplet}/{LIBRARY}")
    paths += [f"/usr/lib64/{LIBRARY}", f"/usr/lib/wsl/lib/{LIBRARY}"]
    return list(dict.fromkeys(paths))


def _no_driver_reason(failures: list[tuple[str, str, str]], explicit: bool) -> str:
    """One sentence from ``(path, "open"|"symbol", detail)`` failures."""
    for path, what, detail in failures:
        if what == "symbol":
            where = f"MOONCAKE_LIBCUDA={path}" if explicit else path
            return f"no CUDA driver ({where} is not a CUDA driver: {detail})"
    if explicit:
        path, _, detail = failures[0]
        return f"no CUDA driver ({LIBRARY} not found: MOONCAKE_LIBCUDA={path}: {detail})"
    # A file that exists but does not load (wrong architecture, broken install) is news;
    # the usual "No such file" of every other candidate is not.
    odd = [f"{p}: {d}" for p, _, d in failures if os.path.isabs(p) and os.path.exists(p)]
    tried = ", ".join(p for p, _, _ in failures)
    more = f"; {'; '.join(odd)}" if odd else ""
    return (f"no CUDA driver ({LIBRARY} not found: tried {tried}{more}; install the NVIDIA "
            f"driver or set MOONCAKE_LIBCUDA to its path)")


def _try_load() -> None:
    """Open the driver, cuInit, count devices; sets ``_state``. Called under ``_lock``."""
    global _state, _reason, _info
    if _native is None:
        _state = "failed"
        if _native_error:
            _reason = f"CUDA needs the native build ({_native_error}; run pip install -e .)"
        else:
            chosen = "MOONCAKE_PUREPYTHON=1 selects" if PURE_PYTHON else "this process uses"
            _reason = (f"CUDA needs the native build ({chosen} the pure-Python data path, "
                       "which has no CUDA)")
        return
    path = _native.library_path()
    if path is None:  # nothing opened yet in this process
        explicit = bool(libcuda_path())
        failures: list[tuple[str, str, str]] = []
        for candidate in library_candidates():
            try:
                _native.open_library(candidate)
            except OSError as exc:
                failures.append((candidate, "open", str(exc)))
                continue
            except LookupError as exc:
                failures.append((candidate, "symbol", str(exc)))
                continue
            path = candidate
            break
        if path is None:
            _state, _reason = "failed", _no_driver_reason(failures, explicit)
            return
    try:
        version, count = _native.init(CudaError)
    except CudaError as exc:
        _state = "failed"
        _reason = f"no CUDA device ({exc}; driver {path})"
        return
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        _state = "failed"
        _reason = f"no CUDA device (driver {version} at {path} sees 0 devices{hint})"
        return
    _info = DriverInfo(path, version, count)
    _state, _reason = "ready", ""
    log.info("CUDA driver %s (%d) with %d device(s)", path, version, count)


def _driver() -> Any:
    """The native driver module, loaded; CudaUnavailable with the reason otherwise."""
    if _state != "ready":
        with _lock:
            if _state == "unloaded":
                _try_load()
        if _state != "ready":
            raise CudaUnavailable(_reason)
    return _native


def _after_fork_in_child() -> None:
    global _state, _reason
    if _state == "ready":
        _state = "failed"
        _reason = ("no CUDA device (CUDA was initialised before this process was forked, and "
                   "a forked child cannot use it: start it with the 'spawn' method)")


os.register_at_fork(after_in_child=_after_fork_in_child)


def available() -> bool:
    """Whether CUDA works here (loads the driver on first call: tens to hundreds of ms)."""
    try:
        _driver()
    except CudaUnavailable:
        return False
    return True


def why_unavailable() -> str:
    """The one-sentence reason CUDA does not work here, or "" when it does."""
    return "" if available() else _reason


def driver_info() -> DriverInfo:
    """Path, version and device count of the loaded driver (CudaUnavailable without one)."""
    _driver()
    assert _info is not None
    return _info


def driver_in_process() -> bool:
    """Whether a CUDA driver is loaded in this process (by us, torch or anyone else).

    No CUDA memory can exist in a process that never loaded the driver, so this answers
    "could this address be GPU memory?" without loading (or initialising) CUDA.
    """
    global _driver_seen, _checked_adds
    if _driver_seen or _state == "ready":
        return True
    adds = _loaded_objects_added()
    if adds is not None and adds == _checked_adds:
        return False  # no library was loaded since the last look found no driver
    mode = os.RTLD_NOW | os.RTLD_NOLOAD
    for name in library_candidates():
        try:
            ctypes.CDLL(name, mode=mode)  # NOLOAD: succeeds only when loaded already
        except OSError:
            continue
        _driver_seen = True
        return True
    _checked_adds = adds
    return False


class _PhdrInfo(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_void_p), ("name", ctypes.c_char_p),
                ("phdr", ctypes.c_void_p), ("phnum", ctypes.c_uint16),
                ("adds", ctypes.c_ulonglong), ("subs", ctypes.c_ulonglong)]


_PHDR_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_PhdrInfo), ctypes.c_size_t,
                                  ctypes.c_void_p)
_checked_adds: int | None = None
_adds_seen = [0]


def _first_object(info: Any, size: int, data: Any) -> int:
    if size >= _PhdrInfo.adds.offset + 8:
        _adds_seen[0] = info.contents.adds
    else:  # a C library without the counters: every call checks in full
        _adds_seen[0] = -1
    return 1  # the first object is enough: the counter is process-wide


_first_object_c = _PHDR_CALLBACK(_first_object)
try:
    _dl_iterate_phdr: Any = ctypes.CDLL(None).dl_iterate_phdr
    _dl_iterate_phdr.argtypes = [_PHDR_CALLBACK, ctypes.c_void_p]
    _dl_iterate_phdr.restype = ctypes.c_int
except AttributeError:  # pragma: no cover - not glibc
    _dl_iterate_phdr = None


def _loaded_objects_added() -> int | None:
    """How many shared objects were ever loaded in this process (glibc's dlpi_adds): a
    cheap way (a few us) to know nothing new, so no driver, was loaded since last time;
    None where it cannot be told."""
    if _dl_iterate_phdr is None:
        return None
    _dl_iterate_phdr(_first_object_c, None)
    adds = _adds_seen[0]
    return None if adds < 0 else adds


def device_count() -> int:
    return driver_info().device_count


def device_name(device: int = 0) -> str:
    return _driver().device_name(device)


def device_pci_bus_id(device: int = 0) -> str:
    """``"0000:18:00.0"``: names the GPU the same way in every process."""
    return _driver().device_pci_bus_id(device)


# -- pointers --------------------------------------------------------------------------------

@dataclass(frozen=True)
class PointerInfo:
    """What an address is.

    Attributes:
        kind: ``"cuda"`` (device memory) or ``"host"`` (anything the CPU addresses:
            pageable, pinned, registered, and managed memory, which the CPU may touch).
        device: the CUDA device ordinal for ``"cuda"`` (and for pinned or managed memory
            when CUDA says one), else -1.
        base, nbytes: the allocation holding the address, when CUDA knows it
            (cuMemGetAddressRange for device memory); for plain host memory ``base`` is the
            address itself and ``nbytes`` 0 (unknown).
        pinned: page-locked host memory (cuMemHostAlloc / cuMemHostRegister).
        managed: CUDA managed (unified) memory.
        ipc_capable: a CUDA IPC handle can be exported for it (False for cuMemCreate
            memory such as PyTorch's ``expandable_segments``).
    """

    kind: str
    device: int
    base: int
    nbytes: int
    pinned: bool = False
    managed: bool = False
    ipc_capable: bool = False

    @property
    def location(self) -> str:
        """The engine's location string: ``"cuda:N"`` or ``"cpu"``."""
        return f"cuda:{self.device}" if self.kind == "cuda" else "cpu"


def _check_address(address: int) -> None:
    if not isinstance(address, int) or isinstance(address, bool) or not 0 <= address < 1 << 64:
        raise InvalidArgument(f"bad address {address!r}: an int in [0, 2**64)")


def pointer_info(address: int) -> PointerInfo:
    """Classify ``address`` (cheap: one driver call, two for device memory).

    Without a CUDA driver loaded in this process every address is host memory (nothing
    is loaded to find out). Callable from any thread.

    Raises:
        InvalidArgument: not an address.
        CudaUnavailable: a driver is loaded in this process but cannot be used by us.
        CudaError: the driver refused the query.
    """
    _check_address(address)
    if not driver_in_process():
        return PointerInfo("host", -1, address, 0)
    drv = _driver()
    memory_type, device, managed, range_base, range_nbytes, ipc = drv.pointer_attributes(address)
    if memory_type == 0:
        return PointerInfo("host", -1, address, 0)
    if managed:
        return PointerInfo("host", device, range_base or address, range_nbytes, managed=True)
    if memory_type == _MEMORYTYPE_HOST:
        return PointerInfo("host", device, range_base or address, range_nbytes, pinned=True)
    if memory_type in (_MEMORYTYPE_DEVICE, _MEMORYTYPE_UNIFIED):
        try:
            base, nbytes = drv.address_range(address, device)
        except CudaError:  # not cuMemAlloc memory (e.g. cuMemCreate): the mapped range
            base, nbytes = range_base, range_nbytes
        return PointerInfo("cuda", device, base, nbytes, ipc_capable=bool(ipc))
    return PointerInfo("host", -1, address, 0)  # CUDA arrays have no linear address


# -- device memory (tests and tools) ---------------------------------------------------------

class _Owned:
    """Something a driver call freed in ``close()``; warns when it was left to the GC."""

    _closed = True

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not self._closed:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, source=self)
            try:
                self.close()
            except Exception:  # interpreter shutdown, driver gone: nothing left to free
                pass


class DeviceBuffer(_Owned):
    """``nbytes`` of device memory from cuMemAlloc (for tests and tools: the engine
    registers memory a framework allocated). Close it, or use it in a ``with`` block."""

    def __init__(self, nbytes: int, device: int = 0) -> None:
        if nbytes <= 0:
            raise InvalidArgument(f"nbytes must be > 0, got {nbytes}")
        self._drv = _driver()
        self.device = device
        self.nbytes = nbytes
        self.address = self._drv.mem_alloc(nbytes, device)
        self._closed = False

    def close(self) -> None:
        """Free the memory (waits for work using it)."""
        if not self._closed:
            self._closed = True
            self._drv.mem_free(self.address, self.device)

    def __repr__(self) -> str:
        return f"DeviceBuffer(0x{self.address:x}, {self.nbytes}, cuda:{self.device})"


def pinned_buffer(nbytes: int, device: int = 0) -> Any:
    """``nbytes`` of pinned host memory (portable: every device copies to it at full speed).

    Returns the native ``HostBuffer``: ``address``, ``nbytes``, a writable buffer
    (``memoryview(buf)``) and ``close()``, which refuses while a view is alive.
    """
    if nbytes <= 0:
        raise InvalidArgument(f"nbytes must be > 0, got {nbytes}")
    return _driver().HostBuffer(nbytes, device)


def pin(address: int, nbytes: int, device: int = 0) -> None:
    """Page-lock existing host memory (cuMemHostRegister; slow: call once per region)."""
    _check_address(address)
    _driver().host_register(address, nbytes, device)


def unpin(address: int, device: int = 0) -> None:
    """Undo :func:`pin` for the region starting at ``address``."""
    _check_address(address)
    _driver().host_unregister(address, device)


# -- streams, events, copies -----------------------------------------------------------------

class Stream(_Owned):
    """A CUDA stream of the engine's own on ``device`` (non-blocking: it does not
    serialise with the legacy default stream of frameworks)."""

    def __init__(self, device: int = 0) -> None:
        self._drv = _driver()
        self.device = device
        self.handle = self._drv.stream_create(device)
        self._closed = False

    def synchronize(self) -> None:
        """Wait for all work queued so far (blocks without the GIL)."""
        self._drv.stream_synchronize(self.handle, self.device)

    def query(self) -> bool:
        """True when all queued work is done."""
        return self._drv.stream_query(self.handle, self.device)

    def wait(self, event: "Event") -> None:
        """Later work on this stream waits for ``event`` (the host does not)."""
        self._drv.stream_wait_event(self.handle, event.handle, self.device)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._drv.stream_destroy(self.handle, self.device)

    def __repr__(self) -> str:
        return f"Stream(0x{self.handle:x}, cuda:{self.device})"


class Event(_Owned):
    """A point in a stream's work; ``timing`` events also measure time between them."""

    def __init__(self, device: int = 0, timing: bool = False) -> None:
        self._drv = _driver()
        self.device = device
        self.handle = self._drv.event_create(device, timing)
        self._closed = False

    def record(self, stream: "Stream | int") -> "Event":
        """Mark the work queued on ``stream`` so far; returns self. ``stream`` is one of
        ours or a framework's raw ``CUstream`` handle (torch: ``Stream.cuda_stream``; 0 is
        the legacy default stream)."""
        handle = stream.handle if isinstance(stream, Stream) else stream
        if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
            raise InvalidArgument(f"not a CUDA stream: {stream!r}")
        self._drv.event_record(self.handle, handle, self.device)
        return self

    def synchronize(self) -> None:
        """Wait until the recorded work is done (blocks without the GIL)."""
        self._drv.event_synchronize(self.handle, self.device)

    def query(self) -> bool:
        """True when the recorded work is done."""
        return self._drv.event_query(self.handle, self.device)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to ``end`` (both timing events, both completed)."""
        return self._drv.event_elapsed_ms(self.handle, end.handle, self.device)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._drv.event_destroy(self.handle, self.device)

    def __repr__(self) -> str:
        return f"Event(0x{self.handle:x}, cuda:{self.device})"


def copy_async(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    """Queue a copy of ``nbytes`` on ``stream``, any direction (unified addresses).

    Asynchronous for device and pinned memory; pageable host memory makes CUDA stage it
    and return after. Wait with ``stream.synchronize()`` or an :class:`Event`.
    """
    _check_address(dst)
    _check_address(src)
    if nbytes < 0:
        raise InvalidArgument(f"nbytes must be >= 0, got {nbytes}")
    if nbytes:
        stream._drv.memcpy_async(dst, src, nbytes, stream.handle, stream.device)


def copy(dst: int, src: int, nbytes: int, device: int = 0) -> None:
    """Copy ``nbytes`` and wait (any direction)."""
    _check_address(dst)
    _check_address(src)
    if nbytes < 0:
        raise InvalidArgument(f"nbytes must be >= 0, got {nbytes}")
    if nbytes:
        _driver().memcpy(dst, src, nbytes, device)


# -- IPC -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IpcHandle:
    """What a peer needs to map one of our device allocations.

    ``address - base`` of a registered region is its offset in the mapping the peer opens.
    ``bus_id`` names the exporter's GPU whatever either side's CUDA_VISIBLE_DEVICES is.
    """

    handle: bytes
    device: int
    bus_id: str
    base: int
    nbytes: int

    def to_wire(self) -> list[Any]:
        """A msgpack-able form for a segment descriptor."""
        return [self.handle, self.device, self.bus_id, self.base, self.nbytes]

    @classmethod
    def from_wire(cls, data: Any) -> "IpcHandle":
        """Rebuild from :meth:`to_wire`, checking every field (it came from a peer).

        Raises:
            InvalidArgument: a malformed handle.
        """
        try:
            handle, device, bus_id, base, nbytes = data
        except (TypeError, ValueError):
            raise InvalidArgument("CUDA IPC handle: expected 5 fields") from None
        if not isinstance(handle, bytes) or len(handle) != IPC_HANDLE_NBYTES:
            raise InvalidArgument(f"CUDA IPC handle: handle must be {IPC_HANDLE_NBYTES} bytes")
        for name, value in (("device", device), ("base", base), ("nbytes", nbytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"CUDA IPC handle: bad {name} {value!r}")
        if not isinstance(bus_id, str) or len(bus_id) > 64:
            raise InvalidArgument(f"CUDA IPC handle: bad bus id {bus_id!r}")
        if base + nbytes > 1 << 64:
            raise InvalidArgument("CUDA IPC handle: base + nbytes past 2**64")
        return cls(handle, device, bus_id, base, nbytes)


def export_ipc(address: int) -> IpcHandle:
    """The IPC handle of the device allocation holding ``address`` (cuIpcGetMemHandle).

    Raises:
        InvalidArgument: ``address`` is not device memory.
        CudaError: the driver refused (e.g. cuMemCreate memory; the message says so).
    """
    info = pointer_info(address)
    if info.kind != "cuda":
        raise InvalidArgument(f"0x{address:x} is {info.kind} memory, not CUDA device memory: "
                              "only device memory has CUDA IPC handles")
    drv = _driver()
    try:
        handle = drv.ipc_get_handle(info.base, info.device)
    except CudaError as exc:
        if not info.ipc_capable:
            raise CudaError(f"{exc}; 0x{address:x} is not from cudaMalloc/cuMemAlloc (e.g. "
                            "PyTorch's expandable_segments), which CUDA IPC handles need",
                            exc.cuda_code, exc.cuda_name) from exc
        raise
    return IpcHandle(handle, info.device, drv.device_pci_bus_id(info.device), info.base,
                     info.nbytes)


def dmabuf_fd(address: int, nbytes: int) -> tuple[int, int]:
    """``(fd, offset)``: a dma-buf of the page-aligned device range holding
    ``[address, address+nbytes)`` and where ``address`` lies in it, for RDMA NICs
    (``ibv_reg_dmabuf_mr``). The caller closes ``fd``.

    Raises:
        InvalidArgument: not device memory.
        CudaError: the driver cannot export it (too old, or the GPU or memory cannot).
    """
    info = pointer_info(address)
    if info.kind != "cuda":
        raise InvalidArgument(f"0x{address:x} is {info.kind} memory, not CUDA device memory")
    drv = _driver()
    if not hasattr(drv, "dmabuf_fd"):
        raise CudaError("this CUDA binding cannot export dma-buf handles")
    page = mmap.PAGESIZE
    start = max(info.base, address - address % page)
    end = min(info.base + info.nbytes, -(-(address + nbytes) // page) * page)
    return drv.dmabuf_fd(start, end - start, info.device), address - start


class IpcDriver(Protocol):
    """What :class:`IpcCache` needs of a driver (the native module, or a test double)."""

    def ipc_open(self, handle: bytes, device: int) -> int: ...
    def ipc_close(self, address: int, device: int) -> None: ...
    def device_count(self) -> int: ...
    def device_pci_bus_id(self, device: int) -> str: ...


@dataclass(eq=False)
class _Mapping:
    handle: bytes
    address: int
    device: int
    tag: Any = None
    users: int = 0
    retired: bool = False


class IpcCache:
    """Peer allocations mapped into this process: each opened once per (peer, base).

    CUDA maps a handle only once per process, and opening costs milliseconds, so the
    cuda_ipc transport asks here for every batch. A handle or ``tag`` that changes for the
    same (peer, base) (the peer freed and registered again there) replaces the old mapping.

    Mappings taken with :meth:`acquire` are in use until :meth:`release`: :meth:`forget`,
    :meth:`close` or a replacement then unmap them only when their last user lets go (a
    copy never runs through an unmapped address). Mappings from :meth:`open` are not
    counted: the caller guarantees no copy uses them while they are unmapped. Lock: one,
    held across an open or close (a blocking driver call) so that two threads never map
    the same handle twice.
    """

    def __init__(self, driver: IpcDriver | None = None) -> None:
        self._drv = driver
        self._lock = threading.Lock()
        self._maps: dict[tuple[str, int], _Mapping] = {}
        self.opened = 0
        """Mappings opened over this cache's life (tests and stats)."""

    def _driver(self) -> IpcDriver:
        if self._drv is None:
            self._drv = _driver()
        return self._drv

    def local_device(self, handle: IpcHandle) -> int:
        """The local device to map into: the exporter's GPU when this process sees it
        (same PCI bus id), else device 0 (peer access reaches it)."""
        drv = self._driver()
        for device in range(drv.device_count()):
            if drv.device_pci_bus_id(device) == handle.bus_id:
                return device
        return 0

    def _get(self, peer: str, handle: IpcHandle, device: int | None, tag: Any) -> _Mapping:
        key = (peer, handle.base)
        mapping = self._maps.get(key)
        if mapping is not None:
            if mapping.handle == handle.handle and mapping.tag == tag:
                return mapping
            self._unmap(key, mapping)  # stale: the peer reallocated or re-registered there
        drv = self._driver()
        local = self.local_device(handle) if device is None else device
        address = drv.ipc_open(handle.handle, local)
        mapping = self._maps[key] = _Mapping(handle.handle, address, local, tag)
        self.opened += 1
        return mapping

    def open(self, peer: str, handle: IpcHandle, device: int | None = None,
             tag: Any = None) -> int:
        """This process's address of ``handle.base`` of ``peer``, mapping it on first use.

        Args:
            device: the local device to map into (default: :meth:`local_device`).
            tag: what else identifies the allocation (the region's generation): a new tag
                at the same base is a new mapping.

        Raises:
            CudaError: the driver could not map it.
        """
        with self._lock:
            return self._get(peer, handle, device, tag).address

    def acquire(self, peer: str, handle: IpcHandle, device: int | None = None,
                tag: Any = None) -> _Mapping:
        """:meth:`open`, counting one more user: returns the mapping (``address``,
        ``device``), to hand back to :meth:`release`."""
        with self._lock:
            mapping = self._get(peer, handle, device, tag)
            mapping.users += 1
            return mapping

    def release(self, mappings: Any) -> None:
        """Let go of mappings from :meth:`acquire`; retired ones are unmapped now."""
        with self._lock:
            for mapping in mappings:
                mapping.users -= 1
                if mapping.retired and mapping.users == 0:
                    self._close_mapping(mapping)

    def _unmap(self, key: tuple[str, int], mapping: _Mapping) -> None:
        del self._maps[key]
        mapping.retired = True
        if mapping.users == 0:
            self._close_mapping(mapping)

    def _close_mapping(self, mapping: _Mapping) -> None:
        try:
            self._driver().ipc_close(mapping.address, mapping.device)
        except CudaError as exc:
            log.warning("closing the CUDA IPC mapping at 0x%x failed: %s", mapping.address, exc)

    def forget(self, peer: str, keep: Any = None) -> int:
        """Unmap the allocations of ``peer`` (it went away or republished), except the
        ``(base, tag)`` pairs in ``keep``; how many were dropped."""
        with self._lock:
            keys = [k for k, m in self._maps.items()
                    if k[0] == peer and not (keep and (k[1], m.tag) in keep)]
            for key in keys:
                self._unmap(key, self._maps[key])
            return len(keys)

    def peers(self) -> set[str]:
        """The peers with mappings open."""
        with self._lock:
            return {k[0] for k in self._maps}

    def close(self) -> None:
        """Unmap everything (mappings in use: when their last user lets go)."""
        with self._lock:
            for key in list(self._maps):
                self._unmap(key, self._maps[key])

    def __len__(self) -> int:
        return len(self._maps)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._maps


_use_default()
