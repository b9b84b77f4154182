// The mock CUDA runtime of tests/cudamock/cuda_runtime.h: lazy streams over host memory.
//
// Every stream is a FIFO of work items; an event is a position in one stream's FIFO. Nothing
// runs when it is enqueued: a stream advances only when forced (a query of the stream or of one
// of its events, another stream's wait on one of its events, cudaFree, sg_cudamock_drain), and
// a wait item advances the stream it waits on up to the event's position first. One global
// lock serializes everything (rank threads of the local communicator share the mock).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda/sg_cuda_emu_hook.h"  // sg_emu_enqueue: emulated kernels go to our streams
#include "cuda_runtime.h"

namespace {

struct Item {
  CUstream_st *wait_on = nullptr;  // a wait item: that stream up to wait_pos first
  uint64_t wait_pos = 0;
  std::function<bool()> gate;  // a gated item (collectives): done when gate() says so
  std::function<void()> fn;    // else: the work
};

}  // namespace

struct CUstream_st {
  std::deque<Item> q;
  int owner = 0;  // the creating thread's stand-in for a GPU context (see cudaFree)
  uint64_t enq = 0;   // items ever queued
  uint64_t done = 0;  // items run
  bool stalled = false;
  bool busy = false;  // being advanced (a wait cycle would recurse forever)
  bool alive = true;
};

struct CUevent_st {
  CUstream_st *s = nullptr;  // NULL: never recorded (queries succeed, waits are no-ops)
  uint64_t pos = 0;
  bool alive = true;
  bool timing = true;  // not cudaEventDisableTiming: a record queues an item that stamps `at`
  uint64_t gen = 0;    // records so far: only the latest one's stamp counts
  double at_ms = 0;    // when the latest record ran (steady clock)
};

namespace {

std::recursive_mutex g_mu;
bool g_stall_d2h = false;                 // sg_cudamock_stall_d2h
std::vector<CUstream_st *> g_d2h_stalled;  // the streams it stalled
int g_devices = 1;
thread_local int g_current = 0;
// Contexts, as CUDA >= 12 has them: a thread has none until cudaSetDevice (or a call that needs
// one, on device g_current = 0) makes a device's primary context current; the first time that
// happens for a device creates the context (hundreds of MB of GPU memory, and refused under
// EXCLUSIVE_PROCESS), counted per device (sg_cudamock_contexts).
const int kMaxDevices = 16;
thread_local bool t_has_ctx = false;
bool g_primary[kMaxDevices];
int g_primary_made[kMaxDevices];
char g_ctx_handle[kMaxDevices];  // what cuCtxGetCurrent answers: &g_ctx_handle[device]
thread_local cudaError_t g_last = cudaSuccess;
// Objects live until exit so that a late wait on a destroyed stream stays safe.
std::vector<std::unique_ptr<CUstream_st>> g_streams;
std::vector<std::unique_ptr<CUevent_st>> g_events;
std::map<void *, size_t> g_allocs;
std::map<void *, bool> g_is_host;  // cudaMallocHost

// Call counters (sg_cudamock_calls, sg_cudamock_thread_calls).
const char *const kCounted[] = {"cudaMemcpyAsync", "cudaMallocAsync",     "cudaMallocHost",
                                "cudaEventQuery",  "cudaStreamQuery",     "cudaStreamWaitEvent",
                                "cudaEventRecord", "cudaFree",            "cudaSetDevice",
                                "pageable_block",  "kernel",              "cudaMemsetAsync",
                                "collective",      "host_sync",           "free_block"};
enum { kMemcpyAsync, kMallocAsync, kMallocHost, kEventQuery, kStreamQuery, kStreamWaitEvent,
       kEventRecord, kFree, kSetDevice, kPageableBlock, kKernel, kMemsetAsync, kCollective,
       kHostSync, kFreeBlock, kNumCounted };
long long g_calls[kNumCounted];
thread_local long long t_calls[kNumCounted];
void counted(int which) {  // under g_mu
  g_calls[which]++;
  t_calls[which]++;
}

// The object this thread's last poll found not ready: polling it again continues one wait.
thread_local const void *t_polling = nullptr;
void polled(const void *obj, bool ready) {  // under g_mu
  if (obj != t_polling) counted(kHostSync);
  t_polling = ready ? nullptr : obj;
}

const size_t kTooLarge = (size_t)1 << 40;  // "more than the GPU has"

cudaError_t fail(cudaError_t e) {
  g_last = e;
  return e;
}

void make_current(int device) {  // under g_mu
  if (!g_primary[device]) g_primary[device] = true, g_primary_made[device]++;
  t_has_ctx = true;
  g_current = device;
}

// A call that needs a context: a thread without one gets its current device's (0 on a fresh
// thread), as the runtime does implicitly.
void need_ctx() {  // under g_mu
  if (!t_has_ctx) make_current(g_current);
}

// The driver's cuCtxGetCurrent (through cudaGetDriverEntryPointByVersion): NULL on a thread
// without a current context.
int mock_ctx_get_current(void **ctx) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!ctx) return 1;  // CUDA_ERROR_INVALID_VALUE
  *ctx = t_has_ctx ? (void *)&g_ctx_handle[g_current] : nullptr;
  return 0;
}

// Runs s up to `target` items; false if it cannot get there (stalled, or a wait that cannot).
bool advance(CUstream_st *s, uint64_t target) {
  if (s->done >= target) return true;
  if (s->stalled || s->busy) return false;
  s->busy = true;
  bool ok = true;
  while (s->done < target) {
    CUstream_st *const on = s->q.front().wait_on;
    const uint64_t pos = s->q.front().wait_pos;
    if (on && !advance(on, pos)) {
      ok = false;
      break;
    }
    if (s->q.front().gate) {
      std::function<bool()> gate = s->q.front().gate;  // may advance other streams
      if (!gate()) {
        ok = false;
        break;
      }
    }
    std::function<void()> fn = std::move(s->q.front().fn);
    s->q.pop_front();
    s->done++;
    if (fn) fn();
  }
  s->busy = false;
  return ok;
}

void push(CUstream_st *s, Item it) {
  s->q.push_back(std::move(it));
  s->enq++;
}

void push_fn(CUstream_st *s, std::function<void()> fn) {
  Item it;
  it.fn = std::move(fn);
  push(s, std::move(it));
}

bool valid_stream(CUstream_st *s) { return s && s->alive; }
bool valid_event(CUevent_st *e) { return e && e->alive; }

void drain_all() {
  for (auto &s : g_streams) advance(s.get(), s->enq);
}

// Ranks as threads stand for ranks on GPUs of their own: a thread's streams (those it created)
// are its "device". Thread ids start at 1.
int g_threads = 0;
thread_local int t_owner = 0;
int owner_id() {  // under g_mu
  if (!t_owner) t_owner = ++g_threads;
  return t_owner;
}

// Whether a stream of the calling thread's "device" still has work it cannot run now.
bool own_work_stuck() {  // under g_mu
  const int me = owner_id();
  for (auto &s : g_streams)
    if (s->owner == me && !advance(s.get(), s->enq)) return true;
  return false;
}

// cudaFree and cudaFreeHost synchronize the device: they return once every stream of it has
// run everything queued, blocking (for at most 60 s here, then cudaErrorNotReady) while one is
// stalled or behind a collective that never completes, before any deadline of the caller's.
cudaError_t device_sync_for_free(std::unique_lock<std::recursive_mutex> &lk) {
  for (int i = 0; own_work_stuck(); i++) {
    if (i == 0) counted(kFreeBlock);
    if (i >= 60000) return fail(cudaErrorNotReady);
    lk.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    lk.lock();
  }
  drain_all();  // what other threads' streams can run now runs too (the old, kind behaviour)
  return cudaSuccess;
}

// Exactly `bytes` (aligned like cudaMalloc), so that a sanitizer sees overruns of "device" memory.
// Filled with 0xff bytes (NaN in every float format): fresh GPU memory holds garbage, and reading
// it before writing it must not pass a test by finding zeros.
void *alloc_aligned(size_t bytes) {
  void *p = nullptr;
  if (posix_memalign(&p, 256, bytes ? bytes : 1) != 0) return nullptr;
  memset(p, 0xff, bytes ? bytes : 1);
  g_allocs[p] = bytes;
  return p;
}

// Whether [p, p+bytes) lies in one cudaMalloc / cudaMallocAsync block (not pinned host memory).
bool is_device(const void *p, size_t bytes) {
  auto it = g_allocs.upper_bound((void *)p);
  if (it == g_allocs.begin()) return false;
  --it;
  const char *base = (const char *)it->first;
  return !g_is_host.count(it->first) && (const char *)p >= base &&
         (const char *)p + bytes <= base + it->second;
}

// Whether p lies in a cudaMallocHost block.
bool is_pinned(const void *p) {
  auto it = g_allocs.upper_bound((void *)p);
  if (it == g_allocs.begin()) return false;
  --it;
  return g_is_host.count(it->first) && (const char *)p < (const char *)it->first + it->second;
}

// The copy kind must say where the buffers are (a wrong one is a bug that UVA may hide or not).
bool kind_matches(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind) {
  const bool dd = is_device(dst, bytes), sd = is_device(src, bytes);
  switch (kind) {
    case cudaMemcpyHostToHost: return !dd && !sd;
    case cudaMemcpyHostToDevice: return dd && !sd;
    case cudaMemcpyDeviceToHost: return !dd && sd;
    case cudaMemcpyDeviceToDevice: return dd && sd;
    case cudaMemcpyDefault: return true;
  }
  return false;
}

cudaError_t free_tracked(void *p) {
  if (!p) return cudaSuccess;
  auto it = g_allocs.find(p);
  if (it == g_allocs.end()) return fail(cudaErrorInvalidValue);  // double or foreign free
  g_allocs.erase(it);
  g_is_host.erase(p);
  free(p);
  return cudaSuccess;
}

void counted_hook(int kernel) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  counted(kernel ? kKernel : kMemcpyAsync);
}

void enqueue_hook(void *stream, std::function<void()> work) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  push_fn((CUstream_st *)stream, std::move(work));
}

int last_error_hook() { return (int)cudaGetLastError(); }

struct Init {
  Init() {
    sg_emu_enqueue = enqueue_hook;
    sg_emu_last_error = last_error_hook;
    sg_emu_counted = counted_hook;
  }
} g_init;

}  // namespace

// ---- for the NCCL mock (sg_cudamock_internal.h) ---------------------------------------------

std::recursive_mutex &sg_cudamock_lock() { return g_mu; }

uint64_t sg_cudamock_push_gate(cudaStream_t s, std::function<bool()> gate) {
  Item it;
  it.gate = std::move(gate);
  const uint64_t pos = s->enq;  // the item's index: the stream has done `pos` items before it
  push(s, std::move(it));
  return pos;
}

bool sg_cudamock_at(cudaStream_t s, uint64_t pos) { return advance(s, pos) && s->done == pos; }

bool sg_cudamock_valid_stream(cudaStream_t s) { return valid_stream(s); }

void sg_cudamock_count_collective() {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  counted(kCollective);
}

extern "C" {

const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
  }
  return "unknown error";
}

const char *cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
  }
  return "cudaErrorUnknown";
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = g_last;
  g_last = cudaSuccess;
  return e;
}

cudaError_t cudaGetDeviceCount(int *count) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!count) return fail(cudaErrorInvalidValue);
  *count = g_devices;
  return g_devices > 0 ? cudaSuccess : fail(cudaErrorNoDevice);
}

cudaError_t cudaGetDevice(int *device) {
  if (!device) return fail(cudaErrorInvalidValue);
  *device = g_current;
  return cudaSuccess;
}

// As CUDA >= 12: makes the device's primary context current, creating it if needed.
cudaError_t cudaSetDevice(int device) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (device < 0 || device >= g_devices || device >= kMaxDevices)
    return fail(cudaErrorInvalidDevice);
  if (device != g_current) counted(kSetDevice);  // changes of this thread's current device
  make_current(device);
  return cudaSuccess;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version,
                                             unsigned long long flags,
                                             enum cudaDriverEntryPointQueryResult *status) {
  (void)version, (void)flags;
  if (!symbol || !fn) return fail(cudaErrorInvalidValue);
  const bool known = strcmp(symbol, "cuCtxGetCurrent") == 0;
  *fn = known ? (void *)mock_ctx_get_current : nullptr;
  if (status) *status = known ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device) {
  if (!value || attr != cudaDevAttrMultiProcessorCount) return fail(cudaErrorInvalidValue);
  *value = 4;  // small grids: many grid-stride rounds
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!prop || device < 0 || device >= g_devices) return fail(cudaErrorInvalidDevice);
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "cudamock GPU %d", device);
  prop->multiProcessorCount = 4;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t bytes) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!p) return fail(cudaErrorInvalidValue);
  *p = nullptr;
  if (bytes >= kTooLarge) return fail(cudaErrorMemoryAllocation);
  need_ctx();
  *p = alloc_aligned(bytes);
  return *p ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaFree(void *p) {
  std::unique_lock<std::recursive_mutex> lk(g_mu);
  counted(kFree);
  counted(kHostSync);
  if (p && !g_allocs.count(p)) return fail(cudaErrorInvalidValue);  // double or foreign free
  const cudaError_t e = device_sync_for_free(lk);
  if (e != cudaSuccess) return e;
  return free_tracked(p);
}

cudaError_t cudaMallocHost(void **p, size_t bytes) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  counted(kMallocHost);
  cudaError_t e = cudaMalloc(p, bytes);
  if (e == cudaSuccess) g_is_host[*p] = true;
  return e;
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!a) return fail(cudaErrorInvalidValue);
  memset(a, 0, sizeof *a);
  a->type = cudaMemoryTypeUnregistered;
  auto it = g_allocs.upper_bound((void *)p);
  if (it == g_allocs.begin()) return cudaSuccess;
  --it;
  const char *base = (const char *)it->first;
  if ((const char *)p >= base + (it->second ? it->second : 1)) return cudaSuccess;
  a->type = g_is_host.count(it->first) ? cudaMemoryTypeHost : cudaMemoryTypeDevice;
  a->devicePointer = a->type == cudaMemoryTypeDevice ? (void *)p : nullptr;
  a->hostPointer = a->type == cudaMemoryTypeHost ? (void *)p : nullptr;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void *p) { return cudaFree(p); }

cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  counted(kMallocAsync);
  if (!valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  return cudaMalloc(p, bytes);
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  if (!g_allocs.count(p)) return fail(cudaErrorInvalidValue);
  push_fn(s, [p] { free_tracked(p); });
  return cudaSuccess;
}

// As the driver does it: a copy from or to pageable host memory is synchronous, it returns once
// the stream has run everything before it and the copy is done, so it blocks (here for at most
// 60 s, then cudaErrorNotReady) while the stream is stalled or waits on a collective.
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t s) {
  std::unique_lock<std::recursive_mutex> lk(g_mu);
  counted(kMemcpyAsync);
  if (!valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  if ((!dst || !src) && bytes) return fail(cudaErrorInvalidValue);
  if (bytes && !kind_matches(dst, src, bytes, kind)) {
    fprintf(stderr, "cudamock: cudaMemcpyAsync kind %d does not match dst %p, src %p (%zu bytes)\n",
            (int)kind, dst, src, bytes);
    return fail(cudaErrorInvalidValue);
  }
  const bool pageable = bytes && ((kind == cudaMemcpyHostToDevice && !is_pinned(src)) ||
                                  (kind == cudaMemcpyDeviceToHost && !is_pinned(dst)));
  if (!pageable) {
    push_fn(s, [=] { memmove(dst, src, bytes); });
    if (g_stall_d2h && kind == cudaMemcpyDeviceToHost) {  // a slow copy-out: it waits here
      s->stalled = true;
      g_d2h_stalled.push_back(s);
    }
    return cudaSuccess;
  }
  counted(kHostSync);
  for (int i = 0; !advance(s, s->enq); i++) {
    if (i == 0) counted(kPageableBlock);
    if (i >= 60000) return fail(cudaErrorNotReady);
    lk.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    lk.lock();
    if (!valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  }
  memmove(dst, src, bytes);
  return cudaSuccess;
}

// The legacy default stream, for cudaMemcpy. Every stream here is non-blocking (the library
// and the tests create only such), so none of them waits for it.
CUstream_st *legacy_stream() {
  static CUstream_st *legacy = nullptr;
  if (!legacy) {
    g_streams.push_back(std::make_unique<CUstream_st>());
    legacy = g_streams.back().get();
  }
  return legacy;
}

// As CUDA specifies it: a host-to-device copy from pageable memory returns once the source is
// staged, its DMA still to come on the legacy stream (a kernel on a non-blocking stream may run
// before it lands); other copies finish the legacy stream's work, then copy, before returning.
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if ((!dst || !src) && bytes) return fail(cudaErrorInvalidValue);
  if (bytes && !kind_matches(dst, src, bytes, kind)) return fail(cudaErrorInvalidValue);
  counted(kHostSync);
  CUstream_st *legacy = legacy_stream();
  const bool pageable_src = !is_device(src, bytes) && !is_pinned(src);
  if (bytes && kind == cudaMemcpyHostToDevice && pageable_src) {
    auto staged = std::make_shared<std::vector<char>>((const char *)src, (const char *)src + bytes);
    push_fn(legacy, [=] { memcpy(dst, staged->data(), bytes); });
    return cudaSuccess;
  }
  advance(legacy, legacy->enq);
  if (bytes) memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  if (!dst && bytes) return fail(cudaErrorInvalidValue);
  if (bytes && !is_device(dst, bytes)) return fail(cudaErrorInvalidValue);  // device memory only
  counted(kMemsetAsync);
  push_fn(s, [=] { memset(dst, value, bytes); });
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *user_data) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!valid_stream(s) || !fn) return fail(cudaErrorInvalidValue);
  push_fn(s, [=] { fn(user_data); });
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!s) return fail(cudaErrorInvalidValue);
  (void)flags;
  need_ctx();
  g_streams.push_back(std::make_unique<CUstream_st>());
  g_streams.back()->owner = owner_id();
  *s = g_streams.back().get();
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned int flags, int priority) {
  (void)priority;
  return cudaStreamCreateWithFlags(s, flags);
}

// Pending work still completes after a real destroy: run what can run now.
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  advance(s, s->enq);
  s->alive = false;
  return cudaSuccess;
}

// NotReady is also left as this thread's last error, which the next launch's cudaGetLastError
// reports unless the caller cleared it (the runtime records it like any other result).
cudaError_t cudaStreamQuery(cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  counted(kStreamQuery);
  if (!valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  const bool ready = advance(s, s->enq);
  polled(s, ready);
  return ready ? cudaSuccess : fail(cudaErrorNotReady);
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) { return cudaStreamQuery(s); }

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  counted(kStreamWaitEvent);
  if (!valid_stream(s) || !valid_event(e)) return fail(cudaErrorInvalidResourceHandle);
  (void)flags;
  if (!e->s) return cudaSuccess;  // never recorded: nothing to wait for
  Item it;
  it.wait_on = e->s;
  it.wait_pos = e->pos;  // the event as it is now, as CUDA specifies
  push(s, std::move(it));
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!e) return fail(cudaErrorInvalidValue);
  need_ctx();
  g_events.push_back(std::make_unique<CUevent_st>());
  g_events.back()->timing = !(flags & cudaEventDisableTiming);
  *e = g_events.back().get();
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!valid_event(e)) return fail(cudaErrorInvalidResourceHandle);
  e->alive = false;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  counted(kEventRecord);
  if (!valid_event(e) || !valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  const uint64_t gen = ++e->gen;
  if (e->timing)  // the stamp is taken when the stream gets there, like the GPU's
    push_fn(s, [e, gen] {
      if (e->gen == gen)
        e->at_ms = std::chrono::duration<double, std::milli>(
                       std::chrono::steady_clock::now().time_since_epoch())
                       .count();
    });
  e->s = s;
  e->pos = s->enq;
  return cudaSuccess;
}

// As CUDA: never recorded or without timing -> cudaErrorInvalidResourceHandle; not complete ->
// cudaErrorNotReady. Forces nothing (CUDA does not wait either): the caller must have waited.
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t from, cudaEvent_t to) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!ms) return fail(cudaErrorInvalidValue);
  if (!valid_event(from) || !valid_event(to) || !from->s || !to->s || !from->timing ||
      !to->timing)
    return fail(cudaErrorInvalidResourceHandle);
  if (from->s->done < from->pos || to->s->done < to->pos) return cudaErrorNotReady;
  *ms = (float)(to->at_ms - from->at_ms);
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  counted(kEventQuery);
  if (!valid_event(e)) return fail(cudaErrorInvalidResourceHandle);
  const bool ready = !e->s || advance(e->s, e->pos);
  polled(e, ready);
  return ready ? cudaSuccess : fail(cudaErrorNotReady);  // last error: as above
}

void sg_cudamock_set_devices(int n) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  g_devices = n;
}

void sg_cudamock_stall_d2h(int on) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  g_stall_d2h = on != 0;
  if (on) return;
  for (CUstream_st *s : g_d2h_stalled)
    if (valid_stream(s)) s->stalled = false;
  g_d2h_stalled.clear();
}

void sg_cudamock_stall(cudaStream_t s, int on) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (s) s->stalled = on != 0;
}

size_t sg_cudamock_pending(cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return s ? (size_t)(s->enq - s->done) : 0;
}

void sg_cudamock_drain(void) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  drain_all();
}

int sg_cudamock_contexts(int device) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return device >= 0 && device < kMaxDevices ? g_primary_made[device] : -1;
}

size_t sg_cudamock_live_allocations(void) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return g_allocs.size();
}

long long sg_cudamock_calls(const char *name) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  for (int i = 0; name && i < kNumCounted; i++)
    if (strcmp(name, kCounted[i]) == 0) return g_calls[i];
  return -1;
}

long long sg_cudamock_thread_calls(const char *name) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  for (int i = 0; name && i < kNumCounted; i++)
    if (strcmp(name, kCounted[i]) == 0) return t_calls[i];
  return -1;
}

}  // extern "C"
