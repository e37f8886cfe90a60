/* A stand-in for libcudart with the CUDA runtime's C ABI, for tests without a GPU.
 * Device memory is host memory, copies are memmove, streams and events are tokens.
 *   FAKE_CUDA_DEVICES      how many GPUs cudaGetDeviceCount reports (default 1; 0: none)
 *   FAKE_CUDA_EVENT_NEVER  1: cudaEventQuery never reports completion (a hung collective)
 */
#include <stdlib.h>
#include <string.h>

static int live_allocations;
static __thread int current_device;

static int env_int(const char *name, int fallback) {
  const char *value = getenv(name);
  return value && *value ? atoi(value) : fallback;
}

int cudaGetDeviceCount(int *count) {
  *count = env_int("FAKE_CUDA_DEVICES", 1);
  return *count ? 0 : 100; /* cudaErrorNoDevice */
}
int cudaSetDevice(int device) {
  if (device < 0 || device >= env_int("FAKE_CUDA_DEVICES", 1)) return 101; /* invalid device */
  current_device = device;
  return 0;
}
int cudaGetDevice(int *device) { *device = current_device; return 0; }
int cudaStreamCreateWithFlags(void **stream, unsigned flags) { (void)flags; *stream = malloc(1); return 0; }
int cudaStreamSynchronize(void *stream) { (void)stream; return 0; }
int cudaStreamWaitEvent(void *stream, void *event, unsigned flags) { (void)stream; (void)event; (void)flags; return 0; }
int cudaEventCreateWithFlags(void **event, unsigned flags) { (void)flags; *event = malloc(1); return 0; }
int cudaEventRecord(void *event, void *stream) { (void)event; (void)stream; return 0; }
int cudaEventQuery(void *event) { (void)event; return env_int("FAKE_CUDA_EVENT_NEVER", 0) ? 600 : 0; }
int cudaEventDestroy(void *event) { free(event); return 0; }
int cudaMalloc(void **address, size_t size) { *address = malloc(size); live_allocations++; return *address ? 0 : 2; }
int cudaFree(void *address) { if (address) live_allocations--; free(address); return 0; }
int cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, void *stream) {
  (void)kind; (void)stream;
  memmove(dst, src, count);
  return 0;
}
const char *cudaGetErrorString(int error) {
  switch (error) {
    case 100: return "no CUDA-capable device is detected (fake)";
    case 101: return "invalid device ordinal (fake)";
    case 600: return "device not ready (fake)";
    default: return "unknown error (fake)";
  }
}

/* test-only */
int fakeCudaLiveAllocations(void) { return live_allocations; }
int fakeCudaCurrentDevice(void) { return current_device; }
