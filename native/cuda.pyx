# cython: language_level=3, embedsignature=True
"""The CUDA driver API (libcuda.so.1), opened with dlopen at first use, never linked.

Importing this module loads nothing. ``open_library(path)`` dlopens the driver and
resolves every entry point (a missing one is a ``LookupError`` naming it), ``init()`` runs
``cuInit``; only then do the other functions work. ``transfer/cuda.py`` chooses the path
and turns failures into sentences: this module only calls the driver.

The driver API is used rather than libcudart because libcuda.so.1 is the one library every
CUDA machine has, its ABI is stable across CUDA 12 and 13 (versioned entry points are named
explicitly, e.g. ``cuMemAlloc_v2``), so one build serves every runtime a framework brings.

Contexts: each call runs in the primary context of the device it names (the one CUDA
runtimes such as torch use) and restores the caller's current context after, so calls from
a user's thread leave its CUDA state as it was. Every driver call runs without the GIL;
errors are raised after, with the GIL, as the error class given to ``init`` (message
``"<call>: <CUDA_ERROR_NAME> (<text>)"``, attributes ``code`` and ``name``).
Handles (streams, events) and addresses cross into Python as ints.
"""

import os

from cpython.buffer cimport PyBuffer_FillInfo
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from libc.stdint cimport uintptr_t
from libc.string cimport memcpy as c_memcpy, memset
from posix.dlfcn cimport dlopen, dlsym, dlclose, dlerror, RTLD_NOW, RTLD_LOCAL

from includes.cuda cimport *


cdef struct Api:
    cuInit_t cuInit
    cuDriverGetVersion_t cuDriverGetVersion
    cuGetErrorName_t cuGetErrorName
    cuGetErrorString_t cuGetErrorString
    cuDeviceGetCount_t cuDeviceGetCount
    cuDeviceGet_t cuDeviceGet
    cuDeviceGetName_t cuDeviceGetName
    cuDeviceGetPCIBusId_t cuDeviceGetPCIBusId
    cuDevicePrimaryCtxRetain_t cuDevicePrimaryCtxRetain
    cuCtxGetCurrent_t cuCtxGetCurrent
    cuCtxSetCurrent_t cuCtxSetCurrent
    cuPointerGetAttributes_t cuPointerGetAttributes
    cuMemGetAddressRange_t cuMemGetAddressRange
    cuMemAlloc_t cuMemAlloc
    cuMemFree_t cuMemFree
    cuMemHostAlloc_t cuMemHostAlloc
    cuMemFreeHost_t cuMemFreeHost
    cuMemHostRegister_t cuMemHostRegister
    cuMemHostUnregister_t cuMemHostUnregister
    cuIpcGetMemHandle_t cuIpcGetMemHandle
    cuIpcOpenMemHandle_t cuIpcOpenMemHandle
    cuIpcCloseMemHandle_t cuIpcCloseMemHandle
    cuMemcpy_t cuMemcpy
    cuMemcpyAsync_t cuMemcpyAsync
    cuStreamCreate_t cuStreamCreate
    cuStreamDestroy_t cuStreamDestroy
    cuStreamSynchronize_t cuStreamSynchronize
    cuStreamQuery_t cuStreamQuery
    cuStreamWaitEvent_t cuStreamWaitEvent
    cuEventCreate_t cuEventCreate
    cuEventDestroy_t cuEventDestroy
    cuEventRecord_t cuEventRecord
    cuEventSynchronize_t cuEventSynchronize
    cuEventQuery_t cuEventQuery
    cuEventElapsedTime_t cuEventElapsedTime
    cuMemGetHandleForAddressRange_t cuMemGetHandleForAddressRange  # NULL before CUDA 11.7


cdef enum:
    MAX_DEVICES = 64

cdef Api api
cdef void *_lib = NULL
cdef bint _ready = False          # cuInit succeeded
cdef int _device_count = 0
cdef CUcontext _ctx[MAX_DEVICES]  # retained primary contexts, never released
cdef object _Error = RuntimeError
_path = None


# -- loading ----------------------------------------------------------------------------

cdef int _bind(void *lib, const char *name, void **slot) except -1:
    slot[0] = dlsym(lib, name)
    if slot[0] == NULL:
        raise LookupError(f"symbol {name.decode()} missing")
    return 0


cdef int _resolve(void *lib) except -1:
    # Versioned names: the unsuffixed symbols of these calls are the pre-CUDA-3.2 ABI
    # (32-bit CUdeviceptr) or older semantics, still exported for old binaries.
    _bind(lib, b"cuInit", <void **>&api.cuInit)
    _bind(lib, b"cuDriverGetVersion", <void **>&api.cuDriverGetVersion)
    _bind(lib, b"cuGetErrorName", <void **>&api.cuGetErrorName)
    _bind(lib, b"cuGetErrorString", <void **>&api.cuGetErrorString)
    _bind(lib, b"cuDeviceGetCount", <void **>&api.cuDeviceGetCount)
    _bind(lib, b"cuDeviceGet", <void **>&api.cuDeviceGet)
    _bind(lib, b"cuDeviceGetName", <void **>&api.cuDeviceGetName)
    _bind(lib, b"cuDeviceGetPCIBusId", <void **>&api.cuDeviceGetPCIBusId)
    _bind(lib, b"cuDevicePrimaryCtxRetain", <void **>&api.cuDevicePrimaryCtxRetain)
    _bind(lib, b"cuCtxGetCurrent", <void **>&api.cuCtxGetCurrent)
    _bind(lib, b"cuCtxSetCurrent", <void **>&api.cuCtxSetCurrent)
    _bind(lib, b"cuPointerGetAttributes", <void **>&api.cuPointerGetAttributes)
    _bind(lib, b"cuMemGetAddressRange_v2", <void **>&api.cuMemGetAddressRange)
    _bind(lib, b"cuMemAlloc_v2", <void **>&api.cuMemAlloc)
    _bind(lib, b"cuMemFree_v2", <void **>&api.cuMemFree)
    _bind(lib, b"cuMemHostAlloc", <void **>&api.cuMemHostAlloc)
    _bind(lib, b"cuMemFreeHost", <void **>&api.cuMemFreeHost)
    _bind(lib, b"cuMemHostRegister_v2", <void **>&api.cuMemHostRegister)
    _bind(lib, b"cuMemHostUnregister", <void **>&api.cuMemHostUnregister)
    _bind(lib, b"cuIpcGetMemHandle", <void **>&api.cuIpcGetMemHandle)
    _bind(lib, b"cuIpcOpenMemHandle_v2", <void **>&api.cuIpcOpenMemHandle)
    _bind(lib, b"cuIpcCloseMemHandle", <void **>&api.cuIpcCloseMemHandle)
    _bind(lib, b"cuMemcpy", <void **>&api.cuMemcpy)
    _bind(lib, b"cuMemcpyAsync", <void **>&api.cuMemcpyAsync)
    _bind(lib, b"cuStreamCreate", <void **>&api.cuStreamCreate)
    _bind(lib, b"cuStreamDestroy_v2", <void **>&api.cuStreamDestroy)
    _bind(lib, b"cuStreamSynchronize", <void **>&api.cuStreamSynchronize)
    _bind(lib, b"cuStreamQuery", <void **>&api.cuStreamQuery)
    _bind(lib, b"cuStreamWaitEvent", <void **>&api.cuStreamWaitEvent)
    _bind(lib, b"cuEventCreate", <void **>&api.cuEventCreate)
    _bind(lib, b"cuEventDestroy_v2", <void **>&api.cuEventDestroy)
    _bind(lib, b"cuEventRecord", <void **>&api.cuEventRecord)
    _bind(lib, b"cuEventSynchronize", <void **>&api.cuEventSynchronize)
    _bind(lib, b"cuEventQuery", <void **>&api.cuEventQuery)
    # cuEventElapsedTime_v2 is CUDA 12.8+; the first version has the same signature.
    api.cuEventElapsedTime = <cuEventElapsedTime_t>dlsym(lib, b"cuEventElapsedTime_v2")
    if api.cuEventElapsedTime == NULL:
        _bind(lib, b"cuEventElapsedTime", <void **>&api.cuEventElapsedTime)
    api.cuMemGetHandleForAddressRange = <cuMemGetHandleForAddressRange_t>dlsym(
        lib, b"cuMemGetHandleForAddressRange")
    return 0


def _dlerror() -> str:
    cdef const char *text = dlerror()
    return text.decode(errors="replace") if text != NULL else "unknown dlopen error"


def open_library(path: str) -> None:
    """dlopen ``path`` and resolve every entry point this module uses (once per process).

    Raises:
        OSError: dlopen failed (the message is dlerror's).
        LookupError: the library lacks an entry point: ``"symbol <name> missing"``.
        RuntimeError: a driver library is open already.
    """
    global _lib, _path
    if _lib != NULL:
        raise RuntimeError(f"a CUDA driver is open already ({_path})")
    cdef bytes bpath = os.fsencode(path)
    cdef const char *cpath = bpath
    cdef void *lib
    with nogil:
        lib = dlopen(cpath, RTLD_NOW | RTLD_LOCAL)
    if lib == NULL:
        raise OSError(_dlerror())
    try:
        _resolve(lib)
    except BaseException:
        memset(&api, 0, sizeof(api))
        dlclose(lib)  # nothing of it ran: safe to unload
        raise
    _lib = lib
    _path = path


def init(error_class) -> tuple:
    """cuInit(0) and count the devices: ``(driver_version, device_count)``.

    ``error_class(message, code, name)`` is raised for every CUDA failure from now on.
    Blocks (cuInit takes tens to hundreds of ms) without the GIL.
    """
    global _Error, _ready, _device_count
    if _lib == NULL:
        raise RuntimeError("no CUDA driver is open: call open_library() first")
    _Error = error_class
    cdef CUresult rc
    cdef int version = 0
    cdef int count = 0
    with nogil:
        rc = api.cuInit(0)
    _check(rc, b"cuInit")
    with nogil:
        rc = api.cuDriverGetVersion(&version)
        if rc == CUDA_SUCCESS:
            rc = api.cuDeviceGetCount(&count)
    _check(rc, b"cuDeviceGetCount")
    _device_count = min(count, <int>MAX_DEVICES)
    _ready = True
    return version, count


def library_path():
    """The path given to the successful ``open_library``, or None."""
    return _path


# -- errors and contexts ----------------------------------------------------------------

cdef int _raise(CUresult rc, const char *call) except -1:
    cdef const char *name = NULL
    cdef const char *text = NULL
    if api.cuGetErrorName == NULL or api.cuGetErrorName(rc, &name) != CUDA_SUCCESS:
        name = NULL
    if api.cuGetErrorString == NULL or api.cuGetErrorString(rc, &text) != CUDA_SUCCESS:
        text = NULL
    pyname = name.decode(errors="replace") if name != NULL else f"CUresult {rc}"
    pytext = text.decode(errors="replace") if text != NULL else "no description"
    raise _Error(f"{call.decode()}: {pyname} ({pytext})", rc, pyname)


cdef inline int _check(CUresult rc, const char *call) except -1:
    if rc != CUDA_SUCCESS:
        _raise(rc, call)
    return 0


cdef int _need_ready() except -1:
    if not _ready:
        raise RuntimeError("the CUDA driver is not initialised (transfer/cuda.py loads it)")
    return 0


cdef CUcontext _context(int device) except? NULL:
    """The retained primary context of ``device`` (retained on first use)."""
    _need_ready()
    if device < 0 or device >= _device_count:
        raise ValueError(f"no CUDA device {device}: this process sees {_device_count}")
    if _ctx[device] != NULL:
        return _ctx[device]
    cdef CUdevice dev
    cdef CUcontext ctx = NULL
    cdef CUresult rc
    with nogil:
        rc = api.cuDeviceGet(&dev, device)
        if rc == CUDA_SUCCESS:
            rc = api.cuDevicePrimaryCtxRetain(&ctx, dev)
    _check(rc, b"cuDevicePrimaryCtxRetain")
    _ctx[device] = ctx  # two racing threads retain twice: harmless, never released
    return ctx


cdef inline CUresult _enter(CUcontext ctx, CUcontext *prev) noexcept nogil:
    cdef CUresult rc = api.cuCtxGetCurrent(prev)
    if rc == CUDA_SUCCESS and prev[0] != ctx:
        rc = api.cuCtxSetCurrent(ctx)
    return rc


cdef inline void _leave(CUcontext ctx, CUcontext prev) noexcept nogil:
    if prev != ctx:
        api.cuCtxSetCurrent(prev)


# -- devices -------------------------------------------------------------------------------

def device_count() -> int:
    """Devices this process sees (CUDA_VISIBLE_DEVICES applies)."""
    _need_ready()
    return _device_count


def device_name(int device) -> str:
    """The marketing name of ``device``, e.g. ``"NVIDIA H100 80GB HBM3"``."""
    _context(device)
    cdef char name[256]
    cdef CUresult rc
    with nogil:
        rc = api.cuDeviceGetName(name, sizeof(name), device)
    _check(rc, b"cuDeviceGetName")
    return name.decode(errors="replace")


def device_pci_bus_id(int device) -> str:
    """``"0000:18:00.0"``: the same string in every process, whatever CUDA_VISIBLE_DEVICES is."""
    _context(device)
    cdef char bus[64]
    cdef CUresult rc
    with nogil:
        rc = api.cuDeviceGetPCIBusId(bus, sizeof(bus), device)
    _check(rc, b"cuDeviceGetPCIBusId")
    return bus.decode(errors="replace").lower()


# -- pointers ------------------------------------------------------------------------------

def pointer_attributes(uintptr_t address) -> tuple:
    """``(memory_type, device, managed, range_base, range_nbytes, ipc_capable)`` of an address.

    ``memory_type`` is 0 for memory CUDA does not know (plain pageable host memory), 1 host
    (pinned or registered), 2 device, 4 unified. ``range_*`` is the mappable range the
    address lies in (for ``cuMemAddressReserve`` memory, the reservation).
    """
    _need_ready()
    cdef int attrs[6]
    cdef unsigned long long slots[6]   # zeroed, wide enough for every result type
    cdef void *data[6]
    cdef int i
    cdef CUresult rc
    cdef CUcontext ctx
    cdef CUcontext prev = NULL
    attrs[0] = CU_POINTER_ATTRIBUTE_MEMORY_TYPE
    attrs[1] = CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    attrs[2] = CU_POINTER_ATTRIBUTE_IS_MANAGED
    attrs[3] = CU_POINTER_ATTRIBUTE_RANGE_START_ADDR
    attrs[4] = CU_POINTER_ATTRIBUTE_RANGE_SIZE
    attrs[5] = CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
    memset(slots, 0, sizeof(slots))
    for i in range(6):
        data[i] = &slots[i]
    with nogil:
        rc = api.cuPointerGetAttributes(6, attrs, data, <CUdeviceptr>address)
    if rc == CUDA_ERROR_INVALID_CONTEXT and _device_count > 0:
        # No context current on this thread: ask again from device 0's primary context.
        ctx = _context(0)
        memset(slots, 0, sizeof(slots))
        with nogil:
            rc = _enter(ctx, &prev)
            if rc == CUDA_SUCCESS:
                rc = api.cuPointerGetAttributes(6, attrs, data, <CUdeviceptr>address)
                _leave(ctx, prev)
    _check(rc, b"cuPointerGetAttributes")
    # Results are written at their own width (4-byte enums and ints, bools, 8-byte
    # addresses) into zeroed 8-byte slots: read them back at that width.
    cdef unsigned int memory_type
    cdef int ordinal
    c_memcpy(&memory_type, &slots[0], sizeof(memory_type))
    c_memcpy(&ordinal, &slots[1], sizeof(ordinal))
    return (memory_type, ordinal, slots[2] != 0, <uintptr_t>slots[3], <size_t>slots[4],
            slots[5] != 0)


def address_range(uintptr_t address, int device) -> tuple:
    """``(base, nbytes)`` of the allocation holding ``address`` (cuMemGetAddressRange_v2)."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUdeviceptr base = 0
    cdef size_t nbytes = 0
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuMemGetAddressRange(&base, &nbytes, <CUdeviceptr>address)
            _leave(ctx, prev)
    _check(rc, b"cuMemGetAddressRange_v2")
    return <uintptr_t>base, nbytes


def dmabuf_fd(uintptr_t address, size_t nbytes, int device) -> int:
    """A dma-buf file descriptor of device memory ``[address, address+nbytes)`` (both
    aligned to the host page), for RDMA registration (cuMemGetHandleForAddressRange)."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef int fd = -1
    cdef CUresult rc
    if api.cuMemGetHandleForAddressRange == NULL:
        raise _Error("this CUDA driver cannot export dma-buf handles (CUDA 11.7+ needed)")
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuMemGetHandleForAddressRange(&fd, <CUdeviceptr>address, nbytes, 1, 0)
            _leave(ctx, prev)
    _check(rc, b"cuMemGetHandleForAddressRange")
    return fd


# -- device memory (tests and tools; the engine registers what frameworks allocated) ----

def mem_alloc(size_t nbytes, int device) -> int:
    """cuMemAlloc_v2 on ``device``; free with :func:`mem_free`."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUdeviceptr ptr = 0
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuMemAlloc(&ptr, nbytes)
            _leave(ctx, prev)
    _check(rc, b"cuMemAlloc_v2")
    return <uintptr_t>ptr


def mem_free(uintptr_t address, int device) -> None:
    """cuMemFree_v2 (waits for work using the memory, without the GIL)."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuMemFree(<CUdeviceptr>address)
            _leave(ctx, prev)
    _check(rc, b"cuMemFree_v2")


# -- IPC -----------------------------------------------------------------------------------

def ipc_get_handle(uintptr_t address, int device) -> bytes:
    """The 64-byte IPC handle of the allocation at ``address`` (its base, for cuMemAlloc memory)."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUipcMemHandle handle
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuIpcGetMemHandle(&handle, <CUdeviceptr>address)
            _leave(ctx, prev)
    _check(rc, b"cuIpcGetMemHandle")
    return PyBytes_FromStringAndSize(handle.reserved, CU_IPC_HANDLE_SIZE)


def ipc_open(bytes handle, int device) -> int:
    """Map another process's allocation into this one (lazy peer access); its base address.

    A handle may be opened once per process (``transfer/cuda.py`` caches it); a handle this
    process exported itself cannot be opened here.
    """
    if len(handle) != CU_IPC_HANDLE_SIZE:
        raise ValueError(f"a CUDA IPC handle is {CU_IPC_HANDLE_SIZE} bytes, got {len(handle)}")
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUipcMemHandle h
    cdef CUdeviceptr ptr = 0
    cdef CUresult rc
    c_memcpy(h.reserved, PyBytes_AS_STRING(handle), CU_IPC_HANDLE_SIZE)
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuIpcOpenMemHandle(&ptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            _leave(ctx, prev)
    _check(rc, b"cuIpcOpenMemHandle_v2")
    return <uintptr_t>ptr


def ipc_close(uintptr_t address, int device) -> None:
    """Unmap what :func:`ipc_open` returned."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuIpcCloseMemHandle(<CUdeviceptr>address)
            _leave(ctx, prev)
    _check(rc, b"cuIpcCloseMemHandle")


# -- copies --------------------------------------------------------------------------------

def memcpy_async(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream,
                 int device) -> None:
    """Queue a copy on ``stream`` (any direction: addresses are unified). Pageable host
    memory makes it synchronous; pinned memory keeps it asynchronous."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuMemcpyAsync(<CUdeviceptr>dst, <CUdeviceptr>src, nbytes, <CUstream>stream)
            _leave(ctx, prev)
    _check(rc, b"cuMemcpyAsync")


def memcpy(uintptr_t dst, uintptr_t src, size_t nbytes, int device) -> None:
    """Copy and wait (any direction)."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuMemcpy(<CUdeviceptr>dst, <CUdeviceptr>src, nbytes)
            _leave(ctx, prev)
    _check(rc, b"cuMemcpy")


# -- streams and events --------------------------------------------------------------------

def stream_create(int device) -> int:
    """A non-blocking stream (it does not wait for the legacy default stream)."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUstream stream = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING)
            _leave(ctx, prev)
    _check(rc, b"cuStreamCreate")
    return <uintptr_t>stream


def stream_destroy(uintptr_t stream, int device) -> None:
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuStreamDestroy(<CUstream>stream)
            _leave(ctx, prev)
    _check(rc, b"cuStreamDestroy_v2")


def stream_synchronize(uintptr_t stream, int device) -> None:
    """Wait for everything queued on ``stream`` (blocks, without the GIL)."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuStreamSynchronize(<CUstream>stream)
            _leave(ctx, prev)
    _check(rc, b"cuStreamSynchronize")


def stream_query(uintptr_t stream, int device) -> bool:
    """True when everything queued on ``stream`` has finished."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuStreamQuery(<CUstream>stream)
            _leave(ctx, prev)
    if rc == CUDA_ERROR_NOT_READY:
        return False
    _check(rc, b"cuStreamQuery")
    return True


def stream_wait_event(uintptr_t stream, uintptr_t event, int device) -> None:
    """Make later work on ``stream`` wait for ``event`` (the host does not wait)."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuStreamWaitEvent(<CUstream>stream, <CUevent>event, 0)
            _leave(ctx, prev)
    _check(rc, b"cuStreamWaitEvent")


def event_create(int device, bint timing=False) -> int:
    """An event; without ``timing`` it is cheaper to record and to wait for."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUevent event = NULL
    cdef unsigned int flags = CU_EVENT_DEFAULT if timing else CU_EVENT_DISABLE_TIMING
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuEventCreate(&event, flags)
            _leave(ctx, prev)
    _check(rc, b"cuEventCreate")
    return <uintptr_t>event


def event_destroy(uintptr_t event, int device) -> None:
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuEventDestroy(<CUevent>event)
            _leave(ctx, prev)
    _check(rc, b"cuEventDestroy_v2")


def event_record(uintptr_t event, uintptr_t stream, int device) -> None:
    """Mark the point reached by the work queued on ``stream`` so far."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuEventRecord(<CUevent>event, <CUstream>stream)
            _leave(ctx, prev)
    _check(rc, b"cuEventRecord")


def event_synchronize(uintptr_t event, int device) -> None:
    """Wait until the recorded work is done (blocks, without the GIL)."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuEventSynchronize(<CUevent>event)
            _leave(ctx, prev)
    _check(rc, b"cuEventSynchronize")


def event_query(uintptr_t event, int device) -> bool:
    """True when the recorded work is done (or the event was never recorded)."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuEventQuery(<CUevent>event)
            _leave(ctx, prev)
    if rc == CUDA_ERROR_NOT_READY:
        return False
    _check(rc, b"cuEventQuery")
    return True


def event_elapsed_ms(uintptr_t start, uintptr_t end, int device) -> float:
    """Milliseconds between two completed timing events (about 0.5 us resolution)."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef float ms = 0
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuEventElapsedTime(&ms, <CUevent>start, <CUevent>end)
            _leave(ctx, prev)
    _check(rc, b"cuEventElapsedTime")
    return ms


# -- pinned host memory --------------------------------------------------------------------

def host_register(uintptr_t address, size_t nbytes, int device) -> None:
    """Page-lock existing host memory for every context (cuMemHostRegister_v2, portable)."""
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuMemHostRegister(<void *>address, nbytes, CU_MEMHOSTREGISTER_PORTABLE)
            _leave(ctx, prev)
    _check(rc, b"cuMemHostRegister_v2")


def host_unregister(uintptr_t address, int device) -> None:
    cdef CUcontext ctx = _context(device)
    cdef CUcontext prev = NULL
    cdef CUresult rc
    with nogil:
        rc = _enter(ctx, &prev)
        if rc == CUDA_SUCCESS:
            rc = api.cuMemHostUnregister(<void *>address)
            _leave(ctx, prev)
    _check(rc, b"cuMemHostUnregister")


cdef class HostBuffer:
    """Pinned host memory (cuMemHostAlloc, portable): a writable buffer of ``nbytes``.

    ``memoryview(buf)`` counts as an export; ``close()`` while one is alive raises
    BufferError, so no view outlives the memory. Freed by ``close()`` or when collected.
    """

    cdef void *ptr
    cdef CUcontext ctx
    cdef readonly size_t nbytes
    cdef readonly Py_ssize_t exports

    def __cinit__(self, size_t nbytes, int device=0):
        if nbytes == 0:
            raise ValueError("nbytes must be > 0")
        self.ctx = _context(device)
        cdef CUcontext prev = NULL
        cdef void *ptr = NULL
        cdef CUresult rc
        with nogil:
            rc = _enter(self.ctx, &prev)
            if rc == CUDA_SUCCESS:
                rc = api.cuMemHostAlloc(&ptr, nbytes, CU_MEMHOSTALLOC_PORTABLE)
                _leave(self.ctx, prev)
        _check(rc, b"cuMemHostAlloc")
        self.ptr = ptr
        self.nbytes = nbytes

    @property
    def address(self) -> int:
        if self.ptr == NULL:
            raise ValueError("the pinned buffer is closed")
        return <uintptr_t>self.ptr

    @property
    def closed(self) -> bool:
        return self.ptr == NULL

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if self.ptr == NULL:
            raise BufferError("the pinned buffer is closed")
        PyBuffer_FillInfo(buffer, self, self.ptr, self.nbytes, 0, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *buffer):
        self.exports -= 1

    def close(self) -> None:
        """Free the memory (waits for copies using it, without the GIL)."""
        if self.ptr == NULL:
            return
        if self.exports > 0:
            raise BufferError(f"{self.exports} view(s) of the pinned buffer are alive")
        cdef void *ptr = self.ptr
        cdef CUcontext prev = NULL
        cdef CUresult rc
        self.ptr = NULL
        with nogil:
            rc = _enter(self.ctx, &prev)
            if rc == CUDA_SUCCESS:
                rc = api.cuMemFreeHost(ptr)
                _leave(self.ctx, prev)
        _check(rc, b"cuMemFreeHost")

    def __dealloc__(self):
        cdef CUcontext prev = NULL
        if self.ptr != NULL and _enter(self.ctx, &prev) == CUDA_SUCCESS:
            api.cuMemFreeHost(self.ptr)
            _leave(self.ctx, prev)
