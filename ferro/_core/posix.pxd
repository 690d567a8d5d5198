# C declarations for the system calls the transport uses, declared once and all
# usable without the GIL.

from cpython.pythread cimport PyThread_type_lock
from libc.stdint cimport int64_t

cdef extern from "<errno.h>" nogil:
    enum:
        EWOULDBLOCK  # equals EAGAIN on Linux, not on every POSIX system

cdef extern from "<sys/types.h>" nogil:
    ctypedef long ssize_t

cdef extern from "<poll.h>" nogil:
    ctypedef unsigned long nfds_t
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd* fds, nfds_t nfds, int timeout)
    enum:
        POLLIN
        POLLOUT
        POLLERR
        POLLHUP
        POLLNVAL

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len

cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t
    struct msghdr:
        void* msg_name
        socklen_t msg_namelen
        iovec* msg_iov
        size_t msg_iovlen
        void* msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t sendmsg(int sockfd, const msghdr* msg, int flags)
    ssize_t recv(int sockfd, void* buf, size_t length, int flags)
    enum:
        MSG_NOSIGNAL
        MSG_DONTWAIT

cdef extern from "<time.h>" nogil:
    ctypedef int clockid_t
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(clockid_t clk_id, timespec* tp)
    int nanosleep(const timespec* req, timespec* rem)
    enum:
        CLOCK_MONOTONIC

cdef extern from "<signal.h>" nogil:
    int kill(int pid, int sig)

cdef extern from "pythread.h":
    ctypedef enum PyLockStatus:
        PY_LOCK_ACQUIRED
    PyLockStatus PyThread_acquire_lock_timed(PyThread_type_lock lock, long long microseconds,
                                             int intr_flag) nogil

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "frame.h" nogil:
    enum:
        FERRO_HEADER_SIZE
        FERRO_FRAME_MAGIC
        FERRO_PROTOCOL_VERSION
    void ferro_pack_header(unsigned char* h, unsigned int kind, unsigned long long length,
                           unsigned long long seq, unsigned long long fingerprint)
    unsigned int ferro_get_u32(const unsigned char* p)
    unsigned long long ferro_get_u64(const unsigned char* p)

cdef extern from "pace.h" nogil:
    ctypedef struct ferro_pace:
        int64_t last_progress
    void ferro_pace_start(ferro_pace* p, int64_t now, int64_t spin_ns, int64_t yield_ns)
    void ferro_pace_progress(ferro_pace* p, int64_t now)
    int ferro_pace_look_due(ferro_pace* p, int64_t now)
    int ferro_pace_signals_due(ferro_pace* p, int64_t now)
    void ferro_pace_rest(ferro_pace* p, int64_t now)
