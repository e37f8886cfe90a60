/* A stand-in for libnccl.so.2 with NCCL's C ABI, for tests on machines without a GPU.
 *
 * It is linked against the fake CUDA runtime (fake_cudart.c), whose "device memory" is host
 * memory and whose streams run their work later, on a thread of their own. It behaves as
 * NCCL does where ringplug can get it wrong:
 * - ranks in separate processes meet through the unique id (a folder that ncclGetUniqueId
 *   makes), and every collective computes the real result across them, for every
 *   ncclDataType_t and ncclRedOp_t, PreMulSum included: a wrong op or type code gives a
 *   wrong result (or ncclInvalidArgument), as on a GPU;
 * - collectives are enqueued on the caller's stream and run when the stream reaches them;
 *   within ncclGroupStart/End they are launched at ncclGroupEnd;
 * - a blocking ncclCommInitRank waits for every rank with no deadline, as NCCL does; with
 *   ncclCommInitRankConfig and config.blocking = 0 it returns ncclInProgress and the
 *   communicator's ncclCommGetAsyncError says ncclInProgress until every rank arrived;
 * - two ranks on the same device of the same host (NCCL_HOSTID, else the host name) are
 *   refused with ncclInvalidUsage ("Duplicate GPU detected");
 * - a collective waits for its peers forever; if a peer's process is gone the communicator
 *   fails with ncclRemoteError; ncclCommAbort ends every wait;
 * - ncclCommDestroy waits for the communicator's work to finish (forever if a peer is gone).
 * Safety cap (not NCCL): no wait lasts longer than FAKE_NCCL_WAIT_CAP_S (default 300) s, so
 * that a broken test cannot leave processes behind for ever.
 * Environment variables make it fail the way a real NCCL does when things go wrong:
 *   FAKE_NCCL_VERSION       the version code ncclGetVersion reports (default 23203)
 *   FAKE_NCCL_INIT_ERROR    communicator init returns this result (e.g. 1)
 *   FAKE_NCCL_ASYNC_ERROR   ncclCommGetAsyncError reports this once a collective ran
 *   FAKE_NCCL_FAIL_CALL     the N-th collective call returns ncclSystemError
 *   FAKE_NCCL_DIR           where unique-id folders are made (default TMPDIR, /tmp)
 * Test-only functions (fakeNccl*) let tests look inside.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int ncclResult_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct { /* the prefix every ncclConfig_t since 2.14 starts with */
  size_t size;
  unsigned int magic, version;
  int blocking;
} ConfigPrefix;

enum { SUCCESS = 0, SYSTEM = 2, INTERNAL = 3, INVALID_ARGUMENT = 4, INVALID_USAGE = 5, REMOTE = 6,
       IN_PROGRESS = 7 };
enum { SUM, PROD, MAX, MIN, AVG, NUM_OPS };
enum { ALLREDUCE, BROADCAST, ALLGATHER, REDUCESCATTER };
#define MAX_CUSTOM_OPS 64
#define MAX_RANKS 64

/* The fake CUDA runtime's functions, found in the process at the first init (the real NCCL
 * carries its own CUDA runtime, so no libcudart is among its dependencies either). */
static int (*cuda_get_device)(int *);
static void (*cuda_enqueue)(void *, void (*)(void *), void *);

static int has_fake_runtime(struct dl_phdr_info *info, size_t size, void *found) {
  (void)size;
  if (info->dlpi_name == NULL || info->dlpi_name[0] == 0) return 0;
  void *library = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
  if (library == NULL) return 0;
  if (dlsym(library, "fakeCudaEnqueue") == NULL) {
    dlclose(library);
    return 0;
  }
  *(void **)found = library;
  return 1;
}

static int bind_runtime(void) {
  if (cuda_enqueue != NULL) return 0;
  void *library = NULL;
  dl_iterate_phdr(has_fake_runtime, &library);
  if (library == NULL) {
    const char *path = getenv("RINGPLUG_CUDART_LIB");
    library = dlopen(path && *path ? path : "libcudart.so.13", RTLD_LAZY);
  }
  if (library == NULL) return -1;
  cuda_get_device = (int (*)(int *))dlsym(library, "cudaGetDevice");
  cuda_enqueue = (void (*)(void *, void (*)(void *), void *))dlsym(library, "fakeCudaEnqueue");
  return cuda_get_device && cuda_enqueue ? 0 : -1;
}

typedef struct {
  int used, type, on_device;
  double value;
  const void *address;
} PremulOp;

typedef struct Comm {
  int nranks, rank, device, blocking, aborted, calls, ran;
  volatile int state; /* what ncclCommGetAsyncError says */
  char dir[96], uid[128], host[64];
  pid_t pids[MAX_RANKS];
  long enqueued, finished; /* collectives given to streams, and run */
  PremulOp ops[MAX_CUSTOM_OPS];
  pthread_mutex_t lock;
  pthread_cond_t changed;
} Comm;

typedef struct Coll {
  Comm *comm;
  int kind, type, op, root;
  const void *send;
  void *recv;
  size_t count;
  long seq;
  double scalar; /* PreMulSum */
  int premul;
  const void *scalar_address;
  struct Coll *next;
  void *stream;
} Coll;

static char last_error[512]; /* one per process, as NCCL's */
static int aborts, group_depth, max_group_depth, premul_live, collectives_run;
static __thread Coll *group_head, *group_tail;

static int env_int(const char *name, int fallback) {
  const char *value = getenv(name);
  return value && *value ? atoi(value) : fallback;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pause_a_little(int *delay_us) {
  usleep(*delay_us);
  if (*delay_us < 2000) *delay_us *= 2;
}

static size_t type_size(int type) {
  switch (type) {
    case 0: case 1: case 10: case 11: return 1;
    case 2: case 3: case 7: return 4;
    case 4: case 5: case 8: return 8;
    case 6: case 9: return 2;
    default: return 0;
  }
}

/* ------------------------------------------------------------------ element conversions */
static float bf16_to_float(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float value;
  memcpy(&value, &bits, 4);
  return value;
}

static uint16_t float_to_bf16(float value) { /* round to nearest even, as torch */
  uint32_t bits;
  memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
  return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

static double load(const void *data, size_t i, int type) {
  switch (type) {
    case 0: return ((const int8_t *)data)[i];
    case 1: return ((const uint8_t *)data)[i];
    case 2: return ((const int32_t *)data)[i];
    case 3: return ((const uint32_t *)data)[i];
    case 6: return (double)((const _Float16 *)data)[i];
    case 7: return ((const float *)data)[i];
    case 8: return ((const double *)data)[i];
    case 9: return bf16_to_float(((const uint16_t *)data)[i]);
    default: return 0;
  }
}

static void store(void *data, size_t i, int type, double value) {
  switch (type) {
    case 0: ((int8_t *)data)[i] = (int8_t)(int64_t)value; break;
    case 1: ((uint8_t *)data)[i] = (uint8_t)(int64_t)value; break;
    case 2: ((int32_t *)data)[i] = (int32_t)(int64_t)value; break;
    case 3: ((uint32_t *)data)[i] = (uint32_t)(int64_t)value; break;
    case 6: ((_Float16 *)data)[i] = (_Float16)(float)value; break;
    case 7: ((float *)data)[i] = (float)value; break;
    case 8: ((double *)data)[i] = value; break;
    case 9: ((uint16_t *)data)[i] = float_to_bf16((float)value); break;
  }
}

static double rounded(double value, int type) { /* value as the element type holds it */
  char cell[8];
  store(cell, 0, type, value);
  return load(cell, 0, type);
}

static int is_integer(int type) { return type <= 5; }

/* out[i] = reduction over ranks of inputs[r][i]; 64-bit integers exactly, the rest via double */
static void reduce(void *out, const void *const *inputs, int n, size_t count, int type, int op,
                   double scalar) {
  for (size_t i = 0; i < count; i++) {
    if (type == 4 || type == 5) {
      int64_t acc = 0;
      uint64_t uacc = 0;
      for (int r = 0; r < n; r++) {
        int64_t v = ((const int64_t *)inputs[r])[i];
        uint64_t u = ((const uint64_t *)inputs[r])[i];
        if (r == 0) { acc = v; uacc = u; continue; }
        if (op == SUM || op == AVG) { acc += v; uacc += u; }
        else if (op == PROD) { acc *= v; uacc *= u; }
        else if (op == MAX) { if (v > acc) acc = v; if (u > uacc) uacc = u; }
        else if (op == MIN) { if (v < acc) acc = v; if (u < uacc) uacc = u; }
      }
      if (op == AVG) { acc /= n; uacc /= (uint64_t)n; }
      if (type == 4) ((int64_t *)out)[i] = acc;
      else ((uint64_t *)out)[i] = uacc;
      continue;
    }
    double acc = 0;
    for (int r = 0; r < n; r++) {
      double v = load(inputs[r], i, type);
      if (op >= NUM_OPS) v = rounded(v * scalar, type); /* PreMulSum: each input scaled */
      if (r == 0) { acc = v; continue; }
      if (op == SUM || op == AVG || op >= NUM_OPS) acc += v;
      else if (op == PROD) acc *= v;
      else if (op == MAX) acc = (isnan(v) || v > acc) ? v : acc;
      else if (op == MIN) acc = (isnan(v) || v < acc) ? v : acc;
    }
    if (op == AVG) acc = is_integer(type) ? (double)(int64_t)(acc / n) : acc / n;
    store(out, i, type, acc);
  }
}

/* ------------------------------------------------------------------ files of the meeting folder */
static void path_of(char *out, size_t size, Comm *c, const char *what, long seq, int rank) {
  if (seq >= 0) snprintf(out, size, "%s/%s%ld.%d", c->dir, what, seq, rank);
  else snprintf(out, size, "%s/%s.%d", c->dir, what, rank);
}

static int write_file(const char *path, const void *data, size_t bytes) {
  char temporary[160];
  snprintf(temporary, sizeof temporary, "%s.tmp", path);
  FILE *f = fopen(temporary, "wb");
  if (f == NULL) return -1;
  size_t written = bytes ? fwrite(data, 1, bytes, f) : 0;
  fclose(f);
  if (written != bytes) return -1;
  return rename(temporary, path);
}

static void *read_file(const char *path, size_t *bytes) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return NULL;
  fseek(f, 0, SEEK_END);
  long size = ftell(f);
  fseek(f, 0, SEEK_SET);
  void *data = malloc(size > 0 ? (size_t)size : 1);
  if (size > 0 && fread(data, 1, (size_t)size, f) != (size_t)size) {
    free(data);
    fclose(f);
    return NULL;
  }
  fclose(f);
  *bytes = (size_t)size;
  return data;
}

static int gone(pid_t pid) { return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH; }

/* Wait until every rank wrote `what` for `seq`; returns SUCCESS, REMOTE (a peer's process is
 * gone), INTERNAL (aborted) or SYSTEM (the safety cap). */
static int wait_for_all(Comm *c, const char *what, long seq) {
  double start = now(), cap = env_int("FAKE_NCCL_WAIT_CAP_S", 300), last_look = start;
  int delay = 50;
  char path[160];
  for (;;) {
    int missing = -1;
    for (int r = 0; r < c->nranks && missing < 0; r++) {
      path_of(path, sizeof path, c, what, seq, r);
      if (access(path, F_OK) != 0) missing = r;
    }
    if (missing < 0) return SUCCESS;
    if (c->aborted) return INTERNAL;
    double t = now();
    if (t - last_look > 0.05) {
      last_look = t;
      if (c->pids[missing] && gone(c->pids[missing])) {
        snprintf(last_error, sizeof last_error,
                 "remote process exited or there was a network error: rank %d (pid %d) is gone "
                 "(fake)", missing, (int)c->pids[missing]);
        return REMOTE;
      }
    }
    if (t - start > cap) {
      snprintf(last_error, sizeof last_error, "the fake's safety cap of %g s ran out", cap);
      return SYSTEM;
    }
    pause_a_little(&delay);
  }
}

/* ------------------------------------------------------------------ communicators */
static int meet(Comm *c) {
  char path[160], line[128];
  snprintf(line, sizeof line, "%d %s %d\n", (int)getpid(), c->host, c->device);
  path_of(path, sizeof path, c, "rank", -1, c->rank);
  if (write_file(path, line, strlen(line)) != 0) {
    snprintf(last_error, sizeof last_error, "cannot write %s (fake)", path);
    return SYSTEM;
  }
  int result = wait_for_all(c, "rank", -1);
  if (result != SUCCESS) return result;
  for (int r = 0; r < c->nranks; r++) {
    size_t bytes = 0;
    path_of(path, sizeof path, c, "rank", -1, r);
    char *text = read_file(path, &bytes);
    if (text == NULL) return SYSTEM;
    int pid = 0, device = -1;
    char host[64] = "";
    text[bytes ? bytes - 1 : 0] = 0;
    sscanf(text, "%d %63s %d", &pid, host, &device);
    free(text);
    c->pids[r] = pid;
    if (r != c->rank && device == c->device && strcmp(host, c->host) == 0) {
      snprintf(last_error, sizeof last_error,
               "Duplicate GPU detected : rank %d and rank %d both on CUDA device %d (fake)",
               r < c->rank ? r : c->rank, r < c->rank ? c->rank : r, device);
      return INVALID_USAGE;
    }
  }
  return SUCCESS;
}

static void *meet_later(void *argument) {
  Comm *c = argument;
  int result = meet(c);
  c->state = result;
  return NULL;
}

static ncclResult_t init(Comm **out, int nranks, ncclUniqueId id, int rank, int blocking) {
  int error = env_int("FAKE_NCCL_INIT_ERROR", 0);
  if (error) {
    snprintf(last_error, sizeof last_error, "Cuda failure 35 'CUDA driver version is insufficient' (fake)");
    return error;
  }
  if (nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks) {
    snprintf(last_error, sizeof last_error, "Invalid rank requested : %d/%d (fake)", rank, nranks);
    return INVALID_ARGUMENT;
  }
  const char *dir = strstr(id.internal, "dir=");
  if (dir == NULL) {
    snprintf(last_error, sizeof last_error, "not a unique id of this fake NCCL");
    return INVALID_ARGUMENT;
  }
  if (bind_runtime() != 0) {
    snprintf(last_error, sizeof last_error, "the fake CUDA runtime is not loaded (fake)");
    return 1;
  }
  Comm *c = calloc(1, sizeof *c);
  c->nranks = nranks;
  c->rank = rank;
  c->blocking = blocking;
  memcpy(c->uid, id.internal, sizeof c->uid);
  snprintf(c->dir, sizeof c->dir, "%s", dir + 4);
  cuda_get_device(&c->device);
  const char *host = getenv("NCCL_HOSTID");
  if (host && *host) snprintf(c->host, sizeof c->host, "%s", host);
  else gethostname(c->host, sizeof c->host);
  pthread_mutex_init(&c->lock, NULL);
  pthread_cond_init(&c->changed, NULL);
  *out = c;
  if (!blocking) {
    c->state = IN_PROGRESS;
    pthread_t thread;
    pthread_create(&thread, NULL, meet_later, c);
    pthread_detach(thread);
    return IN_PROGRESS;
  }
  c->state = meet(c);
  return c->state;
}

static void leave(Comm *c) {
  /* The last rank to leave removes the folder; earlier ones leave their last files, which a
   * slower peer may still be reading. */
  char path[160];
  path_of(path, sizeof path, c, "left", -1, c->rank);
  write_file(path, "", 0);
  for (int r = 0; r < c->nranks; r++) {
    path_of(path, sizeof path, c, "left", -1, r);
    if (access(path, F_OK) != 0) return;
  }
  char command[200];
  snprintf(command, sizeof command, "rm -rf '%s'", c->dir);
  if (system(command) != 0) { /* best effort */ }
}

/* ------------------------------------------------------------------ collectives */
static size_t contribution(Coll *k) {
  size_t size = type_size(k->type);
  if (k->kind == BROADCAST) return k->comm->rank == k->root ? k->count * size : 0;
  if (k->kind == REDUCESCATTER) return (size_t)k->comm->nranks * k->count * size;
  return k->count * size;
}

static void run(void *argument) { /* on the stream's worker, in stream order */
  Coll *k = argument;
  Comm *c = k->comm;
  pthread_mutex_lock(&c->lock);
  while (c->finished != k->seq && !c->aborted) pthread_cond_wait(&c->changed, &c->lock);
  pthread_mutex_unlock(&c->lock);
  int failed = c->state != SUCCESS && c->state != IN_PROGRESS; /* (finalizing: in progress) */
  int result = c->aborted || failed ? INTERNAL : SUCCESS;
  char path[160];
  size_t size = type_size(k->type), mine = contribution(k);
  if (result == SUCCESS) {
    path_of(path, sizeof path, c, "c", k->seq, c->rank);
    result = write_file(path, k->send, mine) == 0 ? SUCCESS : SYSTEM;
  }
  if (result == SUCCESS) result = wait_for_all(c, "c", k->seq);
  if (result == SUCCESS) {
    void *inputs[MAX_RANKS] = {0};
    for (int r = 0; r < c->nranks && result == SUCCESS; r++) {
      size_t bytes = 0;
      path_of(path, sizeof path, c, "c", k->seq, r);
      inputs[r] = read_file(path, &bytes);
      if (inputs[r] == NULL) result = SYSTEM;
    }
    if (result == SUCCESS) {
      double scalar = k->scalar;
      if (k->premul && k->scalar_address) scalar = load(k->scalar_address, 0, k->type);
      if (k->kind == ALLREDUCE) {
        reduce(k->recv, (const void *const *)inputs, c->nranks, k->count, k->type, k->op, scalar);
      } else if (k->kind == BROADCAST) {
        memcpy(k->recv, inputs[k->root], k->count * size);
      } else if (k->kind == ALLGATHER) {
        for (int r = 0; r < c->nranks; r++)
          memcpy((char *)k->recv + (size_t)r * k->count * size, inputs[r], k->count * size);
      } else {
        const void *blocks[MAX_RANKS];
        for (int r = 0; r < c->nranks; r++)
          blocks[r] = (const char *)inputs[r] + (size_t)c->rank * k->count * size;
        reduce(k->recv, blocks, c->nranks, k->count, k->type, k->op, scalar);
      }
      __atomic_add_fetch(&collectives_run, 1, __ATOMIC_SEQ_CST);
    }
    for (int r = 0; r < c->nranks; r++) free(inputs[r]);
    /* Every peer wrote this one, so every peer has read the one before: drop mine. */
    if (k->seq > 0) {
      path_of(path, sizeof path, c, "c", k->seq - 1, c->rank);
      unlink(path);
    }
  }
  pthread_mutex_lock(&c->lock);
  if (result != SUCCESS && result != INTERNAL) {
    /* As a kernel whose peer is gone: it never finishes; the error shows in
     * ncclCommGetAsyncError, and only ncclCommAbort ends the wait. */
    if (c->state == SUCCESS) c->state = result;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += env_int("FAKE_NCCL_WAIT_CAP_S", 300);
    while (!c->aborted && pthread_cond_timedwait(&c->changed, &c->lock, &until) == 0) {
    }
  }
  c->ran = 1;
  c->finished = k->seq + 1;
  pthread_cond_broadcast(&c->changed);
  pthread_mutex_unlock(&c->lock);
  free(k);
}

static void launch(Coll *k) {
  Comm *c = k->comm;
  pthread_mutex_lock(&c->lock);
  k->seq = c->enqueued++;
  pthread_mutex_unlock(&c->lock);
  cuda_enqueue(k->stream, run, k);
}

static ncclResult_t submit(int kind, const void *send, void *recv, size_t count, int type, int op,
                           int root, void *comm, void *stream) {
  Comm *c = comm;
  static const char *names[] = {"AllReduce", "Broadcast", "AllGather", "ReduceScatter"};
  if (c == NULL) {
    snprintf(last_error, sizeof last_error, "%s : comm argument is NULL (fake)", names[kind]);
    return INVALID_ARGUMENT;
  }
  if (c->aborted) return INVALID_USAGE;
  if (c->state != SUCCESS) return c->state == IN_PROGRESS ? INVALID_USAGE : c->state;
  if (++c->calls == env_int("FAKE_NCCL_FAIL_CALL", 0)) {
    snprintf(last_error, sizeof last_error, "socket closed by peer (fake)");
    return SYSTEM;
  }
  if (type_size(type) == 0 || type >= 10) {
    snprintf(last_error, sizeof last_error, "%s : invalid type %d (fake)", names[kind], type);
    return INVALID_ARGUMENT;
  }
  Coll *k = calloc(1, sizeof *k);
  k->comm = c;
  k->kind = kind;
  k->send = send;
  k->recv = recv;
  k->count = count;
  k->type = type;
  k->op = op;
  k->root = root;
  k->stream = stream;
  if (kind == ALLREDUCE || kind == REDUCESCATTER) {
    if (op < 0 || (op >= NUM_OPS && (op - NUM_OPS >= MAX_CUSTOM_OPS || !c->ops[op - NUM_OPS].used))) {
      snprintf(last_error, sizeof last_error, "%s : invalid reduction operation %d (fake)", names[kind], op);
      free(k);
      return INVALID_ARGUMENT;
    }
    if (op >= NUM_OPS) {
      PremulOp *p = &c->ops[op - NUM_OPS];
      if (p->type != type) {
        snprintf(last_error, sizeof last_error,
                 "%s : reduction operation %d was created for type %d, used with type %d (fake)",
                 names[kind], op, p->type, type);
        free(k);
        return INVALID_ARGUMENT;
      }
      k->premul = 1;
      k->scalar = p->value;
      k->scalar_address = p->on_device ? p->address : NULL;
    }
  }
  if (kind == BROADCAST && (root < 0 || root >= c->nranks)) {
    snprintf(last_error, sizeof last_error, "Broadcast : invalid root %d (fake)", root);
    free(k);
    return INVALID_ARGUMENT;
  }
  if (count && ((contribution(k) && send == NULL) || recv == NULL)) {
    snprintf(last_error, sizeof last_error, "%s : NULL buffer (fake)", names[kind]);
    free(k);
    return INVALID_ARGUMENT;
  }
  if (group_depth > 0) { /* launched at ncclGroupEnd */
    if (group_tail) group_tail->next = k;
    else group_head = k;
    group_tail = k;
    return SUCCESS;
  }
  launch(k);
  return SUCCESS;
}

ncclResult_t ncclGetVersion(int *version) { *version = env_int("FAKE_NCCL_VERSION", 23203); return 0; }

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  static unsigned counter;
  const char *base = getenv("FAKE_NCCL_DIR");
  if (!base || !*base) base = getenv("TMPDIR");
  if (!base || !*base) base = "/tmp";
  char dir[96];
  snprintf(dir, sizeof dir, "%s/fakenccl-XXXXXX", base);
  if (mkdtemp(dir) == NULL) {
    snprintf(last_error, sizeof last_error, "cannot make a folder in %s (fake)", base);
    return SYSTEM;
  }
  memset(id, 0, sizeof *id);
  snprintf(id->internal, sizeof id->internal, "fake-nccl-id pid=%d n=%u dir=%s", (int)getpid(),
           ++counter, dir);
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
  Comm *c = NULL;
  ncclResult_t result = init(&c, nranks, id, rank, 1);
  *comm = c;
  return result;
}

ncclResult_t ncclCommInitRankConfig(void **comm, int nranks, ncclUniqueId id, int rank, void *config) {
  int blocking = 1;
  if (config) {
    ConfigPrefix prefix = {0};
    memcpy(&prefix, config, sizeof prefix);
    if (prefix.magic != 0xcafebeef) {
      snprintf(last_error, sizeof last_error,
               "ncclConfig_t argument not initialized via NCCL_CONFIG_INITIALIZER (fake)");
      return INVALID_ARGUMENT;
    }
    if (prefix.version >= 21400 && prefix.blocking != INT_MIN) {
      if (prefix.blocking != 0 && prefix.blocking != 1) return INVALID_ARGUMENT;
      blocking = prefix.blocking;
    }
  }
  Comm *c = NULL;
  ncclResult_t result = init(&c, nranks, id, rank, blocking);
  *comm = c;
  return result;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, int type, int op, void *comm, void *stream) {
  return submit(ALLREDUCE, send, recv, count, type, op, 0, comm, stream);
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, int type, int root, void *comm, void *stream) {
  return submit(BROADCAST, send, recv, count, type, SUM, root, comm, stream);
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, int type, void *comm, void *stream) {
  return submit(ALLGATHER, send, recv, count, type, SUM, 0, comm, stream);
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, int type, int op, void *comm, void *stream) {
  return submit(REDUCESCATTER, send, recv, count, type, op, 0, comm, stream);
}

ncclResult_t ncclGroupStart(void) {
  if (++group_depth > max_group_depth) max_group_depth = group_depth;
  return 0;
}

ncclResult_t ncclGroupEnd(void) {
  if (group_depth <= 0) {
    snprintf(last_error, sizeof last_error, "ncclGroupEnd: not in a group call (fake)");
    return INVALID_USAGE;
  }
  if (--group_depth == 0) {
    Coll *k = group_head;
    group_head = group_tail = NULL;
    while (k) {
      Coll *next = k->next;
      k->next = NULL;
      launch(k);
      k = next;
    }
  }
  return 0;
}

ncclResult_t ncclRedOpCreatePreMulSum(int *op, void *scalar, int type, int residence, void *comm) {
  Comm *c = comm;
  if (c == NULL || type_size(type) == 0 || type >= 10 || (residence != 0 && residence != 1)) return INVALID_ARGUMENT;
  for (int i = 0; i < MAX_CUSTOM_OPS; i++) {
    PremulOp *p = &c->ops[i];
    if (p->used) continue;
    p->used = 1;
    p->type = type;
    p->on_device = residence == 0; /* ncclScalarDevice: read when the collective runs */
    p->address = scalar;
    p->value = residence == 1 ? load(scalar, 0, type) : 0;
    __atomic_add_fetch(&premul_live, 1, __ATOMIC_SEQ_CST);
    *op = NUM_OPS + i;
    return 0;
  }
  return INTERNAL;
}

ncclResult_t ncclRedOpDestroy(int op, void *comm) {
  Comm *c = comm;
  if (c == NULL || op < NUM_OPS || op - NUM_OPS >= MAX_CUSTOM_OPS || !c->ops[op - NUM_OPS].used) return INVALID_ARGUMENT;
  c->ops[op - NUM_OPS].used = 0;
  __atomic_sub_fetch(&premul_live, 1, __ATOMIC_SEQ_CST);
  return 0;
}

ncclResult_t ncclCommGetAsyncError(void *comm, ncclResult_t *error) {
  Comm *c = comm;
  if (c == NULL) return INVALID_ARGUMENT;
  *error = c->state;
  int planted = env_int("FAKE_NCCL_ASYNC_ERROR", 0);
  if (*error == SUCCESS && planted && (c->ran || c->calls > 0)) {
    *error = planted;
    snprintf(last_error, sizeof last_error, "peer rank 1 closed its connection (fake)");
  }
  return 0;
}

ncclResult_t ncclCommAbort(void *comm) {
  Comm *c = comm;
  if (c == NULL) return 0;
  pthread_mutex_lock(&c->lock);
  c->aborted = 1;
  pthread_cond_broadcast(&c->changed);
  pthread_mutex_unlock(&c->lock);
  __atomic_add_fetch(&aborts, 1, __ATOMIC_SEQ_CST);
  leave(c);
  return 0; /* the memory stays: a stream worker may still be leaving a collective */
}

static void wait_for_work(Comm *c) {
  pthread_mutex_lock(&c->lock);
  while (c->finished < c->enqueued && !c->aborted) pthread_cond_wait(&c->changed, &c->lock);
  pthread_mutex_unlock(&c->lock);
}

static void *finalize_later(void *argument) {
  Comm *c = argument;
  wait_for_work(c);
  if (c->state == IN_PROGRESS) c->state = SUCCESS;
  return NULL;
}

ncclResult_t ncclCommFinalize(void *comm) {
  Comm *c = comm;
  if (c == NULL) return INVALID_ARGUMENT;
  if (c->state != SUCCESS) return c->state;
  if (c->blocking) {
    wait_for_work(c);
    return 0;
  }
  c->state = IN_PROGRESS;
  pthread_t thread;
  pthread_create(&thread, NULL, finalize_later, c);
  pthread_detach(thread);
  return IN_PROGRESS;
}

ncclResult_t ncclCommDestroy(void *comm) {
  Comm *c = comm;
  if (c == NULL) return 0;
  wait_for_work(c); /* as NCCL: the communicator's work finishes first */
  leave(c);
  return 0;
}

ncclResult_t ncclCommCount(void *comm, int *count) { *count = ((Comm *)comm)->nranks; return 0; }
ncclResult_t ncclCommCuDevice(void *comm, int *device) { *device = ((Comm *)comm)->device; return 0; }
ncclResult_t ncclCommUserRank(void *comm, int *rank) { *rank = ((Comm *)comm)->rank; return 0; }

/* test-only */
int fakeNcclAborts(void) { return aborts; }
int fakeNcclMaxGroupDepth(void) { return max_group_depth; }
int fakeNcclLivePremulOps(void) { return premul_live; }
int fakeNcclCollectivesRun(void) { return collectives_run; }
const char *fakeNcclCommUid(void *comm) { return ((Comm *)comm)->uid; }
int fakeNcclCommRanks(void *comm) { return ((Comm *)comm)->nranks; }
