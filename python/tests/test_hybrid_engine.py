"""Hybrid sharding from Python, the Engine: Engine(shard, replica_comm=replica) with
shard, replica = comm.split_nodes(L) (python/tests/test_hybrid_torch.py has ShardedAdamW).

 - exactly summable gradients (multiples of 1/4, 1 and 3 micro-batches, set_microbatches): the
   hybrid parameters are bitwise those of a flat engine over the same W ranks, in 2x2, 3x2 and
   2x3; world_size and rank are the global ones;
 - bad arguments: a replica_comm that is not a Comm; closing a communicator a hybrid engine
   still uses is refused until the engine is closed.
"""

import numpy as np
import pytest

import shardgrad as sg

FAST = dict(timeout_ms=60000)
N = 40


def exact_grads(rank, step, micro):
    return np.array([((i + 3 * step + 5 * micro + rank) % 7) * 0.25 for i in range(N)],
                    dtype=np.float32)


def train_engine(comm, hybrid_nodes, micro, steps=3):
    """Final fp32 parameters after `steps` steps; hybrid_nodes: 0 for flat."""
    shard = replica = None
    rank = comm.rank
    if hybrid_nodes:
        shard, replica = comm.split_nodes(comm.size // hybrid_nodes)
    e = sg.Engine(shard or comm, replica_comm=replica, lr=1e-2, **FAST)
    try:
        pid = e.add_param("w", N)
        e.finalize()
        if hybrid_nodes:
            e.set_microbatches(micro)
        assert e.world_size == comm.size and e.rank == rank
        for s in range(steps):
            for m in range(micro):
                e.grad_add(pid, exact_grads(rank, s, m))
                e.backward_end()
            e.step()
        return e.get_param(pid).copy()
    finally:
        e.close()
        for c in (shard, replica):
            if c is not None:
                c.close()


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("micro", [1, 3])
def test_engine_hybrid_bitwise_flat(nodes, per_node, micro):
    w = nodes * per_node
    flat = sg.run_threads(w, train_engine, 0, micro)
    hyb = sg.run_threads(w, train_engine, nodes, micro)
    for r in range(w):
        assert np.array_equal(flat[r].view(np.uint32), hyb[r].view(np.uint32)), r
    assert np.abs(flat[0]).max() > 0


def test_engine_hybrid_arguments():
    comms = sg.Comm.local(1)
    c = comms[0]
    try:
        with pytest.raises(TypeError):
            sg.Engine(c, replica_comm="not a comm")
        shard, replica = c.split_nodes(1)
        e = sg.Engine(shard, replica_comm=replica, **FAST)
        with pytest.raises(sg.InvalidStateError):
            replica.close()  # the engine still uses it
        e.close()
        replica.close()
        shard.close()
    finally:
        c.close()


