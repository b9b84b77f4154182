"""The torch.distributed transport of Comm.from_torch (sg_comm_create_xport filled by
shardgrad.torch.comm), in one process: two gloo process groups on a shared HashStore, one
per thread, stand in for two torchrun processes. Training against the threads backend
(bitwise), a peer that never calls (TimeoutError, not a hang), failures inside torch (CommError
with torch's text), closing in every order, and the C API's argument checks.

The multi-process runs (torchrun, a peer process that dies) are in test_torch_dist.py.
Runtime: ~15 s."""

import ctypes
import datetime
import gc
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import shardgrad as sg  # noqa: E402
from shardgrad import _lib  # noqa: E402

if not _lib.has("sg_comm_create_xport"):
    pytest.skip("libshardgrad without sg_comm_create_xport", allow_module_level=True)

from shardgrad.torch import comm as _torch_xport  # noqa: E402
from shardgrad._structs import XPORT_CANCEL, XPORT_SEND, SgXport  # noqa: E402
from shardgrad.torch import ShardedAdamW  # noqa: E402


def in_threads(world, fn):
    """fn(rank) on `world` threads; results by rank, the first exception re-raised."""
    out, errs = [None] * world, [None] * world

    def body(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: B902 - re-raised below
            errs[r] = e

    ts = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    for e in errs:
        if e is not None:
            raise e
    return out


def gloo_groups(world, timeout_s=60):
    store = dist.HashStore()
    return in_threads(world, lambda r: dist.ProcessGroupGloo(
        dist.PrefixStore("t", store), r, world, datetime.timedelta(seconds=timeout_s)))


def torch_comms(world):
    return [_torch_xport.create(g, r, world) for r, g in enumerate(gloo_groups(world))]


_seed_lock = threading.Lock()  # torch's generator is per process: ranks take turns


def model():
    with _seed_lock:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                   torch.nn.Linear(64, 4))


def train(comm, steps=4, replica=None, rank=None, world=None):
    """rank, world: the global ones where comm is a node's (hybrid: replica_comm=replica)."""
    m = model()
    # small buckets: several reductions per backward, overlapping it on the comm worker
    opt = ShardedAdamW(m, comm, replica_comm=replica, lr=1e-2, weight_decay=0.1,
                       bucket_bytes=1024, timeout_ms=30000)
    r = comm.rank if rank is None else rank
    w = comm.size if world is None else world
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8 * w, 16, generator=g), torch.randn(8 * w, 4, generator=g)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(m(x[8 * r:8 * r + 8]), y[8 * r:8 * r + 8])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()
    opt.close()
    return flat, losses


@pytest.mark.parametrize("world", [2, 3])
def test_training_equals_the_threads_backend_bitwise(world):
    comms = torch_comms(world)
    try:
        got = in_threads(world, lambda r: train(comms[r]))
    finally:
        for c in comms:
            c.close()
    ref = sg.run_threads(world, train)
    for r in range(world):
        assert torch.equal(got[r][0], got[0][0])  # every rank holds the same parameters
        # same algorithms as the MPI communicator, whose sums equal the threads backend's
        assert torch.equal(got[r][0], ref[r][0]), (got[r][0] - ref[r][0]).abs().max()
    assert got[0][1][-1] < got[0][1][0]
    assert not _torch_xport._transports  # every communicator released


def hybrid(comm, close_parent_first):
    """2 nodes x 2 ranks from comm.split_nodes(2), ShardedAdamW(shard, replica_comm=replica)."""
    shard, replica = comm.split_nodes(2)
    if close_parent_first:  # the parts keep the transport
        comm.close()
    try:
        return train(shard, replica=replica, rank=shard.rank + 2 * replica.rank, world=4)
    finally:
        shard.close()
        replica.close()


def test_hybrid_over_splits_of_a_torch_comm_equals_the_threads_backend_bitwise():
    """W = 4 as 2 x 2 over one gloo group per rank (sg_comm_split_nodes of the transport's
    communicator: the parts send through the same group); the parent closed before its parts
    on the transport side. Bitwise equal to the same hybrid layout on the threads backend."""
    comms = torch_comms(4)
    got = in_threads(4, lambda r: hybrid(comms[r], True))
    ref = sg.run_threads(4, hybrid, False)
    for r in range(4):
        assert torch.equal(got[r][0], got[0][0])  # every rank holds the same parameters
        assert torch.equal(got[r][0], ref[r][0]), (got[r][0] - ref[r][0]).abs().max()
        assert got[r][1] == ref[r][1]
    assert got[0][1][-1] < got[0][1][0]
    assert not _torch_xport._transports  # released with the last of each rank's family


def test_split_and_split_nodes_of_a_torch_comm():
    comms = torch_comms(4)

    def body(r):
        c = comms[r]
        half = c.split(r % 2, -r)  # ranks {0, 2} and {1, 3}, ranked backwards
        shard, replica = c.split_nodes(0)  # by host name: one host here
        out = ((half.kind, half.rank, half.size), (shard.size, replica.size, replica.rank))
        for x in (half, shard, replica, c):
            x.close()
        return out

    got = in_threads(4, body)
    for r in range(4):
        assert got[r][0] == ("torch", 1 - r // 2, 2), got[r]
        assert got[r][1] == (4, 1, 0), got[r]
    assert not _torch_xport._transports


def test_a_peer_that_never_calls_times_out():
    comms = torch_comms(2)
    try:
        t0 = time.monotonic()
        with pytest.raises(sg.ShardgradTimeoutError) as ex:
            ShardedAdamW(model(), comms[0], timeout_ms=1500)  # rank 1 never joins
        took = time.monotonic() - t0
        assert took < 30, took
        assert "torch" in str(ex.value)  # the collective names the transport
        # broken for good: later engines fail at once instead of waiting again
        with pytest.raises(sg.CommError, match="broken"):
            ShardedAdamW(model(), comms[0], timeout_ms=1500)
    finally:
        for c in comms:
            c.close()
    assert not _torch_xport._transports


class _Failing:
    """A process group whose send raises, or whose Work fails in wait()."""

    def __init__(self, group, where):
        self.group, self.where = group, where

    def send(self, tensors, peer, tag):
        if self.where == "send":
            raise RuntimeError("boom in send")
        return self.group.send(tensors, peer, tag)

    def recv(self, tensors, peer, tag):
        if self.where == "wait":
            return _FailingWork()
        return self.group.recv(tensors, peer, tag)


class _FailingWork:
    def wait(self):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")


@pytest.mark.parametrize("where", ["send", "wait"])
def test_failures_inside_torch_surface_with_their_text(where):
    groups = gloo_groups(2)
    comms = [_torch_xport.create(_Failing(g, where), r, 2) for r, g in enumerate(groups)]

    def body(r):
        try:
            ShardedAdamW(model(), comms[r], timeout_ms=3000)
        except sg.ShardgradError as e:
            return e
        return None

    try:
        errs = in_threads(2, body)
    finally:
        for c in comms:
            c.close()
    want = "boom in send" if where == "send" else "Connection closed by peer"
    assert any(isinstance(e, sg.CommError) and want in str(e) for e in errs), errs
    for e in errs:  # the other rank fails too (its peer broke), or times out
        assert isinstance(e, (sg.CommError, sg.ShardgradTimeoutError)), errs


@pytest.mark.parametrize("order", ["comm_first", "optimizer_first", "collected",
                                   "groups_first"])
def test_closing_in_any_order(order):
    groups = gloo_groups(2)
    comms = [_torch_xport.create(g, r, 2) for r, g in enumerate(groups)]
    opts = in_threads(2, lambda r: ShardedAdamW(model(), comms[r], timeout_ms=20000))
    if order == "groups_first":  # the transports keep what they need of the groups
        del groups
        gc.collect()
    if order == "comm_first":
        for c in comms:
            with pytest.raises(sg.InvalidStateError, match="close them first"):
                c.close()
        assert len(_torch_xport._transports) == 2  # still in use: nothing released
    if order == "collected":
        del opts
        gc.collect()
    else:
        x = torch.randn(4, 16)
        for o in opts:  # still trains (single rank steps would need both: just close)
            assert o.param_groups[0]["params"][0].shape == (64, 16)
        for o in opts:
            o.close()
    for c in comms:
        c.close()
    gc.collect()
    assert not _torch_xport._transports


# ------------------------------------------------------------------------------------------
# the C API: sg_comm_create_xport, sg_xport_done

def _noop_send(user, buf, n, peer, tag, token, msg, cap):
    return 0


_SEND = XPORT_SEND(_noop_send)
_CANCEL = XPORT_CANCEL(lambda user, token: 0)


def _xport(**kw):
    t = SgXport(struct_size=ctypes.sizeof(SgXport), name=b"fake", user=None, threaded=0,
                isend=_SEND, irecv=_SEND, cancel=_CANCEL)
    for k, v in kw.items():
        setattr(t, k, v)
    return t


def _create(t, rank=0, world=2):
    h = ctypes.c_void_p()
    st = _lib.load().sg_comm_create_xport(ctypes.byref(t) if t is not None else None, rank,
                                          world, ctypes.byref(h))
    return st, h.value, sg.last_error()


def test_create_xport_checks_its_arguments():
    L = _lib.load()
    assert L.sg_comm_create_xport(ctypes.byref(_xport()), 0, 2, None) == sg.Status.ERR_INVALID_ARGUMENT
    cases = [(None, 0, 2, "t is NULL"),
             (_xport(struct_size=8), 0, 2, "struct_size"),
             (_xport(isend=XPORT_SEND()), 0, 2, "isend is NULL"),
             (_xport(cancel=XPORT_CANCEL()), 0, 2, "cancel is NULL"),
             (_xport(), 2, 2, "rank 2 outside 0..1"),
             (_xport(), 0, 0, "world must be in 1..65536"),
             (_xport(name=b"n" * 40), 0, 2, "longer than 31")]
    for t, rank, world, text in cases:
        st, h, err = _create(t, rank, world)
        assert st == sg.Status.ERR_INVALID_ARGUMENT and h is None, (text, st)
        assert "sg_comm_create_xport" in err and text in err, (text, err)
    st, h, _ = _create(_xport())
    assert st == sg.Status.OK and L.sg_comm_rank(h) == 0 and L.sg_comm_size(h) == 2
    sg.Comm(h, "fake").close()
    st, h, _ = _create(_xport(), 0, 1)
    c = sg.Comm(h, "fake")
    part = c.split(0)  # splits are communicators over the same transport
    assert (part.kind, part.rank, part.size) == ("fake", 0, 1)
    assert c.split(-1) is None
    c.close()
    part.close()


def test_xport_done_checks_token_and_double_completion():
    L = _lib.load()
    assert L.sg_xport_done(None, 0, 0, None) == sg.Status.ERR_INVALID_ARGUMENT
    assert "token is NULL" in sg.last_error()
    seen = []

    def send(user, buf, n, peer, tag, token, msg, cap):
        seen.append(L.sg_xport_done(token, 0, 0, None))  # complete at once, from inside
        seen.append(L.sg_xport_done(token, 0, 0, None))  # and again: refused
        seen.append(sg.last_error())
        return 0

    def recv(user, buf, n, peer, tag, token, msg, cap):
        ctypes.memset(buf, 0, n)  # a made-up peer's bytes
        return L.sg_xport_done(token, 0, n, None)

    cb_send, cb_recv = XPORT_SEND(send), XPORT_SEND(recv)
    st, h, err = _create(_xport(isend=cb_send, irecv=cb_recv))
    assert st == 0, err
    c = sg.Comm(h, "fake")
    with sg.Engine(c, timeout_ms=5000) as e:  # finalize talks to the made-up peer
        e.add_param("w", 8)
        try:
            e.finalize()
        except sg.ShardgradError:
            pass  # what the made-up peer said does not matter here
        assert seen[:2] == [sg.Status.OK, sg.Status.ERR_INVALID_STATE], seen
        assert "already completed" in seen[2]
    c.close()


def test_a_failing_isend_gives_comm_error_with_its_message():
    def send(user, buf, n, peer, tag, token, msg, cap):
        ctypes.memmove(msg, b"link down\0", 10)
        return 5

    cb = XPORT_SEND(send)
    st, h, err = _create(_xport(isend=cb, irecv=cb), rank=1)
    assert st == 0, err
    c = sg.Comm(h, "fake")
    with sg.Engine(c, timeout_ms=5000) as e:
        e.add_param("w", 8)
        with pytest.raises(sg.CommError, match=r"sg_comm\(fake\).*failed \(5\): link down"):
            e.finalize()
    c.close()


def test_done_with_an_error_fails_the_collective():
    L = _lib.load()

    def recv(user, buf, n, peer, tag, token, msg, cap):
        return L.sg_xport_done(token, 3, 0, b"peer reset")

    cb = XPORT_SEND(recv)
    st, h, err = _create(_xport(irecv=cb), rank=1)
    assert st == 0, err
    c = sg.Comm(h, "fake")
    with sg.Engine(c, timeout_ms=5000) as e:
        e.add_param("w", 8)
        with pytest.raises(sg.CommError, match="a transfer failed: peer reset"):
            e.finalize()
    c.close()


def test_release_is_called_once_after_the_last_engine():
    released = []
    from shardgrad._structs import XPORT_RELEASE
    rel = XPORT_RELEASE(lambda user: released.append(user))
    st, h, err = _create(_xport(release=rel, user=ctypes.c_void_p(42)), world=1)
    assert st == 0, err
    c = sg.Comm(h, "fake")
    e = sg.Engine(c, timeout_ms=5000)
    e.add_param("w", 8)
    e.finalize()
    e.grad_add(0, np.ones(8, np.float32))
    e.step()
    # (the C library would defer a destroy to the engine's; the binding refuses outright)
    with pytest.raises(sg.InvalidStateError):
        c.close()  # refused by the binding likewise
    assert released == []
    e.close()
    assert released == []  # the engine is gone, the communicator is not
    c.close()
    assert released == [42]


class _HeldWork:
    """A Work that completes when the test says so (and then 'delivers' into its tensor)."""

    def __init__(self, tensor, payload=None):
        self.tensor, self.payload, self.go = tensor, payload, threading.Event()

    def wait(self):
        self.go.wait(10)
        if self.payload is not None:  # what gloo does for a receive: write the message
            self.tensor.copy_(self.payload)


class _HeldGroup:
    def __init__(self):
        self.works = []

    def send(self, tensors, peer, tag):
        self.works.append(_HeldWork(tensors[0]))
        return self.works[-1]

    def recv(self, tensors, peer, tag):
        n = tensors[0].numel()
        self.works.append(_HeldWork(tensors[0], torch.full((n,), 7, dtype=torch.uint8)))
        return self.works[-1]


class _DoneLog:
    def __init__(self):
        self.calls = []

    def sg_xport_done(self, token, failed, nbytes, msg):
        self.calls.append((token, failed, nbytes))


def test_cancelled_transfers_never_touch_library_memory(monkeypatch):
    """gloo keeps using a transfer's tensor after the library cancelled it at a deadline and
    freed the buffer: a send must have copied its bytes when it started (a late peer got
    freed memory before), and a receive that lands after its cancel must not write the buffer
    nor report completion. A receive that completes copies into the buffer, then reports."""
    done = _DoneLog()
    monkeypatch.setattr(_torch_xport._lib, "load", lambda: done)
    g = _HeldGroup()
    tp = _torch_xport.TorchTransport(g, 0, 2)
    send_buf = (ctypes.c_ubyte * 16)(*range(16))
    tp.start(False, ctypes.addressof(send_buf), 16, 1, 5, 101)
    ctypes.memset(send_buf, 0xEE, 16)  # the library reuses or frees it after a cancel
    assert g.works[0].tensor.tolist() == list(range(16))
    assert tp.cancel(101) == 0
    g.works[0].go.set()

    late = (ctypes.c_ubyte * 16)()
    tp.start(True, ctypes.addressof(late), 16, 1, 6, 102)
    assert tp.cancel(102) == 0  # exact: the buffer is safe to free at once
    g.works[1].go.set()

    ok = (ctypes.c_ubyte * 16)()
    tp.start(True, ctypes.addressof(ok), 16, 1, 7, 103)
    g.works[2].go.set()
    deadline = time.monotonic() + 10
    while not done.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # the cancelled ones' waiters have finished too
    assert bytes(late) == bytes(16), "a cancelled receive wrote the library's buffer"
    assert bytes(ok) == bytes([7] * 16)
    assert done.calls == [(103, 0, 16)], done.calls
    assert not tp.pending
