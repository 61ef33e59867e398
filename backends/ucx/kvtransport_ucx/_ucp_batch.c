/*
 * Tiny batch-issue helper for kvtransport_ucx (loaded with ctypes).
 *
 * Deliberately header-free: the UCP entry points and the (opaque) request
 * parameter struct are handed in by the Python side, so this file does not
 * depend on UCX headers or struct layouts.
 */
#include <stddef.h>
#include <stdint.h>

typedef void *(*kvt_put_nbx_fn)(void *ep, const void *buffer, size_t count,
                                uint64_t remote_addr, void *rkey,
                                const void *param);
typedef void (*kvt_request_free_fn)(void *request);

/* UCS_PTR_IS_ERR: (uintptr_t)ptr >= (uintptr_t)UCS_ERR_LAST, UCS_ERR_LAST == -100 */
#define KVT_PTR_IS_ERR(_p) (((uintptr_t)(_p)) >= ((uintptr_t)(intptr_t)-100))

/*
 * Issue one put: 0 when issued (a request still in flight is released to UCP, which frees it on
 * completion), -1 when it failed, with its (negative) ucs_status_t in *err_status.
 */
static inline int kvt_put_one(kvt_put_nbx_fn put_nbx, kvt_request_free_fn request_free, void *ep,
                              uint64_t local_addr, size_t length, uint64_t remote_addr, void *rkey,
                              const void *param, int64_t *err_status)
{
    void *req = put_nbx(ep, (const void *)(uintptr_t)local_addr, length, remote_addr, rkey, param);

    if (req == NULL) {
        return 0;
    }
    if (KVT_PTR_IS_ERR(req)) {
        *err_status = (int64_t)(intptr_t)req;
        return -1;
    }
    request_free(req);
    return 0;
}

/*
 * Issue n puts.  Returns the number issued; when it is < n, *err_status holds
 * the (negative) ucs_status_t of the failed put at that index.  Requests that
 * are still in flight are released with request_free (UCP frees them on
 * completion); completion is observed by a later endpoint flush.
 */
int64_t kvt_put_batch(kvt_put_nbx_fn put_nbx, kvt_request_free_fn request_free,
                      void *ep, void *rkey, const void *param,
                      const uint64_t *local_addrs, const uint64_t *remote_addrs,
                      const uint64_t *lengths, uint64_t length_if_scalar,
                      size_t n, int64_t *err_status)
{
    size_t i;

    for (i = 0; i < n; ++i) {
        if (kvt_put_one(put_nbx, request_free, ep, local_addrs[i],
                        (size_t)(lengths ? lengths[i] : length_if_scalar), remote_addrs[i], rkey, param,
                        err_status)) {
            return (int64_t)i;
        }
    }
    return (int64_t)n;
}

/*
 * kvt_put_batch with addresses given as offsets: put i copies lengths[i] bytes from
 * local_base + local_offs[i] to remote_base + remote_offs[i] (arithmetic modulo 2**64).  Lets a
 * caller keep one table per request and issue every layer of it by changing the two bases.
 */
int64_t kvt_put_batch_rel(kvt_put_nbx_fn put_nbx, kvt_request_free_fn request_free,
                          void *ep, void *rkey, const void *param,
                          const uint64_t *local_offs, const uint64_t *remote_offs,
                          const uint64_t *lengths, uint64_t local_base, uint64_t remote_base,
                          size_t n, int64_t *err_status)
{
    size_t i;

    for (i = 0; i < n; ++i) {
        if (kvt_put_one(put_nbx, request_free, ep, local_base + local_offs[i], (size_t)lengths[i],
                        remote_base + remote_offs[i], rkey, param, err_status)) {
            return (int64_t)i;
        }
    }
    return (int64_t)n;
}

/* ------------------------------------------------------------------ waiting without the GIL
 * Loops that would otherwise run in Python (one GIL hand-off per iteration, up to the interpreter's
 * switch interval each when another thread is busy) run here, in one foreign call.  When the wait is
 * over they can also write a prepared message to a socket (a completion signal), so that it leaves
 * before the calling thread needs the interpreter again.  libc is declared by hand (64-bit Linux
 * layouts) to keep the file header-free. */
struct kvt_timespec {
    long tv_sec;
    long tv_nsec;
};
int clock_gettime(int clock_id, struct kvt_timespec *ts);
int nanosleep(const struct kvt_timespec *req, struct kvt_timespec *rem);
long send(int fd, const void *buf, unsigned long len, int flags);
int *__errno_location(void);

#define KVT_CLOCK_MONOTONIC 1
#define KVT_UCS_INPROGRESS 1
#define KVT_MSG_NOSIGNAL 0x4000
#define KVT_EINTR 4

/* What to do when a wait ends; every field is optional (NULL / fd < 0). */
struct kvt_after {
    volatile int32_t *parked;      /* set to 0 just before returning: the thread needs the interpreter now */
    volatile int64_t *since;       /* ... and the time of that (CLOCK_MONOTONIC, ns) stored here first */
    const volatile int32_t *yield; /* progress loop: return early once *yield != 0 (another thread waits) */
    int32_t fd;                    /* on success, write buf[0:len] to fd ... */
    const char *buf;
    uint64_t len;
    int64_t sent;                  /* ... out: bytes written, or -errno if none could be */
    int32_t mbox;                  /* one-slot mailbox: KVT_MBOX_OPEN while another thread may add ... */
    const char *extra;             /* ... bytes to write right after buf (kvt_after_append) */
    uint64_t extra_len;
    int64_t extra_sent;            /* out, like sent */
};

#define KVT_MBOX_OPEN 0
#define KVT_MBOX_CLOSED 1
#define KVT_MBOX_FULL 2

static uint64_t kvt_now_ns(void)
{
    struct kvt_timespec ts;
    clock_gettime(KVT_CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void kvt_sleep_ns(uint64_t ns)
{
    struct kvt_timespec ts;
    ts.tv_sec = (long)(ns / 1000000000ull);
    ts.tv_nsec = (long)(ns % 1000000000ull);
    nanosleep(&ts, 0);
}

static int64_t kvt_write(int fd, const char *buf, uint64_t len)
{
    uint64_t off = 0;
    long n;

    while (off < len) {
        n = send(fd, buf + off, (unsigned long)(len - off), KVT_MSG_NOSIGNAL);
        if (n < 0) {
            if (*__errno_location() == KVT_EINTR) {
                continue;
            }
            return off > 0 ? (int64_t)off : -(int64_t)*__errno_location();
        }
        off += (uint64_t)n;
    }
    return (int64_t)off;
}

/* The wait ended (final: for good; ok: successfully): write, close the mailbox, unpark. */
static void kvt_finish(struct kvt_after *after, int ok, int final)
{
    int32_t prev;

    if (after == 0) {
        return;
    }
    if (ok && after->fd >= 0 && after->buf != 0 && after->len > 0) {
        after->sent = kvt_write(after->fd, after->buf, after->len);
    }
    if (final) {
        prev = __atomic_exchange_n(&after->mbox, KVT_MBOX_CLOSED, __ATOMIC_ACQ_REL);
        if (prev == KVT_MBOX_FULL && ok && after->fd >= 0 && after->sent == (int64_t)after->len) {
            after->extra_sent = kvt_write(after->fd, after->extra, after->extra_len);
        }
    }
    if (after->since != 0) {
        *after->since = (int64_t)kvt_now_ns();
    }
    if (after->parked != 0) {
        __atomic_store_n(after->parked, 0, __ATOMIC_RELEASE);
    }
}

/* Another thread: have `buf` written right after the waiting call's own bytes.  Returns 1 if taken,
 * 0 if the mailbox is closed (the wait ended) or already full.  `buf` must stay valid until the
 * mailbox is closed. */
int32_t kvt_after_append(struct kvt_after *after, const char *buf, uint64_t len)
{
    int32_t expected = KVT_MBOX_OPEN;

    if (__atomic_load_n(&after->mbox, __ATOMIC_ACQUIRE) != KVT_MBOX_OPEN) {
        return 0;
    }
    after->extra = buf;
    after->extra_len = len;
    return __atomic_compare_exchange_n(&after->mbox, &expected, KVT_MBOX_FULL, 0, __ATOMIC_ACQ_REL,
                                       __ATOMIC_ACQUIRE) ? 1 : 0;
}

/* Close the mailbox (idempotent); returns its previous state. */
int32_t kvt_after_close(struct kvt_after *after)
{
    return __atomic_exchange_n(&after->mbox, KVT_MBOX_CLOSED, __ATOMIC_ACQ_REL);
}

typedef unsigned int (*kvt_progress_fn)(void *worker);
typedef signed char (*kvt_check_status_fn)(void *request); /* ucs_status_t: a one-byte packed enum */

/*
 * Progress `worker` until `request` leaves UCS_INPROGRESS; return early when `budget_ns` has passed,
 * when no round progressed anything for `idle_ns` (the caller may then sleep on the worker's event
 * fd), or when after->yield is set.  Returns the request's status (UCS_INPROGRESS when it returned
 * early) and adds the number of events progressed to *events.  The caller serialises access to the
 * worker; the request stays the caller's.
 */
int64_t kvt_progress_until(kvt_progress_fn progress, kvt_check_status_fn check_status, void *worker,
                           void *request, uint64_t budget_ns, uint64_t idle_ns, uint64_t *events,
                           struct kvt_after *after)
{
    uint64_t now = kvt_now_ns();
    uint64_t end = now + budget_ns, idle_end = now + idle_ns;
    unsigned int n;
    signed char st;

    for (;;) {
        n = progress(worker);
        *events += n;
        st = check_status(request);
        if (st != KVT_UCS_INPROGRESS) {
            kvt_finish(after, st == 0, 1);
            return (int64_t)st;
        }
        now = kvt_now_ns();
        if (n) {
            idle_end = now + idle_ns;
        }
        if (now >= end || now >= idle_end || (after != 0 && after->yield != 0 && *after->yield)) {
            kvt_finish(after, 0, 0); /* the caller comes back (or gives up and closes the mailbox) */
            return (int64_t)st;
        }
    }
}

typedef int (*kvt_query_fn)(void *handle);

/*
 * Poll `query(handle)` (e.g. cuEventQuery) until it returns something other than `not_ready`:
 * spinning for `spin_ns`, then sleeping `sleep_ns` between polls, for at most `timeout_ns`.
 * Returns the last result (`not_ready` on timeout); on 0 (success) performs `after`.
 */
int64_t kvt_wait_query(kvt_query_fn query, void *handle, int64_t not_ready, uint64_t spin_ns,
                       uint64_t sleep_ns, uint64_t timeout_ns, struct kvt_after *after)
{
    uint64_t start = kvt_now_ns(), now;
    int rc;

    for (;;) {
        rc = query(handle);
        if ((int64_t)rc != not_ready) {
            kvt_finish(after, rc == 0, 1);
            return (int64_t)rc;
        }
        now = kvt_now_ns();
        if (now - start >= timeout_ns) {
            kvt_finish(after, 0, 1);
            return not_ready;
        }
        if (now - start >= spin_ns) {
            kvt_sleep_ns(sleep_ns);
        }
    }
}
