/* CUDA TEST DOUBLE: a fake CUDA *driver* library (the libcuda.so.1 entry points kvpool calls),
 * over host memory, so that the code above the driver line - kvpool.transfer.cuda_driver, the CUDA
 * IPC transport, GPU staging - runs across real processes on a machine without a GPU.
 *
 * Built by kvpool.testing.fakecuda (system cc) and loaded through KVPOOL_CUDA_DRIVER=<path>; no
 * production code names it. What it models:
 *  - device memory: a memfd per allocation, mapped read-write at a hidden alias; the "device
 *    pointer" handed out is a separate PROT_NONE reservation, so host code that touches device
 *    memory directly (instead of through a copy) crashes here as it would on a GPU
 *    (FAKECUDA_CPU_VISIBLE=1 maps it readable instead, for the fake-verbs GPUDirect tests);
 *  - IPC: a handle names the owner's pid, its memfd and size; another process opens it through
 *    pidfd_getfd (or /proc/<pid>/fd); two devices (FAKECUDA_DEVICES), peer access always possible
 *    but, as on a GPU, a kernel on one device reaches memory of another only once its context
 *    enabled access to that device (cuCtxEnablePeerAccess; an IPC open with the lazy flag enables
 *    it from the opening context); copies need none;
 *  - streams: a worker thread per stream runs copies, kernel launches and event records in order
 *    (FAKECUDA_DELAY_US delays each operation, so tests can see work in flight); the NULL stream
 *    is synchronous;
 *  - one kernel, "kvpool_gather" (see kvpool/transfer/kernels/gather.cu): copies n (src, dst, len)
 *    triples read from device tables;
 *  - contexts: copies, stream/event creation, pinned allocations, IPC opens and launches fail with
 *    CUDA_ERROR_INVALID_CONTEXT on a thread with no current context (cuCtxSetCurrent), as on a GPU;
 *  - events and streams belong to the context current when they were created: recording an event
 *    on a stream of another device fails with CUDA_ERROR_INVALID_HANDLE, as on a GPU;
 *  - stream errors: a failed operation's error is sticky on its stream and reported by
 *    cuStreamSynchronize and by cuEventSynchronize / cuEventQuery of events recorded after it;
 *    fakecuda_fail_next(rc) makes the next queued copy or launch fail with rc (tests inject faults);
 *  - fakecuda_stats(): launches, copies and bytes, for tests that assert batching;
 *  - fakecuda_fail_enqueue(kind, after, times, rc): after `after` more calls of a kind (0: the
 *    asynchronous copies, 1: kernel launches) queued, the next `times` return rc and queue nothing
 *    (a call failing while a run is being queued); fakecuda_enqueue_faults_left(kind);
 *  - fakecuda_fail_context(times, rc): cuCtxSetCurrent fails with rc on threads with no current
 *    context, the next `times` calls (< 0: until cleared);
 *  - fakecuda_hold_event_sync(after): a GPU stream that stops, as its waiter sees it: after `after`
 *    more cuEventSynchronize calls returned (or cuEventQuery calls that saw their event), later
 *    syncs wait (before looking at their event) and queries answer NOT_READY until
 *    fakecuda_hold_event_sync(-1); fakecuda_event_sync_counts() says how many wait, how many
 *    returned so far and when the first returned since the hold began (CLOCK_MONOTONIC ns;
 *    kvpool.testing.fakecuda.SyncHold wraps these).
 * What it cannot tell: speed, real pointer-attribute or IPC semantics, unified addressing details,
 * VMM (cuMemExportToShareableHandle) allocations.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct fctx* CUcontext;
typedef struct fstream* CUstream;
typedef struct fevent* CUevent;
typedef struct fmodule* CUmodule;
typedef struct ffunc* CUfunction;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char bytes[16]; } CUuuid;

enum {
  OK = 0, E_INVALID_VALUE = 1, E_OUT_OF_MEMORY = 2, E_NOT_INITIALIZED = 3, E_INVALID_DEVICE = 101,
  E_INVALID_CONTEXT = 201, E_MAP_FAILED = 205, E_INVALID_HANDLE = 400, E_NOT_FOUND = 500,
  E_NOT_READY = 600, E_ILLEGAL_ADDRESS = 700, E_ALREADY_REGISTERED = 712, E_NOT_REGISTERED = 713,
};

/* ------------------------------------------------------------------ memory tables */
#define MAXMEM 4096
struct mem {
  uintptr_t base; size_t size; char* alias; int fd; int device; int kind; /* 1 device, 2 ipc, 3 host */
};
static struct mem g_mem[MAXMEM];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_init = 0;
static long g_launches = 0, g_copies = 0, g_bytes = 0;
struct fctx { int device; };
static struct fctx g_ctx[8];
static __thread CUcontext t_ctx = NULL;
static int g_fail_next = 0; /* fakecuda_fail_next(): the next queued copy/launch fails with it */
static int g_peer[8][8];    /* g_peer[a][b]: device a's context may access device b's memory */
#define NEED_CTX() do { if (!t_ctx) return E_INVALID_CONTEXT; } while (0)

static int ndevices(void) {
  const char* s = getenv("FAKECUDA_DEVICES");
  int n = s ? atoi(s) : 2;
  return n < 0 ? 0 : n > 8 ? 8 : n;
}

static struct mem* find_locked(uintptr_t p) {
  for (int i = 0; i < MAXMEM; ++i)
    if (g_mem[i].size && p >= g_mem[i].base && p < g_mem[i].base + g_mem[i].size) return &g_mem[i];
  return NULL;
}

static int add_mem(uintptr_t base, size_t size, char* alias, int fd, int device, int kind) {
  pthread_mutex_lock(&g_mu);
  for (int i = 0; i < MAXMEM; ++i)
    if (!g_mem[i].size) {
      g_mem[i] = (struct mem){base, size, alias, fd, device, kind};
      pthread_mutex_unlock(&g_mu);
      return 0;
    }
  pthread_mutex_unlock(&g_mu);
  return -1;
}

/* A host-accessible pointer for [p, p+n): the alias of device memory, or p itself (host memory). */
static char* hostp(uintptr_t p, size_t n) {
  pthread_mutex_lock(&g_mu);
  struct mem* m = find_locked(p);
  char* out = (char*)p;
  if (m && m->kind != 3) out = (p + n <= m->base + m->size) ? m->alias + (p - m->base) : NULL;
  pthread_mutex_unlock(&g_mu);
  return out;
}

static int do_copy(uintptr_t dst, uintptr_t src, size_t n) {
  char* d = hostp(dst, n);
  char* s = hostp(src, n);
  if (!d || !s) return E_ILLEGAL_ADDRESS;
  memmove(d, s, n);
  __atomic_add_fetch(&g_copies, 1, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&g_bytes, (long)n, __ATOMIC_SEQ_CST);
  return OK;
}

/* Whether a kernel on `device` may touch [p, p+n): host memory, or device memory of its own
 * device or of one its context enabled peer access to. */
static int reachable(int device, uintptr_t p) {
  pthread_mutex_lock(&g_mu);
  struct mem* m = find_locked(p);
  int d = (m && m->kind != 3) ? m->device : -1;
  pthread_mutex_unlock(&g_mu);
  return device < 0 || d < 0 || d == device || __atomic_load_n(&g_peer[device][d], __ATOMIC_SEQ_CST);
}

static int do_gather(int device, uintptr_t srcs, uintptr_t dsts, uintptr_t lens, unsigned n) {
  uint64_t* S = (uint64_t*)hostp(srcs, 8ull * n);
  uint64_t* D = (uint64_t*)hostp(dsts, 8ull * n);
  uint64_t* L = (uint64_t*)hostp(lens, 8ull * n);
  if (!S || !D || !L) return E_ILLEGAL_ADDRESS;
  __atomic_add_fetch(&g_launches, 1, __ATOMIC_SEQ_CST);
  for (unsigned i = 0; i < n; ++i) {
    if (!reachable(device, D[i]) || !reachable(device, S[i])) return E_ILLEGAL_ADDRESS;
    char* d = hostp(D[i], L[i]);
    char* s = hostp(S[i], L[i]);
    if (!d || !s) return E_ILLEGAL_ADDRESS;
    memmove(d, s, L[i]);
    __atomic_add_fetch(&g_bytes, (long)L[i], __ATOMIC_SEQ_CST);
  }
  return OK;
}

/* ------------------------------------------------------------------ streams and events */
struct fevent { pthread_mutex_t mu; pthread_cond_t cv; int pending, error, device; };
enum { OP_COPY, OP_GATHER, OP_EVENT };
struct op { int kind; uintptr_t a, b, c; size_t n; struct fevent* ev; struct op* next; };
struct fstream {
  pthread_t th; pthread_mutex_t mu; pthread_cond_t cv; struct op *head, *tail; int busy, stop, error, device;
};

static void delay(void) {
  const char* s = getenv("FAKECUDA_DELAY_US");
  long us = s ? atol(s) : 0;
  if (us > 0) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
  }
}

static void fire(struct fevent* ev, int error) {
  pthread_mutex_lock(&ev->mu);
  ev->pending = 0;
  ev->error = error;
  pthread_cond_broadcast(&ev->cv);
  pthread_mutex_unlock(&ev->mu);
}

static int run_op(struct op* o, int stream_error, int device) {
  delay();
  if (o->kind != OP_EVENT) {
    int inj = __atomic_exchange_n(&g_fail_next, 0, __ATOMIC_SEQ_CST);
    if (inj) return inj;
  }
  switch (o->kind) {
    case OP_COPY: return do_copy(o->a, o->b, o->n);
    case OP_GATHER: return do_gather(device, o->a, o->b, o->c, (unsigned)o->n);
    default: fire(o->ev, stream_error); return OK;
  }
}

static void* worker(void* arg) {
  struct fstream* s = arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->head && !s->stop) pthread_cond_wait(&s->cv, &s->mu);
    if (!s->head) break;
    struct op* o = s->head;
    s->head = o->next;
    if (!s->head) s->tail = NULL;
    s->busy = 1;
    int err = s->error;
    pthread_mutex_unlock(&s->mu);
    int rc = run_op(o, err, s->device);
    free(o);
    pthread_mutex_lock(&s->mu);
    if (rc && !s->error) s->error = rc;  /* sticky, like a real launch failure */
    s->busy = 0;
    pthread_cond_broadcast(&s->cv);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

static int enqueue(CUstream s, int kind, uintptr_t a, uintptr_t b, uintptr_t c, size_t n, struct fevent* ev) {
  struct op o = {kind, a, b, c, n, ev, NULL};
  if (!s) return run_op(&o, OK, t_ctx ? t_ctx->device : -1);
  struct op* p = malloc(sizeof *p);
  if (!p) return E_OUT_OF_MEMORY;
  *p = o;
  pthread_mutex_lock(&s->mu);
  if (s->tail) s->tail->next = p; else s->head = p;
  s->tail = p;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return OK;
}

/* ------------------------------------------------------------------ init, devices, contexts */
CUresult cuInit(unsigned flags) { (void)flags; g_init = 1; return OK; }
CUresult cuDriverGetVersion(int* v) { *v = 13000; return OK; }
CUresult cuDeviceGetCount(int* n) { if (!g_init) return E_NOT_INITIALIZED; *n = ndevices(); return OK; }
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal < 0 || ordinal >= ndevices()) return E_INVALID_DEVICE;
  *d = ordinal;
  return OK;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
  snprintf(name, (size_t)len, "kvpool fake CUDA device %d", d);
  return OK;
}
CUresult cuDeviceGetUuid(CUuuid* u, CUdevice d) {
  if (d < 0 || d >= ndevices()) return E_INVALID_DEVICE;
  memset(u->bytes, 0, 16);
  memcpy(u->bytes, "fakecuda-dev", 12);
  u->bytes[15] = (char)d;
  return OK;
}
CUresult cuDeviceGetUuid_v2(CUuuid* u, CUdevice d) { return cuDeviceGetUuid(u, d); }
CUresult cuDeviceCanAccessPeer(int* can, CUdevice a, CUdevice b) { (void)a; (void)b; *can = 1; return OK; }
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  if (d < 0 || d >= ndevices()) return E_INVALID_DEVICE;
  g_ctx[d].device = d;
  *c = &g_ctx[d];
  return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; return OK; }
/* fakecuda_fail_context(times, rc): the next `times` (< 0: all, until called again)
 * cuCtxSetCurrent calls of threads with no current context return rc and set nothing (a context
 * that cannot be made current on a new thread, e.g. a native completion thread's). */
static pthread_mutex_t g_ctx_fault_mu = PTHREAD_MUTEX_INITIALIZER;
static long g_ctx_fault_times;
static int g_ctx_fault_rc;

void fakecuda_fail_context(long times, int rc) {
  pthread_mutex_lock(&g_ctx_fault_mu);
  g_ctx_fault_times = times;
  g_ctx_fault_rc = rc;
  pthread_mutex_unlock(&g_ctx_fault_mu);
}

CUresult cuCtxSetCurrent(CUcontext c) {
  if (t_ctx == NULL) {
    int rc = OK;
    pthread_mutex_lock(&g_ctx_fault_mu);
    if (g_ctx_fault_times != 0) {
      rc = g_ctx_fault_rc;
      if (g_ctx_fault_times > 0) g_ctx_fault_times--;
    }
    pthread_mutex_unlock(&g_ctx_fault_mu);
    if (rc != OK) return rc;
  }
  t_ctx = c;
  return OK;
}
CUresult cuCtxGetCurrent(CUcontext* c) { *c = t_ctx; return OK; }
CUresult cuCtxGetDevice(CUdevice* d) { if (!t_ctx) return E_INVALID_CONTEXT; *d = t_ctx->device; return OK; }
CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned flags) {
  (void)flags;
  if (!t_ctx || !peer) return E_INVALID_CONTEXT;
  __atomic_store_n(&g_peer[t_ctx->device][peer->device], 1, __ATOMIC_SEQ_CST);
  return OK;
}
CUresult cuCtxSynchronize(void) { return OK; } /* streams are synchronized one by one */

/* ------------------------------------------------------------------ memory */
static int cur_device(void) { return t_ctx ? t_ctx->device : -1; }

static CUresult map_device(int fd, size_t size, int device, int kind, CUdeviceptr* out) {
  char* alias = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (alias == MAP_FAILED) return E_MAP_FAILED;
  /* FAKECUDA_CPU_VISIBLE=1: the device pointer is a second shared mapping the CPU can touch, for
   * the fake-verbs RDMA tests, where the "NIC" (a CPU memcpy) reads GPU memory as GPUDirect would */
  const char* vis = getenv("FAKECUDA_CPU_VISIBLE");
  void* dev = (vis && vis[0] == '1')
                  ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                  : mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (dev == MAP_FAILED) { munmap(alias, size); return E_OUT_OF_MEMORY; }
  if (add_mem((uintptr_t)dev, size, alias, fd, device, kind)) {
    munmap(alias, size); munmap(dev, size); return E_OUT_OF_MEMORY;
  }
  *out = (CUdeviceptr)(uintptr_t)dev;
  return OK;
}

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t size) {
  if (cur_device() < 0) return E_INVALID_CONTEXT;
  if (!size) return E_INVALID_VALUE;
  int fd = (int)syscall(SYS_memfd_create, "fakecuda", 1u /* MFD_CLOEXEC */);
  if (fd < 0) return E_OUT_OF_MEMORY;
  if (ftruncate(fd, (off_t)size)) { close(fd); return E_OUT_OF_MEMORY; }
  CUresult rc = map_device(fd, size, cur_device(), 1, p);
  if (rc) close(fd);
  return rc;
}

static CUresult unmap(uintptr_t p, int kind) {
  pthread_mutex_lock(&g_mu);
  struct mem* m = find_locked(p);
  if (!m || m->base != p || m->kind != kind) { pthread_mutex_unlock(&g_mu); return E_INVALID_VALUE; }
  struct mem c = *m;
  memset(m, 0, sizeof *m);
  pthread_mutex_unlock(&g_mu);
  if (c.kind != 3) {
    munmap(c.alias, c.size);
    munmap((void*)c.base, c.size);
    close(c.fd);
  }
  return OK;
}

CUresult cuMemFree_v2(CUdeviceptr p) { return unmap((uintptr_t)p, 1); }

CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
  pthread_mutex_lock(&g_mu);
  struct mem* m = find_locked((uintptr_t)p);
  CUresult rc = (m && m->kind != 3) ? OK : E_NOT_FOUND;
  if (!rc) { if (base) *base = m->base; if (size) *size = m->size; }
  pthread_mutex_unlock(&g_mu);
  return rc;
}

CUresult cuMemHostAlloc(void** pp, size_t size, unsigned flags) {
  (void)flags;
  NEED_CTX();
  void* p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return E_OUT_OF_MEMORY;
  if (add_mem((uintptr_t)p, size, p, -1, -1, 3)) { munmap(p, size); return E_OUT_OF_MEMORY; }
  *pp = p;
  return OK;
}
CUresult cuMemFreeHost(void* p) {
  pthread_mutex_lock(&g_mu);
  struct mem* m = find_locked((uintptr_t)p);
  size_t size = m ? m->size : 0;
  pthread_mutex_unlock(&g_mu);
  if (!size) return E_INVALID_VALUE;
  CUresult rc = unmap((uintptr_t)p, 3);
  if (!rc) munmap(p, size);
  return rc;
}
CUresult cuMemHostRegister_v2(void* p, size_t size, unsigned flags) {
  (void)flags;
  pthread_mutex_lock(&g_mu);
  struct mem* m = find_locked((uintptr_t)p);
  pthread_mutex_unlock(&g_mu);
  if (m) return E_ALREADY_REGISTERED;
  return add_mem((uintptr_t)p, size, p, -1, -1, 3) ? E_OUT_OF_MEMORY : OK;
}
CUresult cuMemHostUnregister(void* p) { return unmap((uintptr_t)p, 3) ? E_NOT_REGISTERED : OK; }
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned flags) {
  (void)flags;
  *d = (CUdeviceptr)(uintptr_t)p;
  return OK;
}

enum { ATTR_CONTEXT = 1, ATTR_MEMORY_TYPE = 2, ATTR_DEVICE_ORDINAL = 9, ATTR_RANGE_START = 11, ATTR_RANGE_SIZE = 12 };
CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr ptr) {
  pthread_mutex_lock(&g_mu);
  struct mem* m = find_locked((uintptr_t)ptr);
  struct mem c = m ? *m : (struct mem){0};
  pthread_mutex_unlock(&g_mu);
  if (!m) return E_INVALID_VALUE; /* plain pageable host memory: unknown to CUDA */
  switch (attr) {
    case ATTR_MEMORY_TYPE: *(unsigned*)data = c.kind == 3 ? 1u : 2u; return OK;
    case ATTR_DEVICE_ORDINAL: *(int*)data = c.kind == 3 ? -1 : c.device; return OK;
    case ATTR_RANGE_START: *(CUdeviceptr*)data = c.base; return OK;
    case ATTR_RANGE_SIZE: *(size_t*)data = c.size; return OK;
    case ATTR_CONTEXT: *(CUcontext*)data = c.kind == 3 ? NULL : &g_ctx[c.device]; return OK;
    default: return E_INVALID_VALUE;
  }
}

/* ------------------------------------------------------------------ enqueue faults */
static pthread_mutex_t g_fault_mu = PTHREAD_MUTEX_INITIALIZER;
static long g_fault_after[2], g_fault_times[2];
static int g_fault_rc[2];

void fakecuda_fail_enqueue(int kind, long after, long times, int rc) {
  if (kind < 0 || kind > 1) return;
  pthread_mutex_lock(&g_fault_mu);
  g_fault_after[kind] = after;
  g_fault_times[kind] = times;
  g_fault_rc[kind] = rc;
  pthread_mutex_unlock(&g_fault_mu);
}

long fakecuda_enqueue_faults_left(int kind) {
  if (kind < 0 || kind > 1) return 0;
  pthread_mutex_lock(&g_fault_mu);
  long left = g_fault_times[kind];
  pthread_mutex_unlock(&g_fault_mu);
  return left;
}

static int enqueue_fault(int kind) {
  int rc = OK;
  pthread_mutex_lock(&g_fault_mu);
  if (g_fault_times[kind] > 0) {
    if (g_fault_after[kind] > 0) {
      g_fault_after[kind]--;
    } else {
      g_fault_times[kind]--;
      rc = g_fault_rc[kind];
    }
  }
  pthread_mutex_unlock(&g_fault_mu);
  return rc;
}
#define FAULT(kind) do { int f_ = enqueue_fault(kind); if (f_) return f_; } while (0)

/* ------------------------------------------------------------------ copies */
CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { NEED_CTX(); return do_copy(d, s, n); }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n) { NEED_CTX(); return do_copy(d, (uintptr_t)s, n); }
CUresult cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n) { NEED_CTX(); return do_copy((uintptr_t)d, s, n); }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { NEED_CTX(); return do_copy(d, s, n); }
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
  NEED_CTX();
  FAULT(0);
  return enqueue(st, OP_COPY, d, s, 0, n, NULL);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, CUstream st) {
  NEED_CTX();
  FAULT(0);
  return enqueue(st, OP_COPY, d, (uintptr_t)s, 0, n, NULL);
}
CUresult cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t n, CUstream st) {
  NEED_CTX();
  FAULT(0);
  return enqueue(st, OP_COPY, (uintptr_t)d, s, 0, n, NULL);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
  return enqueue(st, OP_COPY, d, s, 0, n, NULL);
}

CUresult cuStreamCreate(CUstream* out, unsigned flags) {
  (void)flags;
  NEED_CTX();
  struct fstream* s = calloc(1, sizeof *s);
  if (!s) return E_OUT_OF_MEMORY;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  s->device = cur_device();
  if (pthread_create(&s->th, NULL, worker, s)) { free(s); return E_OUT_OF_MEMORY; }
  *out = s;
  return OK;
}
CUresult cuStreamSynchronize(CUstream s) {
  if (!s) return OK;
  pthread_mutex_lock(&s->mu);
  while (s->head || s->busy) pthread_cond_wait(&s->cv, &s->mu);
  int rc = s->error;
  pthread_mutex_unlock(&s->mu);
  return rc;
}
CUresult cuStreamDestroy_v2(CUstream s) {
  if (!s) return E_INVALID_HANDLE;
  pthread_mutex_lock(&s->mu);
  s->stop = 1;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->th, NULL); /* drains the queue first, like the real driver */
  free(s);
  return OK;
}

CUresult cuEventCreate(CUevent* out, unsigned flags) {
  (void)flags;
  struct fevent* e = calloc(1, sizeof *e);
  if (!e) return E_OUT_OF_MEMORY;
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->cv, NULL);
  e->device = cur_device();
  *out = e;
  return OK;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
  /* as on a GPU: the event and the stream must be of one context (device here) */
  if (s && e->device >= 0 && s->device >= 0 && e->device != s->device) return E_INVALID_HANDLE;
  pthread_mutex_lock(&e->mu);
  e->pending = 1;
  pthread_mutex_unlock(&e->mu);
  return enqueue(s, OP_EVENT, 0, 0, 0, 0, e);
}
static pthread_mutex_t g_hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_hold_cv = PTHREAD_COND_INITIALIZER;
static long g_hold_after = -1; /* -1: no hold; n >= 0: n more syncs return, later ones wait */
static long g_sync_waiting = 0, g_sync_returned = 0;
static long long g_first_return_ns = 0; /* CLOCK_MONOTONIC of the first return since a hold began */

void fakecuda_hold_event_sync(long after) {
  pthread_mutex_lock(&g_hold_mu);
  g_hold_after = after;
  if (after >= 0) g_first_return_ns = 0;
  pthread_cond_broadcast(&g_hold_cv);
  pthread_mutex_unlock(&g_hold_mu);
}

void fakecuda_event_sync_counts(long* waiting, long* returned, long long* first_ns) {
  pthread_mutex_lock(&g_hold_mu);
  *waiting = g_sync_waiting;
  *returned = g_sync_returned;
  *first_ns = g_first_return_ns;
  pthread_mutex_unlock(&g_hold_mu);
}

static void sync_hold(void) {
  pthread_mutex_lock(&g_hold_mu);
  if (g_hold_after > 0) {
    g_hold_after--;
  } else if (g_hold_after == 0) {
    g_sync_waiting++;
    while (g_hold_after == 0) pthread_cond_wait(&g_hold_cv, &g_hold_mu);
    g_sync_waiting--;
  }
  pthread_mutex_unlock(&g_hold_mu);
}

/* An event reached is seen by cuEventQuery as by cuEventSynchronize, through the hold: while the
 * stream is held (no syncs left to return) it is not reached yet; otherwise seeing it counts as a
 * sync that returned. */
CUresult cuEventQuery(CUevent e) {
  pthread_mutex_lock(&e->mu);
  int p = e->pending, err = e->error;
  pthread_mutex_unlock(&e->mu);
  if (p) return E_NOT_READY;
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  pthread_mutex_lock(&g_hold_mu);
  if (g_hold_after == 0) {
    pthread_mutex_unlock(&g_hold_mu);
    return E_NOT_READY;
  }
  if (g_hold_after > 0) g_hold_after--;
  g_sync_returned++;
  if (!g_first_return_ns) g_first_return_ns = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
  pthread_mutex_unlock(&g_hold_mu);
  return err;
}
CUresult cuEventSynchronize(CUevent e) {
  sync_hold();
  pthread_mutex_lock(&e->mu);
  while (e->pending) pthread_cond_wait(&e->cv, &e->mu);
  int err = e->error;
  pthread_mutex_unlock(&e->mu);
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  pthread_mutex_lock(&g_hold_mu);
  g_sync_returned++;
  if (!g_first_return_ns) g_first_return_ns = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
  pthread_mutex_unlock(&g_hold_mu);
  return err; /* a failed operation before the record: the stream's sticky error */
}
CUresult cuEventDestroy_v2(CUevent e) { free(e); return OK; }

/* ------------------------------------------------------------------ IPC */
struct ipc { char magic[8]; int32_t pid; int32_t fd; uint64_t size; int32_t device; };

CUresult cuIpcGetMemHandle(CUipcMemHandle* h, CUdeviceptr p) {
  pthread_mutex_lock(&g_mu);
  struct mem* m = find_locked((uintptr_t)p);
  struct mem c = m ? *m : (struct mem){0};
  pthread_mutex_unlock(&g_mu);
  if (!m || c.kind != 1 || c.base != (uintptr_t)p) return E_INVALID_VALUE; /* allocation bases only */
  struct ipc x = {"FKCUIPC", (int32_t)getpid(), c.fd, c.size, c.device};
  memset(h, 0, sizeof *h);
  memcpy(h->reserved, &x, sizeof x);
  return OK;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* out, CUipcMemHandle h, unsigned flags) {
  NEED_CTX();
  struct ipc x;
  memcpy(&x, h.reserved, sizeof x);
  if (memcmp(x.magic, "FKCUIPC", 8) || x.size == 0) return E_INVALID_VALUE;
  if (x.pid == getpid()) return E_INVALID_CONTEXT; /* a process cannot open its own handle */
  int fd = -1;
  int pfd = (int)syscall(SYS_pidfd_open, x.pid, 0);
  if (pfd >= 0) {
    fd = (int)syscall(SYS_pidfd_getfd, pfd, x.fd, 0);
    close(pfd);
  }
  if (fd < 0) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", x.pid, x.fd);
    fd = open(path, O_RDWR | O_CLOEXEC);
  }
  if (fd < 0) return E_INVALID_HANDLE; /* the owner exited or freed it */
  struct stat st;
  if (fstat(fd, &st) || (uint64_t)st.st_size < x.size) { close(fd); return E_INVALID_HANDLE; }
  CUresult rc = map_device(fd, x.size, x.device, 2, out);
  if (rc) close(fd);
  if (!rc && (flags & 1) && x.device >= 0 && x.device < 8) /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */
    __atomic_store_n(&g_peer[t_ctx->device][x.device], 1, __ATOMIC_SEQ_CST);
  return rc;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) { return unmap((uintptr_t)p, 2); }

/* ------------------------------------------------------------------ modules and the one kernel */
struct fmodule { int dummy; };
struct ffunc { int id; };
static struct fmodule g_module;
static struct ffunc g_gather = {1};

CUresult cuModuleLoadData(CUmodule* m, const void* image) {
  if (!image || !strstr((const char*)image, "kvpool_gather")) return E_INVALID_VALUE;
  *m = &g_module;
  return OK;
}
CUresult cuModuleUnload(CUmodule m) { (void)m; return OK; }
CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
  (void)m;
  if (strcmp(name, "kvpool_gather")) return E_NOT_FOUND;
  *f = &g_gather;
  return OK;
}
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shmem, CUstream s, void** params, void** extra) {
  (void)gx; (void)gy; (void)gz; (void)by; (void)bz; (void)shmem; (void)extra;
  NEED_CTX();
  if (f != &g_gather || !params || bx == 0) return E_INVALID_VALUE;
  FAULT(1);
  CUdeviceptr srcs = *(CUdeviceptr*)params[0], dsts = *(CUdeviceptr*)params[1], lens = *(CUdeviceptr*)params[2];
  unsigned n = *(unsigned*)params[3];
  return enqueue(s, OP_GATHER, (uintptr_t)srcs, (uintptr_t)dsts, (uintptr_t)lens, n, NULL);
}

/* ------------------------------------------------------------------ errors, stats */
CUresult cuGetErrorString(CUresult e, const char** s) {
  switch (e) {
    case OK: *s = "no error"; break;
    case E_INVALID_VALUE: *s = "invalid argument"; break;
    case E_OUT_OF_MEMORY: *s = "out of memory"; break;
    case E_INVALID_HANDLE: *s = "invalid resource handle"; break;
    case E_INVALID_CONTEXT: *s = "invalid device context"; break;
    case E_NOT_READY: *s = "device not ready"; break;
    case E_ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered"; break;
    default: *s = "unknown error"; break;
  }
  return OK;
}
CUresult cuGetErrorName(CUresult e, const char** s) { return cuGetErrorString(e, s); }

void fakecuda_fail_next(int rc) { __atomic_store_n(&g_fail_next, rc, __ATOMIC_SEQ_CST); }

void fakecuda_stats(long* launches, long* copies, long* bytes) {
  *launches = __atomic_load_n(&g_launches, __ATOMIC_SEQ_CST);
  *copies = __atomic_load_n(&g_copies, __ATOMIC_SEQ_CST);
  *bytes = __atomic_load_n(&g_bytes, __ATOMIC_SEQ_CST);
}
