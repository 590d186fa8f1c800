# cython: language_level=3
"""C declarations of the POSIX/Linux calls used by the native data path (declarations only)."""

from posix.types cimport pid_t
from libc.stddef cimport size_t


cdef extern from "<sys/types.h>" nogil:
    ctypedef long ssize_t


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t process_vm_readv(pid_t pid, const iovec *local_iov, unsigned long liovcnt,
                             const iovec *remote_iov, unsigned long riovcnt,
                             unsigned long flags)
    ssize_t process_vm_writev(pid_t pid, const iovec *local_iov, unsigned long liovcnt,
                              const iovec *remote_iov, unsigned long riovcnt,
                              unsigned long flags)


cdef extern from "<sys/socket.h>" nogil:
    struct msghdr:
        void *msg_name
        unsigned int msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t sendmsg(int fd, const msghdr *msg, int flags)
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    int MSG_NOSIGNAL
    int MSG_WAITALL
    int MSG_PEEK
    int MSG_DONTWAIT


cdef extern from "<string.h>" nogil:
    void *memcpy(void *dst, const void *src, size_t n)
    char *strerror(int errnum)


cdef extern from "<errno.h>" nogil:
    int errno
    int EINTR
    int EAGAIN
    int EWOULDBLOCK
