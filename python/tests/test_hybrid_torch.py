"""Hybrid sharding from Python, ShardedAdamW(model, shard, replica_comm=replica) with
shard, replica = comm.split_nodes(L), on a small transformer LM, W = 4 as 2 nodes x 2 ranks, 12
steps of 2 micro-batches (python/tests/test_hybrid_engine.py has the Engine's bitwise checks):
 - per-step losses and final parameters of hybrid (f32 wire) against flat ZeRO-2 at W = 4
   within 2e-6 (only the order of the sums differs: in-node, then across nodes; measured 2.5e-7
   on parameters up to 4.1, 3.6e-7 on losses);
 - bf16 on the cross-node wire within 1e-2 on parameters and 1e-3 on losses (one bf16 rounding
   of each node's shard sum per step; measured 3.2e-3 and 6e-5, while the loss falls from 4.04
   to 2.89); every rank holds the same model whatever its node;
 - a replica_comm that is not a Comm is a TypeError.
"""

import copy

import numpy as np
import pytest

import shardgrad as sg

FAST = dict(timeout_ms=60000)

# ---- ShardedAdamW -----------------------------------------------------------------------------

torch = pytest.importorskip("torch")

from shardgrad.torch import ShardedAdamW  # noqa: E402
from sg_models import make_batches, make_model, max_param_diff, train_sharded  # noqa: E402

STEPS, MICRO, W = 12, 2, 4


def torch_body(comm, nodes, wire, batches, base):
    model = copy.deepcopy(base)  # one model built once: torch's global RNG is not per thread
    shard = replica = None
    if nodes:
        shard, replica = comm.split_nodes(comm.size // nodes)
    opt = ShardedAdamW(model, shard or comm, replica_comm=replica, lr=3e-3, weight_decay=0.1,
                       replica_reduce_dtype=wire, **FAST)
    try:
        losses, _ = train_sharded(model, opt, batches, comm.rank)
    finally:
        opt.close()
        for c in (shard, replica):
            if c is not None:
                c.close()
    return losses, model


def test_sharded_adamw_hybrid_against_flat():
    batches = make_batches(1, STEPS, MICRO, W, 4)
    base = make_model(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 4 rank threads on 2 cores
    try:
        flat, hyb, bf = (sg.run_threads(W, torch_body, nodes, wire, batches, base)
                         for nodes, wire in ((0, "f32"), (2, "f32"), (2, "bf16")))
    finally:
        torch.set_num_threads(threads)
    for r in range(W):
        np.testing.assert_allclose(hyb[r][0], flat[r][0], rtol=0, atol=2e-6)
        np.testing.assert_allclose(bf[r][0], flat[r][0], rtol=0, atol=1e-3)
        assert max_param_diff(hyb[r][1], flat[r][1])[0] <= 2e-6, r
        assert max_param_diff(bf[r][1], flat[r][1])[0] <= 1e-2, r
    # every rank holds the same model, whatever its node
    for r in range(1, W):
        assert max_param_diff(hyb[r][1], hyb[0][1])[0] == 0.0
        assert max_param_diff(bf[r][1], bf[0][1])[0] == 0.0
    assert flat[0][0][-1] < flat[0][0][0]  # the loss fell


def test_sharded_adamw_replica_comm_type():
    comms = sg.Comm.local(1)
    try:
        with pytest.raises(TypeError):
            ShardedAdamW(make_model(0), comms[0], replica_comm=3)
    finally:
        comms[0].close()
