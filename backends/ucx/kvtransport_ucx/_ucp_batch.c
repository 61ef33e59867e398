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
    void *req;

    for (i = 0; i < n; ++i) {
        req = put_nbx(ep, (const void *)(uintptr_t)local_addrs[i],
                      (size_t)(lengths ? lengths[i] : length_if_scalar),
                      remote_addrs[i], rkey, param);
        if (req == NULL) {
            continue;
        }
        if (KVT_PTR_IS_ERR(req)) {
            *err_status = (int64_t)(intptr_t)req;
            return (int64_t)i;
        }
        request_free(req);
    }
    return (int64_t)n;
}
