"""Communicators from torch.distributed: comm_from_torch (what Comm.from_torch calls) and its
transport over a process group.

The transport: a communicator (sg_comm_create_xport) whose bytes travel as torch.distributed
sends and receives of uint8 CPU tensors over a process group (gloo), beside whatever else the
application does with that group.

How a transfer runs. The engine's comm worker (a C thread) calls isend/irecv through ctypes,
which takes the GIL for the callback: a send copies the library's bytes into a tensor of
torch's own, a receive gets an empty one; it posts ProcessGroup.send/recv and hands the Work to
a waiter thread. gloo's send/recv Work completes only inside Work.wait() (is_completed() stays
False, there is no future), so a waiter blocks in wait() (torch releases the GIL there), copies
a received message into the library's buffer and reports the result with sg_xport_done.

Why copies and not views of the library's buffer (torch.frombuffer): gloo keeps using a
transfer's tensor after the library gave up on it (a deadline passed: the library cancels it,
frees the buffer and fails the call), so a view would let gloo send freed memory to the peer
(which then reads garbage, as a late peer did) or write a late message into it. With tensors
of torch's own a cancelled transfer never touches library memory: cancel is exact. And a view's
deleter needs the GIL, which gloo's threads, dropping the last reference, would take while the
interpreter exits; torch's own tensors free without Python. The cost is one host memcpy per
transfer, beside a network transfer of the same bytes. The library polls its own record of the transfer, never Python, so
a waiting comm worker does not compete for the GIL. Waiters are a pool that grows to the
number of transfers in flight (a handful per collective) and is reused.

Deadlines are the library's: a transfer that does not finish in time is cancelled (the Work is
kept alive, with its tensor, for as long as gloo might still use that tensor; the library's
buffer is no longer touched) and the engine's call fails with TimeoutError. A failed Work (peer gone: gloo reports the closed connection)
fails the call with CommError carrying torch's message.

Every callback catches everything (an exception must never cross into C) and answers with a
status and a message. The callbacks are module-level ctypes objects that live as long as the
process, and each communicator's state is found through an integer key, so no callback can run
after its function object was freed, whatever is closed or collected first.

Splits: Comm.split and Comm.split_nodes of such a communicator give communicators over the same
group (the library maps their ranks to the group's and gives each its own tags), so one gloo
group serves a hybrid layout; the transport is released when the last of them is closed,
whatever the order.

Tags: the library's tags (communicator, channel and call) are below 2^31; the application's own
point-to-point messages on the same group should use other tags or another group.
"""

import ctypes
import itertools
import os
import queue
import threading

import torch

from .. import _lib
from .._structs import XPORT_CANCEL, XPORT_RECV, XPORT_RELEASE, XPORT_SEND, SgXport
from ..core import Comm, _call, has_backend
from ..errors import InvalidStateError, MismatchError, UnsupportedError

__all__ = ["comm_from_torch", "create", "TorchTransport"]


# ------------------------------------------------------------------------------------------
# communicators from torch.distributed

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def _dist_initialized():
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _started_by_mpirun():
    return any(k in os.environ for k in _MPI_ENV)


def comm_from_torch(group=None):
    """Collective over `group` (default: the whole world): a shardgrad communicator with the
    same ranks as an initialized torch.distributed process group (Comm.from_torch).

    - NCCL group (CUDA): an NCCL communicator on torch's current CUDA device, its unique id made
      by the group's rank 0 and shared through the group (broadcast_object_list).
    - A job started by mpirun (the whole world only): Comm.mpi(), checked to give every process
      the rank torch gave it.
    - Otherwise (gloo on CPU under torchrun): a communicator whose transfers go through the
      group itself, when the library has that transport (sg_comm_create_xport); else
      UnsupportedError saying what to do instead.
    """
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidStateError("Comm.from_torch: torch.distributed is not initialized (call "
                                "torch.distributed.init_process_group first, e.g. under "
                                "torchrun)", function="python")
    g = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(g), dist.get_world_size(g)
    backend = str(dist.get_backend(g)).lower()
    if "nccl" in backend:
        return _nccl_from_torch(dist, g, rank, world)
    whole = world == dist.get_world_size()
    if whole and _started_by_mpirun() and has_backend("mpi"):
        comm = Comm.mpi()
        if comm.size != world or comm.rank != rank:
            got = (comm.rank, comm.size)
            comm.close()
            raise MismatchError("Comm.from_torch: MPI gives this process rank %d of %d, torch "
                                "rank %d of %d: start torch with the ranks mpirun assigned "
                                "(RANK=$OMPI_COMM_WORLD_RANK)" % (got + (rank, world)),
                                function="python")
        return comm
    if not _lib.has("sg_comm_create_xport"):
        raise UnsupportedError(
            "Comm.from_torch: a %s process group needs shardgrad's torch.distributed transport, "
            "which this libshardgrad lacks; start the job with mpirun instead of torchrun "
            "(from_torch then uses MPI), or create the communicator with Comm.mpi()" % backend,
            function="python")
    return create(g, rank, world)


def _nccl_from_torch(dist, g, rank, world):
    if not has_backend("nccl"):
        raise UnsupportedError("Comm.from_torch: the process group uses NCCL but this "
                               "libshardgrad was built without it (sg_has_backend('nccl'))",
                               function="python")
    uid = [Comm.nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=dist.get_global_rank(g, 0), group=g)
    return Comm.nccl(rank, world, uid[0], cuda_device=torch.cuda.current_device())


# ------------------------------------------------------------------------------------------
# the transport


class _Waiters:
    """Daemon threads that block in Work.wait(); at least one free thread per queued job, so a
    transfer never waits behind another that cannot finish before it."""

    def __init__(self):
        self._q = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self.threads = 0

    def submit(self, job):
        with self._lock:
            spawn = self._idle == 0
            if spawn:
                self.threads += 1
            else:
                self._idle -= 1
        if spawn:
            threading.Thread(target=self._run, name="shardgrad-xport-wait", daemon=True).start()
        self._q.put(job)

    def _run(self):
        while True:
            job = self._q.get()
            try:
                job()
            except BaseException:  # a job reports its own failures; never lose the thread
                pass
            with self._lock:
                self._idle += 1


_waiters = _Waiters()
_transports = {}  # key -> TorchTransport, until the library releases it
_keys = itertools.count(1)  # 0 would reach the callbacks as None
_kept = []  # (work, tensor) of cancelled transfers gloo may still use: never freed


class TorchTransport:
    """One communicator's transfers over `group` (a torch ProcessGroup with send/recv taking
    ranks within the group)."""

    def __init__(self, group, rank, world):
        self.group = group
        self.rank = rank
        self.world = world
        self.lock = threading.Lock()
        self.pending = {}  # token -> [work, tensor, finished]
        self.released = False

    def start(self, recv, buf, nbytes, peer, tag, token):
        t = torch.empty(nbytes, dtype=torch.uint8)
        if not recv and nbytes:
            ctypes.memmove(t.data_ptr(), buf, nbytes)
        work = (self.group.recv if recv else self.group.send)([t], peer, tag)
        entry = [work, t, False]
        with self.lock:
            self.pending[token] = entry
        _waiters.submit(lambda: self._wait(token, entry, buf if recv else None, nbytes))

    def _wait(self, token, entry, recv_buf, nbytes):
        err = None
        try:
            entry[0].wait()
        except BaseException as e:  # noqa: B902 - reported to the library as text
            err = "%s: %s" % (type(e).__name__, str(e).strip().splitlines()[0] if str(e) else "")
        with self.lock:  # cancel takes it too: after a cancel, no byte reaches recv_buf
            entry[2] = True
            if self.pending.pop(token, None) is None:
                return  # cancelled: the library forgot the token and may have freed the buffer
            lib = _lib.load()
            if err is None:
                if recv_buf is not None and nbytes:
                    ctypes.memmove(recv_buf, entry[1].data_ptr(), nbytes)
                lib.sg_xport_done(token, 0, nbytes if recv_buf is not None else 0, None)
            else:
                lib.sg_xport_done(token, 1, 0, err.encode("utf-8", "replace"))

    def cancel(self, token):
        """0: the library's buffer is never touched again (always so: gloo keeps only the
        transfer's own tensor, kept alive here while gloo may still use it)."""
        with self.lock:
            entry = self.pending.pop(token, None)
        if entry is not None and not entry[2]:
            _kept.append((entry[0], entry[1]))
        return 0


def _write_msg(msg, cap, text):
    if not msg or cap == 0:
        return
    raw = text.encode("utf-8", "replace")[:cap - 1] + b"\0"
    ctypes.memmove(msg, raw, len(raw))


def _start(recv):
    def cb(user, buf, nbytes, peer, tag, token, msg, cap):
        try:
            tp = _transports.get(user)
            if tp is None:
                raise RuntimeError("the communicator's transport was already released")
            tp.start(recv, buf, nbytes, peer, tag, token)
            return 0
        except BaseException as e:  # noqa: B902 - never into C
            _write_msg(msg, cap, "torch.distributed %s, rank %d, tag %d: %s: %s"
                       % ("recv" if recv else "send", peer, tag, type(e).__name__, e))
            return 1
    return cb


def _cancel(user, token):
    try:
        tp = _transports.get(user)
        return tp.cancel(token) if tp is not None else 0
    except BaseException:  # noqa: B902
        return 1  # unknown: assume the buffer may still be used


def _release(user):
    try:
        tp = _transports.pop(user, None)
        if tp is not None:
            tp.released = True
    except BaseException:  # noqa: B902
        pass


_CB_SEND = XPORT_SEND(_start(False))
_CB_RECV = XPORT_RECV(_start(True))
_CB_CANCEL = XPORT_CANCEL(_cancel)
_CB_RELEASE = XPORT_RELEASE(_release)


def create(group, rank, world, name=b"torch"):
    """A Comm of `world` ranks, this process being `rank`, over `group` (a torch ProcessGroup
    on CPU tensors, e.g. gloo). Not collective."""
    key = next(_keys)
    _transports[key] = TorchTransport(group, rank, world)
    t = SgXport(struct_size=ctypes.sizeof(SgXport), name=name, user=key, threaded=1,
                isend=_CB_SEND, irecv=_CB_RECV, cancel=_CB_CANCEL, release=_CB_RELEASE)
    h = ctypes.c_void_p()
    try:
        _call("sg_comm_create_xport", ctypes.byref(t), int(rank), int(world), ctypes.byref(h))
    except BaseException:
        _transports.pop(key, None)
        raise
    return Comm(h.value, "torch")
