/* A stand-in libnccl for testing interposition without a GPU (tests/unit/library_test.cc).
 * Like the real one, each public ncclXxx is a weak alias of its pncclXxx, so a library
 * preloaded ahead of it (liblgreco.so) wins the ncclXxx names while pncclXxx stays
 * reachable. One communicator of one rank; the collectives copy or do nothing; every
 * call is counted, and fake_nccl_counts() prints the counts. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

typedef int ncclResult_t;
typedef void* ncclComm_t;
typedef void* cudaStream_t;

static int n_allreduce, n_allgather, n_broadcast, n_group_start, n_group_end, n_destroy, n_send, n_recv;

static size_t type_size(int t) { return t == 6 || t == 9 ? 2 : t == 4 || t == 5 || t == 8 ? 8 : t <= 1 ? 1 : 4; }

#define ALIAS(name) __attribute__((weak, alias("p" #name)))

ncclResult_t ncclGetVersion(int* v) { *v = 22809; return 0; }
const char* pncclGetErrorString(int r) { return r ? "fake error" : "no error"; }
const char* ncclGetErrorString(int r) ALIAS(ncclGetErrorString);
ncclResult_t pncclAllReduce(const void* s, void* r, size_t n, int t, int op, ncclComm_t c, cudaStream_t st) {
  (void)op, (void)c, (void)st;
  ++n_allreduce;
  if (s != r) memmove(r, s, n * type_size(t));
  return 0;
}
ncclResult_t ncclAllReduce(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t) ALIAS(ncclAllReduce);
ncclResult_t pncclAllGather(const void* s, void* r, size_t n, int t, ncclComm_t c, cudaStream_t st) {
  (void)c, (void)st;
  ++n_allgather;
  memmove(r, s, n * type_size(t));
  return 0;
}
ncclResult_t ncclAllGather(const void*, void*, size_t, int, ncclComm_t, cudaStream_t) ALIAS(ncclAllGather);
ncclResult_t pncclBroadcast(const void* s, void* r, size_t n, int t, int root, ncclComm_t c, cudaStream_t st) {
  (void)root, (void)c, (void)st;
  ++n_broadcast;
  if (s != r) memmove(r, s, n * type_size(t));
  return 0;
}
ncclResult_t ncclBroadcast(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t) ALIAS(ncclBroadcast);
ncclResult_t pncclSend(const void* d, size_t n, int t, int peer, ncclComm_t c, cudaStream_t st) {
  (void)d, (void)n, (void)t, (void)peer, (void)c, (void)st;
  ++n_send;
  return 0;
}
ncclResult_t pncclRecv(void* d, size_t n, int t, int peer, ncclComm_t c, cudaStream_t st) {
  (void)d, (void)n, (void)t, (void)peer, (void)c, (void)st;
  ++n_recv;
  return 0;
}
ncclResult_t pncclGroupStart(void) { ++n_group_start; return 0; }
ncclResult_t ncclGroupStart(void) ALIAS(ncclGroupStart);
ncclResult_t pncclGroupEnd(void) { ++n_group_end; return 0; }
ncclResult_t ncclGroupEnd(void) ALIAS(ncclGroupEnd);
ncclResult_t pncclCommCount(ncclComm_t c, int* n) { (void)c; *n = 1; return 0; }
ncclResult_t pncclCommUserRank(ncclComm_t c, int* r) { (void)c; *r = 0; return 0; }
ncclResult_t pncclCommCuDevice(ncclComm_t c, int* d) { (void)c; *d = 0; return 0; }
ncclResult_t pncclCommGetAsyncError(ncclComm_t c, int* e) { (void)c; *e = 0; return 0; }
ncclResult_t pncclCommDestroy(ncclComm_t c) { (void)c; ++n_destroy; return 0; }
ncclResult_t ncclCommDestroy(ncclComm_t) ALIAS(ncclCommDestroy);
ncclResult_t pncclCommAbort(ncclComm_t c) { (void)c; return 0; }

void fake_nccl_counts(void) {
  printf("fake nccl: allreduce=%d allgather=%d broadcast=%d send=%d recv=%d group_start=%d group_end=%d destroy=%d\n",
         n_allreduce, n_allgather, n_broadcast, n_send, n_recv, n_group_start, n_group_end, n_destroy);
}
