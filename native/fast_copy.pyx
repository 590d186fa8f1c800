# cython: language_level=3, embedsignature=True
"""Gather copy of a list of arrays into one raw destination, without the GIL.

``concat_arrays_into`` backs ``mooncake._fast_copy`` (the original wheel's C helper of the
same name): a slice of a list of C-contiguous buffers (numpy arrays in practice) is laid
end to end at a destination address, optionally split over several threads.
"""

from cpython.buffer cimport (PyObject_CheckBuffer, PyObject_GetBuffer, PyBuffer_Release,
                             PyBuffer_IsContiguous, PyBUF_RECORDS_RO)
from libc.stdint cimport uintptr_t, SIZE_MAX
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy


cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    int pthread_create(pthread_t *thread, const void *attr,
                       void *(*start)(void *) noexcept nogil, void *arg)
    int pthread_join(pthread_t thread, void **retval)


cdef struct Part:
    const char **src      # sources of this part, in order
    size_t *nbytes
    Py_ssize_t count
    char *dst             # where this part's first source lands
    pthread_t thread
    bint started


cdef void *copy_part(void *arg) noexcept nogil:
    cdef Part *part = <Part *>arg
    cdef size_t off = 0
    cdef Py_ssize_t i
    for i in range(part.count):
        if part.nbytes[i]:
            memcpy(part.dst + off, part.src[i], part.nbytes[i])
            off += part.nbytes[i]
    return NULL


cdef void copy_parts(Part *parts, int nparts) noexcept nogil:
    """Run part 0 here and the others on their own threads (inline if one cannot start)."""
    cdef int t
    for t in range(1, nparts):
        parts[t].started = pthread_create(&parts[t].thread, NULL, copy_part, &parts[t]) == 0
        if not parts[t].started:
            copy_part(&parts[t])
    copy_part(&parts[0])
    for t in range(1, nparts):
        if parts[t].started:
            pthread_join(parts[t].thread, NULL)


def concat_arrays_into(list arrays not None, uintptr_t dest_ptr, size_t dest_size,
                       Py_ssize_t start=0, Py_ssize_t count=-1, int nthreads=1) -> int:
    """Copy ``arrays[start:start+count]`` back to back to ``dest_ptr``; return the bytes copied.

    ``start`` is clamped to the list; a negative ``count``, or one running past the end,
    means "to the end". Each item must export a C-contiguous buffer. ``nthreads`` (at
    most one per item) threads share the items; the GIL is released during the copies.
    The caller guarantees that ``dest_size`` bytes at ``dest_ptr`` are writable.

    Raises:
        TypeError: an item exports no buffer.
        ValueError: an item is not C-contiguous, or its bytes exceed ``dest_size``.
        OverflowError: the sizes add up past the address space.
    """
    cdef Py_ssize_t n = len(arrays), i, held = 0
    cdef Py_buffer *views = NULL
    cdef const char **src = NULL
    cdef size_t *sizes = NULL
    cdef Part *parts = NULL
    cdef size_t total = 0, off = 0
    cdef Py_ssize_t per, first
    cdef int t, nparts = 0
    start = min(max(start, 0), n)
    if count < 0 or count > n - start:
        count = n - start
    if count == 0:
        return 0
    nthreads = <int>min(max(nthreads, 1), count)
    views = <Py_buffer *>calloc(count, sizeof(Py_buffer))
    src = <const char **>calloc(count, sizeof(char *))
    sizes = <size_t *>calloc(count, sizeof(size_t))
    parts = <Part *>calloc(nthreads, sizeof(Part))
    try:
        if views == NULL or src == NULL or sizes == NULL or parts == NULL:
            raise MemoryError()
        for i in range(count):
            item = arrays[start + i]
            if not PyObject_CheckBuffer(item):
                raise TypeError(f"arrays[{start + i}] is not an array "
                                f"(a {type(item).__name__} exports no buffer)")
            PyObject_GetBuffer(item, &views[i], PyBUF_RECORDS_RO)
            held += 1
            if not PyBuffer_IsContiguous(&views[i], b'C'):
                raise ValueError(f"arrays[{start + i}] is not C-contiguous")
            sizes[i] = <size_t>views[i].len
            if sizes[i] > SIZE_MAX - total:
                raise OverflowError("array byte sizes overflow")
            src[i] = <const char *>views[i].buf
            total += sizes[i]
        if total > dest_size:
            raise ValueError(f"destination buffer too small: need {total} bytes, "
                             f"got {dest_size}")
        per = (count + nthreads - 1) // nthreads
        first = 0
        while first < count:
            parts[nparts].src = src + first
            parts[nparts].nbytes = sizes + first
            parts[nparts].count = min(per, count - first)
            parts[nparts].dst = <char *>dest_ptr + off
            for i in range(first, first + parts[nparts].count):
                off += sizes[i]
            first += parts[nparts].count
            nparts += 1
        with nogil:
            copy_parts(parts, nparts)
        return total
    finally:
        for i in range(held):
            PyBuffer_Release(&views[i])
        free(views)
        free(src)
        free(sizes)
        free(parts)
