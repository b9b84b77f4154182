"""Comm and Engine: Python objects over the sg_comm and sg_engine handles."""

import atexit
import contextlib
import ctypes
import dataclasses
import math
import os
import threading
import weakref

import numpy as np

from . import _lib
from ._structs import (DType, Device, PARAM_NO_DECAY, SgCommTraffic, SgHparams, SgLoadOptions,
                       SgMemoryStats, SgStepInfo, SgTraceEvent, TraceKind)
from .config import Config, to_dtype
from .errors import (InvalidArgumentError, InvalidStateError, ShardgradError, UnsupportedError,
                     check)

__all__ = ["Comm", "Engine", "StepInfo", "MemoryStats", "TraceKind", "TraceEvent",
           "estimate_memory", "run_threads", "version", "has_backend", "status_string",
           "last_error"]

# numpy dtype of each sg_dtype; bf16 has no numpy type and is viewed as its bits (uint16).
_NP_DTYPE = {DType.F32: np.dtype(np.float32), DType.BF16: np.dtype(np.uint16),
             DType.F16: np.dtype(np.float16)}
_ITEMSIZE = {DType.F32: 4, DType.BF16: 2, DType.F16: 2}

# Live handles, closed at interpreter exit (engines first): an MPI communicator that is never
# destroyed leaves MPI unfinalized, which mpirun reports as a failure.
_live_engines = weakref.WeakSet()
_live_comms = weakref.WeakSet()


@atexit.register
def _close_all():
    for e in list(_live_engines):
        try:
            e.close()
        except Exception:
            pass
    for c in list(_live_comms):
        try:
            c.close()
        except Exception:
            pass


def _call(name, *args):
    lib = _lib.load()
    fn = getattr(lib, name, None)
    if fn is None:
        raise UnsupportedError("%s is not exported by %s" % (name, _lib.library_path()),
                               function=name)
    check(lib, fn(*args), name)


def version():
    """(major, minor, patch) of the loaded library."""
    v = _lib.load().sg_version()
    return (v // 10000, v // 100 % 100, v % 100)


def has_backend(name):
    return bool(_lib.load().sg_has_backend(name.encode()))


def status_string(status):
    return _lib.load().sg_status_string(int(status)).decode()


def last_error():
    """This thread's last failure text from the library ("" when none)."""
    raw = _lib.load().sg_last_error()
    return raw.decode("utf-8", "replace") if raw else ""


# ------------------------------------------------------------------------------------------
# communicators


class Comm:
    """A communicator handle (sg_comm). Create with Comm.local(n) or Comm.mpi()."""

    def __init__(self, handle, kind):
        self._h = handle
        self.kind = kind
        self._users = 0  # engines using it
        self._released = 0  # of those, engines whose owner let go (Engine.release)
        self._close_pending = False
        _live_comms.add(self)

    @classmethod
    def local(cls, world):
        """`world` ranks as threads of this process: a list of communicators, comms[r] to be
        driven by its own thread (see run_threads)."""
        if isinstance(world, bool) or not isinstance(world, int):
            raise TypeError("Comm.local: world must be an int, got %r" % (world,))
        if not 1 <= world <= 4096:
            raise InvalidArgumentError("Comm.local: world must be in 1..4096 (got %d)" % world,
                                       function="sg_comm_create_local")
        arr = (ctypes.c_void_p * world)()
        _call("sg_comm_create_local", world, arr)
        return [cls(arr[r], "local") for r in range(world)]

    @classmethod
    def mpi(cls, comm=None):
        """One rank per process over MPI. `comm`: an mpi4py communicator (default
        MPI_COMM_WORLD). Without mpi4py the library initializes MPI itself, and finalizes it
        when the last communicator is closed."""
        ptr = None
        if comm is not None:
            try:
                from mpi4py import MPI
            except ImportError:
                raise UnsupportedError("Comm.mpi: passing a communicator needs mpi4py",
                                       function="sg_comm_create_mpi")
            ptr = ctypes.c_void_p(MPI._addressof(comm))
        h = ctypes.c_void_p()
        _call("sg_comm_create_mpi", ptr, ctypes.byref(h))
        return cls(h.value, "mpi")

    @classmethod
    def nccl_mpi(cls, comm=None):
        """NCCL communicator bootstrapped over MPI (CUDA builds)."""
        ptr = None
        if comm is not None:
            from mpi4py import MPI
            ptr = ctypes.c_void_p(MPI._addressof(comm))
        h = ctypes.c_void_p()
        _call("sg_comm_create_nccl_mpi", ptr, ctypes.byref(h))
        return cls(h.value, "nccl")

    @staticmethod
    def nccl_unique_id():
        """A 128-byte NCCL unique id (bytes) for Comm.nccl on every rank."""
        buf = ctypes.create_string_buffer(128)
        _call("sg_nccl_unique_id", buf)
        return buf.raw

    @classmethod
    def nccl(cls, rank, world, unique_id, cuda_device=-1):
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != 128:
            raise InvalidArgumentError("Comm.nccl: unique_id must be 128 bytes",
                                       function="sg_comm_create_nccl")
        buf = ctypes.create_string_buffer(bytes(unique_id), 128)
        h = ctypes.c_void_p()
        _call("sg_comm_create_nccl", int(rank), int(world), buf, int(cuda_device),
              ctypes.byref(h))
        return cls(h.value, "nccl")

    def split(self, color, key=0):
        """Collective: the ranks passing the same color >= 0 get a new communicator, ranked by
        (key, rank); color < 0 takes part and gets None (as MPI_Comm_split). Close the result
        yourself; it does not depend on this one staying open."""
        for name, v in (("color", color), ("key", key)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError("Comm.split: %s must be an int, got %r" % (name, v))
            if not -2**31 <= v < 2**31:
                raise InvalidArgumentError("Comm.split: %s out of int range (%d)" % (name, v),
                                           function="sg_comm_split")
        h = ctypes.c_void_p()
        _call("sg_comm_split", self.handle, color, key, ctypes.byref(h))
        return Comm(h.value, self.kind) if h.value else None

    def split_nodes(self, ranks_per_node=0):
        """Collective: (shard, replica), the two communicators of a hybrid layout of N nodes
        of L ranks (sg_comm_split_nodes). shard: the ranks of this rank's node; replica: the
        ranks with this rank's index in their node, one per node, in node order. Nodes are
        blocks of `ranks_per_node` consecutive ranks, or with 0 the ranks sharing a host (MPI:
        shared memory; threads: all of them). Nodes of different sizes raise MismatchError on
        every rank. Close both yourself; they do not depend on this one staying open."""
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int):
            raise TypeError("Comm.split_nodes: ranks_per_node must be an int, got %r"
                            % (ranks_per_node,))
        # out of int range: the library's own check, on every rank, as for any other bad value
        rpn = ranks_per_node if -2**31 <= ranks_per_node < 2**31 else -1
        shard, replica = ctypes.c_void_p(), ctypes.c_void_p()
        _call("sg_comm_split_nodes", self.handle, rpn, ctypes.byref(shard),
              ctypes.byref(replica))
        return Comm(shard.value, self.kind), Comm(replica.value, self.kind)

    def stats(self):
        """What this rank moved over the communicator (every engine on it included): a dict
        with bytes_sent, bytes_received and collectives, in bus bytes (see sg_comm_stats)."""
        t = SgCommTraffic(struct_size=ctypes.sizeof(SgCommTraffic))
        _call("sg_comm_stats", self.handle, ctypes.byref(t))
        return {"bytes_sent": t.bytes_sent, "bytes_received": t.bytes_received,
                "collectives": t.collectives}

    @property
    def handle(self):
        if self._h is None:
            raise InvalidStateError("Comm is closed", function="python")
        return self._h

    @property
    def rank(self):
        return _lib.load().sg_comm_rank(self.handle)

    @property
    def size(self):
        return _lib.load().sg_comm_size(self.handle)

    @property
    def closed(self):
        return self._h is None

    def close(self):
        """Destroys the communicator. Not allowed while an Engine still uses it."""
        if self._h is None:
            return
        if self._users and self._users == self._released:
            self._close_pending = True  # destroyed after the last released engine
            return
        if self._users:
            raise InvalidStateError("Comm.close: %d engine(s) still use this communicator; "
                                    "close them first" % (self._users - self._released),
                                    function="python")
        h, self._h = self._h, None
        _live_comms.discard(self)
        _lib.load().sg_comm_destroy(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if self._h is not None:
                if self._users:
                    self._close_pending = True  # the last engine closes it
                else:
                    self.close()
        except Exception:
            pass

    def __repr__(self):
        if self._h is None:
            return "<shardgrad.Comm closed>"
        return "<shardgrad.Comm %s rank %d of %d>" % (self.kind, self.rank, self.size)


def run_threads(world, fn, *args, **kwargs):
    """Runs fn(comm, *args, **kwargs) for every rank of Comm.local(world), each in its own
    thread; returns the results by rank. The first exception (by rank) is re-raised after all
    threads ended; a rank that fails leaves the others waiting in their next collective until
    the config's timeout_ms, so keep it short in tests."""
    comms = Comm.local(world)
    results = [None] * world
    errors = [None] * world

    def body(r):
        try:
            results[r] = fn(comms[r], *args, **kwargs)
        except BaseException as ex:  # noqa: B902 - re-raised below, in the caller's thread
            errors[r] = ex

    threads = [threading.Thread(target=body, args=(r,), name="shardgrad-rank%d" % r)
               for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for c in comms:
            try:
                c.close()
            except InvalidStateError:
                c._close_pending = True
    for ex in errors:
        if ex is not None:
            raise ex
    return results


# ------------------------------------------------------------------------------------------
# results


@dataclasses.dataclass
class StepInfo:
    step: int
    grad_norm: float
    clip_coef: float
    loss_scale: float
    skipped: bool


def _step_info(v):
    return StepInfo(int(v.step), float(v.grad_norm), float(v.clip_coef), float(v.loss_scale),
                    bool(v.skipped))


@dataclasses.dataclass
class MemoryStats:
    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optim_bytes: int
    comm_bytes: int
    total_bytes: int
    peak_bytes: int
    numel: int
    shard_numel: int
    host_bytes: int = 0  # pinned host memory (offload_optimizer on CUDA); not in total_bytes

    @classmethod
    def _from(cls, s):
        return cls(**{f.name: int(getattr(s, f.name)) for f in dataclasses.fields(cls)})

    def as_dict(self):
        return dataclasses.asdict(self)

    def __str__(self):
        mib = 1 << 20
        return ("params %.2f MiB, grads %.2f MiB, master %.2f MiB, optim %.2f MiB, comm %.2f "
                "MiB, total %.2f MiB (peak %.2f MiB), %d elements, %d per rank" % (
                    self.params_bytes / mib, self.grads_bytes / mib, self.master_bytes / mib,
                    self.optim_bytes / mib, self.comm_bytes / mib, self.total_bytes / mib,
                    self.peak_bytes / mib, self.numel, self.shard_numel) +
                (", host %.2f MiB" % (self.host_bytes / mib) if self.host_bytes else ""))


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One recorded event (sg_trace_event). Times are microseconds since trace_start, on the
    clock of the queue that ran the work; instants (GRAD_READY, MARK) have end_us == start_us.
    id: parameter id (GRAD_READY), bucket index in reduction order (REDUCE), bucket index
    (GATHER: one event per bucket and step; WAIT: the last bucket waited for), else -1; step:
    optimizer steps taken when the event was issued; label: the parameter's name or the mark's
    label (at most 47 bytes), else ""."""
    kind: TraceKind
    id: int
    step: int
    start_us: float
    end_us: float
    label: str

    @property
    def duration_us(self):
        return self.end_us - self.start_us

    @classmethod
    def _from(cls, ev):
        try:
            kind = TraceKind(ev.kind)
        except ValueError:
            kind = int(ev.kind)  # a kind newer than this binding
        return cls(kind, int(ev.id), int(ev.step), float(ev.start_us), float(ev.end_us),
                   ev.label.decode("utf-8", "replace"))


def _stats_struct():
    return SgMemoryStats(struct_size=ctypes.sizeof(SgMemoryStats))


def estimate_memory(numels, world, config=None, **kwargs):
    """Memory per rank for parameters of the given sizes at `world` ranks, without allocating."""
    cfg = config if config is not None else Config(**kwargs)
    if config is not None and kwargs:
        cfg = config.copy(**kwargs)
    numels = [int(n) for n in numels]
    if not numels:
        raise InvalidArgumentError("estimate_memory: no parameters", function="python")
    arr = (ctypes.c_size_t * len(numels))(*numels)
    out = _stats_struct()
    _call("sg_estimate_memory", ctypes.byref(cfg.struct), arr, len(numels), int(world),
          ctypes.byref(out))
    return MemoryStats._from(out)


# ------------------------------------------------------------------------------------------
# zero-copy views


def _host_buffer(ptr, nbytes, owner):
    """A writable ctypes buffer over library memory; it keeps `owner` (the Engine) alive."""
    buf = (ctypes.c_char * nbytes).from_address(ptr)
    buf._sg_owner = owner
    return buf


def _is_tensor(x):
    """A framework tensor (torch's), told by what is used of it: its address, detach and
    contiguity; this module imports no framework."""
    return all(hasattr(x, a) for a in ("data_ptr", "detach", "is_contiguous", "device"))


def _src_pointer(src, numel, what, dtype=None, device=Device.CPU):
    """(pointer, sg dtype, keepalive) for an array or tensor of exactly `numel` elements."""
    if _is_tensor(src):
        t = src.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.numel() != numel:
            raise InvalidArgumentError("%s: tensor has %d elements, parameter has %d"
                                       % (what, t.numel(), numel), function="python")
        dt = to_dtype(dtype if dtype is not None else t.dtype, what)
        if dt == DType.AUTO:
            raise InvalidArgumentError("%s: DType.AUTO is for the config only" % what,
                                       function="python")
        if (t.device.type == "cuda") != (device == Device.CUDA):
            raise InvalidArgumentError("%s: tensor on %s but the engine runs on %s"
                                       % (what, t.device, device.name), function="python")
        return t.data_ptr(), dt, t
    a = np.ascontiguousarray(src)
    if a.size != numel:
        raise InvalidArgumentError("%s: array has %d elements, parameter has %d"
                                   % (what, a.size, numel), function="python")
    if dtype is None:
        if a.dtype == np.uint16:
            raise InvalidArgumentError("%s: a uint16 array needs dtype='bf16'" % what,
                                       function="python")
        if a.dtype not in (np.float32, np.float16):
            a = a.astype(np.float32)
        dt = to_dtype(a.dtype, what)
    else:
        dt = to_dtype(dtype, what)
        if dt == DType.AUTO:
            raise InvalidArgumentError("%s: DType.AUTO is for the config only" % what,
                                       function="python")
        if a.dtype.itemsize != _ITEMSIZE[dt]:
            raise InvalidArgumentError("%s: array of %s cannot hold %s" % (what, a.dtype, dt.name),
                                       function="python")
    return a.ctypes.data, dt, a


# ------------------------------------------------------------------------------------------
# engine


class Engine:
    """One engine per model replica per rank (sg_engine). Driven by one thread at a time.

        with Engine(comm, lr=1e-3) as e:
            w = e.add_param("w", (256, 256))
            e.finalize()
            e.set_param(w, init)
            ...  e.grad_add(w, g) ... e.step()

    Views returned by param()/grad() and their torch variants (param_tensor()/grad_tensor(),
    which shardgrad.torch.views provides) point into library memory: they keep the Engine
    object alive, but must not be used after close(). With
    overlap_param_gather=1, step() returns while the parameters are still being all-gathered:
    call param_wait(pid) (or param_wait() for all) before reading a view after a step.

    replica_comm: a hybrid engine (sg_engine_create_hybrid): sharded over `comm` (the ranks of
    one node) and replicated over `replica_comm` (this rank's counterparts on the other nodes);
    both from comm.split_nodes(). Both stay in use until close().
    """

    def __init__(self, comm, config=None, replica_comm=None, **kwargs):
        if not isinstance(comm, Comm):
            raise TypeError("Engine: comm must be a shardgrad.Comm, got %r" % (comm,))
        if replica_comm is not None and not isinstance(replica_comm, Comm):
            raise TypeError("Engine: replica_comm must be a shardgrad.Comm or None, got %r"
                            % (replica_comm,))
        if config is None:
            config = Config(**kwargs)
        elif kwargs:
            config = config.copy(**kwargs)
        self.config = config
        self.comm = comm
        self.replica_comm = replica_comm
        self._h = None
        h = ctypes.c_void_p()
        if replica_comm is None:
            _call("sg_engine_create", comm.handle, ctypes.byref(config.struct), ctypes.byref(h))
        else:  # hybrid: sharded over comm (one node), replicated over replica_comm
            _call("sg_engine_create_hybrid", comm.handle, replica_comm.handle,
                  ctypes.byref(config.struct), ctypes.byref(h))
        self._h = h.value
        self._comms = (comm,) if replica_comm is None else (comm, replica_comm)
        for c in self._comms:
            c._users += 1
        self._names = []
        self._shapes = []
        self._numels = []
        self._ids = {}
        self._finalized = False
        self._pdtype = config.param_dtype
        self._gdtype = config.effective_grad_dtype
        self._device = config.device
        self._lr = float(config.lr)
        self._overlap = int(config.overlap_param_gather)
        _live_engines.add(self)

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def handle(self):
        if self._h is None:
            raise InvalidStateError("Engine is closed", function="python")
        return self._h

    @property
    def closed(self):
        return self._h is None

    @property
    def world_size(self):
        """Ranks training this model: comm.size, times replica_comm.size for a hybrid engine."""
        return self.comm.size * (self.replica_comm.size if self.replica_comm else 1)

    @property
    def rank(self):
        """This rank among world_size (hybrid: replica rank x comm.size + rank in comm)."""
        if self.replica_comm is None:
            return self.comm.rank
        return self.replica_comm.rank * self.comm.size + self.comm.rank

    def close(self):
        """Destroys the engine (waits for pending reductions). Views become invalid."""
        if self._h is None:
            return
        h, self._h = self._h, None
        _live_engines.discard(self)
        _lib.load().sg_engine_destroy(h)
        for comm in self._comms:
            comm._users -= 1
            if getattr(self, "_released_flag", False):
                comm._released -= 1
            if comm._users == 0 and comm._close_pending:
                comm.close()

    def release(self):
        """For an owner that is done with the engine while zero-copy views of its memory may
        still exist (ShardedAdamW.close): the engine is destroyed when the last reference to
        this object goes (each view holds one), and Comm.close() no longer waits for it (the
        communicator is destroyed after it). Drop your own reference after calling this."""
        if self._h is not None and not getattr(self, "_released_flag", False):
            self._released_flag = True
            for comm in self._comms:
                comm._released += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- registration ---------------------------------------------------------------------
    def add_param(self, name, shape, no_decay=False, flags=0):
        """Registers a parameter (shape: int or tuple) before finalize(); returns its id."""
        if isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        shape = tuple(int(s) for s in shape)
        numel = math.prod(shape) if shape else 1
        flags = int(flags) | (PARAM_NO_DECAY if no_decay else 0)
        pid = ctypes.c_int(-1)
        if not isinstance(name, str):
            raise TypeError("add_param: name must be a str, got %r" % (name,))
        if any(s < 0 for s in shape):
            raise InvalidArgumentError("add_param: negative dimension in %r" % (shape,),
                                       function="python")
        # surrogatepass: a str that is not valid UTF-8 (lone surrogates) reaches the library,
        # which refuses it with its own message instead of a UnicodeEncodeError.
        _call("sg_add_param", self.handle, name.encode("utf-8", "surrogatepass"), numel, flags,
              ctypes.byref(pid))
        self._names.append(name)
        self._shapes.append(shape)
        self._numels.append(numel)
        self._ids[name] = pid.value
        return pid.value

    def finalize(self):
        """Collective: builds the plan, checks agreement across ranks, allocates memory."""
        _call("sg_finalize", self.handle)
        self._finalized = True

    @property
    def num_params(self):
        return len(self._names)

    def param_id(self, name):
        return self._ids[name]

    def param_name(self, pid):
        return self._names[self._check_id(pid)]

    def param_shape(self, pid):
        return self._shapes[self._check_id(pid)]

    def _check_id(self, pid):
        if isinstance(pid, str):
            if pid not in self._ids:
                raise InvalidArgumentError("no parameter named %r" % pid, function="python")
            return self._ids[pid]
        pid = int(pid)
        if not 0 <= pid < len(self._names):
            raise InvalidArgumentError("no parameter with id %d (have %d)"
                                       % (pid, len(self._names)), function="python")
        return pid

    # -- parameters -----------------------------------------------------------------------
    def param_ptr(self, pid):
        """Address of working parameter `pid` (full replica, param_dtype, engine device)."""
        p = ctypes.c_void_p()
        _call("sg_param_ptr", self.handle, self._check_id(pid), ctypes.byref(p))
        return p.value

    def param_wait(self, pid=-1):
        """With overlap_param_gather on: orders the caller's work after the all-gather (started
        by the last step()) of the bucket holding parameter `pid` (an id or a name; -1 or None:
        every bucket). On a CPU engine the calling thread waits; on CUDA the engine's stream
        does (see set_stream), not the host. Call it before anything reads the parameter after
        a step, e.g. in a forward pre-hook (shardgrad.torch.ShardedAdamW does that); reading
        earlier sees a mix of old and new values. Buckets are gathered in the order a forward
        pass in registration order needs them, so waiting in that order stalls only where the
        communication is behind. Returns at once when nothing is pending, and always without
        overlap_param_gather. Library calls that touch parameters (step, set_param, get_param,
        save, ...) wait by themselves; NumPy/torch views do not. A failed all-gather is
        reported here (CommError, ShardgradTimeoutError; the engine is then broken). An id
        outside 0..num_params-1 other than -1 raises InvalidArgumentError with the library's
        text; an unknown name raises it too."""
        if pid is None:
            pid = -1
        if isinstance(pid, str):
            pid = self._check_id(pid)
        elif isinstance(pid, bool) or not isinstance(pid, (int, np.integer)):
            raise TypeError("param_wait: pid must be an int or a name, got %r" % (pid,))
        h = self.handle
        if not _lib.has("sg_param_wait"):
            # an older library cannot overlap (Config refuses the field): nothing is pending
            if pid != -1:
                self._check_id(pid)
            return
        _call("sg_param_wait", h, int(pid))

    @property
    def overlap_param_gather(self):
        """True when step() returns before the parameters are gathered (see param_wait)."""
        return bool(self._overlap)

    def _host_view(self, ptr, pid, dtype):
        """Zero-copy NumPy view of numel(pid) elements of dtype at ptr, owned by this engine."""
        n = self._numels[pid]
        buf = _host_buffer(ptr, n * _ITEMSIZE[dtype], self)
        return np.frombuffer(buf, dtype=_NP_DTYPE[dtype], count=n).reshape(self._shapes[pid])

    def param(self, pid):
        """Zero-copy NumPy view of working parameter `pid` (bf16 as uint16). CPU only. After a
        step with overlap_param_gather, param_wait(pid) before reading it."""
        pid = self._check_id(pid)
        self._need_host("param")
        return self._host_view(self.param_ptr(pid), pid, self._pdtype)

    def set_param(self, pid, src, dtype=None):
        """Sets working parameter and this rank's master fragments from host memory."""
        pid = self._check_id(pid)
        ptr, dt, keep = _src_pointer(src, self._numels[pid], "set_param", dtype)
        if _is_tensor(keep) and keep.device.type != "cpu":
            raise InvalidArgumentError("set_param: needs host memory", function="python")
        _call("sg_set_param", self.handle, pid, ctypes.c_void_p(ptr), int(dt))
        del keep

    def get_param(self, pid, dtype=DType.F32):
        """Copy of working parameter `pid` converted to dtype (NumPy; bf16 as uint16)."""
        pid = self._check_id(pid)
        dt = to_dtype(dtype)
        if dt == DType.AUTO:
            dt = self._pdtype
        out = np.empty(self._shapes[pid], dtype=_NP_DTYPE[dt])
        _call("sg_get_param", self.handle, pid, ctypes.c_void_p(out.ctypes.data), int(dt))
        return out

    def broadcast_params(self, root=0):
        """Collective: every rank's working params become root's."""
        _call("sg_broadcast_params", self.handle, int(root))

    def get_master(self, pid):
        """Collective: full fp32 master weights of `pid`."""
        pid = self._check_id(pid)
        out = np.empty(self._shapes[pid], dtype=np.float32)
        _call("sg_get_master", self.handle, pid,
              out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        return out

    def get_optim_state(self, pid, which):
        """Collective: AdamW state of `pid`; which = 0/'m'/'exp_avg' or 1/'v'/'exp_avg_sq'."""
        names = {"m": 0, "exp_avg": 0, "v": 1, "exp_avg_sq": 1}
        w = names.get(which, which) if isinstance(which, str) else which
        if isinstance(w, str):
            raise InvalidArgumentError("get_optim_state: which must be 'm' or 'v' (got %r)"
                                       % which, function="python")
        pid = self._check_id(pid)
        out = np.empty(self._shapes[pid], dtype=np.float32)
        _call("sg_get_optim_state", self.handle, pid, int(w),
              out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        return out

    # -- gradients ------------------------------------------------------------------------
    def grad_ptr(self, pid):
        """Address of the zeroed gradient slot of `pid` for this micro-batch."""
        pid = self._check_id(pid)
        p = ctypes.c_void_p()
        _call("sg_grad_ptr", self.handle, pid, ctypes.byref(p))
        return p.value

    def grad(self, pid):
        """Zero-copy NumPy view of the gradient slot of `pid` (grad_dtype; bf16 as uint16),
        valid until grad_ready(pid). CPU only."""
        pid = self._check_id(pid)
        self._need_host("grad")
        return self._host_view(self.grad_ptr(pid), pid, self._gdtype)

    def grad_ready(self, pid):
        _call("sg_grad_ready", self.handle, self._check_id(pid))

    def grad_add(self, pid, src, dtype=None):
        """Adds src (NumPy array or torch tensor, f32/bf16/f16, numel elements) into the slot of
        `pid` and marks it ready."""
        pid = self._check_id(pid)
        ptr, dt, keep = _src_pointer(src, self._numels[pid], "grad_add", dtype, self._device)
        _call("sg_grad_add", self.handle, pid, ctypes.c_void_p(ptr), int(dt))
        del keep

    def grad_add_ptr(self, pid, ptr, dtype):
        """sg_grad_add on a raw address holding numel elements of dtype (no checks)."""
        _call("sg_grad_add", self.handle, int(pid), ctypes.c_void_p(ptr), int(dtype))

    def backward_end(self):
        _call("sg_backward_end", self.handle)

    def set_sync(self, enabled):
        _call("sg_set_sync", self.handle, 1 if enabled else 0)

    def set_microbatches(self, n):
        """Micro-batches per optimizer step (sg_set_microbatches; 0: not said). A hybrid engine
        then starts each bucket's all-reduce across nodes during the n-th micro-batch's
        backward pass instead of in step(). Same value on every rank, between micro-batches."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError("Engine.set_microbatches: n must be an int, got %r" % (n,))
        if not 0 <= n < 2**31:
            raise InvalidArgumentError("Engine.set_microbatches: n must be >= 0 (got %d)" % n,
                                       function="sg_set_microbatches")
        _call("sg_set_microbatches", self.handle, n)

    def grad_zero(self):
        """Collective: drops every gradient accumulated since the last step (sg_grad_zero).
        Completes the micro-batch in progress (written gradients, zeros for the rest), waits
        for its reductions and zeroes the accumulators, so that the next step() applies only
        what comes after. For recovering from an exception raised during backward: every rank
        calls it at the same point."""
        _call("sg_grad_zero", self.handle)

    # -- step -----------------------------------------------------------------------------
    def step(self, info=True):
        """Collective: reductions, global norm, clipping, AdamW on the shard, all-gather
        (bucket by bucket, last bucket first). With overlap_param_gather it returns once the
        all-gathers are queued: param_wait before reading parameters through views.
        Returns the step's StepInfo; with info=False, None, and the step asks the library for
        no result, so that a step decided on the GPU waits for nothing on the host
        (last_step_info() reads the result later)."""
        if not info:
            _call("sg_step", self.handle, None)
            return None
        v = SgStepInfo(struct_size=ctypes.sizeof(SgStepInfo))
        _call("sg_step", self.handle, ctypes.byref(v))
        return _step_info(v)

    def last_step_info(self):
        """StepInfo of the latest step() (sg_last_step_info). Not collective. After a step
        decided on the GPU the first call waits for its outcome if the GPU has not written it
        yet; otherwise nothing waits. InvalidStateError before the first step."""
        if not _lib.has("sg_last_step_info"):
            raise UnsupportedError("Engine.last_step_info: this libshardgrad has no "
                                   "sg_last_step_info", function="python")
        v = SgStepInfo(struct_size=ctypes.sizeof(SgStepInfo))
        _call("sg_last_step_info", self.handle, ctypes.byref(v))
        return _step_info(v)

    def set_lr(self, lr):
        _call("sg_set_lr", self.handle, float(lr))
        self._lr = float(lr)

    @property
    def lr(self):
        """The learning rate in effect (after load(): the checkpoint's)."""
        if _lib.has("sg_get_lr"):
            v = ctypes.c_float()
            _call("sg_get_lr", self.handle, ctypes.byref(v))
            return float(v.value)
        return self._lr

    @lr.setter
    def lr(self, value):
        self.set_lr(value)

    # -- parameter groups -------------------------------------------------------------------
    def set_param_group(self, pid, group):
        """Puts parameter `pid` (an id or a name) in group 0..MAX_GROUPS-1 (default 0), before
        finalize(). Every rank must use the same groups (finalize raises MismatchError)."""
        _call("sg_set_param_group", self.handle, self._check_id(pid), int(group))

    def set_group(self, group, lr, weight_decay):
        """Sets a group's lr and weight decay (used from the next step). A group never set
        has the config's; group 0's lr is the one set_lr sets. Not checked across ranks."""
        _call("sg_set_group", self.handle, int(group), float(lr), float(weight_decay))
        if int(group) == 0:
            self._lr = float(lr)

    def get_group(self, group):
        """(lr, weight_decay) of group `group`, as float32 values."""
        lr, wd = ctypes.c_float(), ctypes.c_float()
        _call("sg_get_group", self.handle, int(group), ctypes.byref(lr), ctypes.byref(wd))
        return float(lr.value), float(wd.value)

    _HPARAMS = ("lr", "weight_decay", "beta1", "beta2", "eps", "max_grad_norm")

    def hparams(self, group=0):
        """{lr, weight_decay (group `group`'s), beta1, beta2, eps, max_grad_norm} as the next
        step uses them, exact (doubles; sg_get_hparams)."""
        h = SgHparams(struct_size=ctypes.sizeof(SgHparams))
        _call("sg_get_hparams", self.handle, int(group), ctypes.byref(h))
        return {k: float(getattr(h, k)) for k in self._HPARAMS}

    def set_hparams(self, group=0, **values):
        """Sets any of lr, weight_decay (group `group`'s), beta1, beta2, eps, max_grad_norm
        (the engine's) exactly, as Python floats (sg_set_hparams), between steps; the others
        keep their values. The per-step scalars are then formed from them as torch.optim.AdamW
        forms them. Not checked across ranks."""
        unknown = sorted(set(values) - set(self._HPARAMS))
        if unknown:
            raise TypeError("Engine.set_hparams: unknown hyperparameter(s) %s (known: %s)"
                            % (", ".join(unknown), ", ".join(self._HPARAMS)))
        cur = self.hparams(group)
        cur.update({k: float(v) for k, v in values.items()})
        h = SgHparams(struct_size=ctypes.sizeof(SgHparams), **cur)
        _call("sg_set_hparams", self.handle, int(group), ctypes.byref(h))
        if int(group) == 0:
            self._lr = cur["lr"]

    def grad_norm(self):
        """Collective, between the last backward of a step and step(): the global L2 norm of
        the reduced gradient (before clipping; NaN when it is not finite) that the next step
        clips with (sg_grad_norm); step() reuses it."""
        v = ctypes.c_float()
        _call("sg_grad_norm", self.handle, ctypes.byref(v))
        return float(v.value)

    def grad_scale(self, factor):
        """Multiplies the gradient of the coming step by factor (sg_grad_scale): the norm and
        the step see the scaled gradient; factors multiply until the step (or grad_zero, load).
        Give every rank the same factors."""
        _call("sg_grad_scale", self.handle, ctypes.c_double(float(factor)))

    @property
    def step_count(self):
        """Optimizer steps taken so far (skipped steps do not count; restored by load())."""
        v = ctypes.c_uint64()
        _call("sg_get_step", self.handle, ctypes.byref(v))
        return int(v.value)

    def param_step(self, pid):
        """Parameter pid's own step count (sg_get_param_step): the steps that updated it; a
        step in which no rank gave it a gradient skips it, as torch.optim.AdamW does."""
        v = ctypes.c_uint64()
        _call("sg_get_param_step", self.handle, self._check_id(pid), ctypes.byref(v))
        return int(v.value)

    @property
    def loss_scale(self):
        s = ctypes.c_float()
        _call("sg_get_loss_scale", self.handle, ctypes.byref(s))
        return float(s.value)

    @property
    def param_dtype(self):
        return self._pdtype

    @property
    def grad_dtype(self):
        """dtype of the gradient slots (config grad_dtype with AUTO resolved)."""
        return self._gdtype

    def set_stream(self, stream):
        """The caller's CUDA stream (an int handle, a torch.cuda.Stream, or None for the
        engine's own); CPU engines accept only None/0."""
        ptr = getattr(stream, "cuda_stream", stream)
        _call("sg_set_stream", self.handle, ctypes.c_void_p(ptr or None))

    # -- memory ---------------------------------------------------------------------------
    def memory(self):
        out = _stats_struct()
        _call("sg_memory", self.handle, ctypes.byref(out))
        return MemoryStats._from(out)

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, directory):
        """Collective: the training state (params, masters, moments, step, lr, loss scale) into
        `directory`, each rank writing its shard; crash-safe (see sg_save)."""
        _call("sg_save", self.handle, os.fsencode(directory))

    def load(self, directory, convert_optim_state=False):
        """Collective: restores a checkpoint saved at any world size, bucket size or strategy.
        convert_optim_state: a checkpoint whose optimizer state is in the other format
        (optim_state_dtype fp32 or q8) is converted (sg_load_options.convert_optim_state);
        without it, MismatchError."""
        if not isinstance(convert_optim_state, bool):
            raise TypeError("load: convert_optim_state must be a bool, got %r"
                            % (convert_optim_state,))
        if not convert_optim_state:
            _call("sg_load", self.handle, os.fsencode(directory))
        else:
            opt = SgLoadOptions()
            _call("sg_load_options_init", ctypes.byref(opt), ctypes.sizeof(SgLoadOptions))
            opt.convert_optim_state = 1
            _call("sg_load_ex", self.handle, os.fsencode(directory), ctypes.byref(opt))
        self._lr = None  # restored from the checkpoint; the C API has no getter

    def export(self, path):
        """Collective (rank 0 writes): fp32 master weights by name as a safetensors file."""
        _call("sg_export", self.handle, os.fsencode(path))

    def import_(self, path):
        """Collective: sets parameters (working and master) from a safetensors file by name;
        optimizer state and step are unchanged."""
        _call("sg_import", self.handle, os.fsencode(path))

    # -- tracing --------------------------------------------------------------------------
    def trace_start(self, max_events=0):
        """Starts recording (after finalize) into room for max_events events (0: 16384); later
        events are counted as dropped. Not collective. Already recording (also when SG_TRACE
        started it at finalize): InvalidStateError."""
        if isinstance(max_events, bool) or not isinstance(max_events, (int, np.integer)):
            raise TypeError("trace_start: max_events must be an int, got %r" % (max_events,))
        if max_events < 0:
            raise InvalidArgumentError("trace_start: max_events must be >= 0 (got %d)"
                                       % max_events, function="python")
        _call("sg_trace_start", self.handle, int(max_events))

    def trace_stop(self):
        """Stops recording; the events stay readable until the next trace_start."""
        _call("sg_trace_stop", self.handle)

    def trace_mark(self, label):
        """An instant on the caller's queue, e.g. "backward" where a backward pass begins
        (trace_overlap uses these marks to tell micro-batches apart)."""
        if not isinstance(label, str):
            raise TypeError("trace_mark: label must be a str, got %r" % (label,))
        _call("sg_trace_mark", self.handle, label.encode("utf-8"))

    def trace_events(self):
        """(list of TraceEvent in issue order, number dropped) of the current or last
        recording. Waits for the engine's queued work, whose times are known only then."""
        count = ctypes.c_size_t()
        dropped = ctypes.c_uint64()
        _call("sg_trace_events", self.handle, None, 0, ctypes.byref(count), ctypes.byref(dropped))
        while True:  # while recording, events may be added between two calls
            cap = count.value
            buf = (SgTraceEvent * cap)()
            _call("sg_trace_events", self.handle, buf if cap else None, cap, ctypes.byref(count),
                  ctypes.byref(dropped))
            if count.value <= cap:
                return [TraceEvent._from(buf[i]) for i in range(count.value)], int(dropped.value)

    def trace_write(self, path):
        """Writes the recorded events as a Chrome trace (JSON; chrome://tracing, Perfetto) to
        `path`, where %r becomes the rank."""
        _call("sg_trace_write", self.handle, os.fsencode(path))

    @contextlib.contextmanager
    def trace(self, max_events=0):
        """Records the events of the block:

            with e.trace():
                ...
            events, dropped = e.trace_events()
        """
        self.trace_start(max_events)
        body_ok = False
        try:
            yield self
            body_ok = True
        finally:
            if self._h is not None:  # closed in the block: nothing left to stop
                try:
                    self.trace_stop()
                except ShardgradError:
                    if body_ok:  # else the block's own exception is the one to see
                        raise

    def _need_host(self, what):
        if self._device != Device.CPU:
            raise UnsupportedError("%s: NumPy views need a CPU engine; use %s_tensor()"
                                   % (what, what), function="python")

    def __repr__(self):
        if self._h is None:
            return "<shardgrad.Engine closed>"
        return "<shardgrad.Engine %d params, %s>" % (len(self._names),
                                                      "finalized" if self._finalized else "building")
