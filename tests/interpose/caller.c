/* A framework's shared library, as lgreco's net-plugin loader (plugin/net/loader.h) finds
 * it: linked against a libnccl (fake_libnccl.c), it calls NCCL through its PLT (JUMP_SLOT
 * relocations) and takes ncclGroupEnd's address in code (a GLOB_DAT relocation). The
 * Makefile builds it twice: with lazy binding and no RELRO, and with -z now -z relro (its
 * GOT read-only once loaded). Used by tests/unit/loader_test.cc in-process and by
 * plugin_probe.cc. */
#include <stddef.h>
#include <stdio.h>

typedef int ncclResult_t;
typedef void* ncclComm_t;
typedef void* cudaStream_t;
ncclResult_t ncclAllReduce(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

typedef ncclResult_t (*caller_group_fn)(void);

/* One allreduce of n float32 sums. Returns NCCL's result. */
int caller_all_reduce(const void* send, void* recv, size_t n, void* comm) {
  return ncclAllReduce(send, recv, n, 7 /* float32 */, 0 /* sum */, comm, 0);
}

/* ncclGroupEnd's address as this library sees it: read from its GOT at run time. */
caller_group_fn caller_group_end_address(void) { return ncclGroupEnd; }

static float send_buf[1 << 18], recv_buf[1 << 18];

/* What probe.c does: one allreduce inside a group, one outside, of 1 MiB of float32
 * (above LGRECO_MIN_BYTES). Prints one line; returns non-zero if a call failed. */
int caller_run(void) {
  ncclComm_t comm = (ncclComm_t)0x1234;
  const size_t n = 1 << 18;
  for (size_t i = 0; i < n; ++i) send_buf[i] = (float)i, recv_buf[i] = 0;
  int bad = 0;
  bad |= ncclGroupStart();
  bad |= ncclAllReduce(send_buf, recv_buf, n, 7, 0, comm, 0);
  bad |= ncclGroupEnd();
  bad |= ncclAllReduce(send_buf, recv_buf, n, 7, 0, comm, 0);
  printf("caller: results %s, recv[12345]=%g\n", bad ? "FAILED" : "ok", recv_buf[12345]);
  fflush(stdout);
  return bad;
}
