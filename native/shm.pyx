# cython: language_level=3, embedsignature=True
"""Same-host copies: cross-process (process_vm_readv/writev) and mapped memfd memory.

Addresses reaching these functions were checked by ``transfer/segment.py`` against the
target's published regions; this module only moves bytes, without the GIL.
"""

from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport uintptr_t
from posix.types cimport pid_t

from includes.posix cimport (iovec, process_vm_readv, process_vm_writev, ssize_t, errno, EINTR,
                             memfd_create as c_memfd_create, MFD_CLOEXEC)
from includes.errors cimport raise_errno


def vm_copy(int pid, uintptr_t local_address, uintptr_t remote_address, size_t nbytes,
            bint write) -> None:
    """Copy ``nbytes`` between our memory and process ``pid``'s (write=True: ours -> theirs)."""
    cdef iovec local_iov
    cdef iovec remote_iov
    cdef size_t done = 0
    cdef ssize_t rc = 0
    cdef int err = 0
    while done < nbytes:
        local_iov.iov_base = <void *>(local_address + done)
        local_iov.iov_len = nbytes - done
        remote_iov.iov_base = <void *>(remote_address + done)
        remote_iov.iov_len = nbytes - done
        with nogil:
            if write:
                rc = process_vm_writev(<pid_t>pid, &local_iov, 1, &remote_iov, 1, 0)
            else:
                rc = process_vm_readv(<pid_t>pid, &local_iov, 1, &remote_iov, 1, 0)
            err = errno
        if rc > 0:
            done += <size_t>rc
        elif rc < 0 and err == EINTR:
            PyErr_CheckSignals()
        elif rc == 0:
            raise OSError("process_vm transfer made no progress (pid %d)" % pid)
        else:
            raise_errno(err)


def memfd_create(str name) -> int:
    """Create an anonymous memory file (close-on-exec) and return its fd."""
    cdef bytes bname = name.encode()
    cdef int fd = c_memfd_create(bname, MFD_CLOEXEC)
    if fd < 0:
        raise_errno(errno)
    return fd
