# cython: language_level=3, embedsignature=True
"""libibverbs, opened with dlopen at first use, never linked: RDMA devices, ports, GIDs.

Built only where ``infiniband/verbs.h`` is found (Debian's libibverbs-dev): the header
gives the structures' layouts; every function is resolved with dlsym from the library
``open_library`` loads, so the module has no link-time dependency on libibverbs and one
wheel imports on machines with or without it. ``transfer/verbs.py`` chooses the library
path and turns failures into sentences; this module only calls the library.

This is the discovery half of the rdma transport (issue 26): devices, their ports' state,
MTU, LID, link layer and GID tables. Queue pairs and memory regions come next.
Every library call runs without the GIL.
"""

from libc.stdint cimport uint8_t, uint16_t, uint64_t
from libc.string cimport memset
from libc.errno cimport errno
from libc.string cimport strerror
from posix.dlfcn cimport dlopen, dlsym, dlerror, RTLD_NOW, RTLD_LOCAL


cdef extern from "infiniband/verbs.h":
    struct ibv_device:
        pass
    struct ibv_context:
        pass
    struct ibv_device_attr:
        uint8_t phys_port_cnt
        uint64_t node_guid
    struct ibv_port_attr:
        int state
        int active_mtu
        int gid_tbl_len
        uint16_t lid
        uint8_t link_layer
    union ibv_gid:
        uint8_t raw[16]


ctypedef ibv_device **(*get_device_list_t)(int *num) noexcept nogil
ctypedef void (*free_device_list_t)(ibv_device **devices) noexcept nogil
ctypedef const char *(*get_device_name_t)(ibv_device *device) noexcept nogil
ctypedef ibv_context *(*open_device_t)(ibv_device *device) noexcept nogil
ctypedef int (*close_device_t)(ibv_context *context) noexcept nogil
ctypedef int (*query_device_t)(ibv_context *context, ibv_device_attr *attr) noexcept nogil
ctypedef int (*query_port_t)(ibv_context *context, uint8_t port, void *attr) noexcept nogil
ctypedef int (*query_gid_t)(ibv_context *context, uint8_t port, int index,
                            ibv_gid *gid) noexcept nogil


cdef struct Api:
    get_device_list_t get_device_list
    free_device_list_t free_device_list
    get_device_name_t get_device_name
    open_device_t open_device
    close_device_t close_device
    query_device_t query_device
    query_port_t query_port
    query_gid_t query_gid


cdef Api api
cdef void *handle = NULL

PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
LINK_LAYERS = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}
MTUS = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


cdef void *_sym(const char *name) except NULL:
    cdef void *p = dlsym(handle, name)
    if p == NULL:
        raise LookupError(f"libibverbs has no {name.decode()}")
    return p


def open_library(str path):
    """dlopen ``path`` and resolve every function used; OSError when it cannot be loaded,
    LookupError naming a missing function. Loading twice keeps the first library."""
    global handle
    if handle != NULL:
        return
    cdef bytes raw = path.encode()
    cdef void *h = dlopen(raw, RTLD_NOW | RTLD_LOCAL)
    if h == NULL:
        raise OSError(dlerror().decode(errors="replace"))
    handle = h
    try:
        api.get_device_list = <get_device_list_t>_sym(b"ibv_get_device_list")
        api.free_device_list = <free_device_list_t>_sym(b"ibv_free_device_list")
        api.get_device_name = <get_device_name_t>_sym(b"ibv_get_device_name")
        api.open_device = <open_device_t>_sym(b"ibv_open_device")
        api.close_device = <close_device_t>_sym(b"ibv_close_device")
        api.query_device = <query_device_t>_sym(b"ibv_query_device")
        api.query_port = <query_port_t>_sym(b"ibv_query_port")
        api.query_gid = <query_gid_t>_sym(b"ibv_query_gid")
    except LookupError:
        handle = NULL
        raise


cdef str _gid_text(ibv_gid *gid):
    cdef int i
    words = []
    for i in range(0, 16, 2):
        words.append(f"{gid.raw[i]:02x}{gid.raw[i + 1]:02x}")
    return ":".join(words)


cdef bint _empty(ibv_gid *gid):
    cdef int i
    for i in range(16):
        if gid.raw[i]:
            return False
    return True


cdef dict _port(ibv_context *ctx, uint8_t port):
    cdef ibv_port_attr attr
    cdef ibv_gid gid
    cdef int rc, i
    memset(&attr, 0, sizeof(attr))   # the library fills its compat layout, a prefix of it
    with nogil:
        rc = api.query_port(ctx, port, &attr)
    if rc:
        return {"port": port, "error": f"ibv_query_port: {strerror(rc).decode()}"}
    gids = []
    for i in range(attr.gid_tbl_len):
        memset(&gid, 0, sizeof(gid))
        with nogil:
            rc = api.query_gid(ctx, port, i, &gid)
        if rc == 0 and not _empty(&gid):
            gids.append((i, _gid_text(&gid)))
    return {"port": port, "state": PORT_STATES.get(attr.state, str(attr.state)),
            "active_mtu": MTUS.get(attr.active_mtu, 0), "lid": attr.lid,
            "link_layer": LINK_LAYERS.get(attr.link_layer, str(attr.link_layer)),
            "gid_tbl_len": attr.gid_tbl_len, "gids": gids}


def list_devices():
    """Every RDMA device the library sees, with its ports (state, active MTU, LID, link
    layer, the non-empty GIDs); [] when there is none. OSError when the library could not
    list them (its errno)."""
    if handle == NULL:
        raise RuntimeError("open_library first")
    cdef int n = 0, rc
    cdef ibv_device **devs
    cdef ibv_context *ctx
    cdef ibv_device_attr dattr
    with nogil:
        devs = api.get_device_list(&n)
    if devs == NULL:
        if errno == 0:
            return []
        raise OSError(errno, f"ibv_get_device_list: {strerror(errno).decode()}")
    out = []
    try:
        for i in range(n):
            name = api.get_device_name(devs[i]).decode()
            with nogil:
                ctx = api.open_device(devs[i])
            if ctx == NULL:
                out.append({"name": name, "error": f"ibv_open_device: {strerror(errno).decode()}"})
                continue
            try:
                memset(&dattr, 0, sizeof(dattr))
                with nogil:
                    rc = api.query_device(ctx, &dattr)
                if rc:
                    out.append({"name": name, "error": f"ibv_query_device: {strerror(rc).decode()}"})
                    continue
                out.append({"name": name, "node_guid": f"{dattr.node_guid:016x}",
                            "ports": [_port(ctx, p) for p in range(1, dattr.phys_port_cnt + 1)]})
            finally:
                with nogil:
                    api.close_device(ctx)
    finally:
        with nogil:
            api.free_device_list(devs)
    return out
