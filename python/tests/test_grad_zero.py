"""Engine.grad_zero (sg_grad_zero, issue 14 item 4): an exception in the middle of a backward
pass, caught by the training loop, followed by grad_zero: the next step equals a run that never
saw the interrupted micro-batch (bitwise: the gradients are small multiples of 1/8)."""

import numpy as np
import pytest

import shardgrad as sg

SIZES = [300, 65, 1000, 7, 513]


def grads(step, rank):
    rng = np.random.default_rng(1000 * step + 7)  # the same on every rank: exact averages
    return [rng.integers(-2, 3, n).astype(np.float32) / 8 for n in SIZES]


def engine(comm, strategy):
    e = sg.Engine(comm, strategy=strategy, bucket_bytes=1024, timeout_ms=30000, lr=0.01)
    for i, n in enumerate(SIZES):
        e.add_param("p%d" % i, n)
    e.finalize()
    for i, n in enumerate(SIZES):
        e.set_param(i, np.linspace(-1, 1, n, dtype=np.float32))
    return e


def backward(e, g, stop_at=None):
    for i in reversed(range(len(SIZES))):
        if i == stop_at:
            e.grad(i)[:] = 99.0  # written, never marked ready: the exception comes first
            raise RuntimeError("loss.backward() failed")
        e.grad_add(i, g[i])


def run(comm, strategy, interrupt):
    e = engine(comm, strategy)
    try:
        backward(e, grads(0, comm.rank))
        e.step()
        if interrupt:
            try:
                backward(e, grads(1, comm.rank), stop_at=1 if comm.rank == 0 else None)
            except RuntimeError:
                pass
            e.grad_zero()
            # the slots handed out now are zero again
            assert all(not e.grad(i).any() for i in range(len(SIZES)))
        backward(e, grads(2, comm.rank))
        e.step()
        return [e.get_master(i).copy() for i in range(len(SIZES))]
    finally:
        e.close()


@pytest.mark.parametrize("strategy", [sg.Strategy.NO_SHARD, sg.Strategy.SHARD_OPT,
                                      sg.Strategy.SHARD_GRAD_OP])
@pytest.mark.parametrize("world", [1, 2])
def test_grad_zero_after_exception_equals_fresh_run(world, strategy):
    got = sg.run_threads(world, run, strategy, True)
    want = sg.run_threads(world, run, strategy, False)
    for r in range(world):
        for a, b in zip(got[r], want[r]):
            np.testing.assert_array_equal(a, b)


def test_grad_zero_needs_finalize():
    comm = sg.Comm.local(1)[0]
    e = sg.Engine(comm)
    try:
        e.add_param("w", 4)
        with pytest.raises(sg.InvalidStateError):
            e.grad_zero()
    finally:
        e.close()
        comm.close()
