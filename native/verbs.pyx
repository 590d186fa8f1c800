# cython: language_level=3, embedsignature=True
"""libibverbs, opened with dlopen at first use, never linked: RDMA devices, ports, GIDs.

Built everywhere Cython is, with no libibverbs headers: the structures' layouts and the
constants come from our own declarations of the ABI (``native/verbs_abi.h``, checked
against rdma-core's header by tests/transfer/test_verbs_abi.py); every function is
resolved with dlsym from the library ``open_library`` loads, so the module has no
link-time dependency on libibverbs and one wheel imports on machines with or without it.
``transfer/verbs.py`` chooses the library path and turns failures into sentences; this
module only calls the library.

Discovery (``list_devices``: ports' state, MTU, LID, link layer, GID tables) and the
data path of the rdma transport: :class:`Device` (an opened device with its protection
domain and completion queue), :class:`MemoryRegion` (``ibv_reg_mr`` or
``ibv_reg_dmabuf_mr``) and :class:`QueuePair` (RC, moved RESET, INIT, RTR, RTS; RDMA
WRITE and READ posted as one chained list). ``Device.poll`` polls the completion queue
without the GIL, spinning briefly and then sleeping, until a completion or its timeout.
Every library call runs without the GIL.
"""

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset
from posix.time cimport clock_gettime, nanosleep, timespec, CLOCK_MONOTONIC
from libc.errno cimport errno
from libc.string cimport strerror
from posix.dlfcn cimport dlopen, dlsym, dlerror, RTLD_NOW, RTLD_LOCAL


cdef extern from "<endian.h>":
    uint64_t be64toh(uint64_t x) nogil


cdef extern from "verbs_abi.h":
    # our declarations of libibverbs' ABI (native/verbs_abi.h): no libibverbs-dev needed
    struct ibv_device:
        pass
    struct ibv_context:
        pass
    struct ibv_comp_channel:
        pass
    struct ibv_device_attr:
        uint8_t phys_port_cnt
        uint64_t node_guid
        int max_qp_wr
        int max_cqe
        int max_qp_rd_atom
        int max_qp_init_rd_atom
    struct ibv_port_attr:
        int state
        int active_mtu
        int gid_tbl_len
        uint16_t lid
        uint8_t link_layer
    union ibv_gid:
        uint8_t raw[16]
    struct ibv_pd:
        pass
    struct ibv_mr:
        void *addr
        size_t length
        uint32_t lkey
        uint32_t rkey
    struct ibv_cq:
        pass
    struct ibv_srq:
        pass
    struct ibv_qp:
        uint32_t qp_num
    struct ibv_qp_cap:
        uint32_t max_send_wr
        uint32_t max_recv_wr
        uint32_t max_send_sge
        uint32_t max_recv_sge
        uint32_t max_inline_data
    struct ibv_qp_init_attr:
        void *qp_context
        ibv_cq *send_cq
        ibv_cq *recv_cq
        ibv_srq *srq
        ibv_qp_cap cap
        int qp_type
        int sq_sig_all
    struct ibv_global_route:
        ibv_gid dgid
        uint32_t flow_label
        uint8_t sgid_index
        uint8_t hop_limit
        uint8_t traffic_class
    struct ibv_ah_attr:
        ibv_global_route grh
        uint16_t dlid
        uint8_t sl
        uint8_t src_path_bits
        uint8_t static_rate
        uint8_t is_global
        uint8_t port_num
    struct ibv_qp_attr:
        int qp_state
        int path_mtu
        uint32_t rq_psn
        uint32_t sq_psn
        uint32_t dest_qp_num
        unsigned int qp_access_flags
        ibv_ah_attr ah_attr
        uint16_t pkey_index
        uint8_t max_rd_atomic
        uint8_t max_dest_rd_atomic
        uint8_t min_rnr_timer
        uint8_t port_num
        uint8_t timeout
        uint8_t retry_cnt
        uint8_t rnr_retry
    struct ibv_sge:
        uint64_t addr
        uint32_t length
        uint32_t lkey
    struct ibv_rdma_wr:
        uint64_t remote_addr
        uint32_t rkey
    union ibv_send_wr_wr:
        ibv_rdma_wr rdma
    struct ibv_send_wr:
        uint64_t wr_id
        ibv_send_wr *next
        ibv_sge *sg_list
        int num_sge
        int opcode
        unsigned int send_flags
        ibv_send_wr_wr wr
    struct ibv_wc:
        uint64_t wr_id
        int status
        int opcode
        uint32_t vendor_err
        uint32_t byte_len
        uint32_t qp_num
    # static inline: calls through the provider's ops table, no symbol
    int ibv_post_send(ibv_qp *qp, ibv_send_wr *wr, ibv_send_wr **bad_wr) nogil
    int ibv_poll_cq(ibv_cq *cq, int num_entries, ibv_wc *wc) nogil
    enum:
        IBV_PORT_NOP
        IBV_PORT_DOWN
        IBV_PORT_INIT
        IBV_PORT_ARMED
        IBV_PORT_ACTIVE
        IBV_PORT_ACTIVE_DEFER
        IBV_LINK_LAYER_UNSPECIFIED
        IBV_LINK_LAYER_INFINIBAND
        IBV_LINK_LAYER_ETHERNET
        IBV_MTU_256
        IBV_MTU_512
        IBV_MTU_1024
        IBV_MTU_2048
        IBV_MTU_4096
        IBV_QPT_RC
        IBV_QPS_RESET
        IBV_QPS_INIT
        IBV_QPS_RTR
        IBV_QPS_RTS
        IBV_QPS_ERR
        IBV_QP_STATE
        IBV_QP_ACCESS_FLAGS
        IBV_QP_PKEY_INDEX
        IBV_QP_PORT
        IBV_QP_AV
        IBV_QP_PATH_MTU
        IBV_QP_TIMEOUT
        IBV_QP_RETRY_CNT
        IBV_QP_RNR_RETRY
        IBV_QP_RQ_PSN
        IBV_QP_MAX_QP_RD_ATOMIC
        IBV_QP_MIN_RNR_TIMER
        IBV_QP_SQ_PSN
        IBV_QP_MAX_DEST_RD_ATOMIC
        IBV_QP_DEST_QPN
        IBV_WR_RDMA_WRITE
        IBV_WR_RDMA_READ
        IBV_SEND_SIGNALED
        IBV_ACCESS_LOCAL_WRITE
        IBV_ACCESS_REMOTE_WRITE
        IBV_ACCESS_REMOTE_READ
        IBV_WC_SUCCESS
        IBV_WC_LOC_LEN_ERR
        IBV_WC_LOC_QP_OP_ERR
        IBV_WC_LOC_PROT_ERR
        IBV_WC_WR_FLUSH_ERR
        IBV_WC_BAD_RESP_ERR
        IBV_WC_LOC_ACCESS_ERR
        IBV_WC_REM_INV_REQ_ERR
        IBV_WC_REM_ACCESS_ERR
        IBV_WC_REM_OP_ERR
        IBV_WC_RETRY_EXC_ERR
        IBV_WC_RNR_RETRY_EXC_ERR
    # the exported functions, resolved with dlsym
    ctypedef ibv_device **(*ibv_get_device_list_fn)(int *num) noexcept nogil
    ctypedef void (*ibv_free_device_list_fn)(ibv_device **devices) noexcept nogil
    ctypedef const char *(*ibv_get_device_name_fn)(ibv_device *device) noexcept nogil
    ctypedef ibv_context *(*ibv_open_device_fn)(ibv_device *device) noexcept nogil
    ctypedef int (*ibv_close_device_fn)(ibv_context *context) noexcept nogil
    ctypedef int (*ibv_query_device_fn)(ibv_context *context,
                                        ibv_device_attr *attr) noexcept nogil
    ctypedef int (*ibv_query_port_fn)(ibv_context *context, uint8_t port,
                                      ibv_port_attr *attr) noexcept nogil
    ctypedef int (*ibv_query_gid_fn)(ibv_context *context, uint8_t port, int index,
                                     ibv_gid *gid) noexcept nogil
    ctypedef ibv_pd *(*ibv_alloc_pd_fn)(ibv_context *context) noexcept nogil
    ctypedef int (*ibv_dealloc_pd_fn)(ibv_pd *pd) noexcept nogil
    ctypedef ibv_mr *(*ibv_reg_mr_fn)(ibv_pd *pd, void *addr, size_t length,
                                      int access) noexcept nogil
    ctypedef ibv_mr *(*ibv_reg_dmabuf_mr_fn)(ibv_pd *pd, uint64_t offset, size_t length,
                                             uint64_t iova, int fd, int access) noexcept nogil
    ctypedef int (*ibv_dereg_mr_fn)(ibv_mr *mr) noexcept nogil
    ctypedef ibv_cq *(*ibv_create_cq_fn)(ibv_context *context, int cqe, void *cq_context,
                                         ibv_comp_channel *channel,
                                         int comp_vector) noexcept nogil
    ctypedef int (*ibv_destroy_cq_fn)(ibv_cq *cq) noexcept nogil
    ctypedef ibv_qp *(*ibv_create_qp_fn)(ibv_pd *pd, ibv_qp_init_attr *attr) noexcept nogil
    ctypedef int (*ibv_modify_qp_fn)(ibv_qp *qp, ibv_qp_attr *attr, int mask) noexcept nogil
    ctypedef int (*ibv_destroy_qp_fn)(ibv_qp *qp) noexcept nogil


cdef struct Api:
    ibv_get_device_list_fn get_device_list
    ibv_free_device_list_fn free_device_list
    ibv_get_device_name_fn get_device_name
    ibv_open_device_fn open_device
    ibv_close_device_fn close_device
    ibv_query_device_fn query_device
    ibv_query_port_fn query_port
    ibv_query_gid_fn query_gid
    ibv_alloc_pd_fn alloc_pd
    ibv_dealloc_pd_fn dealloc_pd
    ibv_reg_mr_fn reg_mr
    ibv_reg_dmabuf_mr_fn reg_dmabuf_mr   # NULL in libraries older than rdma-core 34
    ibv_dereg_mr_fn dereg_mr
    ibv_create_cq_fn create_cq
    ibv_destroy_cq_fn destroy_cq
    ibv_create_qp_fn create_qp
    ibv_modify_qp_fn modify_qp
    ibv_destroy_qp_fn destroy_qp


cdef Api api
cdef void *handle = NULL

PORT_STATES = {IBV_PORT_NOP: "NOP", IBV_PORT_DOWN: "DOWN", IBV_PORT_INIT: "INIT",
               IBV_PORT_ARMED: "ARMED", IBV_PORT_ACTIVE: "ACTIVE",
               IBV_PORT_ACTIVE_DEFER: "ACTIVE_DEFER"}
LINK_LAYERS = {IBV_LINK_LAYER_UNSPECIFIED: "unspecified",
               IBV_LINK_LAYER_INFINIBAND: "InfiniBand", IBV_LINK_LAYER_ETHERNET: "Ethernet"}
MTUS = {IBV_MTU_256: 256, IBV_MTU_512: 512, IBV_MTU_1024: 1024, IBV_MTU_2048: 2048,
        IBV_MTU_4096: 4096}


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
        api.get_device_list = <ibv_get_device_list_fn>_sym(b"ibv_get_device_list")
        api.free_device_list = <ibv_free_device_list_fn>_sym(b"ibv_free_device_list")
        api.get_device_name = <ibv_get_device_name_fn>_sym(b"ibv_get_device_name")
        api.open_device = <ibv_open_device_fn>_sym(b"ibv_open_device")
        api.close_device = <ibv_close_device_fn>_sym(b"ibv_close_device")
        api.query_device = <ibv_query_device_fn>_sym(b"ibv_query_device")
        api.query_port = <ibv_query_port_fn>_sym(b"ibv_query_port")
        api.query_gid = <ibv_query_gid_fn>_sym(b"ibv_query_gid")
        api.alloc_pd = <ibv_alloc_pd_fn>_sym(b"ibv_alloc_pd")
        api.dealloc_pd = <ibv_dealloc_pd_fn>_sym(b"ibv_dealloc_pd")
        api.reg_mr = <ibv_reg_mr_fn>_sym(b"ibv_reg_mr")
        api.reg_dmabuf_mr = <ibv_reg_dmabuf_mr_fn>dlsym(handle, b"ibv_reg_dmabuf_mr")
        api.dereg_mr = <ibv_dereg_mr_fn>_sym(b"ibv_dereg_mr")
        api.create_cq = <ibv_create_cq_fn>_sym(b"ibv_create_cq")
        api.destroy_cq = <ibv_destroy_cq_fn>_sym(b"ibv_destroy_cq")
        api.create_qp = <ibv_create_qp_fn>_sym(b"ibv_create_qp")
        api.modify_qp = <ibv_modify_qp_fn>_sym(b"ibv_modify_qp")
        api.destroy_qp = <ibv_destroy_qp_fn>_sym(b"ibv_destroy_qp")
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
                out.append({"name": name, "node_guid": f"{be64toh(dattr.node_guid):016x}",
                            "ports": [_port(ctx, p) for p in range(1, dattr.phys_port_cnt + 1)]})
            finally:
                with nogil:
                    api.close_device(ctx)
    finally:
        with nogil:
            api.free_device_list(devs)
    return out


# -- the data path ----------------------------------------------------------------------

ACCESS_LOCAL_WRITE = IBV_ACCESS_LOCAL_WRITE
ACCESS_REMOTE_WRITE = IBV_ACCESS_REMOTE_WRITE
ACCESS_REMOTE_READ = IBV_ACCESS_REMOTE_READ
MTU_ENUMS = {v: k for k, v in MTUS.items()}
WC_STATUS = {IBV_WC_SUCCESS: "success", IBV_WC_LOC_LEN_ERR: "local length error",
             IBV_WC_LOC_QP_OP_ERR: "local QP operation error",
             IBV_WC_LOC_PROT_ERR: "local protection error",
             IBV_WC_WR_FLUSH_ERR: "work request flushed", IBV_WC_BAD_RESP_ERR: "bad response",
             IBV_WC_LOC_ACCESS_ERR: "local access error",
             IBV_WC_REM_INV_REQ_ERR: "remote invalid request",
             IBV_WC_REM_ACCESS_ERR: "remote access error",
             IBV_WC_REM_OP_ERR: "remote operation error",
             IBV_WC_RETRY_EXC_ERR: "transport retry counter exceeded",
             IBV_WC_RNR_RETRY_EXC_ERR: "RNR retry counter exceeded"}
WC_SUCCESS = IBV_WC_SUCCESS
WC_REM_ACCESS_ERR = IBV_WC_REM_ACCESS_ERR
WC_WR_FLUSH_ERR = IBV_WC_WR_FLUSH_ERR
DEF MAX_POLL = 64


cdef object _oserror(int err, str what):
    return OSError(err, f"{what}: {strerror(err).decode()}")


cdef double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef class Device:
    """An opened RDMA device: one port, a protection domain and one completion queue.

    Memory regions and queue pairs made from it must be closed before it is.
    """
    cdef ibv_context *ctx
    cdef ibv_pd *pd
    cdef ibv_cq *cq
    cdef readonly str name
    cdef readonly int port
    cdef readonly int max_qp_wr
    cdef readonly int cq_depth
    cdef readonly int max_rd_atomic
    cdef readonly int max_dest_rd_atomic
    cdef readonly int active_mtu
    cdef readonly int lid
    cdef readonly str link_layer

    def __cinit__(self, str name, int port=1, int cq_depth=4096):
        """Open device ``name``, its ``port``, and a completion queue of ``cq_depth``
        entries (at most what the device allows: ``cq_depth`` says what it got)."""
        if handle == NULL:
            raise RuntimeError("open_library first")
        cdef int n = 0, i, rc
        cdef ibv_device **devs
        cdef ibv_device_attr dattr
        cdef ibv_port_attr pattr
        self.name = name
        self.port = port
        with nogil:
            devs = api.get_device_list(&n)
        if devs == NULL:
            raise _oserror(errno or 19, "ibv_get_device_list")
        try:
            for i in range(n):
                if api.get_device_name(devs[i]).decode() == name:
                    with nogil:
                        self.ctx = api.open_device(devs[i])
                    if self.ctx == NULL:
                        raise _oserror(errno, f"ibv_open_device({name})")
                    break
            else:
                raise OSError(19, f"no RDMA device named {name!r}")
        finally:
            with nogil:
                api.free_device_list(devs)
        memset(&dattr, 0, sizeof(dattr))
        memset(&pattr, 0, sizeof(pattr))
        with nogil:
            rc = api.query_device(self.ctx, &dattr)
            if rc == 0:
                rc = api.query_port(self.ctx, <uint8_t>port, &pattr)
        if rc:
            self.close()
            raise _oserror(rc, f"querying {name} port {port}")
        self.max_qp_wr = dattr.max_qp_wr
        if dattr.max_cqe > 0:
            cq_depth = min(cq_depth, dattr.max_cqe)   # Soft-RoCE: 32767
        self.cq_depth = cq_depth
        self.max_rd_atomic = max(1, min(16, dattr.max_qp_init_rd_atom))
        self.max_dest_rd_atomic = max(1, min(16, dattr.max_qp_rd_atom))
        self.active_mtu = pattr.active_mtu
        self.lid = pattr.lid
        self.link_layer = LINK_LAYERS.get(pattr.link_layer, str(pattr.link_layer))
        with nogil:
            self.pd = api.alloc_pd(self.ctx)
        if self.pd == NULL:
            err = errno
            self.close()
            raise _oserror(err, f"ibv_alloc_pd({name})")
        with nogil:
            self.cq = api.create_cq(self.ctx, cq_depth, NULL, NULL, 0)
        if self.cq == NULL:
            err = errno
            self.close()
            raise _oserror(err, f"ibv_create_cq({name}, {cq_depth})")

    def gid(self, int index) -> bytes:
        """The 16 bytes of GID table entry ``index`` of the port."""
        cdef ibv_gid gid
        cdef int rc
        memset(&gid, 0, sizeof(gid))
        with nogil:
            rc = api.query_gid(self.ctx, <uint8_t>self.port, index, &gid)
        if rc:
            raise _oserror(rc, f"ibv_query_gid({self.name}, {index})")
        return (<char *>gid.raw)[:16]

    def reg_mr(self, uint64_t address, size_t nbytes, int access) -> MemoryRegion:
        """Register ``[address, address+nbytes)`` with ``access`` (ACCESS_* flags)."""
        cdef ibv_mr *mr
        with nogil:
            mr = api.reg_mr(self.pd, <void *>address, nbytes, access)
        if mr == NULL:
            raise _oserror(errno, f"ibv_reg_mr({self.name}, 0x{address:x}+{nbytes})")
        return MemoryRegion._wrap(self, mr, address, nbytes)

    def reg_dmabuf_mr(self, uint64_t offset, size_t nbytes, uint64_t iova, int fd,
                      int access) -> MemoryRegion:
        """Register ``nbytes`` at ``offset`` of dma-buf ``fd`` (GPU memory), addressed by
        peers as ``iova``. OSError(EOPNOTSUPP) where the library predates dma-buf."""
        cdef ibv_mr *mr
        if api.reg_dmabuf_mr == NULL:
            raise OSError(95, "this libibverbs has no ibv_reg_dmabuf_mr (rdma-core < 34)")
        with nogil:
            mr = api.reg_dmabuf_mr(self.pd, offset, nbytes, iova, fd, access)
        if mr == NULL:
            raise _oserror(errno, f"ibv_reg_dmabuf_mr({self.name}, 0x{iova:x}+{nbytes})")
        return MemoryRegion._wrap(self, mr, iova, nbytes)

    def create_qp(self, int max_send_wr) -> QueuePair:
        """A reliable-connection queue pair in RESET, on this device's completion queue."""
        cdef ibv_qp_init_attr attr
        cdef ibv_qp *qp
        cdef QueuePair out
        memset(&attr, 0, sizeof(attr))
        attr.send_cq = self.cq
        attr.recv_cq = self.cq
        attr.qp_type = IBV_QPT_RC
        attr.sq_sig_all = 0
        attr.cap.max_send_wr = max_send_wr
        attr.cap.max_recv_wr = 1
        attr.cap.max_send_sge = 1
        attr.cap.max_recv_sge = 1
        with nogil:
            qp = api.create_qp(self.pd, &attr)
        if qp == NULL:
            raise _oserror(errno, f"ibv_create_qp({self.name})")
        out = QueuePair.__new__(QueuePair)
        out.qp = qp
        out.dev = self
        out.qp_num = qp.qp_num
        return out

    def poll(self, int max_entries, double timeout_s) -> list:
        """Completions ``(wr_id, status, byte_len, qp_num)``, at least one unless
        ``timeout_s`` passed first; spins briefly, then sleeps 20 us between polls."""
        cdef ibv_wc wcs[MAX_POLL]
        cdef int n = 0, spins = 0
        cdef double deadline
        cdef timespec pause
        pause.tv_sec = 0
        pause.tv_nsec = 20000
        if self.cq == NULL:
            raise RuntimeError(f"device {self.name} is closed")
        max_entries = max(1, min(max_entries, MAX_POLL))
        with nogil:
            deadline = _now() + timeout_s
            while True:
                n = ibv_poll_cq(self.cq, max_entries, wcs)
                if n != 0:
                    break
                spins += 1
                if spins > 200:
                    if _now() >= deadline:
                        break
                    nanosleep(&pause, NULL)
        if n < 0:
            raise OSError(5, f"ibv_poll_cq({self.name}) failed ({n})")
        return [(wcs[i].wr_id, wcs[i].status, wcs[i].byte_len, wcs[i].qp_num) for i in range(n)]

    def close(self):
        """Destroy the completion queue and protection domain and close the device;
        OSError(EBUSY) while regions or queue pairs made from it are open."""
        cdef int rc = 0
        with nogil:
            if self.cq != NULL:
                rc = api.destroy_cq(self.cq)
        if rc:
            raise _oserror(rc, f"ibv_destroy_cq({self.name})")
        self.cq = NULL
        with nogil:
            if self.pd != NULL:
                rc = api.dealloc_pd(self.pd)
        if rc:
            raise _oserror(rc, f"ibv_dealloc_pd({self.name})")
        self.pd = NULL
        with nogil:
            if self.ctx != NULL:
                rc = api.close_device(self.ctx)
        if rc:
            raise _oserror(rc, f"ibv_close_device({self.name})")
        self.ctx = NULL


cdef class MemoryRegion:
    """A registered memory region: ``lkey`` for our work requests, ``rkey`` for peers'."""
    cdef ibv_mr *mr
    cdef readonly Device dev
    cdef readonly uint64_t address
    cdef readonly size_t nbytes
    cdef readonly uint32_t lkey
    cdef readonly uint32_t rkey

    @staticmethod
    cdef MemoryRegion _wrap(Device dev, ibv_mr *mr, uint64_t address, size_t nbytes):
        cdef MemoryRegion out = MemoryRegion.__new__(MemoryRegion)
        out.mr = mr
        out.dev = dev
        out.address = address
        out.nbytes = nbytes
        out.lkey = mr.lkey
        out.rkey = mr.rkey
        return out

    def close(self):
        """Deregister: the rkey is revoked, later remote access fails at the NIC."""
        cdef int rc = 0
        with nogil:
            if self.mr != NULL:
                rc = api.dereg_mr(self.mr)
        if rc:
            raise _oserror(rc, f"ibv_dereg_mr(0x{self.address:x})")
        self.mr = NULL


cdef class QueuePair:
    """A reliable-connection queue pair; ``connect`` moves it to RTS, ``post`` sends."""
    cdef ibv_qp *qp
    cdef readonly Device dev
    cdef readonly uint32_t qp_num

    cdef int _modify(self, ibv_qp_attr *attr, int mask, str what) except -1:
        cdef int rc
        if self.qp == NULL:
            raise RuntimeError("the queue pair is closed")
        with nogil:
            rc = api.modify_qp(self.qp, attr, mask)
        if rc:
            raise _oserror(rc, f"ibv_modify_qp({self.dev.name} qp {self.qp_num} to {what})")
        return 0

    def connect(self, uint32_t dest_qpn, uint32_t rq_psn, uint32_t sq_psn, int mtu,
                bytes dgid, int sgid_index, int dlid, int access, int traffic_class=0,
                int timeout=14, int retry_cnt=7):
        """RESET -> INIT (``access``: what the peer may do through this QP) -> RTR (to the
        peer's ``dest_qpn``, ``dgid``/``dlid``, path ``mtu`` in bytes) -> RTS."""
        cdef ibv_qp_attr attr
        if len(dgid) != 16 or mtu not in MTU_ENUMS:
            raise ValueError(f"bad dgid {dgid!r} or mtu {mtu}")
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_INIT
        attr.port_num = <uint8_t>self.dev.port
        attr.pkey_index = 0
        attr.qp_access_flags = access
        self._modify(&attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT
                     | IBV_QP_ACCESS_FLAGS, "INIT")
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_RTR
        attr.path_mtu = MTU_ENUMS[mtu]
        attr.dest_qp_num = dest_qpn
        attr.rq_psn = rq_psn
        attr.max_dest_rd_atomic = <uint8_t>self.dev.max_dest_rd_atomic
        attr.min_rnr_timer = 12
        attr.ah_attr.port_num = <uint8_t>self.dev.port
        attr.ah_attr.dlid = <uint16_t>dlid
        if self.dev.link_layer == "Ethernet" or dlid == 0:
            attr.ah_attr.is_global = 1
            memcpy(attr.ah_attr.grh.dgid.raw, <char *>dgid, 16)
            attr.ah_attr.grh.sgid_index = <uint8_t>sgid_index
            attr.ah_attr.grh.hop_limit = 64
            attr.ah_attr.grh.traffic_class = <uint8_t>traffic_class
        self._modify(&attr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN
                     | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER, "RTR")
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_RTS
        attr.sq_psn = sq_psn
        attr.timeout = <uint8_t>timeout
        attr.retry_cnt = <uint8_t>retry_cnt
        attr.rnr_retry = 7
        attr.max_rd_atomic = <uint8_t>self.dev.max_rd_atomic
        self._modify(&attr, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT
                     | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC, "RTS")

    def post(self, list wrs) -> int:
        """Post ``(wr_id, write, local, nbytes, lkey, remote, rkey)`` work requests, all
        signaled, as one chained list; returns how many were posted (all, or those before
        the one the provider refused, whose errno is then raised as OSError with
        ``posted`` set)."""
        cdef int n = len(wrs), i, rc
        cdef ibv_send_wr *list_ = NULL
        cdef ibv_sge *sges = NULL
        cdef ibv_send_wr *bad = NULL
        if self.qp == NULL:
            raise RuntimeError("the queue pair is closed")
        if n == 0:
            return 0
        list_ = <ibv_send_wr *>calloc(n, sizeof(ibv_send_wr))
        sges = <ibv_sge *>calloc(n, sizeof(ibv_sge))
        if list_ == NULL or sges == NULL:
            free(list_)
            free(sges)
            raise MemoryError()
        try:
            for i in range(n):
                wr_id, write, local, nbytes, lkey, remote, rkey = wrs[i]
                sges[i].addr = local
                sges[i].length = nbytes
                sges[i].lkey = lkey
                list_[i].wr_id = wr_id
                list_[i].next = &list_[i + 1] if i + 1 < n else NULL
                list_[i].sg_list = &sges[i]
                list_[i].num_sge = 1
                list_[i].opcode = IBV_WR_RDMA_WRITE if write else IBV_WR_RDMA_READ
                list_[i].send_flags = IBV_SEND_SIGNALED
                list_[i].wr.rdma.remote_addr = remote
                list_[i].wr.rdma.rkey = rkey
            with nogil:
                rc = ibv_post_send(self.qp, list_, &bad)
            if rc == 0:
                return n
            posted = (bad - list_) if bad != NULL else 0
            exc = _oserror(rc, f"ibv_post_send({self.dev.name} qp {self.qp_num})")
            exc.posted = posted
            raise exc
        finally:
            free(list_)
            free(sges)

    def to_error(self):
        """Move to ERR: outstanding requests complete as flushed, nothing new is sent."""
        cdef ibv_qp_attr attr
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_ERR
        self._modify(&attr, IBV_QP_STATE, "ERR")

    def close(self):
        """Destroy the queue pair (its outstanding requests are flushed)."""
        cdef int rc = 0
        with nogil:
            if self.qp != NULL:
                rc = api.destroy_qp(self.qp)
        if rc:
            raise _oserror(rc, f"ibv_destroy_qp({self.qp_num})")
        self.qp = NULL
