# cython: language_level=3
"""The CUDA driver API (libcuda.so.1) as function-pointer types: declarations only.

No CUDA header is read and nothing is linked: ``cuda.pyx`` resolves these with dlsym at
first use. Types, values and versioned symbol names are those of CUDA 12/13's ``cuda.h``
(a driver keeps exporting them for older binaries, so one build serves both).
"""

from libc.stddef cimport size_t


ctypedef int CUresult
ctypedef int CUdevice
ctypedef unsigned long long CUdeviceptr   # 64-bit since the _v2 entry points
ctypedef void *CUcontext
ctypedef void *CUstream
ctypedef void *CUevent

cdef enum:
    CU_IPC_HANDLE_SIZE = 64

ctypedef struct CUipcMemHandle:
    char reserved[CU_IPC_HANDLE_SIZE]

cdef enum:
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NOT_READY = 600

# CUpointer_attribute
cdef enum:
    CU_POINTER_ATTRIBUTE_CONTEXT = 1
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
    CU_POINTER_ATTRIBUTE_IS_MANAGED = 8
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
    CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12

# CUmemorytype
cdef enum:
    CU_MEMORYTYPE_HOST = 1
    CU_MEMORYTYPE_DEVICE = 2
    CU_MEMORYTYPE_ARRAY = 3
    CU_MEMORYTYPE_UNIFIED = 4

cdef enum:
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
    CU_STREAM_NON_BLOCKING = 1
    CU_EVENT_DEFAULT = 0
    CU_EVENT_DISABLE_TIMING = 2
    CU_MEMHOSTALLOC_PORTABLE = 1
    CU_MEMHOSTREGISTER_PORTABLE = 1


# One pointer type per entry point; the comment names the exported symbol.
ctypedef CUresult (*cuInit_t)(unsigned int flags) noexcept nogil
# CUDA 11.7+: CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1 exports a dma-buf fd of a range
ctypedef CUresult (*cuMemGetHandleForAddressRange_t)(void *handle, CUdeviceptr dptr,
                                                     size_t size, int handle_type,
                                                     unsigned long long flags) noexcept nogil
ctypedef CUresult (*cuDriverGetVersion_t)(int *version) noexcept nogil
ctypedef CUresult (*cuGetErrorName_t)(CUresult error, const char **text) noexcept nogil
ctypedef CUresult (*cuGetErrorString_t)(CUresult error, const char **text) noexcept nogil
ctypedef CUresult (*cuDeviceGetCount_t)(int *count) noexcept nogil
ctypedef CUresult (*cuDeviceGet_t)(CUdevice *device, int ordinal) noexcept nogil
ctypedef CUresult (*cuDeviceGetName_t)(char *name, int length, CUdevice device) noexcept nogil
ctypedef CUresult (*cuDeviceGetPCIBusId_t)(char *bus_id, int length, CUdevice device) noexcept nogil
ctypedef CUresult (*cuDevicePrimaryCtxRetain_t)(CUcontext *ctx, CUdevice device) noexcept nogil
ctypedef CUresult (*cuCtxGetCurrent_t)(CUcontext *ctx) noexcept nogil
ctypedef CUresult (*cuCtxSetCurrent_t)(CUcontext ctx) noexcept nogil
ctypedef CUresult (*cuPointerGetAttributes_t)(unsigned int count, int *attributes, void **data,
                                              CUdeviceptr ptr) noexcept nogil
ctypedef CUresult (*cuMemGetAddressRange_t)(CUdeviceptr *base, size_t *nbytes,
                                            CUdeviceptr ptr) noexcept nogil      # _v2
ctypedef CUresult (*cuMemAlloc_t)(CUdeviceptr *ptr, size_t nbytes) noexcept nogil  # _v2
ctypedef CUresult (*cuMemFree_t)(CUdeviceptr ptr) noexcept nogil                   # _v2
ctypedef CUresult (*cuMemHostAlloc_t)(void **ptr, size_t nbytes, unsigned int flags) noexcept nogil
ctypedef CUresult (*cuMemFreeHost_t)(void *ptr) noexcept nogil
ctypedef CUresult (*cuMemHostRegister_t)(void *ptr, size_t nbytes,
                                         unsigned int flags) noexcept nogil        # _v2
ctypedef CUresult (*cuMemHostUnregister_t)(void *ptr) noexcept nogil
ctypedef CUresult (*cuIpcGetMemHandle_t)(CUipcMemHandle *handle, CUdeviceptr ptr) noexcept nogil
ctypedef CUresult (*cuIpcOpenMemHandle_t)(CUdeviceptr *ptr, CUipcMemHandle handle,
                                          unsigned int flags) noexcept nogil       # _v2
ctypedef CUresult (*cuIpcCloseMemHandle_t)(CUdeviceptr ptr) noexcept nogil
ctypedef CUresult (*cuMemcpy_t)(CUdeviceptr dst, CUdeviceptr src, size_t nbytes) noexcept nogil
ctypedef CUresult (*cuMemcpyAsync_t)(CUdeviceptr dst, CUdeviceptr src, size_t nbytes,
                                     CUstream stream) noexcept nogil
ctypedef CUresult (*cuStreamCreate_t)(CUstream *stream, unsigned int flags) noexcept nogil
ctypedef CUresult (*cuStreamDestroy_t)(CUstream stream) noexcept nogil            # _v2
ctypedef CUresult (*cuStreamSynchronize_t)(CUstream stream) noexcept nogil
ctypedef CUresult (*cuStreamQuery_t)(CUstream stream) noexcept nogil
ctypedef CUresult (*cuStreamWaitEvent_t)(CUstream stream, CUevent event,
                                         unsigned int flags) noexcept nogil
ctypedef CUresult (*cuEventCreate_t)(CUevent *event, unsigned int flags) noexcept nogil
ctypedef CUresult (*cuEventDestroy_t)(CUevent event) noexcept nogil               # _v2
ctypedef CUresult (*cuEventRecord_t)(CUevent event, CUstream stream) noexcept nogil
ctypedef CUresult (*cuEventSynchronize_t)(CUevent event) noexcept nogil
ctypedef CUresult (*cuEventQuery_t)(CUevent event) noexcept nogil
ctypedef CUresult (*cuEventElapsedTime_t)(float *ms, CUevent start, CUevent end) noexcept nogil
