# cython: language_level=3, embedsignature=True
"""Same-host copies: cross-process (process_vm_readv/writev) and mapped memfd memory.

Addresses reaching these functions were checked by ``transfer/segment.py`` against the
target's published regions; this module only moves bytes, without the GIL.
"""

from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport uintptr_t
from libc.stdlib cimport free, malloc
from posix.types cimport pid_t

from includes.posix cimport iovec, process_vm_readv, process_vm_writev, ssize_t, errno, EINTR
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


DEF IOV_BATCH = 1024  # IOV_MAX: the most iovecs one process_vm call takes


def vm_copy_many(int pid, list copies, bint write) -> None:
    """Copy every ``(local_address, remote_address, nbytes)`` of ``copies`` between our
    memory and process ``pid``'s, up to 1024 of them per system call (write=True: ours ->
    theirs). The GIL is released for the calls."""
    cdef Py_ssize_t n = len(copies), i, pos = 0, cnt
    cdef size_t off = 0, left, done
    cdef ssize_t rc = 0
    cdef int err = 0
    if n == 0:
        return
    cdef uintptr_t *loc = <uintptr_t *>malloc(n * sizeof(uintptr_t))
    cdef uintptr_t *rem = <uintptr_t *>malloc(n * sizeof(uintptr_t))
    cdef size_t *lens = <size_t *>malloc(n * sizeof(size_t))
    cdef iovec *liov = <iovec *>malloc(IOV_BATCH * sizeof(iovec))
    cdef iovec *riov = <iovec *>malloc(IOV_BATCH * sizeof(iovec))
    try:
        if not (loc and rem and lens and liov and riov):
            raise MemoryError()
        for i in range(n):
            item = copies[i]
            loc[i], rem[i], lens[i] = item[0], item[1], item[2]
        while pos < n:
            if lens[pos] == off:  # this copy is done (or empty)
                pos += 1
                off = 0
                continue
            cnt = 0
            i = pos
            while i < n and cnt < IOV_BATCH:
                if lens[i] > (off if i == pos else 0):
                    liov[cnt].iov_base = <void *>(loc[i] + (off if i == pos else 0))
                    riov[cnt].iov_base = <void *>(rem[i] + (off if i == pos else 0))
                    liov[cnt].iov_len = riov[cnt].iov_len = lens[i] - (off if i == pos else 0)
                    cnt += 1
                i += 1
            with nogil:
                if write:
                    rc = process_vm_writev(<pid_t>pid, liov, cnt, riov, cnt, 0)
                else:
                    rc = process_vm_readv(<pid_t>pid, liov, cnt, riov, cnt, 0)
                err = errno
            if rc < 0:
                if err == EINTR:
                    PyErr_CheckSignals()
                    continue
                raise_errno(err)
            if rc == 0:
                raise OSError("process_vm transfer made no progress (pid %d)" % pid)
            done = <size_t>rc  # a partial transfer stops inside one copy: resume there
            while done and pos < n:
                left = lens[pos] - off
                if done >= left:
                    done -= left
                    pos += 1
                    off = 0
                else:
                    off += done
                    done = 0
    finally:
        free(loc)
        free(rem)
        free(lens)
        free(liov)
        free(riov)
