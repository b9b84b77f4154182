"""Fork after training (issue 30, item 1), from Python: multiprocessing with the fork start
method, as a DataLoader worker or a process that saves a checkpoint would. The parent's CPU
kernels ran OpenMP parallel regions on this thread, whose libgomp pool does not survive
fork(); the children must still create engines, train, save and exit, each under a deadline
(a hang fails the test instead of stalling it), and their checkpoints must be bitwise the
parent's own continuation."""

import multiprocessing as mp
import os

import numpy as np
import pytest

import shardgrad as sg

DEADLINE_S = 30
SHAPES = {"w": (400, 500), "b": (500,)}  # w: above the kernels' threshold for parallel loops
FAST = dict(timeout_ms=30000, lr=0.01, bucket_bytes=1 << 20)


def grad(step, name):
    """Exact multiples of 1/8, the same on every rank: sums and averages are exact."""
    n = int(np.prod(SHAPES[name]))
    k = (np.arange(n, dtype=np.int64) * 7 + step * 13 + len(name)) % 5 - 2
    return (k * 0.125).astype(np.float32)


def make(comm):
    e = sg.Engine(comm, **FAST)
    ids = {k: e.add_param(k, s) for k, s in SHAPES.items()}
    e.finalize()
    for k, s in SHAPES.items():
        e.set_param(ids[k], np.sin(np.arange(np.prod(s), dtype=np.float32) * 0.37))
    return e, ids


def train(e, ids, first, last):
    for t in range(first, last):
        for k in reversed(list(SHAPES)):
            e.grad_add(ids[k], grad(t, k))
        e.step()


def masters(e, ids):
    return {k: e.get_master(ids[k]) for k in SHAPES}


def continue_from(src, dst, first, last, world):
    """In the child: load src at `world` (threads), train [first, last), save into dst."""
    def body(comm):
        e, ids = make(comm)
        e.load(src)
        train(e, ids, first, last)
        e.save(dst)
        e.close()

    if world == 1:
        comm = sg.Comm.local(1)[0]
        body(comm)  # on this thread: the one whose OpenMP pool fork() broke
        comm.close()
    else:
        sg.run_threads(world, lambda comm: body(comm))


def child(src, dst, first, last, world):
    continue_from(src, dst, first, last, world)
    os._exit(0)  # no atexit of the parent's objects (pytest's, the parent engine's)


def run_forked(target, args):
    ctx = mp.get_context("fork")
    p = ctx.Process(target=target, args=args)
    p.start()
    p.join(DEADLINE_S)
    if p.is_alive():
        p.kill()
        p.join()
        pytest.fail("the forked child did not finish within %d s (hung)" % DEADLINE_S)
    return p.exitcode


def test_fork_after_training(tmp_path):
    base, out1, out2 = (str(tmp_path / n) for n in ("base", "w1", "w2"))
    comm = sg.Comm.local(1)[0]
    e, ids = make(comm)
    train(e, ids, 0, 2)  # parallel regions on this thread
    e.save(base)
    assert run_forked(child, (base, out1, 2, 4, 1)) == 0
    assert run_forked(child, (base, out2, 2, 4, 2)) == 0
    train(e, ids, 2, 4)  # the parent carries on as if nothing happened
    want = masters(e, ids)
    for out in (out1, out2):
        c2 = sg.Comm.local(1)[0]
        f, fids = make(c2)
        f.load(out)
        got = masters(f, fids)
        for k in SHAPES:
            np.testing.assert_array_equal(got[k], want[k], err_msg="%s: %s" % (out, k))
        f.close()
        c2.close()
    e.close()
    comm.close()


def worker(args):
    src, dst = args
    continue_from(src, dst, 2, 3, 1)
    return dst


def test_fork_pool_workers(tmp_path):
    """A multiprocessing.Pool (fork) of workers that each train and save."""
    base = str(tmp_path / "base")
    comm = sg.Comm.local(1)[0]
    e, ids = make(comm)
    train(e, ids, 0, 2)
    e.save(base)
    jobs = [(base, str(tmp_path / ("p%d" % i))) for i in range(2)]
    with mp.get_context("fork").Pool(2) as pool:
        res = pool.map_async(worker, jobs)
        done = res.get(DEADLINE_S)  # multiprocessing.TimeoutError when a worker hangs
    assert done == [j[1] for j in jobs]
    train(e, ids, 2, 3)
    want = masters(e, ids)
    for _, out in jobs:
        c2 = sg.Comm.local(1)[0]
        f, fids = make(c2)
        f.load(out)
        for k, v in masters(f, fids).items():
            np.testing.assert_array_equal(v, want[k])
        f.close()
        c2.close()
    e.close()
    comm.close()
