/* A stand-in for libcudart with the CUDA runtime's C ABI, for tests without a GPU.
 *
 * "Device memory" is host memory. What it keeps of a real GPU is the timing: work given to
 * a stream runs later, on that stream's own worker thread, in the order it was given;
 * an event completes when its stream reaches it; cudaStreamWaitEvent makes a stream wait
 * for another's event. So code that forgets an event wait reads stale data here too.
 * The legacy default stream (0) is a stream of its own (ringplug never uses it).
 *   FAKE_CUDA_DEVICES       how many GPUs cudaGetDeviceCount reports (default 1; 0: none)
 *   FAKE_CUDA_COUNT_ERROR   cudaGetDeviceCount fails with this error (35: the driver is
 *                           older than the runtime)
 *   FAKE_CUDA_EVENT_NEVER   1: cudaEventQuery never reports completion (a hung kernel)
 * Test-only functions (fakeCuda*) let tests and the fake NCCL look inside and enqueue.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { OP_COPY, OP_RECORD, OP_WAIT, OP_CALL, OP_SLEEP };

typedef struct Event {
  long recorded;  /* records asked for */
  long completed; /* records the stream has reached */
} Event;

typedef struct Op {
  int kind;
  void *dst;
  const void *src;
  size_t bytes;
  Event *event;
  long target;
  void (*call)(void *);
  void *argument;
  struct Op *next;
} Op;

typedef struct Stream {
  Op *head, *tail;
  long given, finished;
  pthread_t worker;
} Stream;

/* One lock and one condition for every stream and event: simple, and the fake is not fast. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static int live_allocations, live_streams;
static __thread int current_device;
static Stream *legacy_stream;

static int env_int(const char *name, int fallback) {
  const char *value = getenv(name);
  return value && *value ? atoi(value) : fallback;
}

static void *stream_worker(void *argument) {
  Stream *stream = argument;
  pthread_mutex_lock(&lock);
  for (;;) {
    while (stream->head == NULL) pthread_cond_wait(&changed, &lock);
    Op *op = stream->head;
    if (op->kind == OP_WAIT) {
      while (op->event->completed < op->target) pthread_cond_wait(&changed, &lock);
    } else if (op->kind == OP_RECORD) {
      if (op->event->completed < op->target) op->event->completed = op->target;
    } else {
      pthread_mutex_unlock(&lock);
      if (op->kind == OP_COPY) memmove(op->dst, op->src, op->bytes);
      else if (op->kind == OP_CALL) op->call(op->argument);
      else if (op->kind == OP_SLEEP) {
        struct timespec pause = {(time_t)(op->bytes / 1000), (long)(op->bytes % 1000) * 1000000L};
        nanosleep(&pause, NULL);
      }
      pthread_mutex_lock(&lock);
    }
    stream->head = op->next;
    if (stream->head == NULL) stream->tail = NULL;
    stream->finished++;
    free(op);
    pthread_cond_broadcast(&changed);
  }
  return NULL;
}

static Stream *new_stream(void) {
  Stream *stream = calloc(1, sizeof *stream);
  pthread_attr_t attributes;
  pthread_attr_init(&attributes);
  pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
  pthread_create(&stream->worker, &attributes, stream_worker, stream);
  pthread_attr_destroy(&attributes);
  return stream;
}

/* Streams 0 (legacy), 1 (cudaStreamLegacy) and 2 (cudaStreamPerThread) are the default one. */
static Stream *resolve(void *handle) {
  if ((size_t)handle > 2) return handle;
  pthread_mutex_lock(&lock);
  if (legacy_stream == NULL) legacy_stream = new_stream();
  pthread_mutex_unlock(&lock);
  return legacy_stream;
}

static void enqueue(Stream *stream, Op *op) {
  pthread_mutex_lock(&lock);
  if (stream->tail) stream->tail->next = op;
  else stream->head = op;
  stream->tail = op;
  stream->given++;
  pthread_cond_broadcast(&changed);
  pthread_mutex_unlock(&lock);
}

int cudaGetDeviceCount(int *count) {
  int error = env_int("FAKE_CUDA_COUNT_ERROR", 0);
  if (error) {
    *count = 0;
    return error;
  }
  *count = env_int("FAKE_CUDA_DEVICES", 1);
  return *count ? 0 : 100; /* cudaErrorNoDevice */
}
int cudaDriverGetVersion(int *version) { *version = env_int("FAKE_CUDA_DRIVER_VERSION", 13000); return 0; }
int cudaRuntimeGetVersion(int *version) { *version = 13000; return 0; }
int cudaSetDevice(int device) {
  if (device < 0 || device >= env_int("FAKE_CUDA_DEVICES", 1)) return 101; /* invalid device */
  current_device = device;
  return 0;
}
int cudaGetDevice(int *device) { *device = current_device; return 0; }
int cudaStreamCreateWithFlags(void **stream, unsigned flags) {
  (void)flags;
  *stream = new_stream();
  __atomic_add_fetch(&live_streams, 1, __ATOMIC_SEQ_CST);
  return 0;
}
int cudaStreamSynchronize(void *handle) {
  Stream *stream = resolve(handle);
  pthread_mutex_lock(&lock);
  long target = stream->given;
  while (stream->finished < target) pthread_cond_wait(&changed, &lock);
  pthread_mutex_unlock(&lock);
  return 0;
}
int cudaStreamWaitEvent(void *handle, void *event, unsigned flags) {
  (void)flags;
  if (event == NULL) return 400; /* cudaErrorInvalidResourceHandle */
  Op *op = calloc(1, sizeof *op);
  op->kind = OP_WAIT;
  op->event = event;
  pthread_mutex_lock(&lock);
  op->target = ((Event *)event)->recorded; /* the latest record at the time of the call */
  pthread_mutex_unlock(&lock);
  enqueue(resolve(handle), op);
  return 0;
}
int cudaEventCreateWithFlags(void **event, unsigned flags) { (void)flags; *event = calloc(1, sizeof(Event)); return 0; }
int cudaEventRecord(void *event, void *handle) {
  if (event == NULL) return 400;
  Op *op = calloc(1, sizeof *op);
  op->kind = OP_RECORD;
  op->event = event;
  pthread_mutex_lock(&lock);
  op->target = ++((Event *)event)->recorded;
  pthread_mutex_unlock(&lock);
  enqueue(resolve(handle), op);
  return 0;
}
int cudaEventQuery(void *handle) {
  Event *event = handle;
  if (env_int("FAKE_CUDA_EVENT_NEVER", 0)) return 600;
  pthread_mutex_lock(&lock);
  int done = event->completed >= event->recorded;
  pthread_mutex_unlock(&lock);
  return done ? 0 : 600; /* cudaErrorNotReady */
}
int cudaEventSynchronize(void *handle) {
  Event *event = handle;
  pthread_mutex_lock(&lock);
  while (event->completed < event->recorded) pthread_cond_wait(&changed, &lock);
  pthread_mutex_unlock(&lock);
  return 0;
}
int cudaEventDestroy(void *event) { (void)event; return 0; } /* a queued wait may still read it */
int cudaMalloc(void **address, size_t size) {
  *address = calloc(1, size);
  if (*address == NULL) return 2; /* cudaErrorMemoryAllocation */
  __atomic_add_fetch(&live_allocations, 1, __ATOMIC_SEQ_CST);
  return 0;
}
int cudaFree(void *address) {
  if (address) __atomic_sub_fetch(&live_allocations, 1, __ATOMIC_SEQ_CST);
  free(address);
  return 0;
}
int cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, void *handle) {
  if (kind < 0 || kind > 4) return 21; /* cudaErrorInvalidMemcpyDirection */
  Op *op = calloc(1, sizeof *op);
  op->kind = OP_COPY;
  op->dst = dst;
  op->src = src;
  op->bytes = count;
  enqueue(resolve(handle), op);
  return 0;
}
const char *cudaGetErrorString(int error) {
  switch (error) {
    case 2: return "out of memory (fake)";
    case 21: return "invalid copy direction for memcpy (fake)";
    case 35: return "CUDA driver version is insufficient for CUDA runtime version (fake)";
    case 100: return "no CUDA-capable device is detected (fake)";
    case 101: return "invalid device ordinal (fake)";
    case 400: return "invalid resource handle (fake)";
    case 600: return "device not ready (fake)";
    default: return "unknown error (fake)";
  }
}

/* test-only */
int fakeCudaLiveAllocations(void) { return live_allocations; }
int fakeCudaCurrentDevice(void) { return current_device; }
/* Run call(argument) on the stream's worker, in stream order (the fake NCCL's kernels). */
void fakeCudaEnqueue(void *handle, void (*call)(void *), void *argument) {
  Op *op = calloc(1, sizeof *op);
  op->kind = OP_CALL;
  op->call = call;
  op->argument = argument;
  enqueue(resolve(handle), op);
}
/* Keep the stream busy for `ms` milliseconds (as torch.cuda._sleep does on a GPU). */
int fakeCudaSleep(void *handle, int ms) {
  Op *op = calloc(1, sizeof *op);
  op->kind = OP_SLEEP;
  op->bytes = (size_t)(ms < 0 ? 0 : ms);
  enqueue(resolve(handle), op);
  return 0;
}
