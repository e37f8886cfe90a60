/* A stand-in for libnccl.so.2 with NCCL's C ABI, for tests on machines without a GPU.
 *
 * "Device memory" is host memory (see fake_cudart.c). Collectives compute what a
 * communicator of one rank would; communicators of several ranks can be created (to test
 * how ranks share the unique id) but refuse collectives. Environment variables make it
 * misbehave the way a real NCCL does when things go wrong:
 *   FAKE_NCCL_VERSION       the version code ncclGetVersion reports (default 23203)
 *   FAKE_NCCL_INIT_ERROR    ncclCommInitRank returns this result (e.g. 1)
 *   FAKE_NCCL_ASYNC_ERROR   ncclCommGetAsyncError reports this once a collective ran
 *   FAKE_NCCL_FAIL_CALL     the N-th collective call returns ncclSystemError
 * Test-only functions (fakeNccl*) let tests look inside.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int ncclResult_t;
typedef struct { char internal[128]; } ncclUniqueId;

typedef struct {
  int nranks, rank, aborted, calls;
  char uid[128];
} FakeComm;

static char last_error[256];
static int aborts, group_depth, max_group_depth, premul_live;
static double premul_scalars[64];
static int premul_used[64];

static int env_int(const char *name, int fallback) {
  const char *value = getenv(name);
  return value && *value ? atoi(value) : fallback;
}

static size_t type_size(int type) {
  switch (type) {
    case 0: case 1: return 1;
    case 2: case 3: case 7: return 4;
    case 4: case 5: case 8: return 8;
    case 6: case 9: return 2;
    default: return 0;
  }
}

static float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    float value = man / 1024.0f / 16384.0f;
    return sign ? -value : value;
  }
  bits = exp == 31 ? sign | 0x7f800000 | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

static uint16_t float_to_half(float f) { /* round to nearest even, normal range only */
  uint32_t bits;
  memcpy(&bits, &f, 4);
  uint32_t sign = (bits >> 16) & 0x8000;
  int exp = (int)((bits >> 23) & 0xff) - 127 + 15;
  uint32_t man = bits & 0x7fffff;
  if (exp <= 0) return (uint16_t)sign;
  if (exp >= 31) return (uint16_t)(sign | 0x7c00);
  uint32_t half = sign | ((uint32_t)exp << 10) | (man >> 13);
  uint32_t rest = man & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++;
  return (uint16_t)half;
}

static void scale(void *data, size_t count, int type, double factor) {
  for (size_t i = 0; i < count; i++) {
    if (type == 7) ((float *)data)[i] *= (float)factor;
    else if (type == 8) ((double *)data)[i] *= factor;
    else if (type == 6) ((uint16_t *)data)[i] = float_to_half(half_to_float(((uint16_t *)data)[i]) * (float)factor);
    else if (type == 9) {
      uint32_t bits = (uint32_t)((uint16_t *)data)[i] << 16;
      float value;
      memcpy(&value, &bits, 4);
      value *= (float)factor;
      memcpy(&bits, &value, 4);
      ((uint16_t *)data)[i] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    }
  }
}

ncclResult_t ncclGetVersion(int *version) { *version = env_int("FAKE_NCCL_VERSION", 23203); return 0; }

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  static unsigned counter;
  memset(id, 0, sizeof *id);
  snprintf(id->internal, sizeof id->internal, "fake-nccl-id pid=%d n=%u", (int)getpid(), ++counter);
  return 0;
}

const char *ncclGetErrorString(ncclResult_t result) {
  static const char *texts[] = {"no error", "unhandled cuda error (fake)", "unhandled system error (fake)",
                                "internal error (fake)", "invalid argument (fake)", "invalid usage (fake)",
                                "remote process exited or there was a network error (fake)",
                                "NCCL operation in progress (fake)", "timeout (fake)"};
  return result >= 0 && result < 9 ? texts[result] : "unknown result (fake)";
}

const char *ncclGetLastError(void *comm) { (void)comm; return last_error; }

ncclResult_t ncclCommInitRank(void **comm, int nranks, ncclUniqueId id, int rank) {
  int error = env_int("FAKE_NCCL_INIT_ERROR", 0);
  if (error) {
    snprintf(last_error, sizeof last_error, "Cuda failure 35 'CUDA driver version is insufficient' (fake)");
    return error;
  }
  if (rank < 0 || rank >= nranks) return 4;
  FakeComm *c = calloc(1, sizeof *c);
  c->nranks = nranks;
  c->rank = rank;
  memcpy(c->uid, id.internal, sizeof c->uid);
  *comm = c;
  return 0;
}

static ncclResult_t collective(FakeComm *c) {
  if (c == NULL || c->aborted) return 5;
  c->calls++;
  if (c->calls == env_int("FAKE_NCCL_FAIL_CALL", 0)) {
    snprintf(last_error, sizeof last_error, "socket closed by peer (fake)");
    return 2;
  }
  if (c->nranks != 1) {
    snprintf(last_error, sizeof last_error, "the fake NCCL reduces over one rank only");
    return 5;
  }
  return 0;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, int type, int op, void *comm, void *stream) {
  (void)stream;
  ncclResult_t result = collective(comm);
  if (result) return result;
  memmove(recv, send, count * type_size(type));
  if (op >= 5) {
    if (op - 5 >= 64 || !premul_used[op - 5]) return 4;
    scale(recv, count, type, premul_scalars[op - 5]);
  }
  return 0;
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, int type, int root, void *comm, void *stream) {
  (void)stream;
  ncclResult_t result = collective(comm);
  if (result) return result;
  if (root != 0) return 4;
  memmove(recv, send, count * type_size(type));
  return 0;
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, int type, void *comm, void *stream) {
  return ncclBroadcast(send, recv, count, type, 0, comm, stream);
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, int type, int op, void *comm, void *stream) {
  return ncclAllReduce(send, recv, count, type, op, comm, stream);
}

ncclResult_t ncclGroupStart(void) {
  if (++group_depth > max_group_depth) max_group_depth = group_depth;
  return 0;
}

ncclResult_t ncclGroupEnd(void) { return group_depth-- > 0 ? 0 : 5; }

ncclResult_t ncclRedOpCreatePreMulSum(int *op, void *scalar, int type, int residence, void *comm) {
  (void)comm;
  if (residence != 1) return 4;
  for (int i = 0; i < 64; i++) {
    if (premul_used[i]) continue;
    double value = 0;
    if (type == 7) value = *(float *)scalar;
    else if (type == 8) value = *(double *)scalar;
    else if (type == 6) value = half_to_float(*(uint16_t *)scalar);
    else if (type == 9) { uint32_t bits = (uint32_t)(*(uint16_t *)scalar) << 16; float f; memcpy(&f, &bits, 4); value = f; }
    else return 4;
    premul_used[i] = 1;
    premul_scalars[i] = value;
    premul_live++;
    *op = 5 + i;
    return 0;
  }
  return 3;
}

ncclResult_t ncclRedOpDestroy(int op, void *comm) {
  (void)comm;
  if (op < 5 || op - 5 >= 64 || !premul_used[op - 5]) return 4;
  premul_used[op - 5] = 0;
  premul_live--;
  return 0;
}

ncclResult_t ncclCommGetAsyncError(void *comm, ncclResult_t *error) {
  FakeComm *c = comm;
  *error = c->calls > 0 ? env_int("FAKE_NCCL_ASYNC_ERROR", 0) : 0;
  if (*error) snprintf(last_error, sizeof last_error, "peer rank 1 closed its connection (fake)");
  return 0;
}

ncclResult_t ncclCommAbort(void *comm) { ((FakeComm *)comm)->aborted = 1; aborts++; return 0; }
ncclResult_t ncclCommDestroy(void *comm) { free(comm); return 0; }
ncclResult_t ncclCommCount(void *comm, int *count) { *count = ((FakeComm *)comm)->nranks; return 0; }
ncclResult_t ncclCommCuDevice(void *comm, int *device) { (void)comm; *device = 0; return 0; }
ncclResult_t ncclCommUserRank(void *comm, int *rank) { *rank = ((FakeComm *)comm)->rank; return 0; }

/* test-only */
int fakeNcclAborts(void) { return aborts; }
int fakeNcclMaxGroupDepth(void) { return max_group_depth; }
int fakeNcclLivePremulOps(void) { return premul_live; }
const char *fakeNcclCommUid(void *comm) { return ((FakeComm *)comm)->uid; }
int fakeNcclCommRanks(void *comm) { return ((FakeComm *)comm)->nranks; }
