// The NCCL mock of tests/cudamock/nccl.h. A group of communicators is found through its unique
// id (ranks are threads of this process). The k-th collective of every rank is one Coll; each
// rank's call queues a gated item on its (mock CUDA) stream, and the data moves when the first
// of those items is forced and every rank's stream has reached its own item. Everything runs
// under the CUDA mock's global lock. Point-to-point (ncclSend, ncclRecv) is modelled as grouped
// exchanges in which every rank of the communicator takes part, as an all-to-all is: one
// collective per group (a lone send or receive is a group of its own).
//
// As unkind as NCCL >= 2.18 in non-blocking mode: ncclCommInitRankConfig and ncclCommSplit
// return ncclInProgress with the handle still NULL, and a background thread writes it later
// (a split's after every rank has split; meanwhile the parent reports ncclInProgress and refuses
// collectives). A destroyed or aborted communicator's memory stays (poisoned): a call that
// still uses its handle is counted (sg_ncclmock_dead_calls) and refused, where NCCL would read
// freed memory.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "nccl.h"
#include "sg_cudamock_internal.h"  // lock, gated stream items
#include "sg_elem.h"               // bf16/f16 conversions for the sums

namespace {

enum Kind { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kSendRecv };

// One send or receive of a rank's grouped point-to-point call (ncclSend, ncclRecv in a group).
struct P2p {
  bool send;
  int peer;
  void *buf;
  size_t bytes;
};

struct Part {
  bool joined = false;
  cudaStream_t s = nullptr;
  uint64_t pos = 0;
  const void *send = nullptr;
  void *recv = nullptr;
  std::vector<P2p> p2p;  // kSendRecv: this rank's sends and receives, in call order
};

struct Coll {
  Kind kind;
  size_t count;
  ncclDataType_t dt;
  int root;
  std::vector<Part> parts;
  int joined = 0;
  bool done = false;
  bool aborted = false;
  bool mismatch = false;
  std::vector<std::vector<char>> out;  // per rank: its recv buffer's result, until delivered
};

// The k-th ncclCommSplit of every rank of a group: each rank's color and key, until all came.
struct SplitRound {
  std::vector<int> color, key;
  int arrived = 0, left = 0;
};

struct Group {
  int world = 0;
  int joined = 0;
  std::vector<ncclComm *> members;
  std::map<uint64_t, std::shared_ptr<Coll>> colls;
  std::map<uint64_t, SplitRound> splits;
};

}  // namespace

struct ncclComm {
  std::shared_ptr<Group> g;
  int rank = 0;
  bool blocking = true;
  bool dead = false;    // destroyed or aborted: its handle must not be used again
  int splitting = 0;    // non-blocking splits of this parent still in the background
  bool initializing = false;
  bool settling = false;  // a non-blocking call returned ncclInProgress; done at the next query
  ncclResult_t async = ncclSuccess;
  uint64_t seq = 0;
  uint64_t splits = 0;  // ncclCommSplit calls so far: the k-th split of every rank meets
};

namespace {

std::map<std::string, std::shared_ptr<Group>> g_groups;  // ids still accepting ranks
uint64_t g_ids = 0;
int g_live = 0;
std::vector<ncclComm *> g_all;  // live communicators
std::vector<std::unique_ptr<ncclComm>> g_dead;  // destroyed or aborted, kept poisoned
long long g_dead_calls = 0;  // calls that passed a dead handle
int g_hold_ms = 0;           // collectives sleep this long on entry (sg_ncclmock_hold)
int g_inside = 0;            // collective calls now inside the mock
int g_background = 0;        // background writers of handles still running
int g_stall_size = 0;        // sg_ncclmock_stall_size: stall the streams of collectives of it
std::vector<cudaStream_t> g_stalled;   // the streams it stalled
std::map<int, long long> g_done_by_size;  // collectives computed, by communicator size
thread_local int t_depth = 0;
thread_local std::vector<std::function<void()>> t_pending;
thread_local std::vector<ncclComm *> t_touched;
// This thread's sends and receives inside the open group, per communicator (stream, ops).
thread_local std::map<ncclComm *, std::pair<cudaStream_t, std::vector<P2p>>> t_p2p;

int elem_code(ncclDataType_t dt) {
  return dt == ncclBfloat16  ? 1
         : dt == ncclFloat16 ? 2
         : dt == ncclFloat64 ? 3
         : dt == ncclInt8    ? 4
                             : 0;
}

size_t esize(ncclDataType_t dt) {
  return dt == ncclFloat64 ? 8 : dt == ncclFloat32 ? 4 : dt == ncclInt8 ? 1 : 2;
}

// Sum over ranks, in rank order starting from rank 0's value, of element i of each `src`.
void reduce(const std::vector<const char *> &src, ncclDataType_t dt, size_t n, char *out) {
  const int code = elem_code(dt);
  for (size_t i = 0; i < n; i++) {
    if (code == 3) {
      double t = ((const double *)src[0])[i];
      for (size_t r = 1; r < src.size(); r++) t = t + ((const double *)src[r])[i];
      ((double *)out)[i] = t;
    } else {
      float t = sg_elem_load(src[0], code, i);
      for (size_t r = 1; r < src.size(); r++) t = t + sg_elem_load(src[r], code, i);
      sg_elem_store(out, code, i, t);
    }
  }
}

// The j-th send of part `from` to rank `to`, or nullptr.
const P2p *nth_send(const Part &from, int to, int j) {
  for (const P2p &o : from.p2p)
    if (o.send && o.peer == to && j-- == 0) return &o;
  return nullptr;
}

// A grouped exchange of sends and receives in which every rank takes part (the all-to-all):
// the j-th receive of rank r from p gets the j-th send of p to r, of the same size; false when
// one does not match (nothing moves then).
bool compute_p2p(Coll &c) {
  const int w = (int)c.parts.size();
  for (int r = 0; r < w; r++) {
    std::vector<int> seen(w, 0);
    for (const P2p &o : c.parts[r].p2p) {
      if (o.send) continue;
      const P2p *m = o.peer >= 0 && o.peer < w ? nth_send(c.parts[o.peer], r, seen[o.peer]++)
                                               : nullptr;
      if (!m || m->bytes != o.bytes) return false;
      c.out[r].insert(c.out[r].end(), (const char *)m->buf, (const char *)m->buf + o.bytes);
    }
  }
  return true;
}

// The result of a collective whose every rank has reached it: what each rank's recv buffer
// receives, computed from the send buffers as they are now (every rank's stream is at its item,
// so they are final). Each rank's recv is written only when its own stream passes its item, as
// on a GPU: a rank that reads its recv buffer without waiting for its own stream sees old data.
void compute(Coll &c) {
  const int w = (int)c.parts.size();
  const size_t es = esize(c.dt), bytes = c.count * es;
  c.out.assign(w, std::vector<char>());
  if (c.kind == kSendRecv) {
    if (!compute_p2p(c)) c.mismatch = true;
  } else if (c.kind == kAllReduce) {
    std::vector<const char *> src;
    for (const Part &p : c.parts) src.push_back((const char *)p.send);
    std::vector<char> out(bytes);
    reduce(src, c.dt, c.count, out.data());
    for (int r = 0; r < w; r++) c.out[r] = out;
  } else if (c.kind == kReduceScatter) {
    for (int r = 0; r < w; r++) {
      std::vector<const char *> src;
      for (const Part &p : c.parts) src.push_back((const char *)p.send + (size_t)r * bytes);
      c.out[r].resize(bytes);
      reduce(src, c.dt, c.count, c.out[r].data());
    }
  } else if (c.kind == kAllGather) {
    std::vector<char> all(bytes * w);
    for (int r = 0; r < w; r++) memcpy(all.data() + (size_t)r * bytes, c.parts[r].send, bytes);
    for (int r = 0; r < w; r++) c.out[r] = all;
  } else {
    std::vector<char> v((const char *)c.parts[c.root].send,
                        (const char *)c.parts[c.root].send + bytes);
    for (int r = 0; r < w; r++) c.out[r] = v;
  }
}

// The gate of rank `rank`'s item: true once the collective has been computed (or was aborted);
// then this rank's result lands in its recv buffer.
bool gate(const std::shared_ptr<Coll> &c, int rank) {
  if (c->aborted) return true;
  if (!c->done) {
    if (c->joined < (int)c->parts.size()) return false;
    for (const Part &p : c->parts)
      if (!sg_cudamock_at(p.s, p.pos)) return false;
    if (!c->mismatch) compute(*c);
    c->done = true;
    g_done_by_size[(int)c->parts.size()]++;
  }
  if (!c->mismatch && (size_t)rank < c->out.size() && !c->out[rank].empty()) {
    if (c->kind == kSendRecv) {  // the receives' data one after the other
      size_t off = 0;
      for (const P2p &o : c->parts[rank].p2p)
        if (!o.send) memcpy(o.buf, c->out[rank].data() + off, o.bytes), off += o.bytes;
    } else {
      memcpy(c->parts[rank].recv, c->out[rank].data(), c->out[rank].size());
    }
    std::vector<char>().swap(c->out[rank]);
  }
  return true;
}

// A handle of a destroyed or aborted communicator (counted).
bool dead(ncclComm_t comm) {
  if (!comm || !comm->dead) return false;
  g_dead_calls++;
  return true;
}

ncclResult_t usable(ncclComm_t comm) {
  if (!comm) return ncclInvalidArgument;
  if (dead(comm)) return ncclInvalidUsage;
  if (comm->splitting) return ncclInvalidUsage;  // a split of it is still in progress
  if (comm->initializing || comm->settling) return ncclInvalidUsage;  // not ready for calls
  return comm->async == ncclSuccess ? ncclSuccess : ncclInvalidUsage;
}

// Joins this rank to the comm's next collective; queues its gated item on s.
void join(ncclComm_t comm, Kind kind, const void *send, void *recv, size_t count, ncclDataType_t dt,
          int root, cudaStream_t s, const std::vector<P2p> *ops = nullptr) {
  Group &g = *comm->g;
  std::shared_ptr<Coll> &c = g.colls[comm->seq++];
  if (!c) {
    c = std::make_shared<Coll>();
    c->kind = kind, c->count = count, c->dt = dt, c->root = root;
    c->parts.resize(g.world);
  } else if (c->kind != kind || c->count != count || c->dt != dt || c->root != root) {
    c->mismatch = true;  // ranks disagree: nothing moves, every rank gets an error
    for (ncclComm *m : g.members)
      if (m) m->async = ncclInvalidUsage;
  }
  std::shared_ptr<Coll> held = c;
  Part &p = c->parts[comm->rank];
  p.joined = true, p.s = s, p.send = send, p.recv = recv;
  if (ops) p.p2p = *ops;
  const int rank = comm->rank;
  p.pos = sg_cudamock_push_gate(s, [held, rank] { return gate(held, rank); });
  c->joined++;
  if (g_stall_size && g_stall_size == g.world) { /* a slow link: its stream stops here */
    sg_cudamock_stall(s, 1);
    g_stalled.push_back(s);
  }
}

// Joins this rank's sends and receives of one group to the comm's next collective (every rank of
// the communicator must take part, as in an all-to-all); its gated item on s.
void join_p2p(ncclComm_t comm, cudaStream_t s, const std::vector<P2p> &ops) {
  join(comm, kSendRecv, nullptr, nullptr, 0, ncclInt8, 0, s, &ops);
}

thread_local char t_last[256] = "mock NCCL";

bool on_device(const void *p, size_t bytes) {
  cudaPointerAttributes a, b;
  return cudaPointerGetAttributes(&a, p) == cudaSuccess && a.type == cudaMemoryTypeDevice &&
         cudaPointerGetAttributes(&b, (const char *)p + bytes - 1) == cudaSuccess &&
         b.type == cudaMemoryTypeDevice;
}

// What real NCCL requires but does not check: both buffers in device memory, and either apart
// or exactly in place (all-reduce, broadcast: recv == send; reduce-scatter: recv == send +
// rank * recvcount; all-gather: send == recv + rank * sendcount). Anything else gives wrong
// data on a GPU, so the mock refuses it.
bool buffers_ok(ncclComm_t comm, Kind kind, const void *send, void *recv, size_t count,
                ncclDataType_t dt, int root) {
  const size_t es = esize(dt), w = (size_t)comm->g->world, me = (size_t)comm->rank;
  const size_t sb = count * es * (kind == kReduceScatter ? w : 1);
  const size_t rb = count * es * (kind == kAllGather ? w : 1);
  const char *sp = (const char *)send, *rp = (const char *)recv;
  const bool uses_send = kind != kBroadcast || comm->rank == root;
  if (count == 0) return true;
  if (!on_device(recv, rb) || (uses_send && !on_device(send, sb))) {
    snprintf(t_last, sizeof t_last, "mock NCCL: buffer not in device memory (send %p, recv %p)",
             send, recv);
    return false;
  }
  if (!uses_send) return true;
  const char *in_place = kind == kReduceScatter ? sp + me * count * es : sp;
  const char *in_place_send = kind == kAllGather ? rp + me * count * es : rp;
  if (kind == kAllGather ? sp == in_place_send : rp == in_place) return true;
  if (sp + sb <= rp || rp + rb <= sp) return true;
  snprintf(t_last, sizeof t_last,
           "mock NCCL: send %p (%zu bytes) and recv %p (%zu bytes) overlap without being in "
           "place (rank %d)",
           send, sb, recv, rb, comm->rank);
  return false;
}

// sg_ncclmock_hold: the call stays inside the mock for a while before it looks at comm, as a
// real enqueue takes time; a thread that frees the handle meanwhile is caught by dead().
void hold(std::unique_lock<std::recursive_mutex> &lk) {
  if (g_hold_ms <= 0) return;
  g_inside++;
  const int ms = g_hold_ms;
  lk.unlock();
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  lk.lock();
  g_inside--;
}

ncclResult_t call(ncclComm_t comm, Kind kind, const void *send, void *recv, size_t count,
                  ncclDataType_t dt, int root, cudaStream_t s) {
  std::unique_lock<std::recursive_mutex> lk(sg_cudamock_lock());
  hold(lk);
  ncclResult_t r = usable(comm);
  if (r != ncclSuccess) return r;
  if (!sg_cudamock_valid_stream(s) || (count && (!send || !recv))) return ncclInvalidArgument;
  if (!buffers_ok(comm, kind, send, recv, count, dt, root)) return ncclInvalidArgument;
  sg_cudamock_count_collective();
  if (t_depth == 0) {
    join(comm, kind, send, recv, count, dt, root, s);
    return ncclSuccess;
  }
  t_pending.push_back([=] { join(comm, kind, send, recv, count, dt, root, s); });
  t_touched.push_back(comm);
  return ncclSuccess;
}

void forget(ncclComm_t comm) {
  Group &g = *comm->g;
  if (comm->rank < (int)g.members.size() && g.members[comm->rank] == comm)
    g.members[comm->rank] = nullptr;
  g_live--;
  for (size_t i = 0; i < g_all.size(); i++)
    if (g_all[i] == comm) g_all.erase(g_all.begin() + (long)i);
  comm->dead = true;
  g_dead.emplace_back(comm);
}

// A new member `rank` of the group of `key` (under the lock); nullptr when the group cannot take
// it. *mine: the group.
ncclComm_t join_group(const std::string &key, int nranks, int rank, bool blocking,
                      std::shared_ptr<Group> *mine) {
  std::shared_ptr<Group> &g = g_groups[key];
  if (!g) {
    g = std::make_shared<Group>();
    g->world = nranks;
    g->members.assign(nranks, nullptr);
  }
  if (g->world != nranks || g->members[rank]) return nullptr;
  ncclComm_t c = new ncclComm;
  c->g = g;
  c->rank = rank;
  c->blocking = blocking;
  g->members[rank] = c;
  g->joined++;
  g_live++;
  g_all.push_back(c);
  *mine = g;
  if (g->joined == g->world) g_groups.erase(key);  // an id makes one communicator
  return c;
}

// Sleeps (lock released) until pred() or 60 s; pred()'s last answer.
template <class Pred>
bool wait_for(std::unique_lock<std::recursive_mutex> &lk, Pred pred) {
  for (int i = 0; i < 60000 && !pred(); i++) {
    lk.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    lk.lock();
  }
  return pred();
}

// Where NCCL's background thread writes a handle: *out, as an atomic store (the caller polls it).
void publish(ncclComm_t *out, ncclComm_t c) { __atomic_store_n(out, c, __ATOMIC_RELEASE); }

bool config_blocking(const ncclConfig_t *config) {
  return !config || config->blocking != 0;  // NCCL's default is blocking
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int *version) {
  if (!version) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
  }
  return "unknown result code";
}

const char *ncclGetLastError(ncclComm_t comm) {
  (void)comm;
  return t_last;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  if (!id) return ncclInvalidArgument;
  memset(id->internal, 0, sizeof id->internal);
  snprintf(id->internal, sizeof id->internal, "sg-ncclmock-%llu-%p", (unsigned long long)++g_ids,
           (void *)&g_ids);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *out, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config) {
  std::unique_lock<std::recursive_mutex> lk(sg_cudamock_lock());
  if (!out || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  *out = nullptr;
  const std::string key(id.internal, sizeof id.internal);
  std::shared_ptr<Group> mine;
  ncclComm_t c = join_group(key, nranks, rank, config_blocking(config), &mine);
  if (!c) return ncclInvalidUsage;
  if (!c->blocking) {  // NCCL >= 2.18: in progress, the handle written later by its thread
    c->initializing = true;
    c->async = ncclInProgress;
    g_background++;
    std::thread([out, c] {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::lock_guard<std::recursive_mutex> lk2(sg_cudamock_lock());
      publish(out, c);
      g_background--;
    }).detach();
    return ncclInProgress;
  }
  *out = c;
  return wait_for(lk, [&] { return mine->joined == mine->world; }) ? ncclSuccess : ncclSystemError;
}

namespace {

// The k-th split of every rank of comm's group, rank `comm->rank` with (color, key): waits until
// every rank has come, then joins this rank to its color's new group (through an id of
// (group, k, color), ranked by (key, rank), as an id would) and waits for its peers there.
// Under the lock; *child stays NULL for NCCL_SPLIT_NOCOLOR.
ncclResult_t split_round(std::unique_lock<std::recursive_mutex> &lk, ncclComm_t comm, uint64_t k,
                         int color, int key, bool blocking, ncclComm_t *child) {
  std::shared_ptr<Group> g = comm->g;
  SplitRound &s = g->splits[k];  // std::map: the reference survives other inserts
  if (!wait_for(lk, [&] { return s.arrived >= g->world || comm->dead; }) || comm->dead)
    return ncclSystemError;  // a peer never split (left in the table), or comm was aborted
  int size = 0, rank = 0;
  for (int r = 0; r < g->world; r++)
    if (s.color[r] == color) {
      size++;
      rank += s.key[r] < key || (s.key[r] == key && r < comm->rank);
    }
  if (++s.left == g->world) g->splits.erase(k);
  if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
  char id[128];
  memset(id, 0, sizeof id);
  snprintf(id, sizeof id, "sg-ncclmock-split-%p-%llu-%d", (void *)g.get(), (unsigned long long)k,
           color);
  std::shared_ptr<Group> mine;
  ncclComm_t c = join_group(std::string(id, sizeof id), size, rank, blocking, &mine);
  if (!c) return ncclInvalidUsage;
  if (!wait_for(lk, [&] { return mine->joined == mine->world; })) return ncclSystemError;
  *child = c;
  return ncclSuccess;
}

}  // namespace

// The k-th split of every rank of a group meets. On a blocking parent the call returns once the
// child is made; on a non-blocking one (NCCL >= 2.18) it returns ncclInProgress at once, *newcomm
// NULL: a background thread waits for the other ranks, makes the child, writes *newcomm and then
// lets the parent leave ncclInProgress (ncclCommGetAsyncError on the parent).
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config) {
  std::unique_lock<std::recursive_mutex> lk(sg_cudamock_lock());
  if (!comm || !newcomm || color < NCCL_SPLIT_NOCOLOR) return ncclInvalidArgument;
  const ncclResult_t u = usable(comm);
  if (u != ncclSuccess) return u;
  *newcomm = nullptr;
  std::shared_ptr<Group> g = comm->g;
  const uint64_t k = comm->splits++;
  SplitRound &s = g->splits[k];
  if (s.color.empty()) s.color.assign(g->world, 0), s.key.assign(g->world, 0);
  s.color[comm->rank] = color;
  s.key[comm->rank] = key;
  s.arrived++;
  const bool child_blocking = config_blocking(config);
  if (comm->blocking) {
    ncclComm_t child = nullptr;
    const ncclResult_t r = split_round(lk, comm, k, color, key, child_blocking, &child);
    *newcomm = child;
    return r;
  }
  comm->splitting++;
  g_background++;
  std::thread([comm, k, color, key, child_blocking, newcomm] {
    std::unique_lock<std::recursive_mutex> lk2(sg_cudamock_lock());
    ncclComm_t child = nullptr;
    const ncclResult_t r = split_round(lk2, comm, k, color, key, child_blocking, &child);
    if (child) publish(newcomm, child);
    comm->splitting--;
    if (r != ncclSuccess && !comm->dead) comm->async = r;
    g_background--;
  }).detach();
  return ncclInProgress;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async_error) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  if (!comm || !async_error) return ncclInvalidArgument;
  if (dead(comm)) return ncclInvalidUsage;
  if (comm->splitting) {
    *async_error = ncclInProgress;
    return ncclSuccess;
  }
  if (comm->initializing && comm->g->joined == comm->g->world) {
    comm->initializing = false;
    comm->async = ncclSuccess;
  }
  if (comm->settling) {  // reported once as in progress, then done
    comm->settling = false;
    *async_error = ncclInProgress;
    return ncclSuccess;
  }
  *async_error = comm->async;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  if (!comm) return ncclInvalidArgument;
  if (dead(comm)) return ncclInvalidUsage;
  if (comm->blocking) return ncclSuccess;
  comm->settling = true;
  return ncclInProgress;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  if (!comm) return ncclInvalidArgument;
  if (dead(comm)) return ncclInvalidUsage;
  forget(comm);
  return ncclSuccess;
}

// Collectives this rank has joined and not finished complete without moving data, as kernels
// leave when NCCL aborts; the other ranks' items stay stuck (their peer is gone).
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  if (!comm) return ncclInvalidArgument;
  if (dead(comm)) return ncclInvalidUsage;
  for (auto &kv : comm->g->colls)
    if (!kv.second->done && kv.second->parts[comm->rank].joined) kv.second->aborted = true;
  forget(comm);
  return ncclSuccess;
}

ncclResult_t ncclGroupStart(void) {
  t_depth++;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  if (t_depth == 0) return ncclInvalidUsage;
  if (--t_depth > 0) return ncclSuccess;
  for (auto &f : t_pending) f();
  t_pending.clear();
  for (auto &kv : t_p2p) join_p2p(kv.first, kv.second.first, kv.second.second);
  t_p2p.clear();
  bool in_progress = false;
  for (ncclComm *c : t_touched)
    if (!c->blocking) c->settling = in_progress = true;
  t_touched.clear();
  return in_progress ? ncclInProgress : ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  if (op != ncclSum) return ncclInvalidArgument;
  return call(comm, kAllReduce, sendbuff, recvbuff, count, datatype, 0, stream);
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  if (op != ncclSum) return ncclInvalidArgument;
  return call(comm, kReduceScatter, sendbuff, recvbuff, recvcount, datatype, 0, stream);
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return call(comm, kAllGather, sendbuff, recvbuff, sendcount, datatype, 0, stream);
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  if (!comm || root < 0 || root >= comm->g->world) return ncclInvalidArgument;
  return call(comm, kBroadcast, sendbuff, recvbuff, count, datatype, root, stream);
}

namespace {

// A send or receive of count elements with peer: inside a group, collected until ncclGroupEnd
// (the mock's point-to-point is grouped exchanges in which every rank takes part); alone, a
// group of its own.
ncclResult_t p2p(bool send, const void *buf, size_t count, ncclDataType_t dt, int peer,
                 ncclComm_t comm, cudaStream_t s) {
  std::unique_lock<std::recursive_mutex> lk(sg_cudamock_lock());
  hold(lk);
  ncclResult_t r = usable(comm);
  if (r != ncclSuccess) return r;
  const size_t bytes = count * esize(dt);
  if (!sg_cudamock_valid_stream(s) || peer < 0 || peer >= comm->g->world || (count && !buf))
    return ncclInvalidArgument;
  if (count && !on_device(buf, bytes)) {
    snprintf(t_last, sizeof t_last, "mock NCCL: %s buffer %p not in device memory",
             send ? "send" : "recv", buf);
    return ncclInvalidArgument;
  }
  sg_cudamock_count_collective();
  const P2p op = {send, peer, (void *)buf, bytes};
  if (t_depth == 0) {
    join_p2p(comm, s, {op});
    return ncclSuccess;
  }
  auto &e = t_p2p[comm];
  if (e.second.empty()) {
    e.first = s;
    t_touched.push_back(comm);
  }
  e.second.push_back(op);
  return ncclSuccess;
}

}  // namespace

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return p2p(true, sendbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return p2p(false, recvbuff, count, datatype, peer, comm, stream);
}

void sg_ncclmock_fail(ncclComm_t comm, ncclResult_t r) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  if (comm) comm->async = r;
}

void sg_ncclmock_fail_all(ncclResult_t r) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  for (ncclComm *c : g_all) c->async = r;
}

void sg_ncclmock_fail_world(int world, ncclResult_t r) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  for (ncclComm *c : g_all)
    if (c->g->world == world) c->async = r;
}

int sg_ncclmock_live(void) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  return g_live;
}

long long sg_ncclmock_dead_calls(void) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  return g_dead_calls;
}

void sg_ncclmock_hold(int ms) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  g_hold_ms = ms;
}

int sg_ncclmock_inside(void) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  return g_inside;
}

int sg_ncclmock_background(void) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  return g_background;
}

void sg_ncclmock_stall_size(int nranks) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  g_stall_size = nranks;
  if (nranks) return;
  for (cudaStream_t s : g_stalled) sg_cudamock_stall(s, 0);
  g_stalled.clear();
}

long long sg_ncclmock_done(int nranks) {
  std::lock_guard<std::recursive_mutex> lk(sg_cudamock_lock());
  auto it = g_done_by_size.find(nranks);
  return it == g_done_by_size.end() ? 0 : it->second;
}

}  // extern "C"
