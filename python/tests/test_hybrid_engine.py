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




def _codec_engine(comm, state, steps, load_dir=None, save_dir=None, convert=False):
    """A 2x2 engine with int8 replica codes and `state` optimizer state; loads, trains, saves.
    Returns (parameters, m of the first 8 elements) or the exception the load raised."""
    shard, replica = comm.split_nodes(2)
    e = sg.Engine(shard, replica_comm=replica, lr=1e-2, replica_codec="int8",
                  optim_state_dtype=state, optim_state_min_numel=0, **FAST)
    try:
        pid = e.add_param("w", 4096)
        e.finalize()
        if load_dir is not None:
            try:
                e.load(load_dir, convert_optim_state=convert)
            except sg.ShardgradError as ex:
                return ex
        for s in range(steps):
            e.grad_add(pid, np.resize(exact_grads(comm.rank, s, 0), 4096))
            e.backward_end()
            e.step()
        if save_dir is not None:
            e.save(save_dir)
        return e.get_param(pid).copy()
    finally:
        e.close()
        shard.close()
        replica.close()


@pytest.mark.parametrize("saved,loaded", [("f32", "q8"), ("q8", "f32")])
def test_codec_checkpoint_converts_optimizer_state(tmp_path, saved, loaded):
    """A checkpoint with replica sections (the codec's residuals) after the optimizer's: the
    format check reads the optimizer's last section, not the file's, and a conversion leaves
    the residual sections as they are; every replica ends with the same parameters."""
    d = str(tmp_path / "ck")
    sg.run_threads(4, _codec_engine, saved, 2, None, d)
    refused = sg.run_threads(4, _codec_engine, loaded, 1, d, None, False)
    assert all(isinstance(x, sg.MismatchError) for x in refused), refused
    assert "convert_optim_state" in str(refused[0])
    out = sg.run_threads(4, _codec_engine, loaded, 2, d, None, True)
    for r in range(1, 4):
        assert np.array_equal(out[0].view(np.uint32), out[r].view(np.uint32)), r
    assert np.isfinite(out[0]).all()
