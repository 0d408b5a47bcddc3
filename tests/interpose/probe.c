/* A program linked against a libnccl (fake_libnccl.c) that calls NCCL as a framework
 * does, through its PLT: with LD_PRELOAD=liblgreco.so those calls reach lgreco first. */
#include <stddef.h>
#include <stdio.h>

typedef int ncclResult_t;
typedef void* ncclComm_t;
typedef void* cudaStream_t;
ncclResult_t ncclAllReduce(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclBroadcast(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t ncclCommDestroy(ncclComm_t);
void fake_nccl_counts(void);

static float send_buf[1 << 18], recv_buf[1 << 18];

int main(void) {
  ncclComm_t comm = (ncclComm_t)0x1234;
  const size_t n = 1 << 18; /* 1 MiB of float32: above LGRECO_MIN_BYTES */
  for (size_t i = 0; i < n; ++i) send_buf[i] = (float)i;
  int bad = 0;
  bad |= ncclGroupStart();
  bad |= ncclAllReduce(send_buf, recv_buf, n, 7 /* float32 */, 0 /* sum */, comm, 0);
  bad |= ncclGroupEnd();
  bad |= ncclAllReduce(send_buf, recv_buf, n, 7, 0, comm, 0);
  bad |= ncclBroadcast(send_buf, recv_buf, n, 7, 0, comm, 0);
  bad |= ncclCommDestroy(comm);
  printf("probe: results %s, recv[12345]=%g\n", bad ? "FAILED" : "ok", recv_buf[12345]);
  fake_nccl_counts();
  return bad;
}
