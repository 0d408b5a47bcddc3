/* liblgreco.so's C ABI for a framework's own communication hook (PyTorch DDP's comm hook
 * for CPU tensors: python/lgreco/torch.py). One session per process group: the same
 * engine, controller and CPU backend as the shim, over lgreco's socket fabric.
 *
 * Every rank opens its session with the same layout and rendezvous address, then makes
 * the same calls in the same order from one thread. Messages are written to the
 * caller's buffer (NUL-terminated, truncated to its length). */
#ifndef LGRECO_HOOK_H_
#define LGRECO_HOOK_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LGRECO_HOOK_API __attribute__((visibility("default")))
#define LGRECO_HOOK_ABI_VERSION 1

#define LGRECO_HOOK_DONE 0          /* data holds the mean over ranks */
#define LGRECO_HOOK_PASS_THROUGH 1  /* data untouched: reduce it uncompressed (every rank alike) */
#define LGRECO_HOOK_ERROR (-1)      /* the message says why; the session is broken */

typedef struct lgreco_hook_session lgreco_hook_session;

LGRECO_HOOK_API int lgreco_hook_abi_version(void);

/* Collective: rendezvous at master_host:master_port (rank 0 listens there) within
 * LGRECO_TIMEOUT. layout_json: a registration document (docs/REGISTRATION.md) of the
 * buckets, in call order. NULL on failure, with the message. */
LGRECO_HOOK_API lgreco_hook_session* lgreco_hook_open(int rank, int world_size, const char* master_host,
                                                      int master_port, const char* layout_json, char* message,
                                                      size_t message_len);

/* The mean over ranks of a bucket's count elements, in place. dtype: 0 float32,
 * 1 float16, 2 bfloat16. step: the training iteration, the same on every rank and never
 * decreasing. Returns LGRECO_HOOK_DONE, _PASS_THROUGH or _ERROR. */
LGRECO_HOOK_API int lgreco_hook_allreduce_mean(lgreco_hook_session* session, uint32_t bucket, uint64_t step,
                                               void* data, uint64_t count, int dtype, char* message,
                                               size_t message_len);

/* The engine's counters, in this order: calls, compressed calls, passed-through calls,
 * uncompressed bytes of the compressed calls, their encoded bytes (one encoding: what
 * the controller minimises), bytes this rank sent (the error probe's included). Writes
 * min(n, 6) values; returns 6, or -1 for a null session. */
LGRECO_HOOK_API int lgreco_hook_counters(lgreco_hook_session* session, uint64_t* values, size_t n);

/* One line of counters (calls, compressed, bytes). 0, or -1 for a null session. */
LGRECO_HOOK_API int lgreco_hook_summary(lgreco_hook_session* session, char* text, size_t text_len);

LGRECO_HOOK_API void lgreco_hook_close(lgreco_hook_session* session);

#ifdef __cplusplus
}
#endif

#endif /* LGRECO_HOOK_H_ */
