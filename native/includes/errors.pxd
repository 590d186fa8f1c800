# cython: language_level=3
"""Turn a saved errno into the matching OSError subclass (raised with the GIL held)."""

from cpython.exc cimport PyErr_SetFromErrno
from libc.errno cimport errno


cdef inline int raise_errno(int err) except -1:
    global errno
    errno = err
    PyErr_SetFromErrno(OSError)
    return -1
