# cython: language_level=3, embedsignature=True
"""Any buffer -> (address, nbytes), and raw memory -> memoryview.

``Export`` holds a ``Py_buffer`` of the object for as long as the memory is registered,
so a ``bytearray`` cannot be resized (and its memory moved) under a peer's transfer; views
handed to users come from an Export or a Window, so they keep that memory alive.
"""

from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBuffer_FillInfo,
                             PyBUF_ANY_CONTIGUOUS, PyBUF_WRITABLE, PyBUF_SIMPLE)
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.stdint cimport uintptr_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

cdef extern from "Python.h":
    int PyBUF_READ
    int PyBUF_WRITE


cdef class Export:
    """A held buffer export of ``obj``: ``address`` and ``nbytes`` stay valid until ``release()``.

    An Export is itself a buffer exporter: ``memoryview(export)`` views the held memory and
    counts as one export (``exports``). ``release()`` while views are alive is deferred to
    the last view's release, so no view can outlive the memory behind it.
    """

    cdef Py_buffer view
    cdef bint held
    cdef bint release_pending
    cdef readonly Py_ssize_t exports
    cdef readonly bint readonly

    def __cinit__(self, obj, bint writable=False):
        cdef int flags = PyBUF_ANY_CONTIGUOUS | (PyBUF_WRITABLE if writable else PyBUF_SIMPLE)
        PyObject_GetBuffer(obj, &self.view, flags)
        self.held = True
        self.readonly = self.view.readonly

    @property
    def address(self) -> int:
        return <uintptr_t>self.view.buf

    @property
    def nbytes(self) -> int:
        return self.view.len

    @property
    def released(self) -> bool:
        """True once ``release()`` was asked for (the memory may still back live views)."""
        return not self.held or self.release_pending

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if not self.held or self.release_pending:
            raise BufferError("the registration behind this memory was released")
        PyBuffer_FillInfo(buffer, self, self.view.buf, self.view.len, self.view.readonly, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *buffer):
        self.exports -= 1
        if self.exports == 0 and self.release_pending:
            self.release_pending = False
            self.held = False
            PyBuffer_Release(&self.view)

    def release(self) -> None:
        """Give the export back (after the last view of it is released, if any is alive)."""
        if not self.held:
            return
        if self.exports > 0:
            self.release_pending = True
            return
        self.held = False
        PyBuffer_Release(&self.view)

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)


cdef class Window:
    """Raw memory as a buffer exporter that keeps ``owner`` (what keeps the memory valid) alive."""

    cdef void *buf
    cdef Py_ssize_t length
    cdef bint ro
    cdef object owner

    def __cinit__(self, uintptr_t address, Py_ssize_t nbytes, bint readonly, owner):
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        self.buf = <void *>address
        self.length = nbytes
        self.ro = readonly
        self.owner = owner

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        PyBuffer_FillInfo(buffer, self, self.buf, self.length, self.ro, flags)

    def __releasebuffer__(self, Py_buffer *buffer):
        pass


def view(uintptr_t address, Py_ssize_t nbytes, bint readonly=False):
    """Return a memoryview over ``nbytes`` of raw memory at ``address`` (caller checked bounds)."""
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    return PyMemoryView_FromMemory(<char *>address, nbytes, PyBUF_READ if readonly else PyBUF_WRITE)


def copy(uintptr_t dst, uintptr_t src, size_t nbytes) -> None:
    """memcpy ``nbytes`` from ``src`` to ``dst`` without the GIL (caller checked bounds)."""
    with nogil:
        memcpy(<void *>dst, <const void *>src, nbytes)


def empty_bytes(Py_ssize_t nbytes) -> bytes:
    """A new, uninitialised bytes object for a reader to fill before anyone sees it."""
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    return PyBytes_FromStringAndSize(NULL, nbytes)


def copy_many(list copies) -> None:
    """memcpy each ``(dst, src, nbytes)`` of ``copies``, all without the GIL."""
    cdef Py_ssize_t k = len(copies), i
    cdef uintptr_t *dst
    cdef uintptr_t *src
    cdef size_t *n
    if k == 0:
        return
    dst = <uintptr_t *>malloc(k * sizeof(uintptr_t))
    src = <uintptr_t *>malloc(k * sizeof(uintptr_t))
    n = <size_t *>malloc(k * sizeof(size_t))
    try:
        if dst == NULL or src == NULL or n == NULL:
            raise MemoryError()
        for i in range(k):
            d, s, m = copies[i]
            dst[i] = d
            src[i] = s
            n[i] = m
        with nogil:
            for i in range(k):
                memcpy(<void *>dst[i], <const void *>src[i], n[i])
    finally:
        free(dst)
        free(src)
        free(n)
